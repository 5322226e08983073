"""The monitor on poll batches: prequential averages by hand, the scoring budget, the rollback rule (no Kafka)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from streamtrain.metrics import Metrics
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.config import QualityConfig
from streamtrain.quality.monitor import QualityMonitor
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
