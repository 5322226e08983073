"""Window batch insert vs two other implementations of the same sampler.

All three keep the W largest Efraimidis–Spirakis keys ``λ·(ts − L) − ln E`` and take the
same columnar poll batches, once the window is full:

* ``heapq``: walks each batch one event at a time through ``heapq.heappushpop`` (the
  textbook per-item reservoir);
* ``vectorized``: the honest numpy baseline, per batch: draw the batch's keys at once,
  concatenate them and the batch's columns to the window's, ``argpartition`` back to the
  top W. It keeps every batch's readings array alive (it never compacts), which only
  favours it;
* ours (:class:`streamtrain.window.reservoir.RecencyWindow`): drops keys below the last cut's
  threshold with one comparison and cuts only when W + slack items are stored.

Run: ``python bench/window_insert.py [--json]``.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window.reservoir import RecencyWindow


class HeapReservoir:
    """Per-item baseline: a min-heap of (key, seq, record) capped at W.

    It takes the same poll batches as the window and walks them one event at a time,
    as a per-item implementation must (its record holds a view of the readings).
    """

    def __init__(self, capacity: int, half_life_s: float, seed: int) -> None:
        self.capacity = capacity
        self.decay = 0.0 if math.isinf(half_life_s) else math.log(2) / half_life_s
        self.rand = random.Random(seed)
        self.heap: list[tuple[float, int, tuple]] = []
        self.reference: float | None = None
        self.seq = 0

    def insert_batch(self, batch: EventBatch) -> None:
        starts, lengths = batch.starts.tolist(), batch.lengths.tolist()
        for i, ts in enumerate(batch.ts.tolist()):
            if self.reference is None:
                self.reference = ts
            key = self.decay * (ts - self.reference) - math.log(self.rand.expovariate(1.0))
            self.seq += 1
            if len(self.heap) >= self.capacity and key <= self.heap[0][0]:
                continue
            start = starts[i]
            record = (batch.sensor_ids[i], ts, batch.labels[i], batch.values[start : start + lengths[i]])
            if len(self.heap) < self.capacity:
                heapq.heappush(self.heap, (key, self.seq, record))
            else:
                heapq.heappushpop(self.heap, (key, self.seq, record))


class VectorizedReservoir:
    """Per-batch numpy baseline: concatenate, then argpartition to the top W keys."""

    def __init__(self, capacity: int, half_life_s: float, seed: int) -> None:
        self.capacity = capacity
        self.decay = 0.0 if math.isinf(half_life_s) else math.log(2) / half_life_s
        self.rng = np.random.default_rng(seed)
        self.reference: float | None = None
        self.columns: dict[str, np.ndarray] | None = None
        self.chunks: list[np.ndarray] = []

    def insert_batch(self, batch: EventBatch) -> None:
        if self.reference is None and len(batch):
            self.reference = float(batch.ts[0])
        keys = self.decay * (batch.ts - (self.reference or 0.0)) - np.log(self.rng.standard_exponential(len(batch)))
        self.chunks.append(batch.values)
        incoming = {
            "keys": keys, "ts": batch.ts, "labels": batch.labels, "lengths": batch.lengths, "starts": batch.starts,
            "chunks": np.full(len(batch), len(self.chunks) - 1), "sensor_ids": batch.sensor_ids,
        }  # fmt: skip
        columns = (
            incoming if self.columns is None else {k: np.concatenate([v, incoming[k]]) for k, v in self.columns.items()}
        )
        if columns["keys"].size > self.capacity:
            top = np.argpartition(columns["keys"], columns["keys"].size - self.capacity)[-self.capacity :]
            columns = {k: v[top] for k, v in columns.items()}
        self.columns = columns


def make_events(n: int, seed: int) -> list[SensorEvent]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(48), 0.8, n).astype(int), 4, 512)
    flat = rng.standard_normal(int(lengths.sum())).astype(np.float32).reshape(-1, 1)
    values = np.split(flat, np.cumsum(lengths)[:-1])
    return [SensorEvent(f"s{i % 500}", 1.7e9 + i * 1e-3, v) for i, v in enumerate(values)]


def run_rounds(make, fill_batches: list[EventBatch], batches: list[EventBatch], count: int) -> float:
    """Fill a fresh sampler to capacity, then time the inserts after it is full: events/s."""
    sampler = make()
    for batch in fill_batches:
        sampler.insert_batch(batch)
    started = time.perf_counter()
    for batch in batches:
        sampler.insert_batch(batch)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--events", type=int, default=400_000, help="events inserted after the window is full")
    parser.add_argument("--batch", type=int, default=5000, help="events per insert (a poll batch)")
    parser.add_argument("--half-life-s", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=3, help="repeat each side; best round counts")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    events = make_events(args.capacity + args.events, seed=0)
    fill, measured = events[: args.capacity], events[args.capacity :]
    rows = []
    for half_life in (args.half_life_s, math.inf):
        label = "uniform" if math.isinf(half_life) else f"half-life {half_life:g}s"
        fill_batches = [EventBatch.from_events(fill[i : i + args.batch]) for i in range(0, len(fill), args.batch)]
        batches = [EventBatch.from_events(measured[i : i + args.batch]) for i in range(0, len(measured), args.batch)]
        heap_rate = max(
            run_rounds(
                lambda half_life=half_life: HeapReservoir(args.capacity, half_life, seed=1),
                fill_batches,
                batches,
                len(measured),
            )
            for _ in range(args.rounds)
        )
        vector_rate = max(
            run_rounds(
                lambda half_life=half_life: VectorizedReservoir(args.capacity, half_life, seed=1),
                fill_batches,
                batches,
                len(measured),
            )
            for _ in range(args.rounds)
        )
        ours_rate = max(
            run_rounds(
                lambda half_life=half_life: RecencyWindow(args.capacity, half_life, rng=np.random.default_rng(1)),
                fill_batches,
                batches,
                len(measured),
            )
            for _ in range(args.rounds)
        )
        rows.append(Row(f"window_insert[{label}]", "events/s, ours vs per-item heapq", ours_rate, heap_rate))
        rows.append(
            Row(
                f"window_insert[{label}]",
                "events/s, ours vs vectorized concat+argpartition",
                ours_rate,
                vector_rate,
                "> 1x",
            )
        )
    emit(rows, args.json)


if __name__ == "__main__":
    main()
