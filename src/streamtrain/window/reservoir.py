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
extra items; one ``argpartition`` over W + S items then cuts it back to the top W. Keys
below the last cut's threshold can never enter again, so most of a uniform stream is
dropped by one comparison. Readers always see the cut state (a cut runs first), so the
window they observe is exactly the top W (without ``max_age_s``). The admitted events'
readings are copied into chunks of the window's own, off the malloc heap when large
(``chunk_array``), and compacted at cuts once garbage dominates.

With ``max_age_s`` set the window is *not* the top W of the stream, nor of the events
still young enough. Every cut (before each read, and whenever the store outgrows W + S)
first drops the events older than ``max_age_s`` by the clock, then keeps the top W keys
of the rest; an event a cut has pushed out never comes back. So the window is the top W
keys of the young events that survived every cut since they arrived: at most W items,
fewer while the places of expired winners wait for newer events (W = 1: the events
offered while the winner held the window are gone at the next cut, so once the winner
expires the window is empty until the next event arrives). What it holds depends on when
cuts ran, not only on the stream. It is so on purpose: holding the exact top W of the
young events means keeping every event that fewer than W others outrank (a higher key
and at least as young), about W·(1 + ln(n/W)) of n young events for a uniform reservoir,
and WINDOW_CAPACITY would no longer bound memory. No key threshold is kept either (an
old winner's key must not keep younger events out after it expired), so every offered
event is stored until a cut.

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

Snapshots share readings: under the lock a snapshot copies the small per-item columns
and takes references to the reading chunks (never written after insert), so the lock
is held for O(W) column copies only. A pass's subset then gathers just its own items'
readings; a full-window pass concatenates the chunks once, outside the lock.

Restore under changed settings: a window saved with another ``half_life_s`` is re-keyed,
not redrawn: each key's random part ``−ln E = key − λ_old·(ts − L)`` is recovered
exactly (up to float rounding) and the key rebuilt as ``λ_new·(ts − L) − ln E``. The items
kept are those the old half-life chose; from then on every event competes under the new
one. A window saved with another ``channels`` cannot be restored (ValueError).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamtrain.events import EventBatch
from streamtrain.window.snapshot import WindowSnapshot
from streamtrain.window.storage import ITEM_COLUMNS, chunk_array, decay_rate, gather_tokens

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


class RecencyWindow:
    """Bounded reservoir of sensor events with recency weighting by event time.

    Thread-safe: one writer (the ingest thread) and any number of readers taking
    snapshots. ``rng`` supplies the key randomness; pass a seeded generator in tests,
    leave it None in production for OS entropy. ``slack`` is the overshoot S between
    cuts (default W): more slack, fewer cuts, more memory.
    """

    # the item columns, and where each item's readings lie: chunk and start in it
    _COLUMNS = (*ITEM_COLUMNS, ("starts", np.int64), ("chunks", np.int64))

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
    ) -> None:
        if capacity < 1:
            raise ValueError(f"window capacity must be >= 1, got {capacity}")
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0 (inf for a uniform reservoir), got {half_life_s}")
        self.capacity = int(capacity)
        self.half_life_s = float(half_life_s)
        self.channels = int(channels)
        self.max_age_s = max_age_s
        self.slack = self.capacity if slack is None else max(1, int(slack))
        self._decay = decay_rate(self.half_life_s)
        self._rng = rng if rng is not None else np.random.default_rng()
        self._clock = clock
        self._lock = threading.Lock()
        self._reference_ts: float | None = None
        self._next_offsets: dict[int, int] = {}
        self.accepted_total = 0  # the ledger of the covered offsets (module docstring)
        self._rejected: dict[str, int] = {}
        self.held_out_total = 0
        self._evicted_at_start = 0  # evicted_total when this process took the window over
        self.version = 0
        self._reset_storage(0)

    def _reset_storage(self, rows: int) -> None:
        self._cols = {name: np.empty(max(rows, 1024), dtype=dtype) for name, dtype in self._COLUMNS}
        self._n = 0  # stored rows; the window is their top `capacity` keys
        self._threshold = -math.inf  # keys at or below it can never enter again
        self._chunk_arrays: list[np.ndarray] = []  # readings, [tokens, C] each; rows point into them; never written

    # ------------------------------------------------------------------ sizes and counters
    def __len__(self) -> int:
        return min(self._n, self.capacity)

    @property
    def evicted_total(self) -> int:
        """Accepted events not in the window: lost the race (at once or at a cut) or expired."""
        with self._lock:
            return self.accepted_total - min(self._n, self.capacity)

    @property
    def evicted_since_start(self) -> int:
        """The part of ``evicted_total`` that happened since this process built or restored the window.

        Never decreases: what the ``streamtrain_window_evicted_total`` counter reports.
        """
        return self.evicted_total - self._evicted_at_start

    @property
    def rejected_total(self) -> dict[str, int]:
        """Refused messages by reason, over the covered offsets."""
        with self._lock:
            return dict(self._rejected)

    @property
    def seen_total(self) -> int:
        """Messages covered: accepted events, rejected messages and held-out events."""
        with self._lock:
            return self.accepted_total + sum(self._rejected.values()) + self.held_out_total

    @property
    def tokens(self) -> int:
        with self._lock:
            self._cut_locked()
            return int(self._cols["lengths"][: self._n].sum())

    @property
    def next_offsets(self) -> dict[int, int]:
        with self._lock:
            return dict(self._next_offsets)

    # ------------------------------------------------------------------ writing
    def draw_keys(self, ts: np.ndarray) -> np.ndarray:
        """Reservoir keys ``λ·(ts − L) − ln E`` for events with times ``ts``."""
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
        its valid events kept out for the holdout; all are stored under the same lock as
        the items, so every state knows what it covers.
        """
        if batch.values.ndim != 2 or batch.values.shape[1] != self.channels:
            raise ValueError(f"batch values must be [tokens, {self.channels}], got {batch.values.shape}")
        n = len(batch)
        keys = self.draw_keys(batch.ts)
        with self._lock:
            contenders = np.flatnonzero(keys > self._threshold)
            if contenders.size:
                self._append_locked(batch, keys, contenders)
            if self._n > self.capacity + self.slack:
                self._cut_locked()
            if next_offsets:
                self._next_offsets.update({int(p): int(o) for p, o in next_offsets.items()})
            self._count_rejected_locked(rejected)
            self.held_out_total += int(held_out)
            self.accepted_total += n
            self.version += 1
        return InsertReport(offered=n, stored=int(contenders.size), dropped=n - int(contenders.size))

    def advance_offsets(
        self, next_offsets: Mapping[int, int], *, rejected: Mapping[str, int] | None = None, held_out: int = 0
    ) -> None:
        """Record offsets consumed without events for the window (dead-lettered or held out)."""
        with self._lock:
            self._next_offsets.update({int(p): int(o) for p, o in next_offsets.items()})
            self._count_rejected_locked(rejected)
            self.held_out_total += int(held_out)
            self.version += 1

    def _count_rejected_locked(self, rejected: Mapping[str, int] | None) -> None:
        for reason, count in (rejected or {}).items():
            if count:
                self._rejected[str(reason)] = self._rejected.get(str(reason), 0) + int(count)

    def _append_locked(self, batch: EventBatch, keys: np.ndarray, rows: np.ndarray) -> None:
        k = rows.shape[0]
        lengths = batch.lengths[rows]
        # the rows' readings, copied into storage of the window's own (chunk_array)
        chunk = gather_tokens(
            batch.values, batch.starts[rows], lengths, out=chunk_array(int(lengths.sum()), self.channels)
        )
        starts = np.zeros(k, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        self._chunk_arrays.append(chunk)
        self._grow_locked(self._n + k)
        at = slice(self._n, self._n + k)
        cols = self._cols
        cols["keys"][at] = keys[rows]
        cols["ts"][at] = batch.ts[rows]
        cols["labels"][at] = batch.labels[rows]
        cols["lengths"][at] = lengths
        cols["starts"][at] = starts
        cols["chunks"][at] = len(self._chunk_arrays) - 1
        cols["partitions"][at] = batch.partitions[rows]
        cols["offsets"][at] = batch.offsets[rows]
        cols["seq"][at] = self.accepted_total + rows  # arrival order: accepted count before + position
        cols["sensor_ids"][at] = batch.sensor_ids[rows]
        self._n += k

    def _grow_locked(self, rows: int) -> None:
        size = self._cols["keys"].shape[0]
        if rows <= size:
            return
        new_size = max(rows, 2 * size)
        for name, dtype in self._COLUMNS:
            grown = np.empty(new_size, dtype=dtype)
            grown[: self._n] = self._cols[name][: self._n]
            self._cols[name] = grown

    def _cut_locked(self) -> None:
        """Keep the top ``capacity`` keys (and drop expired rows); compact readings if sparse."""
        n = self._n
        keep = np.arange(n)
        if self.max_age_s is not None and n:
            fresh = self._cols["ts"][:n] >= self._clock() - self.max_age_s
            if not fresh.all():
                keep = keep[fresh]  # expired rows count as evicted (accepted_total - size)
        if keep.size > self.capacity:
            keys = self._cols["keys"][keep]
            top = np.argpartition(keys, keep.size - self.capacity)[keep.size - self.capacity :]
            keep = np.sort(keep[top])
            if self.max_age_s is None:
                self._threshold = float(self._cols["keys"][keep].min())
        if keep.size == n:
            return
        for name, _ in self._COLUMNS:
            column = self._cols[name]
            column[: keep.size] = column[keep]
        self._n = keep.size
        self._compact_chunks_locked()

    def _compact_chunks_locked(self) -> None:
        """Drop dead chunks; gather live readings of mostly-dead chunks into one new chunk."""
        n, cols = self._n, self._cols
        chunk_ids, lengths = cols["chunks"][:n], cols["lengths"][:n]
        live_tokens = np.bincount(chunk_ids, weights=lengths, minlength=len(self._chunk_arrays))
        sizes = np.array([c.shape[0] for c in self._chunk_arrays], dtype=np.float64)
        alive = live_tokens > 0
        # Compact only when garbage dominates (held > 3x live), then only chunks under 1/3 live:
        # memory stays within a few times the live tokens, copies stay rare.
        if sizes[alive].sum() > 3 * live_tokens.sum() + 65536:
            sparse = alive & (live_tokens * 3 < sizes)
        else:
            sparse = np.zeros_like(alive)
        new_index = np.full(len(self._chunk_arrays), -1, dtype=np.int64)
        kept = np.flatnonzero(alive & ~sparse)
        new_index[kept] = np.arange(kept.size)
        arrays = [self._chunk_arrays[i] for i in kept.tolist()]
        if sparse.any():
            rows = np.flatnonzero(sparse[chunk_ids])
            rows = rows[np.argsort(chunk_ids[rows], kind="stable")]
            row_chunks, row_lengths = chunk_ids[rows], lengths[rows]
            bounds = np.flatnonzero(np.diff(row_chunks)) + 1
            pieces = [
                gather_tokens(
                    self._chunk_arrays[int(row_chunks[group[0]])], cols["starts"][rows[group]], row_lengths[group]
                )
                for group in np.split(np.arange(rows.size), bounds)
            ]  # one gather per sparse chunk: only live readings are copied
            new_starts = np.zeros(rows.size, dtype=np.int64)
            np.cumsum(row_lengths[:-1], out=new_starts[1:])
            cols["starts"][rows] = new_starts
            arrays.append(np.concatenate(pieces, out=chunk_array(int(row_lengths.sum()), self.channels)))
            new_index[sparse] = len(arrays) - 1
        cols["chunks"][:n] = new_index[chunk_ids]
        self._chunk_arrays = arrays

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> WindowSnapshot:
        """A consistent view of the window (after a cut), in insertion order.

        Under the lock: O(W) copies of the per-item columns and references to the reading
        chunks; readings are gathered later, outside it, and only for the items used.
        """
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> WindowSnapshot:
        self._cut_locked()
        n, cols = self._n, self._cols
        sizes = np.array([c.shape[0] for c in self._chunk_arrays], dtype=np.int64)
        base = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=base[1:])
        chunks = tuple(self._chunk_arrays) or (np.zeros((0, self.channels), np.float32),)
        return WindowSnapshot(
            flat_values=chunks,
            starts=base[cols["chunks"][:n]] + cols["starts"][:n] if sizes.size else np.zeros(n, np.int64),
            lengths=cols["lengths"][:n].copy(),
            ts=cols["ts"][:n].copy(),
            labels=cols["labels"][:n].copy(),
            keys=cols["keys"][:n].copy(),
            sensor_ids=cols["sensor_ids"][:n].copy(),
            partitions=cols["partitions"][:n].copy(),
            offsets=cols["offsets"][:n].copy(),
            next_offsets=dict(self._next_offsets),
            version=self.version,
            taken_at=self._clock(),
            seq=cols["seq"][:n].copy(),
        )

    def stats(self, now: float | None = None) -> WindowStats:
        """Statistics for ``GET /v1/window``: O(W) numpy work on columns, no reading copies."""
        now = self._clock() if now is None else now
        with self._lock:
            self._cut_locked()
            n, cols = self._n, self._cols
            ts = cols["ts"][:n].copy()
            lengths = cols["lengths"][:n].copy()
            sensor_ids = cols["sensor_ids"][:n].copy()
            accepted, rejected, held_out = self.accepted_total, dict(self._rejected), self.held_out_total
        return WindowStats(
            size=n,
            capacity=self.capacity,
            seen_total=accepted + sum(rejected.values()) + held_out,
            accepted_total=accepted,
            rejected_total=rejected,
            held_out_total=held_out,
            evicted_total=accepted - n,
            half_life_s=self.half_life_s,
            tokens=int(lengths.sum()),
            sensors=len(set(sensor_ids.tolist())),
            age_s=QuantileSummary.of(np.maximum(now - ts, 0.0)),
            length=QuantileSummary.of(lengths.astype(np.float64)),
        )

    def age_quantiles(self, quantiles: Sequence[float], now: float | None = None) -> list[float]:
        """Item ages (now − event time) at the given quantiles; zeros for an empty window."""
        now = self._clock() if now is None else now
        with self._lock:
            self._cut_locked()
            ts = self._cols["ts"][: self._n].copy()
        if ts.size == 0:
            return [0.0 for _ in quantiles]
        return [float(q) for q in np.quantile(np.maximum(now - ts, 0.0), list(quantiles))]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: items, keys, offsets, counters, RNG."""
        return self.capture_state()()

    def capture_state(self) -> Callable[[], dict[str, Any]]:
        """Fix the state now (cheap, under the lock); the returned call builds the dict.

        The readings are gathered by that call, with no lock held: a checkpoint holds
        ingest back only for the column copies.
        """
        with self._lock:
            snap = self._snapshot_locked()
            scalars = {
                "capacity": self.capacity,
                "half_life_s": self.half_life_s,
                "channels": self.channels,
                "reference_ts": self._reference_ts,
                "accepted_total": self.accepted_total,
                "rejected_total": dict(self._rejected),
                "held_out_total": self.held_out_total,
                "rng_state": self._rng.bit_generator.state,
            }

        def build() -> dict[str, Any]:
            flat, _ = snap.gather_values(np.arange(len(snap)))
            return {
                **scalars,
                "values": flat,
                "lengths": snap.lengths,
                "ts": snap.ts,
                "labels": snap.labels,
                "keys": snap.keys,
                "sensor_ids": snap.sensor_ids,
                "partitions": snap.partitions,
                "offsets": snap.offsets,
                "seq": snap.seq,
                "next_offsets": {str(p): o for p, o in snap.next_offsets.items()},
                "version": snap.version,
            }

        return build

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError (one line) if ``state`` cannot be restored into this window."""
        channels = int(state.get("channels", self.channels))
        if channels != self.channels:
            raise ValueError(
                f"the checkpoint's window holds readings of CHANNELS={channels}, this service is configured "
                f"with CHANNELS={self.channels}"
            )
        lengths = np.asarray(state["lengths"], dtype=np.int64)
        values = np.asarray(state["values"])
        if values.size != int(lengths.sum()) * self.channels:
            raise ValueError("window state is inconsistent: lengths do not sum to the stored values")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict`.

        A smaller capacity keeps the top keys; another half-life re-keys the items
        (module docstring); another ``channels`` raises ValueError.
        """
        self.check_state(state)
        lengths = np.asarray(state["lengths"], dtype=np.int64)
        flat = np.asarray(state["values"], dtype=np.float32).reshape(-1, self.channels)
        batch = EventBatch(
            sensor_ids=np.asarray(state["sensor_ids"], dtype=object).reshape(-1),
            ts=np.asarray(state["ts"], dtype=np.float64),
            labels=np.asarray(state["labels"], dtype=np.int64),
            lengths=lengths,
            values=flat,
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
        with self._lock:
            self._reset_storage(len(batch))
            if len(batch):
                self._append_locked(batch, keys, np.arange(len(batch)))
                if state.get("seq") is not None:
                    self._cols["seq"][: len(batch)] = np.asarray(state["seq"], dtype=np.int64)
            self._cut_locked()
            if self._n == self.capacity and self.max_age_s is None:
                self._threshold = float(self._cols["keys"][: self._n].min())
            self._reference_ts = reference_ts
            self._next_offsets = {int(p): int(o) for p, o in dict(state.get("next_offsets", {})).items()}
            self.accepted_total = int(state.get("accepted_total", self._n))
            self._rejected = {str(r): int(c) for r, c in dict(state.get("rejected_total", {})).items()}
            self.held_out_total = int(state.get("held_out_total", 0))
            self._evicted_at_start = self.accepted_total - self._n
            self.version = int(state.get("version", 0))
            rng_state = state.get("rng_state")
            if (
                rng_state is not None
                and rng_state.get("bit_generator") == self._rng.bit_generator.state["bit_generator"]
            ):
                self._rng.bit_generator.state = rng_state


def rekey(
    keys: np.ndarray, ts: np.ndarray, reference_ts: float | None, old_half_life_s: float, new_half_life_s: float
) -> np.ndarray:
    """Keys ``λ_old·(ts − L) − ln E`` rebuilt as ``λ_new·(ts − L) − ln E`` with the same draws E."""
    reference = float(ts[0]) if reference_ts is None and ts.size else float(reference_ts or 0.0)
    age = ts - reference
    return keys - decay_rate(old_half_life_s) * age + decay_rate(new_half_life_s) * age
