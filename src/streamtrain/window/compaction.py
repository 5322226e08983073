"""A window's readings compaction, off the ingest path: plan at a cut, gather on another thread,
swap in at a later cut.

A cut that finds the reading chunks holding too much garbage picks the sparse ones and
plans a :class:`ChunkMerge` of them, with that cut's columns (published, never written
again), which say which of their rows are live and where their readings lie. Reading those
rows and gathering their readings into one new chunk is most of a compaction's cost (it
copies most of the window into memory the process never touched: seconds at millions of
items, see docs/operations.md), and it needs nothing the writer changes: chunks are never
written after insert. So :meth:`ChunkMerge.gather` runs on a thread of its own
(:func:`run_in_background`) while ingest goes on, and the first cut after it finished swaps
the merged chunk in (:meth:`ChunkMerge.new_starts`). Rows evicted meanwhile just leave garbage in the merged
chunk; rows never enter an old chunk, so every row still in a sparse chunk at the swap was
planned. :func:`run_inline` gathers inside the planning cut instead (tests, benchmarks):
the cut then swaps at once, as a synchronous compaction would.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from streamtrain.window.storage import ItemReadings, chunk_array

log = logging.getLogger(__name__)

#: How a window runs a merge's gather: given the gather, start it (or run it) and return.
CompactionRunner = Callable[[Callable[[], None]], None]


def run_in_background(gather: Callable[[], None]) -> None:
    """Gather on a daemon thread of its own: ingest does not wait for it, nor does an exiting process."""
    threading.Thread(target=gather, name="window-compaction", daemon=True).start()


def run_inline(gather: Callable[[], None]) -> None:
    """Gather inside the cut that planned the merge: it is swapped in by that same cut."""
    gather()


@dataclass(frozen=True)
class CompactionReport:
    """The window's readings compactions since it was built (a restore drops one in flight, not the counts).

    ``in_flight``: a merge is planned and not swapped in yet (gathering, or gathered and
    waiting for the next cut); ``last_gather_s`` and ``last_bytes``: the gather of the
    last merge swapped in and the readings it copied.
    """

    in_flight: bool
    merges_total: int
    bytes_total: int
    last_gather_s: float | None
    last_bytes: int


class ChunkMerge:
    """The live readings of some chunks (``sources``), as one cut found them, gathered into one new chunk.

    A row is named by its place in the sources' concatenation (its key: the sizes of the
    sources before its own, plus its start): the merged chunk holds the planned rows
    ordered by key, so each source is read front to back, and a later cut finds a row's
    new start by a binary search of its key.
    """

    def __init__(
        self,
        sources: Sequence[np.ndarray],
        source_of_chunk: np.ndarray,
        columns: tuple[np.ndarray, np.ndarray, np.ndarray],
        channels: int,
    ) -> None:
        """``source_of_chunk``: each chunk's index in ``sources`` (-1: not merged); ``columns``: the
        planning cut's ``chunks``, ``starts`` and ``lengths`` of its rows, which it publishes and never
        writes again. The merge reads its rows from them when it gathers, then lets go of them: the
        writer plans in O(chunks), and the columns can be written again by the cut after next."""
        self.sources = tuple(sources)
        self._source_of_chunk = source_of_chunk
        self._columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = columns
        self._channels = channels
        self.tokens = 0
        self.done = threading.Event()  # set once gathered, or once the gather failed
        self.failed = False
        self.merged: np.ndarray | None = None
        self.gather_s = 0.0
        self._bases = np.zeros(0, dtype=np.int64)
        self._keys = np.zeros(0, dtype=np.int64)
        self._merged_starts = np.zeros(0, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return 4 * self.tokens * self._channels

    def gather(self) -> None:
        """Read the planned rows, sort them by key and gather their readings into a new chunk (any thread, once)."""
        began = time.perf_counter()
        try:
            source_of, starts, lengths = self._planned_rows()
            sizes = np.fromiter((source.shape[0] for source in self.sources), np.int64, count=len(self.sources))
            self._bases = np.zeros(sizes.size, dtype=np.int64)
            np.cumsum(sizes[:-1], out=self._bases[1:])
            keys = self._bases[source_of] + starts
            order = np.argsort(keys, kind="stable")
            lengths = lengths[order]
            self.tokens = int(lengths.sum())
            merged = chunk_array(self.tokens, self._channels)
            ItemReadings(self.sources, source_of[order].astype(np.int32), starts[order], lengths).gather_into(merged)
            merged_starts = np.zeros(lengths.shape[0], dtype=np.int64)
            np.cumsum(lengths[:-1], out=merged_starts[1:])
            self._keys, self._merged_starts, self.merged = keys[order], merged_starts, merged
        except Exception:  # the sources stay as they are; a later cut may plan again
            self.failed = True
            log.exception("a readings compaction of %d chunks failed; the window keeps them", len(self.sources))
        finally:
            self._columns = None
            self.gather_s = time.perf_counter() - began
            self.done.set()

    def _planned_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each planned row's source, start and length, read from the planning cut's columns, which the
        merge then lets go of (no name of this thread may hold them while it gathers: the cut after
        next would take new columns, seconds of first touch at millions of items)."""
        assert self._columns is not None, "a merge gathers once"
        chunk_ids, starts, lengths = self._columns
        self._columns = None
        row_sources = self._source_of_chunk[chunk_ids]
        rows = np.flatnonzero(row_sources >= 0)
        return row_sources[rows], starts[rows], lengths[rows].astype(np.int64)

    def new_starts(self, source_of: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Where rows still in the sources (``source_of``, ``starts``: all planned rows) start in ``merged``."""
        keys = self._bases[source_of] + starts
        at = np.minimum(np.searchsorted(self._keys, keys), max(self._keys.size - 1, 0))
        if keys.size and not np.array_equal(self._keys[at], keys):
            raise RuntimeError("a row in a chunk being merged was not planned: rows must never enter an old chunk")
        return self._merged_starts[at]
