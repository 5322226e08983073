"""The holdout's split of each poll batch, per event: what the ingest thread spends on it.

``HoldoutSplitter.split`` decides, for every fresh event, whether it is held out, kept out as a
guard, or trained; to see sliding windows it finds where each event starts within its sensor's
previous one (:func:`streamtrain.quality.holdout.overlap_start`). It runs on the ingest thread,
under the interpreter lock the trainer needs too (docs/performance.md, "Who holds the
interpreter lock"). Streams of 20,000 events in poll batches of 500, one channel: events that
do not overlap (the latency bench's: lognormal lengths of median 48, 64 sensors) and sliding
windows (24 readings, stride 1, 8 sensors). Rows: microseconds per event of the whole split, of
the overlaps found for the whole batch at once (``overlap_starts``, what the split runs), and of
the same overlaps found one event at a time (``overlap_start`` per event, the baseline: how the
split found them before). One thread.

    python bench/holdout_split.py [--events 20000] [--json]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.events import EventBatch, SensorEvent  # noqa: E402
from streamtrain.quality.holdout import HoldoutSplitter, overlap_start, overlap_starts  # noqa: E402

BENCH = "holdout_split"
POLL_BATCH = 500


def independent(rng: np.random.Generator, n: int) -> list[SensorEvent]:
    lengths = np.clip(rng.lognormal(np.log(48), 0.8, n), 4, 512).astype(int)
    return [
        SensorEvent(f"sensor-{i % 64}", float(i), rng.normal(size=(length, 1)).astype(np.float32))
        for i, length in enumerate(lengths.tolist())
    ]


def sliding(rng: np.random.Generator, n: int, sensors: int = 8, length: int = 24) -> list[SensorEvent]:
    series = [rng.normal(size=n // sensors + length).astype(np.float32) for _ in range(sensors)]
    return [
        SensorEvent(f"sensor-{i % sensors}", float(i), series[i % sensors][i // sensors : i // sensors + length, None])
        for i in range(n)
    ]


def pairs(batch: EventBatch) -> tuple[np.ndarray, np.ndarray]:
    """(previous, current): each event after its sensor's previous one in the batch."""
    last: dict[str, int] = {}
    previous, current = [], []
    for i, sensor in enumerate(batch.sensor_ids.tolist()):
        if sensor in last:
            previous.append(last[sensor])
            current.append(i)
        last[sensor] = i
    return np.array(previous, np.int64), np.array(current, np.int64)


def one_at_a_time(batch: EventBatch, previous: np.ndarray, current: np.ndarray) -> list[int]:
    starts, lengths = batch.starts.tolist(), batch.lengths.tolist()
    event = lambda k: batch.values[starts[k] : starts[k] + lengths[k]]  # noqa: E731
    return [overlap_start(event(p), event(c)) for p, c in zip(previous.tolist(), current.tolist(), strict=True)]


def at_once(batch: EventBatch, previous: np.ndarray, current: np.ndarray) -> list[int]:
    return overlap_starts(batch.values, batch.starts, batch.lengths, previous, current).tolist()


def per_event_us(work: Callable[..., object], calls: list[tuple[EventBatch, ...]], events: int) -> float:
    start = time.perf_counter()
    for args in calls:
        work(*args)
    return (time.perf_counter() - start) / events * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    for name, make in (("independent events", independent), ("sliding windows", sliding)):
        events = make(rng, args.events)
        batches = [
            EventBatch.from_events(events[i : i + POLL_BATCH], channels=1) for i in range(0, len(events), POLL_BATCH)
        ]
        calls = [(b, *pairs(b)) for b in batches]
        for call in calls:  # the same overlaps, or the comparison means nothing
            assert at_once(*call) == one_at_a_time(*call)
        baseline = per_event_us(one_at_a_time, calls, len(events))
        splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
        split = per_event_us(splitter.split, [(b,) for b in batches], len(events))
        batch_at_once = per_event_us(at_once, calls, len(events))
        rows += [
            Row(BENCH, f"{name}: whole split, us/event", split),
            Row(BENCH, f"{name}: overlaps, whole batch at once, us/event", batch_at_once, baseline),
            Row(BENCH, f"{name}: overlaps, one event at a time, us/event", baseline, baseline),
        ]  # fmt: skip
    emit(rows, args.json)


if __name__ == "__main__":
    main()
