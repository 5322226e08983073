"""Bounded training passes: fresh events first, the rest replayed, each item once."""

from __future__ import annotations

import math

import numpy as np

from streamtrain.events import EventBatch, SensorEvent
from streamtrain.train import PassSampler
from streamtrain.window import RecencyWindow


def fill(window: RecencyWindow, start: int, n: int) -> None:
    events = [SensorEvent("s", float(start + i), np.full((2, 1), start + i, np.float32)) for i in range(n)]
    window.insert_batch(EventBatch.from_events(events, offsets=np.arange(start, start + n)))


def test_small_window_passes_whole() -> None:
    window = RecencyWindow(1000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 50)
    sampler = PassSampler(100, 0.5, "seeded", 0)
    assert len(sampler(window.snapshot())) == 50


def test_bounded_pass_takes_newest_fresh_then_replays_without_repeats() -> None:
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 1000)
    sampler = PassSampler(100, 0.5, "seeded", 0)
    first = sampler(window.snapshot())
    assert len(first) == 100 and len(set(first.offsets.tolist())) == 100
    # 50 newest of the fresh items, 50 uniform replay from the rest
    assert set(range(950, 1000)) <= set(first.offsets.tolist())
    fill(window, 1000, 30)
    second = sampler(window.snapshot())
    offsets = set(second.offsets.tolist())
    assert len(second) == 100 and len(offsets) == 100
    assert set(range(1000, 1030)) <= offsets  # every new event is in the next pass
    assert all(np.all(v == o) for v, o in zip(second.values, second.offsets))


def test_replay_covers_the_window_uniformly() -> None:
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 400)
    sampler = PassSampler(40, 0.0, "seeded", 7)
    counts = np.zeros(400)
    for _ in range(500):
        counts[sampler(window.snapshot()).offsets] += 1
    # each item is replayed with probability 40/400 per pass: binomial(500, 0.1), mean 50
    assert counts.min() > 20 and counts.max() < 85


def test_state_round_trip_and_seeded_reproducibility() -> None:
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 500)
    a, b = PassSampler(64, 0.25, "seeded", 3), PassSampler(64, 0.25, "seeded", 3)
    a(window.snapshot())
    b.load_state_dict(a.state_dict())
    assert np.array_equal(a(window.snapshot()).offsets, b(window.snapshot()).offsets)
