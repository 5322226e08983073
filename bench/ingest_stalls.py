"""How long ingest waits on other threads: window snapshots and checkpoints.

Two measurements, each with the service's defaults (window 100k items, poll batches of
5,000 events, lognormal lengths with median 48, passes of 8,192 items):

* **snapshot**: the prefetch thread takes a window snapshot per pass and keeps a
  ``PASS_MAX_ITEMS`` subset of it, while the ingest thread inserts poll batches. The
  window lock is instrumented: we report how long one snapshot holds it (p50, max), and
  the ingest thread's ``insert_batch`` latency (p99) with and without snapshots running.
* **checkpoint**: a :class:`streamtrain.runtime.service.Service` (no broker: the ingest thread is
  played by a loop that takes the service's ``apply_lock`` and inserts a batch, as
  ``Ingestor._apply`` does) trains on its window while checkpoints are written. We report
  how long ingest waits for ``apply_lock`` (p99, max) against the mean training step.

Run: ``python bench/ingest_stalls.py [--capacity N] [--checkpoints N] [--json]`` (about 1 minute).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.config import load_settings  # noqa: E402
from streamtrain.events import EventBatch  # noqa: E402
from streamtrain.window.reservoir import RecencyWindow  # noqa: E402

BENCH = "ingest_stalls"


def lognormal_batch(n: int, rng: np.random.Generator, first_offset: int) -> EventBatch:
    lengths = np.clip(np.round(rng.lognormal(math.log(48), 0.8, n)), 4, 512).astype(np.int64)
    return EventBatch(
        sensor_ids=np.array([f"s{i % 500}" for i in range(n)], dtype=object),
        ts=np.full(n, time.time()),
        labels=np.full(n, -1, np.int64),
        lengths=lengths,
        values=rng.standard_normal((int(lengths.sum()), 1)).astype(np.float32),
        partitions=np.zeros(n, np.int32),
        offsets=np.arange(first_offset, first_offset + n, dtype=np.int64),
    )


class TimedLock:
    """A lock that records how long each holder kept it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.holds: dict[str, list[float]] = {}

    def __enter__(self) -> TimedLock:
        self._lock.acquire()
        self._local.since = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        held = time.perf_counter() - self._local.since
        self.holds.setdefault(threading.current_thread().name, []).append(held)
        self._lock.release()


def pct(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q)) if values else float("nan")


def insert_latencies(window: RecencyWindow, batches: list[EventBatch], pause_s: float) -> list[float]:
    out = []
    for batch in batches:
        started = time.perf_counter()
        window.insert_batch(batch)
        out.append(time.perf_counter() - started)
        time.sleep(pause_s)
    return out


def snapshot_rows(capacity: int, pass_items: int, inserts: int, seed: int) -> list[Row]:
    rng = np.random.default_rng(seed)
    window = RecencyWindow(capacity, 3600.0, rng=np.random.default_rng(seed))
    offset = 0
    while offset < 2 * capacity:  # full, with garbage from a window's worth of turnover
        window.insert_batch(lognormal_batch(5000, rng, offset))
        offset += 5000
    batches = [lognormal_batch(5000, rng, offset + 5000 * i) for i in range(inserts)]
    quiet = insert_latencies(window, batches[: inserts // 2], 0.01)
    lock = TimedLock()
    window._lock = lock  # type: ignore[assignment]  # instrument the window lock
    stop = threading.Event()
    snapshot_seconds: list[float] = []

    def reader() -> None:
        pick = np.random.default_rng(seed + 1)
        while not stop.is_set():
            started = time.perf_counter()
            snap = window.snapshot()
            sub = snap.subset(np.sort(pick.choice(len(snap), min(pass_items, len(snap)), replace=False)))
            sub.gather_values(np.arange(min(64, len(sub))))
            snapshot_seconds.append(time.perf_counter() - started)

    thread = threading.Thread(target=reader, name="prefetch")
    thread.start()
    busy = insert_latencies(window, batches[inserts // 2 :], 0.01)
    stop.set()
    thread.join()
    held = lock.holds.get("prefetch", [])
    tag = f"{BENCH}[snapshot W={capacity} pass={pass_items}]"
    return [
        Row(tag, "window lock held per snapshot p50 (ms)", 1e3 * pct(held, 0.5)),
        Row(tag, "window lock held per snapshot max (ms)", 1e3 * max(held)),
        Row(tag, "snapshot + pass subset p50 (ms)", 1e3 * pct(snapshot_seconds, 0.5)),
        Row(tag, "insert_batch p99 with snapshots vs alone (ms)", 1e3 * pct(busy, 0.99), 1e3 * pct(quiet, 0.99)),
        Row(tag, "insert_batch max with snapshots vs alone (ms)", 1e3 * max(busy), 1e3 * max(quiet)),
    ]


def checkpoint_rows(capacity: int, checkpoints: int, seed: int) -> list[Row]:
    from streamtrain.runtime.service import Service

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as directory:
        settings = load_settings(
            window_capacity=capacity, checkpoint_dir=directory, checkpoint_interval_s=3600, train_nice=0,
            publish_interval_s=3600,
        )  # fmt: skip
        service = Service(settings)
        offset = 0
        while offset < capacity:
            service.window.insert_batch(lognormal_batch(5000, rng, offset), {0: offset + 5000})
            offset += 5000
        service.trainer.start()
        while service.trainer.step < 3:  # past the first pass's planning and warm-up
            time.sleep(0.05)
        stop = threading.Event()
        waits: list[float] = []
        batches = [lognormal_batch(500, rng, offset + 500 * i) for i in range(64)]

        def ingest() -> None:
            i = 0
            while not stop.is_set():
                started = time.perf_counter()
                with service.ingest.apply_lock:
                    waits.append(time.perf_counter() - started)
                    service.window.insert_batch(batches[i % len(batches)], {0: offset + 500 * (i + 1)})
                i += 1
                time.sleep(0.005)

        thread = threading.Thread(target=ingest, name="ingest")
        thread.start()
        step_before, step_time_before = service.trainer.step, service.trainer.step_seconds
        checkpoint_seconds = []
        for _ in range(checkpoints):
            time.sleep(0.5)
            started = time.perf_counter()
            assert service.checkpoint() is not None
            checkpoint_seconds.append(time.perf_counter() - started)
        stop.set()
        thread.join()
        steps = service.trainer.step - step_before
        step_s = (service.trainer.step_seconds - step_time_before) / max(steps, 1)
        service.trainer.stop()
    tag = f"{BENCH}[checkpoint W={capacity}]"
    return [
        Row(tag, "ingest wait for apply_lock p99 (ms)", 1e3 * pct(waits, 0.99)),
        Row(tag, "ingest wait for apply_lock max vs mean train step (ms)", 1e3 * max(waits), 1e3 * step_s),
        Row(tag, "checkpoint wall time p50 (ms)", 1e3 * pct(checkpoint_seconds, 0.5)),
        Row(tag, "checkpoints / train steps during the run", checkpoints, steps),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=100_000, help="window items (WINDOW_CAPACITY)")
    parser.add_argument("--pass-items", type=int, default=8192, help="PASS_MAX_ITEMS")
    parser.add_argument(
        "--inserts", type=int, default=200, help="poll batches inserted (half alone, half with snapshots)"
    )
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = snapshot_rows(args.capacity, args.pass_items, args.inserts, args.seed)
    rows += checkpoint_rows(args.capacity, args.checkpoints, args.seed)
    emit(rows, args.json)


if __name__ == "__main__":
    main()
