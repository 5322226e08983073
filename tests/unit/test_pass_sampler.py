"""Bounded training passes: fresh events first, the rest replayed, each item once, on their own stream."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from streamtrain.config import SettingsError, load_settings
from streamtrain.data.bucketing import TokenBudget
from streamtrain.data.dataset import WindowBatchDataset
from streamtrain.data.passes import PassSampler, pass_sampler_from_settings
from streamtrain.data.policies import CurriculumPolicy, SensorBalancedPolicy
from streamtrain.data.randomness import SeededRandomness, make_randomness
from streamtrain.events import EventBatch, SensorEvent
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


def test_selection_and_planning_draw_from_distinct_streams() -> None:
    # Same seed, same pass: the sampler's stream ("select") is not the planner's ("plan").
    select = make_randomness("seeded", 5, 3, purpose="select").raw_uint64(8)
    plan = make_randomness("seeded", 5, 3, purpose="plan").raw_uint64(8)
    assert not np.array_equal(select, plan)
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 1000)
    sampler = PassSampler(100, 0.0, "seeded", 5)
    sampler.passes = 3
    chosen = sampler.select(window.snapshot()).index
    rest = np.arange(1000)
    assert np.array_equal(np.sort(rest[SeededRandomness(5, 3, purpose="select").permutation(1000)[:100]]), chosen)


def test_a_bounded_pass_smaller_than_the_minimum_window_still_trains() -> None:
    """0 < PASS_MAX_ITEMS < MIN_WINDOW_ITEMS: passes start once the window holds the minimum."""
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 50)
    sampler = PassSampler(8, 0.5, "seeded", 0)
    polls: list[int] = []

    def snapshot():  # type: ignore[no-untyped-def]
        polls.append(len(window))
        if len(polls) == 3:
            fill(window, 50, 50)  # the window reaches 100 >= 64 on the third look
        return window.snapshot()

    dataset = WindowBatchDataset(snapshot, TokenBudget(64), sampler=sampler, min_items=64, idle_wait_s=0.0, max_passes=2)
    batches = list(dataset)
    assert polls[:3] == [50, 50, 50], "the dataset waited for the minimum window"
    assert sum(b.batch_size for b in batches) == 16, "two passes of 8 items"
    assert sampler.passes == 2, "the sampler is not asked while the window is too small"
    # the first pass took the 4 newest as fresh; the second had nothing new
    first_pass = [b for b in batches if b.position is not None and b.position.pass_index == 0]
    assert {100 - i for i in range(1, 5)} <= {int(t) for b in first_pass for t in b.ts.tolist()}


class Enough(Exception):
    """Ends a test's endless iteration."""


def test_waiting_for_the_window_does_not_move_the_watermark() -> None:
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 10)
    sampler = PassSampler(8, 0.5, "seeded", 0)
    polls = 0

    def snapshot():  # type: ignore[no-untyped-def]
        nonlocal polls
        polls += 1
        if polls > 5:
            raise Enough
        return window.snapshot()

    dataset = WindowBatchDataset(snapshot, TokenBudget(64), sampler=sampler, min_items=64, idle_wait_s=0.0)
    with pytest.raises(Enough):
        next(iter(dataset))
    assert polls == 6 and sampler.watermark == 0 and sampler.passes == 0


def test_state_keeps_the_configured_seed_and_policy(caplog: pytest.LogCaptureFixture) -> None:
    a = PassSampler(64, 0.25, "seeded", 3, SensorBalancedPolicy(2.0))
    a.passes, a.watermark = 7, 120
    b = PassSampler(64, 0.25, "seeded", 4)
    with caplog.at_level(logging.INFO, logger="streamtrain.data.passes"):
        b.load_state_dict(a.state_dict())
    assert (b.passes, b.watermark, b.seed, b.policy.name) == (7, 120, 4, "uniform")
    assert "sensor_balanced" in caplog.text
    with pytest.raises(ValueError, match="watermark"):
        b.load_state_dict({"passes": 1})


def test_sampler_from_settings_follows_sampling() -> None:
    settings = load_settings(sampling="curriculum", curriculum_strength=2.0, curriculum_half_life_steps=10.0)
    sampler = pass_sampler_from_settings(settings)
    assert isinstance(sampler.policy, CurriculumPolicy) and sampler.policy.beta(10) == pytest.approx(1.0)
    assert (sampler.max_items, sampler.fresh_share, sampler.mode) == (8192, 0.5, "seeded")


def test_diagnostics_report_the_selection() -> None:
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 300)
    seen = []
    sampler = PassSampler(100, 0.5, "seeded", 0)
    dataset = WindowBatchDataset(window.snapshot, TokenBudget(64), sampler=sampler, max_passes=2, on_pass_end=seen.append)
    list(dataset)
    first, second = seen
    assert (first.window_items, first.items, first.fresh_items, first.fresh_deferred) == (300, 100, 50, 250)
    assert (second.fresh_items, second.fresh_deferred) == (0, 0)
    assert first.sensors == 1 and first.sensor_top_share == 1.0 and math.isnan(first.sensor_hhi)


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"sampling": "stratified"}, ["stratified", "N_CLASSES"]),
        ({"sampling": "sensor_balanced", "pass_max_items": 0}, ["sensor_balanced", "PASS_MAX_ITEMS"]),
        ({"sampling": "curriculum", "pass_max_items": 0}, ["curriculum", "PASS_MAX_ITEMS"]),
        ({"sampling": "curriculum", "dp": "on", "shuffle": "crypto"}, ["DP mode", "SAMPLING=uniform"]),
        ({"sampling": "balanced"}, ["sampling", "STREAMTRAIN_SAMPLING"]),
        ({"sensor_temperature": 0}, ["sensor_temperature", "greater than 0"]),
        ({"curriculum_strength": "inf"}, ["curriculum_strength", "finite"]),
    ],
)
def test_conflicting_or_bad_sampling_settings_are_refused_in_one_line(overrides: dict, words: list[str]) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(**overrides)
    message = str(refused.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_sampling_settings_that_fit_are_accepted() -> None:
    assert load_settings(sampling="stratified", n_classes=3).sampling == "stratified"
    assert load_settings(sampling="stratified", n_classes=3, pass_max_items=0).pass_max_items == 0
    assert math.isinf(load_settings(sensor_temperature="inf").sensor_temperature)
    assert math.isinf(load_settings(curriculum_half_life_steps="inf").curriculum_half_life_steps)
