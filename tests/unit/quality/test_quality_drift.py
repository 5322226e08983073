"""Drift detection on simulated streams: a regime change is found soon, a stationary stream raises no alarm."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from streamtrain.events import EventBatch, EventLimits, decode_batch
from streamtrain.metrics import Metrics
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.config import QualityConfig
from streamtrain.quality.drift import DriftMonitor
from streamtrain.quality.monitor import QualityMonitor
from streamtrain.tools.sensor_fleet import SensorFleet
from streamtrain.tools.simulation_config import SimulationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/unit/quality: the shared quality fixtures
from quality_fixtures import Frozen  # noqa: E402


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


# --- the detector's levels by hand (what the first mutation run of quality/drift.py asked) ---


def fading_levels(errors: list[float], half_life: float) -> tuple[float | None, float | None]:
    """The level before (a fading mean of every error but the last 64) and the recent one (their mean)."""
    older, recent = errors[:-64], errors[-64:]
    decay = 0.5 ** (1.0 / half_life)
    weights = [decay ** (len(older) - 1 - i) for i in range(len(older))]
    before = sum(w * e for w, e in zip(weights, older, strict=True)) / sum(weights) if older else None
    return before, (sum(recent) / len(recent) if recent else None)


@pytest.mark.parametrize("count", [0, 1, 64, 65, 200])
def test_the_levels_before_and_after_are_a_fading_mean_and_the_last_64_events(count: int) -> None:
    errors = [float((7 * i) % 13) for i in range(count)]
    monitor = DriftMonitor("adwin", 0.002, 100.0, half_life=50.0)
    for error in errors:
        monitor.update(error)
    before, recent = fading_levels(errors, 50.0)
    assert monitor.error_before == (None if before is None else pytest.approx(before, rel=1e-12))
    assert monitor.error_recent == (None if recent is None else pytest.approx(recent, rel=1e-12))
    monitor.restart_levels()  # after a detection "before" starts again from the events to come
    assert monitor.error_before is None and monitor.error_recent == (None if recent is None else pytest.approx(recent))
    monitor.update(100.0)
    if count >= 64:
        assert monitor.error_before == pytest.approx(errors[-64])  # the first event to leave the recent 64


def test_page_hinkley_reads_the_error_relative_to_the_level_before_and_a_zero_level_as_no_change() -> None:
    monitor = DriftMonitor("page_hinkley", 0.002, 100.0, half_life=50.0)
    for _ in range(200):  # a level of zero: every relative error is 1, no division by zero
        assert monitor.update(0.0) is False
    assert monitor.error_before == 0.0
    seen: list[float] = []
    monitor.detector.update = seen.append  # what the detector is fed from here on
    monitor.update(3.0)
    assert seen == [1.0]
    rising = DriftMonitor("page_hinkley", 0.002, 100.0, half_life=50.0)
    for _ in range(100):
        rising.update(2.0)
    rising.detector.update = seen.append
    rising.update(5.0)
    assert seen[-1] == pytest.approx(2.5)


def test_page_hinkley_finds_a_fall_as_well_as_a_rise() -> None:
    """Mode "both": the error falling to a quarter is a change too ("up" alone misses it)."""
    for level in (0.25, 2.0):
        monitor = DriftMonitor("page_hinkley", 0.002, 100.0, half_life=2000.0)
        found = [monitor.update(1.0 + 0.01 * (i % 3)) for i in range(500)]
        assert not any(found)
        assert any(monitor.update(level) for _ in range(400)), level


def test_an_unknown_detector_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="drift detector must be 'adwin' or 'page_hinkley', got 'kswin'"):
        DriftMonitor("kswin", 0.002, 100.0, 2000.0)


def test_the_detectors_take_the_settings_they_are_given() -> None:
    adwin = DriftMonitor("adwin", 0.05, 100.0, 2000.0)
    assert adwin.detector.delta == 0.05
    ph = DriftMonitor("page_hinkley", 0.002, 7.0, 2000.0)
    assert ph.detector.threshold == 7.0 and ph.detector.mode == "both"
