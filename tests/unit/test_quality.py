"""Test-then-train scoring, drift detection, holdout and gate (quality.py), without Kafka."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from streamtrain.events import NO_LABEL, EventBatch, EventLimits, SensorEvent, decode_batch
from streamtrain.metrics import Metrics
from streamtrain.model.network import ModelOutput, RunningNorm, SensorModel
from streamtrain.quality.monitor import (
    EventScores,
    QualityConfig,
    QualityMonitor,
    score_events,
)
from streamtrain.tools.simulate import SensorFleet, SimulationConfig


class ForecastsZero(nn.Module):
    """A frozen model whose forecast is 0 in normalized units (the norm's mean) and whose
    logits always favour class 1."""

    def __init__(self, n_classes: int = 0) -> None:
        super().__init__()
        self.n_classes = n_classes

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        logits = None
        if self.n_classes:
            logits = torch.zeros(x_norm.shape[0], self.n_classes)
            logits[:, 1] = math.log(3.0)  # p = 3/(3 + n - 1)
        return ModelOutput(forecast=torch.zeros_like(x_norm), logits=logits)


@dataclass
class Frozen:
    model: nn.Module
    norm: RunningNorm
    version: int = 1

    @property
    def served(self) -> nn.Module:
        return self.model


def events(*series: list[float], labels: list[int] | None = None) -> EventBatch:
    items = [
        SensorEvent(
            f"s{i}", 1000.0 + i, np.asarray(v, dtype=np.float32)[:, None], NO_LABEL if labels is None else labels[i]
        )
        for i, v in enumerate(series)
    ]
    return EventBatch.from_events(items, channels=1)


def monitor(serving: Frozen | None, **overrides: object) -> QualityMonitor:
    config = QualityConfig(**{"max_events_per_s": 1e9, "drift_detector": "off", **overrides})  # type: ignore[arg-type]
    return QualityMonitor(config, Metrics(), lambda: serving)


# ------------------------------------------------------------------ hand-computed figures


def test_scores_of_a_frozen_model_by_hand() -> None:
    norm = RunningNorm.from_public([0.0], [2.0])
    scores = score_events(ForecastsZero(2), norm, [np.array([[1.0], [2.0], [4.0]]), np.array([[3.0]])], [1, NO_LABEL])
    # Event 0: targets 2 and 4, forecast 0 (data units): ((0-2)/2)^2 + ((0-4)/2)^2 = 1 + 4.
    # Last value: ((1-2)/2)^2 + ((2-4)/2)^2 = 0.25 + 1. Event 1 has no step to forecast.
    assert scores.steps.tolist() == [2, 0]
    assert scores.sse.tolist() == pytest.approx([5.0, 0.0])
    assert scores.naive_sse.tolist() == pytest.approx([1.25, 0.0])
    assert scores.log_loss[0] == pytest.approx(-math.log(3 / 4))  # labelled class 1 with p = 3/4
    assert scores.correct[0] == 1.0 and math.isnan(scores.log_loss[1]) and math.isnan(scores.correct[1])


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


# ------------------------------------------------------------------ holdout


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


# ------------------------------------------------------------------ gate


def trained_like(seed: int) -> SensorModel:
    torch.manual_seed(seed)
    model = SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=64).eval()
    nn.init.normal_(model.forecast_head.weight, std=0.05)
    return model


def gate_with(values: list[list[float]], min_events: int = 32) -> QualityMonitor:
    quality = monitor(None, holdout_share=0.5, holdout_min_events=min_events, holdout_capacity=256)
    quality.holdout.add(events(*values), np.arange(len(values)))
    return quality


def test_gate_holds_back_a_broken_candidate_and_passes_an_equal_one() -> None:
    rng = np.random.default_rng(0)
    quality = gate_with([np.cumsum(rng.normal(size=20)).tolist() for _ in range(64)])
    norm = RunningNorm.from_public([0.0], [3.0])
    serving = Frozen(trained_like(1), norm, 1)
    same = Frozen(trained_like(1), norm, 2)
    no_data: Callable[[], list[np.ndarray]] = list
    assert quality.select(same, serving, no_data).decision.publish
    broken_model = trained_like(1)
    with torch.no_grad():
        broken_model.forecast_head.bias.fill_(5.0)  # a test hook's corruption: forecasts far off
    broken = quality.select(Frozen(broken_model, norm, 3), serving, no_data).decision
    assert not broken.publish and broken.candidate_mse > 10 * broken.serving_mse
    nan_model = trained_like(1)
    with torch.no_grad():
        nan_model.forecast_head.weight.fill_(float("nan"))
    assert not quality.select(Frozen(nan_model, norm, 4), serving, no_data).decision.publish
    few = gate_with([[0.0, 1.0]])
    assert few.select(Frozen(broken_model, norm, 5), serving, no_data).decision.publish  # too few to judge


# ------------------------------------------------------------------ rollback rule


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


# ------------------------------------------------------------------ drift on simulated streams


def fleet_events(fleet: SensorFleet, n: int, elapsed_s: float) -> EventBatch:
    batch = fleet.generate_batch(n, now=time.time(), elapsed_s=elapsed_s)
    return decode_batch(batch.values, EventLimits(max_len=512), time.time(), [0] * n, list(range(n))).events


def drift_run(detector: str, change_at: int | None, total: int, seed: int = 3) -> list[int]:
    """Scored-event counts at which drifts were detected; the serving model is the
    untrained (last-value) network, so the error level is the stream's own."""
    cfg = SimulationConfig(
        seed=seed,
        drift="abrupt" if change_at is not None else "none",
        drift_at_s=(1.0,) if change_at else (),
        length_median=32,
    )
    fleet = SensorFleet(cfg)
    serving = Frozen(SensorModel(1, d_model=16, n_heads=2, n_layers=1).eval(), RunningNorm.from_public([0.0], [2.0]))
    quality = QualityMonitor(QualityConfig(max_events_per_s=1e9, drift_detector=detector), Metrics(), lambda: serving)
    seen = 0
    while seen < total:
        elapsed = 2.0 if change_at is not None and seen >= change_at else 0.0
        quality.observe(fleet_events(fleet, 200, elapsed))
        seen += 200
    return [d.at_event for d in quality.drift_log]


@pytest.mark.parametrize("detector", ["adwin", "page_hinkley"])
def test_a_simulated_drift_is_detected_soon_after_it_happens(detector: str) -> None:
    detections = drift_run(detector, change_at=3000, total=6000)
    assert detections, "no drift detected"
    first = detections[0]
    # The first regime change of this seed lengthens every period: the error falls by half.
    assert 3000 <= first <= 3000 + 1000, detections


@pytest.mark.parametrize("detector", ["adwin", "page_hinkley"])
def test_a_long_stationary_stream_raises_no_alarm(detector: str) -> None:
    assert drift_run(detector, change_at=None, total=30_000) == []
