"""How a window stores its items: the per-item columns, reading chunks off the malloc heap,
and vectorized gathers of items' readings; the decay rate of its keys."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

_LN2 = math.log(2.0)


def decay_rate(half_life_s: float) -> float:
    """λ = ln 2 / half-life; 0 for an infinite half-life (uniform reservoir)."""
    return 0.0 if math.isinf(half_life_s) else _LN2 / half_life_s


# The per-item columns of a window and their dtypes: its storage, its state_dict (which
# adds the items' readings as "values") and a checkpoint's partition sections hold these.
ITEM_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("keys", np.float64),
    ("ts", np.float64),
    ("labels", np.int64),
    ("lengths", np.int64),
    ("partitions", np.int32),
    ("offsets", np.int64),
    ("seq", np.int64),
    ("sensor_ids", object),
)


# Items an object-array gather copies at a time: each piece holds the interpreter about a
# millisecond (a gather of millions in one call holds it for a tenth of a second and more)
OBJECT_PIECE_ITEMS = 1 << 16


def take_objects(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``table[index]`` for an object ``table``, in pieces, so other threads run in between."""
    out = np.empty(index.shape[0], dtype=object)
    for start in range(0, index.shape[0], OBJECT_PIECE_ITEMS):
        out[start : start + OBJECT_PIECE_ITEMS] = table[index[start : start + OBJECT_PIECE_ITEMS]]
    return out


@dataclass(frozen=True)
class SensorCodes:
    """A sensor-id column as codes into a table of distinct ids: what a checkpoint's capture holds.

    Millions of items as Python objects cost an object array whose allocation alone holds
    the interpreter for a tenth of a second; the codes are numbers, and a checkpoint stores
    ids this way anyway (each distinct id once). ``np.asarray(column, dtype=object)`` gives
    the ids, built in pieces.
    """

    codes: np.ndarray  # int32 [n], indices into ``strings``
    strings: np.ndarray  # object [k]: distinct sensor ids

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def __getitem__(self, index: Any) -> SensorCodes:
        return SensorCodes(self.codes[index], self.strings)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return take_objects(self.strings, self.codes.reshape(-1)).reshape(self.codes.shape)


@dataclass(frozen=True)
class ItemReadings:
    """Items' readings where they already lie: item ``i`` is ``lengths[i]`` rows of
    ``chunks[chunk_of[i]]`` from ``starts[i]``; ``chunk_of`` never decreases.

    What a restore hands the window: the arrays read from a checkpoint's base and deltas
    become the window's chunks as they are, instead of gigabytes copied into a new array
    (memory the process touches for the first time, the slowest part of a 10M restore).
    ``np.asarray`` gives the readings back to back, as ``state_dict`` stores them.
    """

    chunks: tuple[np.ndarray, ...]  # float32 [tokens, C] each
    chunk_of: np.ndarray  # int32 [n]
    starts: np.ndarray  # int64 [n], in the item's chunk
    lengths: np.ndarray  # int64 [n]

    @classmethod
    def back_to_back(cls, flat: np.ndarray, lengths: np.ndarray, channels: int) -> ItemReadings:
        """Items whose readings lie one after another in ``flat`` (as ``state_dict`` stores them)."""
        starts = np.zeros(lengths.shape[0], dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        chunk_of = np.zeros(lengths.shape[0], dtype=np.int32)
        return cls((flat.reshape(-1, channels),), chunk_of, starts, lengths)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.lengths.sum()), int(self.chunks[0].shape[1]) if self.chunks else 1

    @property
    def size(self) -> int:
        tokens, channels = self.shape
        return tokens * channels

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = np.empty(self.shape, dtype=np.float32)
        out_starts = np.zeros(self.lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out_starts[1:])
        bounds = np.searchsorted(self.chunk_of, np.arange(len(self.chunks) + 1))
        for chunk, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
            if hi > lo:
                at, end = int(out_starts[lo]), int(out_starts[hi])
                gather_tokens(self.chunks[chunk], self.starts[lo:hi], self.lengths[lo:hi], out=out[at:end])
        return out if dtype is None else out.astype(dtype, copy=False)


def readings_size(values: Any) -> int:
    """How many numbers a window state's ``values`` hold, without gathering :class:`ItemReadings`."""
    return values.size if isinstance(values, ItemReadings | np.ndarray) else int(np.asarray(values).size)


def token_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, start + length)`` for every item, without a Python loop.

    A running sum of steps: +1 inside an item, a jump to the next item's start at its
    first token (about 2 ns a token, half of ``repeat`` + ``arange``).
    """
    nonempty = lengths > 0
    starts, lengths = starts[nonempty], lengths[nonempty]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    steps = np.ones(total, dtype=np.int64)
    first = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=first[1:])
    steps[0] = starts[0]
    steps[first[1:]] = starts[1:] - (starts[:-1] + lengths[:-1] - 1)
    return np.cumsum(steps, out=steps)


def gather_tokens(
    flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """Readings of items ``(starts, lengths)`` of ``flat`` back to back (into ``out`` if given).

    Items that already lie back to back (a whole poll batch, a restored window) are one
    slice copy instead of a gather through a position per token.
    """
    if starts.shape[0] and np.array_equal(starts[1:], starts[:-1] + lengths[:-1]):
        first = int(starts[0])
        run = flat[first : first + int(lengths.sum())]
        if out is None:
            return run.copy()
        out[...] = run
        return out
    return np.take(flat, token_positions(starts, lengths), axis=0, out=out)


# Chunks this large (~340 events of median length 48 in one channel) get an anonymous
# mapping of their own; for smaller ones the page rounding would waste more and the
# mappings would count against vm.max_map_count.
OFF_HEAP_MIN_BYTES = 64 * 1024


def chunk_array(tokens: int, channels: int) -> np.ndarray:
    """Storage for a chunk of readings, off the malloc heap when it is large.

    Window chunks live for minutes; on the heap each would sit between blocks that live
    for milliseconds (poll batches, training tensors) and keep their free space from going
    back to the OS. In their own mapping their pages are returned when they die.
    """
    nbytes = tokens * channels * 4
    if nbytes < OFF_HEAP_MIN_BYTES:
        return np.empty((tokens, channels), dtype=np.float32)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.float32).reshape(tokens, channels)
