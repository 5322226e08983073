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
