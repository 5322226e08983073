"""How a window stores its items: the per-item columns, reading chunks off the malloc heap,
and vectorized gathers of items' readings; the decay rate of its keys."""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_LN2 = math.log(2.0)


def decay_rate(half_life_s: float) -> float:
    """λ = ln 2 / half-life; 0 for an infinite half-life (uniform reservoir)."""
    return _LN2 / half_life_s  # ln 2 / inf is 0.0


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


# How much of a window's readings a checkpoint gathers at a time to write it (ItemReadings.pieces)
READINGS_PIECE_BYTES = 16 << 20

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
    """A sensor-id column as codes into a table of distinct ids: what a window's snapshots hold.

    Millions of items as Python objects cost an object array whose allocation alone holds
    the interpreter for a tenth of a second; the codes are numbers, a pass groups items by
    them (``streamtrain.data.policies.group_codes``), and a checkpoint stores ids this way
    anyway (each distinct id once). ``np.asarray(column, dtype=object)`` and :meth:`tolist`
    give the ids, built in pieces.
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

    def tolist(self) -> list[Any]:
        """The ids, one per item, as ``numpy.ndarray.tolist`` gives an object column's."""
        return np.asarray(self).tolist()


@dataclass(frozen=True)
class ItemReadings:
    """Items' readings where they already lie: item ``i`` is ``lengths[i]`` rows of
    ``chunks[chunk_of[i]]`` from ``starts[i]``.

    A restore hands the window these (the arrays read from a checkpoint's base and deltas
    become its chunks as they are), and a checkpoint writes a window's readings from them
    piece by piece (:meth:`pieces`): at 10M items either way would otherwise copy 2.6 GB
    into memory the process touches for the first time, the slowest part of both.
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

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = gather_items(self.chunks, self.chunk_of, self.starts, self.lengths)
        return out if dtype is None else out.astype(dtype, copy=False)

    def _piece_bounds(self, piece_bytes: int) -> list[tuple[int, int, int, int]]:
        """(first item, end item, first token, end token) of pieces of about ``piece_bytes`` of readings
        (an item is never split), in order; pieces of empty items only are left out."""
        tokens, channels = self.shape
        if not tokens:
            return []
        ends = np.cumsum(self.lengths)
        piece_tokens = max(1, piece_bytes // (4 * channels))
        cuts = np.searchsorted(ends, np.arange(piece_tokens, tokens, piece_tokens), side="right")
        bounds = np.union1d([0, self.lengths.shape[0]], cuts)  # sorted, each once
        token_bounds = np.concatenate([[0], ends])[bounds]
        pieces = zip(bounds[:-1].tolist(), bounds[1:].tolist(), token_bounds[:-1].tolist(), token_bounds[1:].tolist())
        return [piece for piece in pieces if piece[3] > piece[2]]

    def _gather_piece(self, piece: tuple[int, int, int, int], out: np.ndarray) -> None:
        lo, hi, _, _ = piece
        gather_items(self.chunks, self.chunk_of[lo:hi], self.starts[lo:hi], self.lengths[lo:hi], out=out)

    def pieces(self, piece_bytes: int = READINGS_PIECE_BYTES) -> Iterator[memoryview]:
        """The readings back to back (the bytes of ``np.asarray(self)``), gathered piece by piece
        into one buffer of about ``piece_bytes``: each piece is valid until the next is asked for."""
        bounds = self._piece_bounds(piece_bytes)
        if not bounds:
            return
        buffer = np.empty((max(last - first for _, _, first, last in bounds), self.shape[1]), dtype=np.float32)
        for piece in bounds:
            out = buffer[: piece[3] - piece[2]]
            self._gather_piece(piece, out)
            yield out.reshape(-1).view(np.uint8).data

    def gather_into(self, out: np.ndarray, piece_bytes: int = READINGS_PIECE_BYTES) -> None:
        """Write ``np.asarray(self)`` into ``out`` (``[tokens, C]``), piece by piece: a gather's token
        positions (8 bytes a token) then stay bounded, however large the items' chunks are."""
        for piece in self._piece_bounds(piece_bytes):
            self._gather_piece(piece, out[piece[2] : piece[3]])


def gather_items(
    chunks: Sequence[np.ndarray],
    chunk_of: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Readings of items (``chunk_of``, ``starts`` in that chunk, ``lengths``) back to back.

    One gather per chunk: the items are grouped by chunk with one sort (none when they
    already come chunk by chunk, as a restored window's do), not one scan of every item
    per chunk; a run of one chunk's items is gathered straight into its place.
    """
    channels = chunks[0].shape[1] if chunks else 1
    if out is None:
        out = np.empty((int(lengths.sum()), channels), dtype=np.float32)
    out_starts = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=out_starts[1:])
    in_order = bool(np.all(chunk_of[1:] >= chunk_of[:-1]))
    order = np.arange(chunk_of.size) if in_order else np.argsort(chunk_of, kind="stable")
    bounds = np.searchsorted(chunk_of[order], np.arange(len(chunks) + 1))
    for chunk in np.flatnonzero(bounds[1:] > bounds[:-1]).tolist():
        lo, hi = int(bounds[chunk]), int(bounds[chunk + 1])
        rows = order[lo:hi]
        run_starts, run_lengths = starts[rows], lengths[rows]
        if in_order:  # these items are one stretch of the output too
            at = int(out_starts[lo])
            gather_tokens(chunks[chunk], run_starts, run_lengths, out=out[at : at + int(run_lengths.sum())])
        else:
            out[token_positions(out_starts[rows], run_lengths)] = gather_tokens(chunks[chunk], run_starts, run_lengths)
    return out


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


def _reference_counts(arrays: Mapping[str, np.ndarray]) -> list[int]:
    return [sys.getrefcount(array) for array in arrays.values()]


# What _reference_counts shows for an array nothing but its mapping refers to, measured the
# same way (3 in CPython 3.11: the mapping, the loop's name and getrefcount's argument)
_HELD_BY_ITS_MAPPING_ONLY = _reference_counts({"probe": np.empty(0)})[0]


def held_only_by(arrays: Mapping[str, np.ndarray]) -> bool:
    """Whether nothing but ``arrays`` refers to any of its arrays (CPython reference counts).

    Not another mapping, nor an object holding one, nor a view (a view refers to the array
    that owns its memory), nor a name in any thread: then nobody can reach these arrays
    again but through ``arrays``, and its owner may overwrite them.
    """
    return all(count == _HELD_BY_ITS_MAPPING_ONLY for count in _reference_counts(arrays))


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
