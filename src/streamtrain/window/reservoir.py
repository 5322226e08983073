"""The recency-weighted reservoir window the trainer samples from.

Efraimidis–Spirakis weighted reservoir sampling in the log domain: an event with
event time ``ts`` gets the key ``λ·(ts − L) − ln E`` with ``E ~ Exp(1)`` and
``λ = ln 2 / half_life``; the window keeps the W largest keys ever seen (with
``max_age_s``: see below). This is the exponential race (``E / w`` smallest wins,
``w = exp(λ·ts)``) written in logs, so it never computes ``exp(λ·t)``, never overflows
and never needs rescaling. With an infinite half-life ``λ = 0`` and it is a uniform
reservoir. Keys never change once drawn, so without ``max_age_s`` the window is exactly
the top W of the whole stream, whatever the batching.

Batch inserts are vectorized and amortized: the store may overshoot W by a slack S of
extra items (default W / 8); once it holds more than W + S, one ``argpartition`` cuts it
back to the top W. Keys below the last cut's threshold can never enter again, so most of a
uniform stream is dropped by one comparison. The admitted events' readings are copied into
chunks of the window's own, off the malloc heap when large (``chunk_array``), and
compacted once they hold more than 1.25x the live readings: planned at a cut, gathered on
a thread of its own, swapped in at a later cut (:mod:`streamtrain.window.compaction`).
Sensor ids are stored as integer codes into a vocabulary of the window's own (pruned at
cuts), the other columns at the width they need: per item, the columns take 64 bytes
beside the readings.

Readers never wait on the writer's work, nor the writer on theirs. The writer (one at a
time) appends rows past what it last published and writes a cut into arrays no reader
can reach (new ones, or those of the cut before last once nobody holds them), then
publishes the new state by swapping one reference under the lock; a published state is
never written again while anyone can reach it. A reader takes that reference under the
lock (O(1)) and works out, outside it, what a cut at that moment would keep: every read
sees exactly the top W (without ``max_age_s``), whatever the overshoot, but a read cuts
nothing.

With ``max_age_s`` set the window is *not* the top W of the stream, nor of the events
still young enough. A cut (when the store outgrows W + S, and at restore) first drops
the events older than ``max_age_s`` by the clock, then keeps the top W keys of the rest;
an event a cut has pushed out never comes back. A read shows what such a cut would keep
at that moment. So the window is the top W keys of the young events that survived every
cut since they arrived: at most W items, fewer while the places of expired winners wait
for newer events (W = 1, S = 2: three events offered while the winner held the window
are gone at the cut they cause, so once the winner expires the window is empty until the
next event arrives). What it holds depends on when cuts ran, not only on the stream. It
is so on purpose: holding the exact top W of the young events means keeping every event
that fewer than W others outrank (a higher key and at least as young), about
W·(1 + ln(n/W)) of n young events for a uniform reservoir, and WINDOW_CAPACITY would no
longer bound memory. No key threshold is kept either (an old winner's key must not keep
younger events out after it expired), so every offered event is stored until a cut.

Counters: the window keeps the ledger of the Kafka messages its offsets cover, and a
checkpoint saves it with them, so after a restart it counts every covered message once
(replayed messages are not counted twice). ``accepted_total`` counts valid events
offered, ``rejected_total`` refused messages by reason, ``held_out_total`` valid events
kept out of the window for the publish gate's holdout (``HOLDOUT_SHARE``), ``seen_total``
all three, and ``evicted_total`` the accepted events that are not in the window: they
lost the reservoir race (on arrival or at a later cut) or expired (``max_age_s``). Hence
``seen_total == accepted_total + Σ rejected_total + held_out_total`` and
``size == accepted_total − evicted_total`` at every moment. ``evicted_since_start`` is
the part of ``evicted_total`` that happened in this process (what a Prometheus counter,
which starts at zero with the process, reports).

Snapshots share what they can: a snapshot of a state that needs no cut holds read-only
views of the store's columns, and every snapshot holds references to the reading chunks
(never written after insert). A pass's subset then gathers just its own items'
readings; a full-window pass concatenates the chunks once. A checkpoint's
``capture_state`` takes the published state the same way and builds the dict later.

Restore under changed settings: a window saved with another ``half_life_s`` is re-keyed,
not redrawn: each key's random part ``−ln E = key − λ_old·(ts − L)`` is recovered
exactly (up to float rounding) and the key rebuilt as ``λ_new·(ts − L) − ln E``. The items
kept are those the old half-life chose; from then on every event competes under the new
one. A window saved with another ``channels`` cannot be restored (ValueError).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from streamtrain.events import EventBatch
from streamtrain.window.compaction import ChunkMerge, CompactionReport, CompactionRunner, run_in_background
from streamtrain.window.snapshot import PassSource, WindowSnapshot
from streamtrain.window.storage import (
    ItemReadings,
    SensorCodes,
    chunk_array,
    decay_rate,
    gather_tokens,
    held_only_by,
    readings_size,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InsertReport:
    """What one batch insert did.

    ``dropped`` events lost the reservoir race at once (their key is at or below the
    last cut's threshold, so they can never enter); the ``stored`` rest are held until
    the next cut keeps the top W keys, which may still push some of them out.
    """

    offered: int
    stored: int
    dropped: int


@dataclass(frozen=True)
class QuantileSummary:
    min: float
    p50: float
    p90: float
    max: float
    mean: float

    @classmethod
    def of(cls, data: np.ndarray) -> QuantileSummary | None:
        if data.size == 0:
            return None
        p50, p90 = np.quantile(data, [0.5, 0.9])
        return cls(float(data.min()), float(p50), float(p90), float(data.max()), float(data.mean()))


@dataclass(frozen=True)
class WindowStats:
    size: int
    capacity: int
    seen_total: int
    accepted_total: int
    rejected_total: dict[str, int]
    held_out_total: int
    evicted_total: int
    half_life_s: float
    tokens: int
    sensors: int
    age_s: QuantileSummary | None
    length: QuantileSummary | None


@dataclass(frozen=True)
class _Published:
    """One state of the store, as readers see it: immutable once published.

    The writer only appends rows past ``n`` to these arrays (and chunks past ``n_chunks``
    to that list, codes past the vocabulary's used part); a cut writes arrays nobody can
    reach any more (:meth:`RecencyWindow._columns_for_cut`) and a compaction builds a new
    list. So a reader holding this state reads it without a lock. Each state has a
    ``cols`` dict of its own: an array's reference count then tells whether any state
    still holds it.
    """

    cols: Mapping[str, np.ndarray]
    n: int
    chunks: list[np.ndarray]
    n_chunks: int
    vocabulary: np.ndarray  # object [>= codes used]: sensor id of each code
    vocabulary_n: int  # codes used
    next_offsets: Mapping[int, int]
    accepted_total: int
    rejected: Mapping[str, int]
    held_out_total: int
    version: int
    reference_ts: float | None
    rng_state: Mapping[str, Any] | None


class RecencyWindow:
    """Bounded reservoir of sensor events with recency weighting by event time.

    Thread-safe: one writer at a time (the ingest thread; writers are serialized) and
    any number of readers, who never wait on the writer's work. ``rng`` supplies the key
    randomness; pass a seeded generator in tests, leave it None in production for OS
    entropy. ``slack`` is the overshoot S between cuts (default W / 8, at least 4,096 and
    at most W): more slack, fewer cuts, more memory. ``run_compaction`` runs a readings
    compaction's gather: on a thread of its own by default (ingest never waits for it),
    ``compaction.run_inline`` inside the cut (a cut then compacts at once; tests).
    """

    # the stored rows: item columns (sensor ids as codes into a vocabulary, widths sized to
    # need) and where each item's readings lie: chunk and start in it
    _COLUMNS: tuple[tuple[str, Any], ...] = (
        ("keys", np.float64),
        ("ts", np.float64),
        ("labels", np.int64),
        ("lengths", np.int32),
        ("partitions", np.int32),
        ("offsets", np.int64),
        ("seq", np.int64),
        ("sensors", np.int32),
        ("starts", np.int64),
        ("chunks", np.int32),
    )

    # False: every cut takes new columns (bench/first_touch.py compares the two)
    reuse_cut_columns = True

    # rows a compaction's swap works on at a time (its temporaries: a few MB, reused piece to piece)
    _PIECE_ROWS = 1 << 18

    def __init__(
        self,
        capacity: int,
        half_life_s: float = math.inf,
        *,
        channels: int = 1,
        max_age_s: float | None = None,
        slack: int | None = None,
        rng: np.random.Generator | None = None,
        clock: Callable[[], float] = time.time,
        run_compaction: CompactionRunner = run_in_background,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"window capacity must be >= 1, got {capacity}")
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0 (inf for a uniform reservoir), got {half_life_s}")
        self.capacity = int(capacity)
        self.half_life_s = float(half_life_s)
        self.channels = int(channels)
        self.max_age_s = max_age_s
        self.slack = min(self.capacity, max(4096, self.capacity // 8)) if slack is None else max(1, int(slack))
        # Rows of a full set of columns: up to capacity + slack rows are stored between cuts, and
        # the batch that takes the store past them must fit too, or it would take a new set just
        # before the cut takes another. Rows never written cost no memory (untouched pages).
        self._column_rows = self.capacity + 2 * self.slack
        self._decay = decay_rate(self.half_life_s)
        self._rng = rng if rng is not None else np.random.default_rng()
        self._clock = clock
        self._run_compaction = run_compaction
        self._lock = threading.Lock()  # guards only the swap of the published state
        self._write_lock = threading.Lock()  # serializes writers
        self._reference_ts: float | None = None
        # the writer's own state; readers see only what _publish hands them
        self._next_offsets: dict[int, int] = {}
        self._accepted = 0  # the ledger of the covered offsets (module docstring)
        self._rejected: dict[str, int] = {}
        self._held_out = 0
        self._version = 0
        self._evicted_at_start = 0  # evicted_total when this process took the window over
        self._rows_cache: tuple[_Published, float | None, np.ndarray | None] | None = None
        self._compactions = CompactionReport(  # since the window was built, restores included
            in_flight=False, merges_total=0, bytes_total=0, last_gather_s=None, last_bytes=0
        )
        self._reset_storage(0)
        self._publish()

    def _reset_storage(self, rows: int) -> None:
        self._cols = {name: np.empty(max(rows, 1024), dtype=dtype) for name, dtype in self._COLUMNS}
        self._spare_cols: dict[str, np.ndarray] | None = None  # what the last cut replaced (_columns_for_cut)
        self._n = 0  # stored rows; the window is their top `capacity` keys
        self._threshold = -math.inf  # keys at or below it can never enter again
        self._chunk_arrays: list[np.ndarray] = []  # readings, [tokens, C] each; rows point into them; never written
        self._merge: ChunkMerge | None = None  # a readings compaction planned and not swapped in yet
        self._vocabulary = np.empty(1024, dtype=object)
        self._vocabulary_n = 0
        self._codes: dict[str, int] = {}

    def _publish(self) -> None:
        """Hand readers the writer's current state (built outside the lock, swapped under it)."""
        bit_generator = getattr(self._rng, "bit_generator", None)
        state = _Published(
            cols=dict(self._cols),
            n=self._n,
            chunks=self._chunk_arrays,
            n_chunks=len(self._chunk_arrays),
            vocabulary=self._vocabulary,
            vocabulary_n=self._vocabulary_n,
            next_offsets=dict(self._next_offsets),
            accepted_total=self._accepted,
            rejected=dict(self._rejected),
            held_out_total=self._held_out,
            version=self._version,
            reference_ts=self._reference_ts,
            rng_state=None if bit_generator is None else bit_generator.state,
        )
        with self._lock:
            self._published = state

    def _current(self) -> _Published:
        with self._lock:
            return self._published

    # ------------------------------------------------------------------ which rows are the window
    def _select_rows(self, cols: Mapping[str, np.ndarray], n: int, now: float) -> np.ndarray | None:
        """The stored rows a cut at ``now`` keeps (ascending), or None when it keeps all ``n``.

        Expired rows go first (``max_age_s``), then the top ``capacity`` keys of the rest.
        """
        keep: np.ndarray | None = None
        if self.max_age_s is not None and n:
            fresh = cols["ts"][:n] >= now - self.max_age_s
            if not fresh.all():
                keep = np.flatnonzero(fresh)  # expired rows count as evicted (accepted_total - size)
        m = n if keep is None else keep.size
        if m > self.capacity:
            keys = cols["keys"][:n] if keep is None else cols["keys"][keep]
            top = np.argpartition(keys, m - self.capacity)[m - self.capacity :]
            keep = np.sort(top if keep is None else keep[top])
        return keep

    def _window_rows(self, state: _Published, now: float) -> np.ndarray | None:
        """What a cut of ``state`` at ``now`` would keep, without making it (readers never cut).

        Cached per state, so the statistics and the snapshot of one state select once.
        """
        now_key = now if self.max_age_s is not None else None
        cached = self._rows_cache
        if cached is not None and cached[0] is state and cached[1] == now_key:
            return cached[2]
        rows = self._select_rows(state.cols, state.n, now)
        self._rows_cache = (state, now_key, rows)
        return rows

    def _window_size(self, state: _Published) -> int:
        if self.max_age_s is None:
            return min(state.n, self.capacity)
        fresh = int(np.count_nonzero(state.cols["ts"][: state.n] >= self._clock() - self.max_age_s))
        return min(fresh, self.capacity)

    @staticmethod
    def _column(state: _Published, rows: np.ndarray | None, name: str) -> np.ndarray:
        column = state.cols[name]
        if rows is not None:
            return column[rows]
        view = column[: state.n]  # shared with the store: nobody may write it
        view.flags.writeable = False
        return view

    # ------------------------------------------------------------------ sizes and counters
    def __len__(self) -> int:
        return self._window_size(self._current())

    @property
    def accepted_total(self) -> int:
        return self._current().accepted_total

    @property
    def held_out_total(self) -> int:
        return self._current().held_out_total

    @property
    def version(self) -> int:
        return self._current().version

    @property
    def evicted_total(self) -> int:
        """Accepted events not in the window: lost the race (at once or at a cut) or expired."""
        state = self._current()
        return state.accepted_total - self._window_size(state)

    @property
    def evicted_since_start(self) -> int:
        """The part of ``evicted_total`` that happened since this process built or restored the window.

        Never decreases: what the ``streamtrain_window_evicted_total`` counter reports.
        """
        return self.evicted_total - self._evicted_at_start

    @property
    def rejected_total(self) -> dict[str, int]:
        """Refused messages by reason, over the covered offsets."""
        return dict(self._current().rejected)

    @property
    def seen_total(self) -> int:
        """Messages covered: accepted events, rejected messages and held-out events."""
        state = self._current()
        return state.accepted_total + sum(state.rejected.values()) + state.held_out_total

    @property
    def tokens(self) -> int:
        state = self._current()
        rows = self._window_rows(state, self._clock())
        return int(self._column(state, rows, "lengths").sum(dtype=np.int64))

    @property
    def next_offsets(self) -> dict[int, int]:
        return dict(self._current().next_offsets)

    # ------------------------------------------------------------------ writing
    def draw_keys(self, ts: np.ndarray) -> np.ndarray:
        """Reservoir keys ``λ·(ts − L) − ln E`` for events with times ``ts`` (the writer's draws)."""
        if self._reference_ts is None and ts.size:
            self._reference_ts = float(ts[0])
        exp_draws = self._rng.standard_exponential(ts.shape[0])
        return self._decay * (ts - (self._reference_ts or 0.0)) - np.log(exp_draws)

    def insert_batch(
        self,
        batch: EventBatch,
        next_offsets: Mapping[int, int] | None = None,
        *,
        rejected: Mapping[str, int] | None = None,
        held_out: int = 0,
    ) -> InsertReport:
        """Offer a batch of valid events; record the Kafka offsets the new state covers.

        ``next_offsets`` is the next offset per partition once this batch is in, and
        ``rejected`` the messages of the same poll batch refused by reason and ``held_out``
        its valid events kept out for the holdout; all are published in one state with
        the items, so every state knows what it covers.
        """
        if batch.values.ndim != 2 or batch.values.shape[1] != self.channels:
            raise ValueError(f"batch values must be [tokens, {self.channels}], got {batch.values.shape}")
        n = len(batch)
        with self._write_lock:
            keys = self.draw_keys(batch.ts)
            contenders = np.flatnonzero(keys > self._threshold)
            if contenders.size:
                self._append(batch, keys, contenders)
            if self._n > self.capacity + self.slack:
                self._cut()
            if next_offsets:
                self._next_offsets.update({int(p): int(o) for p, o in next_offsets.items()})
            self._count_rejected(rejected)
            self._held_out += int(held_out)
            self._accepted += n
            self._version += 1
            self._publish()
        return InsertReport(offered=n, stored=int(contenders.size), dropped=n - int(contenders.size))

    def advance_offsets(
        self, next_offsets: Mapping[int, int], *, rejected: Mapping[str, int] | None = None, held_out: int = 0
    ) -> None:
        """Record offsets consumed without events for the window (dead-lettered or held out)."""
        with self._write_lock:
            self._next_offsets.update({int(p): int(o) for p, o in next_offsets.items()})
            self._count_rejected(rejected)
            self._held_out += int(held_out)
            self._version += 1
            self._publish()

    def _count_rejected(self, rejected: Mapping[str, int] | None) -> None:
        for reason, count in (rejected or {}).items():
            if count:
                self._rejected[str(reason)] = self._rejected.get(str(reason), 0) + int(count)

    def _sensor_codes(self, sensor_ids: np.ndarray) -> np.ndarray:
        """Integer codes of ``sensor_ids``; new ids are appended to the vocabulary."""
        ids = sensor_ids.tolist()
        found = list(map(self._codes.get, ids))  # the dict lookups run in C: ~60 ns an id
        if None in found:  # ids not seen before get codes in order of first appearance, then all are looked up
            for sensor in dict.fromkeys(itertools.compress(ids, map(operator.is_, found, itertools.repeat(None)))):
                self._new_code(sensor)
            found = list(map(self._codes.get, ids))
        return np.fromiter(found, dtype=np.int32, count=len(found))

    def _new_code(self, sensor: str) -> int:
        code = self._vocabulary_n
        if code == self._vocabulary.shape[0]:  # grown into a new array: published ones stay as they are
            grown = np.empty(2 * code, dtype=object)
            grown[:code] = self._vocabulary[:code]
            self._vocabulary = grown
        self._vocabulary[code] = sensor
        self._codes[sensor] = code
        self._vocabulary_n += 1
        return code

    def _append(
        self, batch: EventBatch, keys: np.ndarray, rows: np.ndarray, *, adopted: ItemReadings | None = None
    ) -> None:
        """Write the rows past the published ``n`` (readers never look there) and their readings.

        ``adopted``: the readings of every row of ``batch``, in order, in arrays nobody writes
        again (a restored state's): they become chunks as they are, instead of a copy.
        """
        k = rows.shape[0]
        lengths = batch.lengths[rows]
        first_chunk = len(self._chunk_arrays)
        chunk_of: np.ndarray | int = first_chunk
        if adopted is not None:
            new_chunks = [self._own_chunk(chunk) for chunk in adopted.chunks]
            starts, chunk_of = adopted.starts, first_chunk + adopted.chunk_of
        else:  # the rows' readings, copied into storage of the window's own (chunk_array)
            new_chunks = [
                gather_tokens(
                    batch.values, batch.starts[rows], lengths, out=chunk_array(int(lengths.sum()), self.channels)
                )
            ]
            starts = np.zeros(k, dtype=np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
        self._grow(self._n + k)
        self._chunk_arrays.extend(new_chunks)
        at = slice(self._n, self._n + k)
        cols = self._cols
        cols["keys"][at] = keys[rows]
        cols["ts"][at] = batch.ts[rows]
        cols["labels"][at] = batch.labels[rows]
        cols["lengths"][at] = lengths
        cols["starts"][at] = starts
        cols["chunks"][at] = chunk_of
        cols["partitions"][at] = batch.partitions[rows]
        cols["offsets"][at] = batch.offsets[rows]
        cols["seq"][at] = self._accepted + rows  # arrival order: accepted count before + position
        cols["sensors"][at] = self._sensor_codes(batch.sensor_ids[rows])
        self._n += k

    def _own_chunk(self, readings: np.ndarray) -> np.ndarray:
        """``readings`` as a chunk: itself when it is contiguous float32, else a copy (``chunk_array``)."""
        readings = readings.reshape(-1, self.channels)
        if readings.dtype == np.float32 and readings.flags.c_contiguous:
            return readings
        chunk = chunk_array(readings.shape[0], self.channels)
        chunk[...] = readings
        return chunk

    def _grow(self, rows: int) -> None:
        size = self._cols["keys"].shape[0]
        if rows <= size:
            return
        new_size = max(rows, min(2 * size, self._column_rows))
        grown = {name: np.empty(new_size, dtype=dtype) for name, dtype in self._COLUMNS}
        for name, column in grown.items():
            column[: self._n] = self._cols[name][: self._n]
        self._cols = grown

    def _cut(self) -> None:
        """Keep the top ``capacity`` keys (and drop expired rows) in other columns; compact readings if sparse."""
        n, cols = self._n, self._cols
        keep = self._select_rows(cols, n, self._clock())
        if keep is None:
            return
        if self.max_age_s is None:
            self._threshold = float(cols["keys"][keep].min()) if keep.size else self._threshold
        size = min(self._column_rows, max(keep.size + 2 * self.slack, 1024))
        kept = self._columns_for_cut(size)
        for name, column in kept.items():
            np.take(cols[name][:n], keep, out=column[: keep.size])
        self._cols, self._n = kept, int(keep.size)
        self._compact_chunks()
        self._compact_vocabulary()

    def _columns_for_cut(self, size: int) -> dict[str, np.ndarray]:
        """Columns of ``size`` rows for a cut: those the cut before last replaced, when nobody can
        reach them any more, else new ones.

        New columns are memory the process never touched, which costs a page fault a page
        (on the development VM, ~100 MB/s: seconds of ingest at 10M items); the columns of
        the cut before last were touched already. They are written again only when no
        published state, view or reader refers to them (:func:`held_only_by`); a capture or
        a pass that still holds them keeps them as they are, and the cut takes new columns.
        The columns this cut replaces are kept for the next one.
        """
        spare, self._spare_cols = self._spare_cols, self._cols
        self._rows_cache = None  # a cached state would hold the spare's arrays; the next read fills it again
        if self.reuse_cut_columns and spare is not None and spare["keys"].shape[0] == size and held_only_by(spare):
            return spare
        return {name: np.empty(size, dtype=dtype) for name, dtype in self._COLUMNS}

    def _compact_chunks(self) -> None:
        """Drop dead chunks; swap in a merge gathered since an earlier cut; plan one if the chunks are sparse.

        A merge is planned only when the chunks hold more than 1.25x the live readings (plus
        64k tokens), and none is in flight; it takes the emptiest chunks first until they
        would hold at most 1.1x: memory stays close to the data, and a chunk is copied only
        once a fifth or more of it is garbage. Its gather runs on ``run_compaction``'s thread;
        when that runs it inline, this cut swaps it in at once. A cut that swaps one in plans
        none (the merged chunk already holds what this cut evicted: planning again at once
        would gather twice as often as compacting inside the cut does).
        """
        swapped = self._swap_in_merge()
        n, cols = self._n, self._cols
        chunk_ids, lengths = cols["chunks"][:n], cols["lengths"][:n]
        live_tokens = np.bincount(chunk_ids, weights=lengths, minlength=len(self._chunk_arrays))
        alive = live_tokens > 0
        if not alive.all():
            self._keep_chunks(alive, None)
            live_tokens = live_tokens[alive]
        if self._merge is not None or swapped:  # the merged chunk holds a cut's evictions already: plan at the next
            return
        sizes = np.fromiter((c.shape[0] for c in self._chunk_arrays), np.float64, count=len(self._chunk_arrays))
        live, held = live_tokens.sum(), sizes.sum()
        if held <= 1.25 * live + 65536:
            return
        candidates = np.flatnonzero(live_tokens < sizes)
        candidates = candidates[np.argsort(live_tokens[candidates] / sizes[candidates], kind="stable")]
        freed = np.cumsum(sizes[candidates] - live_tokens[candidates])
        sparse = np.sort(candidates[: int(np.searchsorted(freed, held - 1.1 * live)) + 1])  # rows' order, mostly
        source_of_chunk = np.full(len(self._chunk_arrays), -1, dtype=np.int32)
        source_of_chunk[sparse] = np.arange(sparse.size, dtype=np.int32)
        self._merge = ChunkMerge(
            [self._chunk_arrays[i] for i in sparse.tolist()],
            source_of_chunk,
            (cols["chunks"][:n], cols["starts"][:n], lengths),
            self.channels,
        )
        self._run_compaction(self._merge.gather)
        self._swap_in_merge()

    def _swap_in_merge(self) -> bool:
        """Put the merged chunk in place of its sources once it is gathered (in the cut's columns, unpublished);
        whether it did.

        Row by row in pieces of ``_PIECE_ROWS``: the temporaries stay small enough to reuse the
        memory of the piece before (new memory costs a page fault a page; docs/operations.md).
        """
        merge = self._merge
        if merge is None or not merge.done.is_set():
            return False
        self._merge = None
        if merge.failed:  # logged: the sources stay
            return False
        position = {id(source): i for i, source in enumerate(merge.sources)}
        source_of_chunk = np.fromiter(
            (position.get(id(chunk), -1) for chunk in self._chunk_arrays), np.int32, count=len(self._chunk_arrays)
        )
        moved = 0
        for lo in range(0, self._n, self._PIECE_ROWS):
            piece = slice(lo, min(lo + self._PIECE_ROWS, self._n))
            row_sources = source_of_chunk[self._cols["chunks"][piece]]
            rows = np.flatnonzero(row_sources >= 0)
            if rows.size:
                starts = self._cols["starts"][piece]
                starts[rows] = merge.new_starts(row_sources[rows], starts[rows])
                moved += rows.size
        self._keep_chunks(source_of_chunk < 0, merge.merged if moved else None)
        done = self._compactions
        self._compactions = CompactionReport(
            in_flight=False,
            merges_total=done.merges_total + 1,
            bytes_total=done.bytes_total + merge.nbytes,
            last_gather_s=merge.gather_s,
            last_bytes=merge.nbytes,
        )
        return True

    def _keep_chunks(self, keep: np.ndarray, merged: np.ndarray | None) -> None:
        """Keep the chunks ``keep`` (a mask) in order, then ``merged`` (where every row not in a kept
        chunk now points); renumber the rows' chunks. A new list: published states keep theirs."""
        new_index = np.full(len(self._chunk_arrays), len(self._chunk_arrays), dtype=np.int32)
        kept = np.flatnonzero(keep)
        new_index[kept] = np.arange(kept.size, dtype=np.int32)
        new_index[~keep] = kept.size
        arrays = [self._chunk_arrays[i] for i in kept.tolist()]
        if merged is not None:
            arrays.append(merged)
        for lo in range(0, self._n, self._PIECE_ROWS):
            chunk_ids = self._cols["chunks"][lo : min(lo + self._PIECE_ROWS, self._n)]
            np.take(new_index, chunk_ids, out=chunk_ids)
        self._chunk_arrays = arrays

    @property
    def compactions(self) -> CompactionReport:
        """The readings compactions so far, and whether one is in flight (``/v1/window``)."""
        return dataclasses.replace(self._compactions, in_flight=self._merge is not None)

    def wait_for_compaction(self, timeout: float | None = None) -> bool:
        """Wait until no merge is gathering (the next cut swaps a gathered one in); False on timeout."""
        merge = self._merge
        return merge is None or merge.done.wait(timeout)

    def _compact_vocabulary(self) -> None:
        """Forget sensor ids no stored row uses, once they are most of the vocabulary."""
        if self._vocabulary_n <= 1024:
            return
        used = np.bincount(self._cols["sensors"][: self._n], minlength=self._vocabulary_n) > 0
        if 2 * int(used.sum()) >= self._vocabulary_n:
            return
        live = np.flatnonzero(used)
        remap = np.full(self._vocabulary_n, -1, dtype=np.int32)
        remap[live] = np.arange(live.size, dtype=np.int32)
        self._cols["sensors"][: self._n] = remap[self._cols["sensors"][: self._n]]
        vocabulary = np.empty(max(1024, 2 * live.size), dtype=object)
        vocabulary[: live.size] = self._vocabulary[live]
        self._vocabulary, self._vocabulary_n = vocabulary, int(live.size)
        self._codes = {sensor: code for code, sensor in enumerate(vocabulary[: live.size].tolist())}

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> WindowSnapshot:
        """A consistent view of the window, in insertion order.

        Under the lock only a reference to the published state is taken; which rows are
        the window, and the columns the view holds, are worked out outside it.
        """
        return self._snapshot_of(self._current(), self._clock())

    def pass_source(self) -> PassSource:
        """What a training pass chooses from: like :meth:`snapshot`, but the columns only a
        chosen item needs are gathered for the chosen items alone (:class:`PassSource`)."""
        state, now = self._current(), self._clock()
        rows = self._window_rows(state, now)

        def column(name: str) -> np.ndarray:
            return self._column(state, rows, name)

        def take(index: np.ndarray | None) -> WindowSnapshot:
            if index is None:
                return self._snapshot_at(state, now, rows)
            return self._snapshot_at(state, now, index if rows is None else rows[index])

        return PassSource(
            lengths=column("lengths").astype(np.int64),
            labels=column("labels"),
            sensor_ids=SensorCodes(column("sensors"), state.vocabulary[: state.vocabulary_n]),
            seq=column("seq"),
            version=state.version,
            taken_at=now,
            take=take,
        )

    def _snapshot_of(self, state: _Published, now: float) -> WindowSnapshot:
        return self._snapshot_at(state, now, self._window_rows(state, now))

    def _snapshot_at(self, state: _Published, now: float, rows: np.ndarray | None) -> WindowSnapshot:
        """The snapshot of ``state``'s stored ``rows`` (None: the first ``n``) at ``now``, its sensor
        ids as :class:`SensorCodes` (the window's codes): one Python object per item costs a pass
        over millions of items interpreter time that ingest waits beside (docs/operations.md,
        "A window of millions")."""
        chunks = tuple(state.chunks[: state.n_chunks]) or (np.zeros((0, self.channels), np.float32),)
        sizes = np.fromiter((c.shape[0] for c in chunks), np.int64, count=len(chunks))
        base = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=base[1:])

        def column(name: str) -> np.ndarray:
            return self._column(state, rows, name)

        return WindowSnapshot(
            flat_values=chunks,
            starts=base[column("chunks")] + column("starts"),
            lengths=column("lengths").astype(np.int64),
            ts=column("ts"),
            labels=column("labels"),
            keys=column("keys"),
            sensor_ids=SensorCodes(column("sensors"), state.vocabulary[: state.vocabulary_n]),
            partitions=column("partitions"),
            offsets=column("offsets"),
            next_offsets=dict(state.next_offsets),
            version=state.version,
            taken_at=now,
            seq=column("seq"),
        )

    def stats(self, now: float | None = None) -> WindowStats:
        """Statistics for ``GET /v1/window``: O(W) numpy work on columns, no reading copies, no lock held."""
        now = self._clock() if now is None else now
        state = self._current()
        rows = self._window_rows(state, now)
        ts = self._column(state, rows, "ts")
        lengths = self._column(state, rows, "lengths")
        sensors = self._column(state, rows, "sensors")
        accepted, rejected = state.accepted_total, dict(state.rejected)
        return WindowStats(
            size=int(ts.shape[0]),
            capacity=self.capacity,
            seen_total=accepted + sum(rejected.values()) + state.held_out_total,
            accepted_total=accepted,
            rejected_total=rejected,
            held_out_total=state.held_out_total,
            evicted_total=accepted - int(ts.shape[0]),
            half_life_s=self.half_life_s,
            tokens=int(lengths.sum(dtype=np.int64)),
            sensors=int(np.count_nonzero(np.bincount(sensors))) if sensors.size else 0,
            age_s=QuantileSummary.of(np.maximum(now - ts, 0.0)),
            length=QuantileSummary.of(lengths.astype(np.float64)),
        )

    def age_quantiles(self, quantiles: Sequence[float], now: float | None = None) -> list[float]:
        """Item ages (now − event time) at the given quantiles; zeros for an empty window."""
        now = self._clock() if now is None else now
        state = self._current()
        ts = self._column(state, self._window_rows(state, now), "ts")
        if ts.size == 0:
            return [0.0 for _ in quantiles]
        return [float(q) for q in np.quantile(np.maximum(now - ts, 0.0), list(quantiles))]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: items, keys, offsets, counters, RNG."""
        return self.capture_state()()

    def capture_state(self) -> WindowCapture:
        """Fix the state now (a reference, under the lock); the capture builds the dict later.

        Everything, readings included, is gathered by the capture (called for the whole
        state, or asked for a delta) with no lock held: a checkpoint never holds ingest back.
        """
        return WindowCapture(self, self._current(), self._clock())

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError (one line) if ``state`` cannot be restored into this window."""
        channels = int(state.get("channels", self.channels))
        if channels != self.channels:
            raise ValueError(
                f"the checkpoint's window holds readings of CHANNELS={channels}, this service is configured "
                f"with CHANNELS={self.channels}"
            )
        lengths = np.asarray(state["lengths"], dtype=np.int64)
        if readings_size(state["values"]) != int(lengths.sum()) * self.channels:
            raise ValueError("window state is inconsistent: lengths do not sum to the stored values")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`.

        A smaller capacity keeps the top keys; another half-life re-keys the items
        (module docstring); another ``channels`` raises ValueError. The window keeps the
        state's readings arrays as its own (no copy) when they are contiguous (one array,
        or a restore's :class:`ItemReadings`): do not write them afterwards.
        """
        self.check_state(state)
        lengths = np.asarray(state["lengths"], dtype=np.int64)
        readings = state["values"]
        if not isinstance(readings, ItemReadings):
            readings = ItemReadings.back_to_back(np.asarray(readings, dtype=np.float32), lengths, self.channels)
        batch = EventBatch(
            sensor_ids=np.asarray(state["sensor_ids"], dtype=object).reshape(-1),
            ts=np.asarray(state["ts"], dtype=np.float64),
            labels=np.asarray(state["labels"], dtype=np.int64),
            lengths=lengths,
            values=np.zeros((0, self.channels), np.float32),  # the readings are adopted from ``readings``
            partitions=np.asarray(state["partitions"], dtype=np.int32),
            offsets=np.asarray(state["offsets"], dtype=np.int64),
        )
        reference_ts = state.get("reference_ts")
        keys = np.asarray(state["keys"], dtype=np.float64)
        saved_half_life = float(state.get("half_life_s", self.half_life_s))
        if saved_half_life != self.half_life_s and len(batch):
            keys = rekey(keys, batch.ts, reference_ts, saved_half_life, self.half_life_s)
            log.warning(
                "the checkpoint's window was keyed with HALF_LIFE_S=%g; re-keyed its %d items for HALF_LIFE_S=%g "
                "(each keeps its own random draw; the items kept are the ones the old half-life chose, new "
                "events compete under the new one)",
                saved_half_life,
                len(batch),
                self.half_life_s,
            )
        with self._write_lock:
            self._reset_storage(len(batch))
            self._accepted = 0
            if len(batch):
                self._append(batch, keys, np.arange(len(batch)), adopted=readings)
                if state.get("seq") is not None:
                    self._cols["seq"][: len(batch)] = np.asarray(state["seq"], dtype=np.int64)
            self._cut()
            if self._n == self.capacity and self.max_age_s is None:
                self._threshold = float(self._cols["keys"][: self._n].min())
            self._reference_ts = reference_ts
            self._next_offsets = {int(p): int(o) for p, o in dict(state.get("next_offsets", {})).items()}
            self._accepted = int(state.get("accepted_total", self._n))
            self._rejected = {str(r): int(c) for r, c in dict(state.get("rejected_total", {})).items()}
            self._held_out = int(state.get("held_out_total", 0))
            self._evicted_at_start = self._accepted - self._n
            self._version = int(state.get("version", 0))
            rng_state = state.get("rng_state")
            bit_generator = getattr(self._rng, "bit_generator", None)
            if (
                rng_state is not None
                and bit_generator is not None
                and rng_state.get("bit_generator") == bit_generator.state["bit_generator"]
            ):
                bit_generator.state = rng_state
            self._publish()


class WindowCapture:
    """One published state of a window, fixed for a checkpoint: the whole state or a delta.

    Calling it builds what :meth:`RecencyWindow.state_dict` returns. :meth:`delta` builds
    only what changed since a window whose items had the arrival numbers
    ``previous_seq``: the items that entered since (readings and columns), the numbers of
    those that left, and every counter whole (:mod:`streamtrain.checkpoint.incremental`).
    A checkpoint asks for its sensor ids as :class:`SensorCodes` (``for_checkpoint=True``;
    a delta's always are): the codes the window keeps, not an object per item.
    """

    def __init__(self, window: RecencyWindow, state: _Published, now: float) -> None:
        self._window = window
        self._state = state
        self._now = now

    @cached_property
    def _snapshot(self) -> WindowSnapshot:
        return self._window._snapshot_of(self._state, self._now)

    @property
    def settings(self) -> tuple[int, float, int]:
        """(capacity, half-life, channels): what a delta and its parent must share."""
        return (self._window.capacity, self._window.half_life_s, self._window.channels)

    @property
    def seq(self) -> np.ndarray:
        """The window's items by arrival number (every item's own, unique), in item order."""
        seq = self._snapshot.seq
        assert seq is not None  # a window's snapshots always carry them
        return seq

    @property
    def partitions(self) -> np.ndarray:
        """The Kafka partition of each of the window's items, in item order."""
        return self._snapshot.partitions

    @property
    def next_offsets(self) -> dict[int, int]:
        """The next offset of every partition the window has read, at the capture."""
        return dict(self._state.next_offsets)

    def _scalars(self) -> dict[str, Any]:
        window, state = self._window, self._state
        return {
            "capacity": window.capacity,
            "half_life_s": window.half_life_s,
            "channels": window.channels,
            "reference_ts": state.reference_ts,
            "accepted_total": state.accepted_total,
            "rejected_total": dict(state.rejected),
            "held_out_total": state.held_out_total,
            "rng_state": state.rng_state,
            "next_offsets": {str(p): o for p, o in state.next_offsets.items()},
            "version": state.version,
        }

    @staticmethod
    def _items(snap: WindowSnapshot, *, values: Any) -> dict[str, Any]:
        return {
            "values": values,
            "lengths": snap.lengths,
            "ts": snap.ts,
            "labels": snap.labels,
            "keys": snap.keys,
            "sensor_ids": snap.sensor_ids,
            "partitions": snap.partitions,
            "offsets": snap.offsets,
            "seq": snap.seq,
        }

    def __call__(self, *, for_checkpoint: bool = False) -> dict[str, Any]:
        """The whole state, as :meth:`RecencyWindow.load_state_dict` reads it; ``for_checkpoint``:
        sensor ids as :class:`SensorCodes` and the readings where they lie (:class:`ItemReadings`,
        gathered piece by piece as the file is written), not as new arrays of millions."""
        snap = self._snapshot
        if for_checkpoint:
            return {**self._scalars(), **self._items(snap, values=snap.item_readings())}
        items = self._items(snap, values=snap.all_values())
        items["sensor_ids"] = np.asarray(items["sensor_ids"], dtype=object)
        return {**self._scalars(), **items}

    def delta(self, previous_seq: np.ndarray) -> dict[str, Any]:
        """What changed since a window of the items ``previous_seq`` (sorted ascending).

        ``entered``: the items not among them, as :meth:`__call__` lists items; ``left_seq``:
        the numbers among them no longer in the window; the counters, offsets and RNG
        state whole.
        """
        seq = self.seq
        entered = np.flatnonzero(~sorted_member(seq, previous_seq))
        left = previous_seq[~sorted_member(previous_seq, np.sort(seq))]
        entering = self._snapshot.subset(entered)
        return {**self._scalars(), "entered": self._items(entering, values=entering.all_values()), "left_seq": left}


def sorted_member(values: np.ndarray, sorted_pool: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` is in ``sorted_pool`` (ascending): a vectorized binary search."""
    if sorted_pool.size == 0:
        return np.zeros(values.shape[0], dtype=bool)
    at = np.minimum(np.searchsorted(sorted_pool, values), sorted_pool.size - 1)
    return sorted_pool[at] == values


def rekey(
    keys: np.ndarray, ts: np.ndarray, reference_ts: float | None, old_half_life_s: float, new_half_life_s: float
) -> np.ndarray:
    """Keys ``λ_old·(ts − L) − ln E`` rebuilt as ``λ_new·(ts − L) − ln E`` with the same draws E."""
    reference = float(ts[0]) if reference_ts is None and ts.size else float(reference_ts or 0.0)
    age = ts - reference
    return keys - decay_rate(old_half_life_s) * age + decay_rate(new_half_life_s) * age
