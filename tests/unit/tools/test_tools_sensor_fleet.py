"""The simulated sensor fleet: contract-valid events, malformed shares, determinism, drift."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats
from simulation_fixtures import NOW, config

from streamtrain.events import EventLimits, Rejection, SensorEvent, decode_event
from streamtrain.tools.sensor_fleet import SensorFleet
from streamtrain.tools.simulation_config import MALFORMED_REASONS, SimulationConfig

MAX_FUTURE_SKEW_S = 300.0  # docs/contract.md, section 1: the default


def spec_violation(raw: bytes, cfg: SimulationConfig, now: float) -> str | None:
    """docs/contract.md, section 1, read independently of streamtrain.events: the first rule broken, or None."""
    if len(raw) > cfg.max_message_bytes:
        return "too_large"
    non_finite_literals: list[str] = []

    def remember_constant(name: str) -> float:
        non_finite_literals.append(name)
        return float(name.replace("Infinity", "inf"))

    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=remember_constant)
    except (UnicodeDecodeError, ValueError):
        return "decode"
    if not isinstance(obj, dict):
        return "decode"
    if any(name not in obj for name in ("sensor_id", "ts", "values")):
        return "schema"
    sensor_id, ts, values, label = obj["sensor_id"], obj["ts"], obj["values"], obj.get("label")
    if not isinstance(sensor_id, str) or not 1 <= len(sensor_id) <= 128:
        return "schema"
    if type(ts) not in (int, float) or not isinstance(values, list):
        return "schema"
    if label is not None and type(label) is not int:
        return "schema"
    flat = [x for step in values for x in (step if isinstance(step, list) else [step])]
    if non_finite_literals or not all(math.isfinite(x) for x in flat) or not math.isfinite(ts):
        return "non_finite"
    if not values:
        return "empty"
    if len(values) > cfg.max_len:
        return "too_long"
    if cfg.channels == 1 and any(isinstance(step, list) for step in values):
        return "bad_channels"
    if cfg.channels > 1 and any(not isinstance(step, list) or len(step) != cfg.channels for step in values):
        return "bad_channels"
    if cfg.n_classes > 0 and label is not None and not 0 <= label < cfg.n_classes:
        return "bad_label"
    if ts > now + MAX_FUTURE_SKEW_S:
        return "bad_timestamp"
    return None


def limits_of(cfg: SimulationConfig) -> EventLimits:
    return EventLimits(
        max_len=cfg.max_len, channels=cfg.channels, n_classes=cfg.n_classes, max_message_bytes=cfg.max_message_bytes
    )


# --- valid events ----------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    channels=st.integers(1, 4),
    n_classes=st.integers(0, 5),
    length_median=st.floats(1.0, 200.0),
    length_sigma=st.floats(0.0, 2.0),
    max_len=st.integers(1, 128),
    process=st.sampled_from(["mixed", "ar", "seasonal"]),
    drift=st.sampled_from(["none", "abrupt", "recurring"]),
    elapsed_s=st.floats(0.0, 10_000.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_unmalformed_events_are_all_valid(
    channels, n_classes, length_median, length_sigma, max_len, process, drift, elapsed_s, seed
):
    cfg = config(
        channels=channels,
        n_classes=n_classes,
        length_median=length_median,
        length_sigma=length_sigma,
        max_len=max_len,
        process=process,
        drift=drift,
        seed=seed,
        event_ids=True,
    )
    fleet = SensorFleet(cfg)
    messages = fleet.generate(40, now=NOW, elapsed_s=elapsed_s)
    for key, value, is_malformed in messages:
        assert not is_malformed
        assert spec_violation(value, cfg, NOW) is None
        event = json.loads(value)
        assert key == event["sensor_id"].encode("utf-8")
        assert event["ts"] <= NOW  # never in the future
        assert ("label" in event) == (n_classes > 0)
        assert len(event["values"]) >= 1
        decoded = decode_event(value, limits_of(cfg), NOW)
        assert isinstance(decoded, SensorEvent), decoded
        assert decoded.values.shape == (len(event["values"]), channels)
        assert np.allclose(decoded.values, np.asarray(event["values"], np.float32).reshape(-1, channels))


def test_event_ids_are_unique_across_batches():
    fleet = SensorFleet(config(event_ids=True, malformed_share=0.2, malformed_reasons=("schema", "empty")))
    ids = [json.loads(v)["event_id"] for batch in range(3) for _, v, _ in fleet.generate(100, now=NOW)]
    assert len(ids) == len(set(ids)) == 300
    assert ids[0] == "test-0" and ids[-1] == "test-299"


def test_lengths_are_lognormal_with_the_configured_median_and_clipped():
    cfg = config(length_median=20, length_sigma=0.5, max_len=40, n_classes=0)
    batch = SensorFleet(cfg).generate_batch(4000, now=NOW)
    lengths = np.array([len(json.loads(v)["values"]) for v in batch.values])
    assert lengths.min() >= 1 and lengths.max() <= 40
    assert abs(np.median(lengths) - 20) <= 1
    # P(L > 40) = P(Z > ln 2 / 0.5) ~ 8.3%: clipped events pile up at max_len.
    share_clipped = np.mean(lengths == 40)
    lo, hi = stats.binom.interval(1 - 1e-6, lengths.size, stats.norm.sf(math.log(40.5 / 20) / 0.5))
    assert lo <= share_clipped * lengths.size <= hi
    fixed = SensorFleet(config(length_median=7, length_sigma=0.0)).generate_batch(50, now=NOW)
    assert {len(json.loads(v)["values"]) for v in fixed.values} == {7}


def test_labels_cover_all_classes_evenly():
    cfg = config(n_classes=5)
    labels = [json.loads(v)["label"] for _, v, _ in SensorFleet(cfg).generate(2500, now=NOW)]
    counts = np.bincount(labels, minlength=5)
    assert counts.size == 5
    assert stats.chisquare(counts).pvalue > 1e-6


def test_stream_is_learnable_beyond_the_last_value_forecast():
    """A linear predictor on recent differences must beat 'next = last' by a wide margin."""
    cfg = config(n_classes=3, length_median=64, max_len=256, seed=3)
    xs, ys = [], []
    for _, value, _ in SensorFleet(cfg).generate(300, now=NOW):
        d = np.diff(np.asarray(json.loads(value)["values"], np.float64))
        for t in range(4, d.size):
            xs.append(d[t - 4 : t])
            ys.append(d[t])
    x, y = np.array(xs), np.array(ys)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    linear_mse = np.mean((y - x @ coef) ** 2)
    naive_mse = np.mean(y**2)  # last-value forecast error is the next difference
    assert linear_mse < 0.5 * naive_mse


# --- malformed messages ------------------------------------------------------------------


@pytest.mark.parametrize("reason", MALFORMED_REASONS)
@pytest.mark.parametrize("channels", [1, 3])
def test_each_malformed_kind_breaks_exactly_its_rule(reason, channels):
    cfg = config(channels=channels, n_classes=4, malformed_share=1.0, malformed_reasons=(reason,), seed=11)
    batch = SensorFleet(cfg).generate_batch(24, now=NOW)
    assert batch.reasons == [reason] * 24
    assert all(m.is_malformed for m in batch.messages())
    for value in batch.values:
        assert spec_violation(value, cfg, NOW) == reason
        decoded = decode_event(value, limits_of(cfg), NOW)
        assert isinstance(decoded, Rejection) and decoded.reason == reason, (reason, decoded, value[:200])


def test_malformed_share_matches_binomial_bounds_and_mixes_all_reasons():
    n, share = 6000, 0.1
    cfg = config(n_classes=3, malformed_share=share, seed=5)
    batch = SensorFleet(cfg).generate_batch(n, now=NOW)
    flagged = [m.is_malformed for m in batch.messages()]
    malformed = sum(flagged)
    lo, hi = stats.binom.interval(1 - 1e-6, n, share)
    assert lo <= malformed <= hi
    counted = Counter(r for r in batch.reasons if r is not None)
    assert set(counted) == set(MALFORMED_REASONS)
    assert stats.chisquare([counted[r] for r in MALFORMED_REASONS]).pvalue > 1e-6
    # every message flagged valid is valid, every flagged one is rejected for its reason
    for value, reason in zip(batch.values, batch.reasons):
        assert spec_violation(value, cfg, NOW) == reason


def test_bad_label_is_left_out_without_classes():
    cfg = config(n_classes=0, malformed_share=1.0)
    assert "bad_label" not in cfg.applicable_malformed_reasons
    assert "bad_label" not in SensorFleet(cfg).generate_batch(400, now=NOW).reasons
    with pytest.raises(ValueError, match="n_classes"):
        config(n_classes=0, malformed_share=0.5, malformed_reasons=("bad_label",))


# --- determinism and drift ---------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_other_bytes():
    cfg = config(channels=2, n_classes=3, malformed_share=0.2, event_ids=True, drift="recurring", drift_period_s=1.0)

    def run(c: SimulationConfig) -> list[Any]:
        fleet = SensorFleet(c)
        return [fleet.generate(50, now=NOW, elapsed_s=t) for t in (0.0, 1.5, 2.5)]

    assert run(cfg) == run(cfg)
    assert run(cfg) != run(cfg.model_copy(update={"seed": 1}))


def test_drift_schedules():
    abrupt = SensorFleet(config(drift="abrupt", drift_at_s=(10.0, 20.0)))
    assert [abrupt.drift_regime(t) for t in (0, 9.99, 10, 19.9, 20, 1e6)] == [0, 0, 1, 1, 2, 2]
    single = SensorFleet(config(drift="abrupt", drift_period_s=5.0))
    assert [single.drift_regime(t) for t in (4.9, 5.0, 500)] == [0, 1, 1]
    recurring = SensorFleet(config(drift="recurring", drift_period_s=10.0, drift_regimes=3))
    assert [recurring.drift_regime(t) for t in (0, 10, 20, 30, 45)] == [0, 1, 2, 0, 1]
    assert SensorFleet(config(drift="none")).drift_regime(1e9) == 0


def test_abrupt_drift_changes_the_readings():
    fleet = SensorFleet(config(drift="abrupt", drift_at_s=(60.0,), sensors=4, seed=2))
    before = np.concatenate([json.loads(v)["values"] for _, v, _ in fleet.generate(400, now=NOW, elapsed_s=0.0)])
    after = np.concatenate([json.loads(v)["values"] for _, v, _ in fleet.generate(400, now=NOW, elapsed_s=61.0)])
    # The regime shifts every level by 1..2 units; sampling noise of the means is ~0.1.
    assert abs(after.mean() - before.mean()) > 0.7
