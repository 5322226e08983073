"""The holdout: the share kept out of the window, reproducible and restored; no held-out reading trained on."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from streamtrain.events import EventBatch, SensorEvent
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.holdout import HoldoutBuffer, HoldoutSplitter

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/unit/quality: the shared quality fixtures
from quality_fixtures import ForecastsZero, Frozen, events, monitor  # noqa: E402


def test_holdout_share_is_kept_out_of_the_window_and_reproducible() -> None:
    batch = events(*[[float(i), float(i) + 1.0] for i in range(2000)])
    kept = []
    for _ in range(2):
        quality = monitor(None, holdout_share=0.1, holdout_capacity=5000)
        to_window = quality.observe(batch)
        kept.append(to_window.ts.tolist())
        held_ts = sorted(set(batch.ts.tolist()) - set(to_window.ts.tolist()))
        assert len(quality.holdout) == quality.held_out_total == 2000 - len(to_window)
        assert [float(v[0, 0]) for v in quality.holdout.values] == [t - 1000.0 for t in held_ts]
        # each kept event keeps its own readings
        for i in range(len(to_window)):
            assert to_window.event(i).values[0, 0] == to_window.ts[i] - 1000.0
    assert kept[0] == kept[1]  # seeded mode: the same events are held out
    assert 150 <= 2000 - len(kept[0]) <= 250  # Binomial(2000, 0.1): 200 +- 5 sd


def test_holdout_state_round_trips() -> None:
    quality = monitor(Frozen(ForecastsZero(), RunningNorm.from_public([0.0], [1.0])), holdout_share=0.5)
    quality.observe(events(*[[float(i), 2.0 * i, 1.0] for i in range(40)], labels=None))
    clone = monitor(None, holdout_share=0.5)
    clone.load_state_dict(quality.state_dict(), channels=1)
    assert [v.tolist() for v in clone.holdout.values] == [v.tolist() for v in quality.holdout.values]
    assert clone.report(1) == quality.report(1)
    assert clone.observe(events([1.0, 2.0])).ts.tolist() == quality.observe(events([1.0, 2.0])).ts.tolist()


def sliding(values: np.ndarray, sensor: str, length: int = 24, stride: int = 1) -> list[SensorEvent]:
    return [
        SensorEvent(sensor, 1000.0 + i, values[i : i + length, None].astype(np.float32))
        for i in range(0, len(values) - length + 1, stride)
    ]


@pytest.mark.parametrize("stride", [1, 5])
def test_no_held_out_reading_of_sliding_windows_is_ever_trained_on(stride: int) -> None:
    rng = np.random.default_rng(8)
    items = sliding(rng.normal(size=3000), "a", stride=stride) + sliding(rng.normal(size=3000), "b", stride=stride)
    batch = EventBatch.from_events(sorted(items, key=lambda e: e.ts))
    splitter = HoldoutSplitter(0.1, 32, "seeded", 0)  # blocks longer than the overlap: guarded
    held, guard = np.zeros(0, np.int64), np.zeros(0, np.int64)
    for part in np.array_split(np.arange(len(batch)), 7):  # poll batches
        h, g = splitter.split(EventBatch.from_events([batch.event(int(i)) for i in part]))
        held, guard = np.concatenate([held, part[h]]), np.concatenate([guard, part[g]])
    trained = np.setdiff1d(np.arange(len(batch)), np.concatenate([held, guard]))
    readings = lambda rows: {(batch.sensor_ids[i], float(v)) for i in rows for v in batch.event(int(i)).values[:, 0]}  # noqa: E731
    assert held.size > 0.07 * len(batch) and not readings(held) & readings(trained)
    assert guard.size <= 2 * (24 // stride) * (held.size // 32 + 2)  # only the overlapping neighbours of each block


def test_events_that_do_not_overlap_are_held_out_in_blocks_without_a_guard() -> None:
    rng = np.random.default_rng(9)
    items = [SensorEvent(f"s{i % 10}", 1000.0 + i, rng.normal(size=(30, 1)).astype(np.float32)) for i in range(6400)]
    splitter = HoldoutSplitter(0.1, 32, "crypto", 0)
    held, guard = splitter.split(EventBatch.from_events(items))
    assert guard.size == 0 and held.size == 640  # one block in ten of every sensor, whatever the phases
    clone = HoldoutSplitter(0.1, 32, "crypto", 0)
    clone.load_state_dict(splitter.state_dict())
    more = EventBatch.from_events(
        [SensorEvent(f"s{i % 10}", 9000.0 + i, rng.normal(size=(30, 1)).astype(np.float32)) for i in range(640)]
    )
    assert np.array_equal(clone.split(more)[0], splitter.split(more)[0])  # restored phases and counts decide alike


def test_the_holdout_buffer_keeps_each_events_sensor_through_a_checkpoint() -> None:
    batch = EventBatch.from_events(
        [SensorEvent(name, 1000.0 + i, np.full((3 + i, 1), i, np.float32)) for i, name in enumerate("abab")], channels=1
    )
    buffer = HoldoutBuffer(capacity=3)
    buffer.add(batch, np.arange(4))
    assert list(buffer.sensors) == ["b", "a", "b"]  # the most recent three, with their sensors
    state = buffer.state_dict()
    back = HoldoutBuffer(capacity=3)
    back.load_state_dict(state, channels=1)
    assert list(back.sensors) == ["b", "a", "b"] and [len(v) for v in back.values] == [4, 5, 6]
    del state["sensors"]  # a holdout saved before sensors were kept: each event a sensor of its own
    back.load_state_dict(state, channels=1)
    assert len(set(back.sensors)) == 3 and len(back.values) == 3


def test_a_short_stream_of_sliding_windows_keeps_its_first_readings_to_train_on_whatever_its_phase() -> None:
    """100 yearly readings make 77 sliding windows of 24: a sensor whose phase held its first
    block lost it and its guard, 70 of the 77 events, and the window could not reach the
    trainer's minimum. Now the first block of a sensor's grown blocks trains, and
    an event held before its blocks grew keeps its overlapping neighbours out as guards."""
    rng = np.random.default_rng(3)
    phases, kept = set(), []
    for s in range(60):  # sensors whose phases cover the period
        sensor = f"series-{s}"
        items = sliding(rng.normal(size=100), sensor)
        batch = EventBatch.from_events(items)
        splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
        phases.add(splitter._phase(sensor))
        held, guard = splitter.split(batch)
        trained = np.setdiff1d(np.arange(len(batch)), np.concatenate([held, guard]))
        readings = lambda rows: {float(v) for i in rows for v in batch.event(int(i)).values[:, 0]}  # noqa: E731
        assert not readings(held) & readings(trained), sensor
        kept.append(trained.size)
    assert phases == set(range(10))
    assert min(kept) >= 23, sorted(kept)  # the first 24 events train, whatever the phase


def test_an_event_held_before_the_blocks_grew_keeps_its_neighbours_out() -> None:
    splitter = HoldoutSplitter(0.1, 1, "seeded", 0)
    sensor = next(f"p{i}" for i in range(1000) if splitter._phase(f"p{i}") == 0)  # its first event is held
    batch = EventBatch.from_events(sliding(np.random.default_rng(4).normal(size=60), sensor))
    held, guard = splitter.split(batch)
    assert held.tolist() == [0] and guard.tolist() == list(range(1, 24))
    clone = HoldoutSplitter(0.1, 1, "seeded", 0)
    clone.load_state_dict(splitter.state_dict())
    more = EventBatch.from_events(sliding(np.random.default_rng(5).normal(size=600), sensor))
    assert all(np.array_equal(a, b) for a, b in zip(clone.split(more), splitter.split(more), strict=True))
