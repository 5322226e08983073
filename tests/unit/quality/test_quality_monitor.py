"""The monitor on poll batches: prequential averages by hand, the scoring budget, the rollback rule (no Kafka)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from streamtrain.data.randomness import make_randomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.metrics import Metrics
from streamtrain.model.network import ModelOutput, SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality import monitor as monitor_module
from streamtrain.quality.config import SCORING_STREAM, QualityConfig
from streamtrain.quality.drift import Drift, DriftMonitor
from streamtrain.quality.monitor import SCORE_BATCH_EVENTS, QualityMonitor
from streamtrain.quality.scoring import EventScores

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/unit/quality: the shared quality fixtures
from quality_fixtures import ForecastsZero, Frozen, events, monitor  # noqa: E402


def test_prequential_report_by_hand() -> None:
    norm = RunningNorm.from_public([0.0], [1.0])
    quality = monitor(Frozen(ForecastsZero(), norm, version=7), half_life_events=1.0)
    assert quality.report(7) is None  # nothing scored yet
    quality.observe(events([1.0, 2.0], [3.0]))  # event 0: sse 4, naive 1; event 1: no steps
    quality.observe(events([0.0, 1.0, 1.0]))  # sse 1 + 1, naive 1 + 0
    report = quality.report(7)
    assert report is not None
    assert report["n"] == 2 and report["drifts"] == 0
    # Half-life of one event: the older event weighs 1/2. Steps: 1 * 0.5 + 2.
    assert report["prequential_mse"] == pytest.approx((4 * 0.5 + 2) / (1 * 0.5 + 2))
    assert report["naive_mse"] == pytest.approx((1 * 0.5 + 1) / (1 * 0.5 + 2))
    assert report["skill"] == pytest.approx(1 - (4 * 0.5 + 2) / (1 * 0.5 + 1))
    assert report["total"]["prequential_mse"] == pytest.approx(6 / 3)
    assert report["total"]["naive_mse"] == pytest.approx(2 / 3)
    assert report["scored_share"] == pytest.approx(2 / 3)  # 3 events offered, 2 had a step
    assert report["serving_version"]["version"] == 7 and report["serving_version"]["n"] == 2
    assert quality.metrics.prequential_events._value.get() == 2


def capped_monitor(now: list[float], **config: object) -> QualityMonitor:
    """A monitor on the clock ``now[0]`` that scores the zero forecaster, at most 10 events a second."""
    norm = RunningNorm.from_public([0.0], [1.0])
    settings = QualityConfig(**{"max_events_per_s": 10.0, "drift_detector": "off", **config})
    return QualityMonitor(settings, Metrics(), lambda: Frozen(ForecastsZero(), norm), clock=lambda: now[0])


def test_the_per_second_cap_scores_a_random_sample() -> None:
    now = [0.0]
    quality = capped_monitor(now)
    batch = events(*([[0.0, 1.0]] * 50))
    quality.observe(batch)
    assert quality.scored == 10  # one second of budget
    quality.observe(batch)
    assert quality.scored == 10  # no time passed: no budget
    now[0] = 0.5
    quality.observe(batch)
    assert quality.scored == 15
    assert quality.report(1)["scored_share"] == pytest.approx(15 / 150)


def test_nothing_is_scored_before_a_model_serves_or_when_scoring_is_off() -> None:
    batch = events([0.0, 1.0, 2.0])
    assert monitor(None).observe(batch) is batch
    off = monitor(Frozen(ForecastsZero(), RunningNorm(1)), max_events_per_s=0.0)
    off.observe(batch)
    assert off.report(1) is None and off.offered == 1


def scores(k: int, mse: float, naive: float) -> EventScores:
    return EventScores(
        steps=np.full(k, 10), sse=np.full(k, 10 * mse), naive_sse=np.full(k, 10 * naive),
        log_loss=np.full(k, np.nan), correct=np.full(k, np.nan),
    )  # fmt: skip


def test_automatic_rollback_when_skill_falls_below_the_predecessors() -> None:
    asked: list[tuple[int, str]] = []
    config = QualityConfig(drift_detector="off", rollback_min_events=50, rollback_margin=0.1)
    quality = QualityMonitor(config, Metrics(), lambda: None, on_rollback=lambda v, why: asked.append((v, why)) or True)
    quality.record(scores(60, 0.5, 1.0), version=3)  # skill 0.5
    quality.record(scores(49, 0.9, 1.0), version=4)  # skill 0.1, but too few events yet
    assert asked == []
    quality.record(scores(1, 0.9, 1.0), version=4)
    assert [v for v, _ in asked] == [3] and "skill 0.100 of version 4" in asked[0][1]
    quality.record(scores(100, 0.9, 1.0), version=4)  # once per version
    assert len(asked) == 1
    quality.record(scores(60, 0.55, 1.0), version=5)  # within the margin of version 4's... and 3 is not its predecessor
    assert len(asked) == 1


def test_no_rollback_within_the_margin_or_when_turned_off() -> None:
    asked: list[int] = []
    for auto, mse in ((True, 0.55), (False, 0.99)):
        config = QualityConfig(drift_detector="off", rollback_min_events=10, rollback_margin=0.1, auto_rollback=auto)
        quality = QualityMonitor(config, Metrics(), lambda: None, on_rollback=lambda v, why: asked.append(v) or True)
        quality.record(scores(20, 0.5, 1.0), version=1)
        quality.record(scores(20, mse, 1.0), version=2)
    assert asked == []


class CountsCalls(ForecastsZero):
    """Forecasts 0 (as :class:`ForecastsZero`) and counts the events of each forward call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        self.calls.append(int(x_norm.shape[0]))
        return super().forward(x_norm, mask)


class ForecastsLastValue(nn.Module):
    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        return ModelOutput(forecast=x_norm, logits=None)


def test_scoring_waits_for_company_but_never_longer_than_the_delay() -> None:
    now = [0.0]
    model = CountsCalls()
    config = QualityConfig(max_events_per_s=1e9, drift_detector="off", score_delay_s=1.0)
    serving = Frozen(model, RunningNorm(1))
    quality = QualityMonitor(config, Metrics(), lambda: serving, clock=lambda: now[0])
    quality.observe(events([0.0, 1.0]))
    assert quality.scored == 1  # nothing scored for a second: at once (a slow stream waits for nothing)
    now[0] = 0.1
    quality.observe(events(*([[0.0, 1.0]] * 10)))
    assert quality.scored == 1  # waits for company
    now[0] = 0.2
    quality.observe(events(*([[0.0, 1.0]] * (SCORE_BATCH_EVENTS - 10))))
    assert quality.scored == 1 + SCORE_BATCH_EVENTS and model.calls == [1, SCORE_BATCH_EVENTS]  # one call
    now[0] = 0.5
    quality.observe(events(*([[0.0, 1.0]] * 5)))
    assert quality.scored == 1 + SCORE_BATCH_EVENTS
    now[0] = 1.3  # a second after the last scoring: what waits is scored
    quality.observe(events([0.0, 1.0]))
    assert quality.scored == 7 + SCORE_BATCH_EVENTS and model.calls[-1] == 6
    quality.observe(events(*([[0.0, 1.0]] * 3)))
    quality.score_waiting()
    assert quality.scored == 10 + SCORE_BATCH_EVENTS


def test_waiting_events_are_scored_by_the_model_that_served_when_they_arrived() -> None:
    now = [0.0]
    norm = RunningNorm.from_public([0.0], [1.0])
    serving = [Frozen(ForecastsZero(), norm, version=1)]
    config = QualityConfig(max_events_per_s=1e9, drift_detector="off", score_delay_s=1.0)
    quality = QualityMonitor(config, Metrics(), lambda: serving[0], clock=lambda: now[0])
    quality.observe(events([5.0, 5.0]))  # scored at once by version 1
    quality.observe(events([2.0, 2.0], [3.0, 3.0]))  # wait, for version 1
    serving[0] = Frozen(ForecastsLastValue(), norm, version=2)
    quality.observe(events([4.0, 4.0]))  # waits, for version 2
    assert quality.scored == 1
    quality.score_waiting()
    assert quality.scored == 4
    first, second = quality.report(1), quality.report(2)
    assert first is not None and second is not None
    # version 1 forecast 0 for 5, 2 and 3; version 2 forecast 4 (the last value) for 4
    assert first["serving_version"]["n"] == 3
    assert first["serving_version"]["prequential_mse"] == pytest.approx((25 + 4 + 9) / 3)
    assert second["serving_version"]["n"] == 1 and second["serving_version"]["prequential_mse"] == 0.0


# what the mutation run of the monitor asked (docs/testing.md)


def sliding_windows(count: int, length: int = 24) -> EventBatch:
    """``count`` stride-1 windows of one sensor, one reading apart in time."""
    x = np.cumsum(np.random.default_rng(60).normal(size=count + length - 1))
    items = [SensorEvent("pump", 1000.0 + i, x[i : i + length, None].astype(np.float32)) for i in range(count)]
    return EventBatch.from_events(items, channels=1)


def test_the_scoring_budget_refills_at_its_rate_from_any_clock_reading() -> None:
    now = [100.0]
    quality = capped_monitor(now)
    batch = events(*([[0.0, 1.0]] * 50))
    quality.observe(batch)
    quality.observe(batch)
    assert quality.scored == 10  # no time passed, no new budget
    now[0] = 100.5
    quality.observe(batch)
    assert quality.scored == 15  # half a second: half the rate
    one = capped_monitor([now[0]], max_events_per_s=1.0)
    one.observe(batch)
    assert one.scored == 1  # a rate of one event a second scores one


def test_each_poll_batch_draws_its_sample_from_its_own_stream_coordinate(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    quality = capped_monitor(now, seed=5)
    drawn: list[list[int]] = []
    monkeypatch.setattr(quality, "_queue", lambda batch, rows: drawn.append(rows.tolist()))
    batch = events(*([[0.0, 1.0]] * 50))
    for second in range(3):
        now[0] = float(second)
        quality.observe(batch)
    expected = [
        np.sort(make_randomness("seeded", 5, draw, worker=SCORING_STREAM).permutation(50)[:10]).tolist()
        for draw in (1, 2, 3)
    ]
    assert drawn == expected and drawn[0] != drawn[1]


def test_every_event_goes_to_the_window_the_holdout_or_the_guards_once_batch_by_batch() -> None:
    stream = sliding_windows(300)
    quality = monitor(None, holdout_share=0.25, holdout_capacity=1000)
    trained: list[float] = []  # each event known by its first reading (a random walk repeats none)
    for i in range(len(stream)):  # one event a poll batch: a block's guards arrive alone
        kept = quality.observe(stream.take(np.array([i])))
        trained.extend(kept.values[kept.starts, 0].tolist())
    held = {float(v[0, 0]) for v in quality.holdout.values}
    guards = {float(v[0, 0]) for v in quality.guards.values}
    assert quality.held_out_total == len(held) > 1 and quality.guarded_total == len(guards) > 1
    assert not (held & guards) and not (set(trained) & (held | guards))
    assert len(trained) + len(held) + len(guards) == 300
    small = monitor(None, holdout_share=0.25, holdout_capacity=8)
    small.observe(stream)
    assert len(small.holdout) == len(small.guards) == 8  # the most recent, within capacity
    assert small.held_out_total == quality.held_out_total and small.guarded_total == quality.guarded_total


def test_the_fading_averages_halve_an_events_weight_every_half_life_and_feed_the_gauges() -> None:
    quality = monitor(None, half_life_events=4.0)
    rng = np.random.default_rng(61)
    sse, naive = rng.uniform(1, 2, size=8), rng.uniform(2, 3, size=8)

    def scores(rows: slice) -> EventScores:
        k = len(sse[rows])
        return EventScores(np.ones(k, dtype=np.int64), sse[rows], naive[rows], np.full(k, np.nan), np.full(k, np.nan))

    quality.record(scores(slice(0, 3)), 1)
    quality.record(scores(slice(3, 8)), 1)
    weights = 0.5 ** (np.arange(7, -1, -1) / 4.0)
    mse, naive_mse = float(weights @ sse / weights.sum()), float(weights @ naive / weights.sum())
    assert quality.recent.mse == pytest.approx(mse) and quality.recent.naive_mse == pytest.approx(naive_mse)
    assert quality.metrics.prequential_mse._value.get() == pytest.approx(mse)
    assert quality.metrics.prequential_naive_mse._value.get() == pytest.approx(naive_mse)
    flat = monitor(None)  # constant readings: the last value makes no error, and the gauge says 0
    flat.record(EventScores(np.ones(2, dtype=np.int64), np.ones(2), np.zeros(2), np.ones(2), np.ones(2)), 1)
    assert flat.metrics.prequential_naive_mse._value.get() == 0.0


def test_drifts_reach_the_trainer_are_logged_counted_and_the_last_ten_listed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[Drift] = []
    config = QualityConfig(max_events_per_s=1e9, drift_detector="adwin", half_life_events=50.0)
    quality = QualityMonitor(config, Metrics(), lambda: None, on_drift=seen.append)
    alone = DriftMonitor("adwin", config.drift_adwin_delta, config.drift_ph_threshold, half_life=50.0)
    levels = np.tile([0.1, 5.0], 8)  # 16 stretches of 300 events, each level far from the last
    noise = np.random.default_rng(62).uniform(0.0, 0.05, size=300)
    expected_before: list[float | None] = []
    with caplog.at_level(logging.WARNING, logger="streamtrain.quality.monitor"):
        for level in levels:
            k = 300
            errors = EventScores(
                np.ones(k, dtype=np.int64), level + noise, np.ones(k), np.full(k, np.nan), np.full(k, np.nan)
            )
            quality.record(errors, 3)
            for error in (level + noise).tolist():
                if alone.update(error):
                    expected_before.append(alone.error_before)
                    alone.restart_levels()
    assert len(seen) == quality.drifts >= 11 and quality.metrics.drift_detected._value.get() == quality.drifts
    first = seen[0]
    assert (first.detector, first.version) == ("adwin", 3) and 300 < first.at_event <= 600
    assert first.error_before is not None and first.error_recent is not None
    assert first.error_before < 1.0 < first.error_recent and abs(first.at - time.time()) < 60
    assert [d.error_before for d in seen] == pytest.approx(expected_before)  # the configured half-life
    report = quality.report(3)
    assert report is not None and report["recent_drifts"] == [dataclasses.asdict(d) for d in seen[-10:]]
    message = (
        f"drift detected by adwin after {first.at_event} scored events (serving version 3): "
        f"error per step {first.error_before:.4g} before, {first.error_recent:.4g} recently"
    )
    assert message in caplog.messages


def test_versions_past_the_thirty_two_tracked_are_forgotten_oldest_first() -> None:
    quality = monitor(None)
    one = EventScores(np.ones(1, dtype=np.int64), np.ones(1), np.ones(1), np.full(1, np.nan), np.full(1, np.nan))
    for version in range(1, 41):
        quality.record(one, version)
    assert list(quality.versions) == list(range(9, 41)) and quality.serving_order == list(range(9, 41))


def test_a_rollback_is_due_at_exactly_the_minimum_events_and_is_reported_in_full() -> None:
    quality = monitor(None, rollback_min_events=50, rollback_margin=0.1)
    asked: list[tuple[int, str]] = []
    quality._on_rollback = lambda version, reason: asked.append((version, reason)) or True

    def scores(k: int, mse: float) -> EventScores:
        return EventScores(
            np.full(k, 10), np.full(k, 10 * mse), np.full(k, 10.0), np.full(k, np.nan), np.full(k, np.nan)
        )

    quality.record(scores(50, 0.4), 1)
    quality.record(scores(50, 0.9), 2)
    assert [version for version, _ in asked] == [1] and quality.versions[2].rolled_back
    assert asked[0][1] == "skill 0.100 of version 2 is below 0.600 of version 1 by more than 0.1 over 50 and 50 events"
    quality.note_rollback(1, "automatic", asked[0][1], 2)
    report = quality.report(1)
    assert report is not None and set(report["rollbacks"][-1]) == {
        "to_version",
        "from_version",
        "trigger",
        "reason",
        "at",
    }
    assert report["rollbacks"][-1]["to_version"] == 1 and report["rollbacks"][-1]["reason"] == asked[0][1]


def test_with_the_gate_off_every_candidate_serves_with_the_network() -> None:
    quality = monitor(None, holdout_share=0.0)
    candidate = Frozen(ForecastsZero(), RunningNorm.from_public([0.0], [1.0]))
    selection = quality.select(candidate, None, lambda: ([], 1.0))  # type: ignore[arg-type]
    reason = "gate off (HOLDOUT_SHARE=0)"
    assert (selection.decision.publish, selection.decision.reason, selection.decision.holdout_events) == (
        True,
        reason,
        0,
    )
    assert selection.reason == reason and selection.network is candidate and selection.forecaster.kind == "network"


def test_scaled_out_the_gate_judges_the_union_of_the_ranks_holdouts() -> None:
    """Two ranks with the same 20 held-out events: 40 in all, enough for a gate that needs 32."""
    quality = monitor(None, holdout_share=0.5, holdout_min_events=32)
    quality.holdout.add(events(*[[0.0, 1.0, 0.5, 0.2]] * 20), np.arange(20))
    sent: list[np.ndarray] = []

    def two_ranks(local: np.ndarray) -> np.ndarray:
        sent.append(local)
        return [2.0 * float(v) for v in local]  # type: ignore[return-value]

    quality.combine = two_ranks
    candidate = Frozen(
        SensorModel(1, d_model=8, n_heads=2, n_layers=1, max_len=64), RunningNorm.from_public([0.0], [1.0])
    )
    selection = quality.select(candidate, None, lambda: ([], 1.0))  # type: ignore[arg-type]
    assert selection.holdout_events == 40 and "holdout has" not in selection.reason
    assert all(s.dtype == np.float64 for s in sent)


def test_the_monitor_state_round_trips_and_goes_on_recording() -> None:
    norm = RunningNorm.from_public([0.0], [1.0])
    quality = monitor(Frozen(ForecastsZero(), norm, version=1), holdout_share=0.25)
    quality.observe(sliding_windows(200))
    quality.record(EventScores(np.ones(1, dtype=np.int64), np.ones(1), np.ones(1), np.ones(1), np.ones(1)), 2)
    quality.versions[1].rolled_back = True
    quality.score_seconds = 1.25
    restored = monitor(None, holdout_share=0.25)
    restored.load_state_dict(quality.state_dict(), channels=1)
    assert restored.guarded_total == quality.guarded_total > 0 and restored.score_seconds == 1.25
    assert [(r.version, r.events, r.rolled_back) for r in restored.versions.values()] == [
        (r.version, r.events, r.rolled_back) for r in quality.versions.values()
    ]
    assert restored.versions[1].rolled_back and not restored.versions[2].rolled_back
    restored.record(EventScores(np.ones(1, dtype=np.int64), np.ones(1), np.ones(1), np.ones(1), np.ones(1)), 3)
    assert restored.serving_order == [1, 2, 3]


def test_the_report_names_its_horizon_units_cost_and_holdout_and_tolerates_an_unknown_version() -> None:
    norm = RunningNorm.from_public([0.0], [1.0])
    quality = monitor(Frozen(ForecastsZero(3), norm, version=1), holdout_share=0.25, half_life_events=1e9)
    quality.observe(events([0.0, 1.0], [1.0, 2.0], [2.0, 3.0], [3.0, 4.0], labels=[1, 0, 1, 1]))
    report = quality.report(999)
    assert report is not None and report["serving_version"] is None
    assert report["accuracy"] == pytest.approx(3 / 4) and report["log_loss"] is not None
    assert report["horizon"] == {"kind": "fading", "half_life_events": 1e9}
    assert report["units"] == "squared error per step and channel, in the serving model's normalized units"
    assert report["drift_detector"] == "off" and report["score_seconds"] == quality.score_seconds > 0
    assert report["holdout"] == {
        "share": 0.25, "events": len(quality.holdout), "held_out_total": quality.held_out_total,
        "guarded_total": quality.guarded_total, "block_events": 1,
    }  # fmt: skip


def test_waiting_events_count_from_zero_after_each_call_and_a_zero_delay_scores_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    norm = RunningNorm.from_public([0.0], [1.0])
    clock = [5.0]
    config = QualityConfig(max_events_per_s=1e9, drift_detector="off", score_delay_s=3600.0)
    serving = Frozen(ForecastsZero(), norm)  # one model: the waiting events are scored in one call
    quality = QualityMonitor(config, Metrics(), lambda: serving, clock=lambda: clock[0])
    ticks = iter(np.arange(0.0, 100.0, 0.5))
    fake_time = SimpleNamespace(perf_counter=lambda: float(next(ticks)), time=time.time, monotonic=time.monotonic)
    monkeypatch.setattr(monitor_module, "time", fake_time)  # the monitor's clock for its own cost only
    quality.observe(events([0.0, 1.0]))
    assert quality.scored == 1 and quality.score_seconds == 0.5  # the first event is scored at once
    quality.observe(events(*([[0.0, 1.0]] * (SCORE_BATCH_EVENTS - 1))))
    assert quality.scored == 1  # one short of a call: counting from zero after the last one
    quality.observe(events([0.0, 1.0]))
    assert quality.scored == 1 + SCORE_BATCH_EVENTS and quality.score_seconds == 1.0
    now = QualityMonitor(
        QualityConfig(max_events_per_s=1e9, drift_detector="off", score_delay_s=0.0),
        Metrics(),
        lambda: Frozen(ForecastsZero(), norm),
        clock=lambda: clock[0],
    )
    now.observe(events([0.0, 1.0]))
    now.observe(events([0.0, 1.0]))
    assert now.scored == 2  # no delay: each scored in its own call, even on a clock that has not moved


def test_no_skill_to_compare_is_no_rollback_and_no_failure() -> None:
    quality = monitor(None, rollback_min_events=10)
    asked: list[int] = []
    quality._on_rollback = lambda version, reason: asked.append(version) or True

    def scores(k: int, naive: float) -> EventScores:
        return EventScores(np.full(k, 10), np.full(k, 5.0), np.full(k, naive), np.full(k, np.nan), np.full(k, np.nan))

    quality.record(scores(20, 10.0), 1)
    quality.record(scores(20, 0.0), 2)  # constant readings: no skill for version 2
    assert asked == [] and quality.versions[2].totals.skill is None


def test_the_scoring_budget_is_not_spent_before_a_model_serves() -> None:
    norm = RunningNorm.from_public([0.0], [1.0])
    serving: list[Frozen] = []
    config = QualityConfig(max_events_per_s=10.0, drift_detector="off")
    quality = QualityMonitor(config, Metrics(), lambda: serving[0] if serving else None, clock=lambda: 7.0)
    batch = events(*([[0.0, 1.0]] * 10))
    quality.observe(batch)
    serving.append(Frozen(ForecastsZero(), norm))
    quality.observe(batch)
    assert quality.scored == 10


def test_a_state_from_before_the_guards_and_the_cost_were_kept_loads_with_none_of_either() -> None:
    quality = monitor(None, holdout_share=0.25)
    quality.observe(sliding_windows(200))
    state = quality.state_dict()
    for key in ("score_seconds", "guarded_total"):
        del state[key]
    restored = monitor(None, holdout_share=0.25)
    restored.guarded_total, restored.score_seconds = 5, 2.0
    restored.load_state_dict(state, channels=1)
    assert restored.guarded_total == 0 and restored.score_seconds == 0.0


def test_a_restored_splitter_gets_the_readings_width_where_its_state_lost_it() -> None:
    x = np.random.default_rng(63).normal(size=(60, 2)).astype(np.float32)
    items = [SensorEvent("pump", 1000.0 + i, x[i : i + 24]) for i in range(30)]
    quality = monitor(None, holdout_share=0.25)
    quality.observe(EventBatch.from_events(items, channels=2))
    state = quality.state_dict()
    state["splitter"] = {**state["splitter"], "last_values": np.asarray(state["splitter"]["last_values"]).ravel()}
    restored = monitor(None, holdout_share=0.25)
    restored.load_state_dict(state, channels=2)
    np.testing.assert_array_equal(
        restored.splitter.state_dict()["last_values"], quality.splitter.state_dict()["last_values"]
    )
