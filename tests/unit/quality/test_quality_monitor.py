"""The monitor on poll batches: prequential averages by hand, the scoring budget, the rollback rule (no Kafka)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from streamtrain.metrics import Metrics
from streamtrain.model.network import ModelOutput
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.config import QualityConfig
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


def test_the_per_second_cap_scores_a_random_sample() -> None:
    now = [0.0]
    norm = RunningNorm.from_public([0.0], [1.0])
    config = QualityConfig(max_events_per_s=10.0, drift_detector="off")
    quality = QualityMonitor(config, Metrics(), lambda: Frozen(ForecastsZero(), norm), clock=lambda: now[0])
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
