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
from streamtrain.data.policies import CurriculumPolicy, SensorBalancedPolicy, StratifiedPolicy
from streamtrain.data.randomness import SeededRandomness, make_randomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window.reservoir import RecencyWindow


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
    assert np.array_equal(np.sort(rest[SeededRandomness(5, 3, purpose="select").sample(1000, 100)]), chosen)


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

    dataset = WindowBatchDataset(
        snapshot, TokenBudget(64), sampler=sampler, min_items=64, idle_wait_s=0.0, max_passes=2
    )
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
    assert (sampler.max_items, sampler.fresh_share, sampler.mode) == (768, 0.9, "seeded")


def test_diagnostics_report_the_selection() -> None:
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(0))
    fill(window, 0, 300)
    seen = []
    sampler = PassSampler(100, 0.5, "seeded", 0)
    dataset = WindowBatchDataset(
        window.snapshot, TokenBudget(64), sampler=sampler, max_passes=2, on_pass_end=seen.append
    )
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


class _Snapshot:
    """The columns the sampler reads, without a window."""

    def __init__(self, sensor_ids: list[str], seq: list[int] | None) -> None:
        n = len(sensor_ids)
        self.lengths = np.full(n, 4, np.int64)
        self.labels = np.full(n, -1, np.int64)
        self.sensor_ids = np.array(sensor_ids, dtype=object)
        self.seq = None if seq is None else np.asarray(seq, np.int64)

    def __len__(self) -> int:
        return len(self.sensor_ids)


@pytest.mark.parametrize(
    "args, message",
    [
        ((8, 0.5, "random", 0), r"^shuffle mode must be one of \('seeded', 'crypto'\), got 'random'$"),
        ((8, -0.1, "seeded", 0), r"^fresh_share must be within \[0, 1\], got -0.1$"),
        ((8, 1.5, "seeded", 0), r"^fresh_share must be within \[0, 1\], got 1.5$"),
        ((-1, 0.5, "seeded", 0), r"^max_items \(0: the whole window\) must be an integer >= 0, got -1$"),
        ((8, 0.5, "seeded", -2), r"^seed must be an integer >= 0, got -2$"),
    ],
)
def test_bad_sampler_settings_are_refused_with_the_rule(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PassSampler(*args)


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_fresh_share_may_be_zero_or_one(share: float) -> None:
    assert PassSampler(8, share, "seeded", 0).fresh_share == share


def test_an_event_at_the_watermark_is_fresh_and_the_fresh_come_newest_first() -> None:
    sampler = PassSampler(3, 1.0, "seeded", 0)
    sampler.watermark = 5
    snapshot = _Snapshot(["a"] * 6, [0, 7, 5, 1, 6, 2])
    selection = sampler.select(snapshot)
    assert selection.fresh.tolist() == [1, 2, 4] and selection.index.tolist() == [1, 2, 4]
    assert sampler.watermark == 8 and sampler.passes == 1
    # newest first: with room for two fresh, arrival 5 (index 2) is the one deferred
    sampler = PassSampler(4, 0.5, "seeded", 0)
    sampler.watermark = 5
    selection = sampler.select(snapshot)
    assert selection.fresh.tolist() == [1, 4] and selection.facts["fresh_deferred"] == 1


def test_a_snapshot_without_arrival_numbers_has_no_fresh_events_and_keeps_the_watermark() -> None:
    sampler = PassSampler(2, 0.5, "seeded", 0)
    selection = sampler.select(_Snapshot(["a", "b", "a", "b"], None))
    assert selection.fresh.size == 0 and len(selection) == 2
    assert sampler.watermark == 0 and sampler.passes == 1


def test_the_watermark_never_moves_back() -> None:
    sampler = PassSampler(0, 0.5, "seeded", 0)
    sampler.watermark = 50
    sampler.advance_past(_Snapshot(["a", "a"], [3, 4]))
    assert sampler.watermark == 50 and sampler.passes == 1
    sampler.advance_past(_Snapshot([], []))
    assert sampler.watermark == 50 and sampler.passes == 2


@pytest.mark.parametrize("max_items", [0, 4])
def test_a_pass_as_large_as_the_window_takes_all_of_it(max_items: int) -> None:
    selection = PassSampler(max_items, 0.5, "seeded", 0).select(_Snapshot(["a", "b", "c", "d"], [0, 1, 2, 3]))
    assert selection.index.tolist() == [0, 1, 2, 3] and selection.fresh.tolist() == [0, 1, 2, 3]


def test_the_fresh_cap_is_the_share_of_the_pass_rounded_down() -> None:
    sampler = PassSampler(5, 0.5, "seeded", 0)  # 2.5 -> 2 fresh
    selection = sampler.select(_Snapshot(["a"] * 10, list(range(10))))
    assert selection.fresh.tolist() == [8, 9] and len(selection) == 5


def test_diagnostics_describe_the_sensor_mix_of_the_pass_and_the_window() -> None:
    sampler = PassSampler(0, 0.5, "seeded", 0)
    selection = sampler.select(_Snapshot(["a", "a", "a", "b"], [0, 1, 2, 3]))
    facts = selection.facts
    assert (facts["window_items"], facts["fresh_items"], facts["fresh_deferred"], facts["sensors"]) == (4, 4, 0, 2)
    assert facts["sensor_top_share"] == 0.75
    # normalized HHI of shares (3/4, 1/4): (10/16 - 1/2) / (1 - 1/2) = 1/4, the pass is the window
    assert facts["sensor_hhi"] == pytest.approx(0.25) and facts["window_sensor_hhi"] == pytest.approx(0.25)
    assert selection.stratify is False


def test_a_bounded_pass_reports_the_window_mix_apart_from_its_own() -> None:
    sampler = PassSampler(2, 1.0, "seeded", 0)
    sampler.watermark = 2
    selection = sampler.select(_Snapshot(["a", "b", "a", "a"], [0, 1, 2, 3]))  # fresh: the two "a" events
    facts = selection.facts
    assert facts["sensors"] == 1 and facts["sensor_top_share"] == 1.0 and facts["sensor_hhi"] == pytest.approx(1.0)
    assert facts["window_sensor_hhi"] == pytest.approx(0.25)


def test_the_policy_facts_and_batch_stratification_come_with_the_selection() -> None:
    curriculum = PassSampler(2, 0.0, "seeded", 0, CurriculumPolicy(2.0, 10.0))
    selection = curriculum.select(_Snapshot(["a"] * 4, [0, 1, 2, 3]), planned_steps=10)
    assert selection.facts["curriculum_beta"] == pytest.approx(1.0)
    stratified = PassSampler(2, 0.0, "seeded", 0, StratifiedPolicy())
    assert stratified.select(_Snapshot(["a"] * 4, [0, 1, 2, 3])).stratify is True


def test_the_signature_names_the_pass_shape_and_the_policy() -> None:
    sampler = PassSampler(64, 0.25, "seeded", 3, SensorBalancedPolicy(2.0))
    assert sampler.signature() == "max_items=64 fresh_share=0.25 sensor_balanced{'temperature': '2.0'}"
    assert PassSampler(8, 0.5, "seeded", 0).policy.name == "uniform"


def test_state_dict_holds_the_counters_the_seed_and_the_policy_name() -> None:
    sampler = PassSampler(8, 0.5, "seeded", 9, SensorBalancedPolicy(2.0))
    sampler.passes, sampler.watermark = 4, 17
    assert sampler.state_dict() == {"passes": 4, "watermark": 17, "seed": 9, "policy": "sensor_balanced"}


@pytest.mark.parametrize(
    "state, message",
    [
        ({}, r"^PassSampler state lacks \['passes', 'watermark'\]; pass a dict from state_dict\(\)$"),
        ({"passes": -1, "watermark": 0}, r"^PassSampler state needs passes >= 0 and watermark >= 0, got"),
        ({"passes": 0, "watermark": -1}, r"^PassSampler state needs passes >= 0 and watermark >= 0, got"),
    ],
)
def test_a_bad_state_is_refused_and_changes_nothing(state: dict, message: str) -> None:
    sampler = PassSampler(8, 0.5, "seeded", 0)
    sampler.passes, sampler.watermark = 3, 30
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict(state)
    assert (sampler.passes, sampler.watermark) == (3, 30)


def test_a_state_of_zero_counters_is_accepted(caplog: pytest.LogCaptureFixture) -> None:
    sampler = PassSampler(8, 0.5, "seeded", 0)
    sampler.passes = 5
    with caplog.at_level(logging.INFO, logger="streamtrain.data.passes"):
        sampler.load_state_dict({"passes": 0, "watermark": 0})  # no policy saved: uniform, as configured
    assert (sampler.passes, sampler.watermark) == (0, 0) and "policy changed" not in caplog.text


def test_sampler_from_settings_passes_the_sensor_temperature() -> None:
    settings = load_settings(
        sampling="sensor_balanced", sensor_temperature=3.5, pass_max_items=100, pass_fresh_share=0.25
    )
    sampler = pass_sampler_from_settings(settings)
    assert isinstance(sampler.policy, SensorBalancedPolicy) and sampler.policy.temperature == 3.5
    assert (sampler.max_items, sampler.fresh_share) == (100, 0.25)


def test_a_pass_of_one_item_takes_one_item() -> None:
    selection = PassSampler(1, 1.0, "seeded", 0).select(_Snapshot(["a", "a", "a"], [0, 1, 2]))
    assert selection.index.tolist() == [2] and selection.fresh.tolist() == [2]


def test_the_curriculum_clock_starts_at_zero_steps() -> None:
    sampler = PassSampler(2, 0.0, "seeded", 0, CurriculumPolicy(2.0, 10.0))
    assert sampler.select(_Snapshot(["a"] * 4, [0, 1, 2, 3])).facts["curriculum_beta"] == 2.0


def test_a_sensor_balanced_pass_gives_a_quiet_sensor_its_share() -> None:
    sampler = PassSampler(4, 0.0, "seeded", 0, SensorBalancedPolicy(float("inf")))
    selection = sampler.select(_Snapshot(["a"] * 8 + ["b"] * 2, list(range(10))))
    assert {8, 9} <= set(selection.index.tolist()) and len(selection) == 4
    assert selection.facts["sensor_top_share"] == 0.5


def test_a_policy_change_at_restore_is_logged_with_both_names(caplog: pytest.LogCaptureFixture) -> None:
    sampler = PassSampler(8, 0.5, "seeded", 0)
    with caplog.at_level(logging.INFO, logger="streamtrain.data.passes"):
        sampler.load_state_dict({"passes": 1, "watermark": 2, "policy": "curriculum"})
    assert caplog.messages == ["sampling policy changed from curriculum (checkpoint) to uniform"]
