"""An immutable view of the window, one per training pass.

A snapshot is built from one published state of the window (taken under its lock by
reference, built outside it): the small per-item columns are gathered, the reading chunks
(never written after insert) are shared, and a pass's subset gathers only its own items'
readings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from streamtrain.window.storage import ItemReadings, SensorCodes, gather_items, gather_tokens


@dataclass(frozen=True)
class WindowSnapshot:
    """A consistent, immutable view of the window for readers (one training pass).

    ``flat_values`` holds the readings: one float32 array ``[T, C]``, or a tuple of such
    arrays (the window's reading chunks, shared, not copied) that behave as their
    concatenation. Item ``i`` is ``flat[starts[i] : starts[i] + lengths[i]]`` of that
    concatenation. ``values`` gives the same as a list of views, built on first use.
    """

    flat_values: np.ndarray | tuple[np.ndarray, ...]
    starts: np.ndarray
    lengths: np.ndarray
    ts: np.ndarray
    labels: np.ndarray
    keys: np.ndarray
    sensor_ids: np.ndarray | SensorCodes  # a window's snapshots: SensorCodes (the window's codes)
    partitions: np.ndarray
    offsets: np.ndarray
    next_offsets: dict[int, int] = field(default_factory=dict)
    version: int = 0
    taken_at: float = 0.0
    seq: np.ndarray | None = None  # int64 [n]: arrival order (number of events accepted before it)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @cached_property
    def _readings(self) -> tuple[np.ndarray, np.ndarray]:
        """(one array of readings, item starts in it); over chunks, only live readings are gathered."""
        if isinstance(self.flat_values, np.ndarray):
            return self.flat_values, self.starts
        flat, lengths = self._gather_from_chunks(self.starts, self.lengths)
        starts = np.zeros(lengths.shape[0], dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        return flat, starts

    def subset(self, index: np.ndarray) -> WindowSnapshot:
        """The items ``index`` as a snapshot of their own.

        Over one array, readings are shared, not copied. Over the window's chunks, only
        the chosen items' readings are gathered (a small pass never copies the window).
        """
        index = np.asarray(index)
        if isinstance(self.flat_values, np.ndarray) or "_readings" in self.__dict__:
            flat, all_starts = self._readings
            starts = all_starts[index]
        else:
            flat, lengths = self._gather_from_chunks(self.starts[index], self.lengths[index])
            starts = np.zeros(lengths.shape[0], dtype=np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
        return WindowSnapshot(
            flat_values=flat,
            starts=starts,
            lengths=self.lengths[index],
            ts=self.ts[index],
            labels=self.labels[index],
            keys=self.keys[index],
            sensor_ids=self.sensor_ids[index],
            partitions=self.partitions[index],
            offsets=self.offsets[index],
            next_offsets=self.next_offsets,
            version=self.version,
            taken_at=self.taken_at,
            seq=None if self.seq is None else self.seq[index],
        )

    def _gather_from_chunks(self, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Readings of items ``(starts, lengths)`` of the chunks' concatenation, back to back."""
        chunks = self.flat_values
        assert isinstance(chunks, tuple)
        chunk_of, local = self._in_chunks(starts)
        return gather_items(chunks, chunk_of, local, lengths), lengths

    def _in_chunks(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(chunk, start in it) of each start in the chunks' concatenation."""
        chunks = self.flat_values
        assert isinstance(chunks, tuple)
        bases = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([c.shape[0] for c in chunks], out=bases[1:])
        chunk_of = (np.searchsorted(bases, starts, side="right") - 1).astype(np.int32)
        return chunk_of, starts - bases[chunk_of]

    def item_readings(self) -> ItemReadings:
        """Every item's readings where they lie, in item order (what a checkpoint writes piece by piece)."""
        if isinstance(self.flat_values, np.ndarray):
            return ItemReadings((self.flat_values,), np.zeros(len(self), np.int32), self.starts, self.lengths)
        chunk_of, local = self._in_chunks(self.starts)
        return ItemReadings(self.flat_values, chunk_of, local, self.lengths)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @cached_property
    def values(self) -> list[np.ndarray]:
        flat, starts = self._readings
        return [flat[a:b] for a, b in zip(starts.tolist(), (starts + self.lengths).tolist())]

    def gather_values(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Readings of items ``index`` back to back, and their lengths (vectorized)."""
        flat, starts = self._readings
        lengths = self.lengths[index]
        return gather_tokens(flat, starts[index], lengths), lengths

    def all_values(self) -> np.ndarray:
        """Every item's readings back to back, in item order (what a checkpoint stores).

        Over chunks the gathered readings already are that, so the window's readings are
        copied once, not twice.
        """
        flat, starts = self._readings
        n = len(self)
        if n == 0 or (int(starts[0]) == 0 and np.array_equal(starts[1:], np.cumsum(self.lengths[:-1]))):
            return flat[: self.tokens]
        return gather_tokens(flat, starts, self.lengths)


@dataclass(frozen=True, eq=False)
class PassSource:
    """What a training pass chooses from: the columns a pass's selection reads, for every
    window item; the rest of a snapshot only for the items the pass takes.

    A window of millions would otherwise gather a dozen columns of every item for each pass
    (at 10M items ~0.6 GB of new memory a pass) to use 8,192 of them. :meth:`subset` gives
    the :class:`WindowSnapshot` of the chosen items, exactly as ``snapshot().subset`` would;
    ``whole`` the snapshot of every item, built on first use (a pass over the whole window).
    """

    lengths: np.ndarray
    labels: np.ndarray
    sensor_ids: SensorCodes
    seq: np.ndarray
    version: int
    taken_at: float
    take: Callable[[np.ndarray | None], WindowSnapshot]  # the snapshot of the items at an index (None: all)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def subset(self, index: np.ndarray) -> WindowSnapshot:
        """The items ``index`` as a snapshot (only their columns are gathered); any index
        :meth:`WindowSnapshot.subset` takes (a mask, negative positions), refused as it refuses
        one (``IndexError``): the window's stored rows extend past its items."""
        index = np.asarray(index)
        n = len(self)
        np.empty(n, dtype=np.bool_)[index]  # numpy's own check; touches only the chosen bytes
        if index.dtype == np.bool_:
            index = np.flatnonzero(index)
        return self.take(np.where(index < 0, index + n, index).astype(np.int64, copy=False))

    @cached_property
    def whole(self) -> WindowSnapshot:
        return self.take(None)

    @property
    def ts(self) -> np.ndarray:
        return self.whole.ts

    def gather_values(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.whole.gather_values(index)
