"""The simulated sensor fleet: Kafka record bytes for ``streamtrain simulate``, without Kafka.

Invariants: the readings are learnable (a linear model beats the last-value forecast by a
wide margin), the labels are visible in the readings, drift follows the configured
schedule, and every malformed message breaks exactly one rule of docs/contract.md,
section 1 (so the service must reject it for the reason it was made for). The same config
and the same sequence of ``generate_batch`` arguments give the same bytes.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson

from streamtrain.tools.simulation_config import SimulationConfig

# Signal shape. An AR(2) pole radius near 1 gives a slowly damped oscillation whose
# one-step optimal error is ~1/9 of the last-value forecast's; the seasonal sensors'
# observation noise is small next to the sinusoid's step-to-step change. Both are
# scaled to unit variance before the per-sensor level and scale are applied.
AR_POLE_RADIUS = 0.97
SEASONAL_NOISE_STD = 0.1
SHORTEST_PERIOD_STEPS = 8.0
LONGEST_PERIOD_STEPS = 64.0
SINGLE_REGIME_PERIOD_STEPS = 16.0
CHANNEL_FREQUENCY_STEP = 0.25  # channel c runs at (1 + 0.25 (c mod 4)) times the base frequency
MAX_EVENT_DELAY_S = 1.0  # event time lies up to this far before the send time
FUTURE_TS_OFFSET_S = 86_400.0  # bad_timestamp events claim to be a day (or more) ahead


class SimulatedMessage(NamedTuple):
    """One Kafka record as the fleet makes it."""

    key: bytes
    value: bytes
    is_malformed: bool


@dataclass(frozen=True)
class FleetBatch:
    """A batch of records; ``reasons[i]`` is the reason message i breaks (None = valid)."""

    keys: list[bytes]
    values: list[bytes]
    reasons: list[str | None]

    def __len__(self) -> int:
        return len(self.keys)

    def messages(self) -> list[SimulatedMessage]:
        return [SimulatedMessage(k, v, r is not None) for k, v, r in zip(self.keys, self.values, self.reasons)]


@dataclass(frozen=True)
class _RegimeShift:
    """What one drift regime changes: period stretch, level offset and label rotation."""

    period_factor: float
    level_shift: float
    label_rotation: int


class SensorFleet:
    """K sensors, each an AR(2) oscillator or a noisy sinusoid, drawn from one seeded Generator.

    Each event picks a sensor and a class ("regime" of the event, its label when
    ``n_classes > 0``); the class sets the oscillation period. A drift regime stretches
    all periods, shifts all levels and rotates the class-to-period mapping, so both the
    forecaster and the classifier see a changed concept after a change. Determinism: the
    same config and the same sequence of ``generate_batch`` arguments give the same bytes
    (``event_ids`` aside when ``run_id`` is left random).
    """

    def __init__(self, config: SimulationConfig) -> None:
        self.config = config
        self._rng = np.random.default_rng(config.seed)
        self.run_id = config.run_id or secrets.token_hex(4)
        self.produced = 0
        k, c = config.sensors, config.channels
        width = len(str(k - 1))
        self.sensor_ids = [f"sensor-{i:0{width}d}" for i in range(k)]
        self._sensor_keys = [s.encode("utf-8") for s in self.sensor_ids]
        if config.process == "mixed":
            self.sensor_is_ar = self._rng.random(k) < 0.5
        else:
            self.sensor_is_ar = np.full(k, config.process == "ar")
        self.sensor_level = self._rng.normal(0.0, 2.0, size=(k, c))
        self.sensor_scale = np.exp(self._rng.normal(0.0, 0.3, size=(k, c)))
        n_regimes = max(config.n_classes, 1)
        if n_regimes == 1:
            periods = np.array([SINGLE_REGIME_PERIOD_STEPS])
        else:
            periods = SHORTEST_PERIOD_STEPS * (LONGEST_PERIOD_STEPS / SHORTEST_PERIOD_STEPS) ** (
                np.arange(n_regimes) / (n_regimes - 1)
            )
        self.class_omega = 2.0 * math.pi / periods
        self.channel_factor = 1.0 + CHANNEL_FREQUENCY_STEP * (np.arange(c) % 4)
        self._shifts = self._draw_regime_shifts()

    def _draw_regime_shifts(self) -> list[_RegimeShift]:
        cfg = self.config
        count = {"none": 1, "abrupt": len(cfg.change_times_s) + 1, "recurring": cfg.drift_regimes}[cfg.drift]
        shifts = [_RegimeShift(1.0, 0.0, 0)]
        for r in range(1, count):
            sign = 1.0 if r % 2 else -1.0
            shifts.append(
                _RegimeShift(
                    period_factor=float(np.exp(sign * self._rng.uniform(0.35, 0.7))),
                    level_shift=float(sign * self._rng.uniform(1.0, 2.0)),
                    label_rotation=r,
                )
            )
        return shifts

    def drift_regime(self, elapsed_s: float) -> int:
        """Index of the drift regime in force ``elapsed_s`` seconds after the start."""
        cfg = self.config
        if cfg.drift == "abrupt":
            return int(np.searchsorted(np.asarray(cfg.change_times_s), elapsed_s, side="right"))
        if cfg.drift == "recurring":
            return int(elapsed_s // cfg.drift_period_s) % cfg.drift_regimes
        return 0

    def generate(self, n: int, now: float | None = None, elapsed_s: float = 0.0) -> list[SimulatedMessage]:
        """``n`` records as (key, value, is_malformed); see :meth:`generate_batch`."""
        return self.generate_batch(n, now, elapsed_s).messages()

    def generate_batch(self, n: int, now: float | None = None, elapsed_s: float = 0.0) -> FleetBatch:
        """Make ``n`` records sent at wall time ``now``, ``elapsed_s`` after the run began.

        Signals are built for the whole batch at once (one AR recursion over time,
        vectorized over events and channels); only the JSON encoding runs per event.
        """
        if n < 0:
            raise ValueError(f"generate_batch: n must be >= 0, got {n}")
        cfg, rng = self.config, self._rng
        now = time.time() if now is None else now
        shift = self._shifts[self.drift_regime(elapsed_s)]
        sensor = rng.integers(cfg.sensors, size=n)
        klass = rng.integers(max(cfg.n_classes, 1), size=n)
        lengths = np.clip(
            np.rint(cfg.length_median * np.exp(cfg.length_sigma * rng.standard_normal(n))), 1, cfg.max_len
        ).astype(np.int64)
        reasons = self._draw_reasons(n)
        too_long = np.flatnonzero(reasons == "too_long")
        lengths[too_long] = rng.integers(cfg.max_len + 1, cfg.longest_message_steps + 1, size=too_long.size)
        lengths[reasons == "empty"] = 0
        # ts: event time just before the send, floored to the millisecond (never in the future).
        ts = np.floor((now - rng.uniform(0.0, MAX_EVENT_DELAY_S, size=n)) * 1000.0) / 1000.0

        omega = self.class_omega[(klass + shift.label_rotation) % self.class_omega.size] / shift.period_factor
        omega = omega[:, None] * self.channel_factor[None, :]
        signal_ = self._signals(self.sensor_is_ar[sensor], omega, int(lengths.max(initial=1)))
        readings = (
            self.sensor_level[sensor][:, None, :] + shift.level_shift + self.sensor_scale[sensor][:, None, :] * signal_
        ).astype(np.float32)

        keys: list[bytes] = []
        payloads: list[bytes] = []
        reason_list: list[str | None] = reasons.tolist()
        for i in range(n):
            values = readings[i, : lengths[i]]
            event: dict[str, Any] = {
                "sensor_id": self.sensor_ids[sensor[i]],
                "ts": float(ts[i]),
                "values": np.ascontiguousarray(values[:, 0] if cfg.channels == 1 else values),
            }
            if cfg.n_classes > 0:
                event["label"] = int(klass[i])
            if cfg.event_ids:
                event["event_id"] = f"{self.run_id}-{self.produced + i}"
            reason = reason_list[i]
            payloads.append(_encode(event) if reason is None else self._malform(reason, event, now))
            keys.append(self._sensor_keys[sensor[i]])
        self.produced += n
        return FleetBatch(keys, payloads, reason_list)

    def _draw_reasons(self, n: int) -> np.ndarray:
        reasons = np.full(n, None, dtype=object)
        malformed = np.flatnonzero(self._rng.random(n) < self.config.malformed_share)
        if malformed.size:
            kinds = np.array(self.config.applicable_malformed_reasons, dtype=object)
            reasons[malformed] = kinds[self._rng.integers(kinds.size, size=malformed.size)]
        return reasons

    def _signals(self, is_ar: np.ndarray, omega: np.ndarray, steps: int) -> np.ndarray:
        """Unit-variance signals ``[n, steps, C]``: AR(2) rows where ``is_ar``, sinusoids elsewhere."""
        rng = self._rng
        n, c = omega.shape
        out = np.empty((n, steps, c))
        seasonal = np.flatnonzero(~is_ar)
        if seasonal.size:
            t = np.arange(steps, dtype=np.float64)[None, :, None]
            phase = rng.uniform(0.0, 2.0 * math.pi, size=(seasonal.size, 1, c))
            amplitude = math.sqrt(2.0 * (1.0 - SEASONAL_NOISE_STD**2))
            out[seasonal] = amplitude * np.sin(
                omega[seasonal][:, None, :] * t + phase
            ) + SEASONAL_NOISE_STD * rng.standard_normal((seasonal.size, steps, c))
        ar = np.flatnonzero(is_ar)
        if ar.size:
            out[ar] = _ar2_oscillator(omega[ar], steps, rng)
        return out

    def _malform(self, reason: str, event: dict[str, Any], now: float) -> bytes:
        """Break exactly one rule of docs/contract.md, section 1, so the service must reject with ``reason``."""
        rng, cfg = self._rng, self.config
        variant = int(rng.integers(4))
        if reason == "too_large":
            base = _encode(event)
            event["padding"] = "x" * (cfg.max_message_bytes - len(base) + 16 + int(rng.integers(1024)))
            return _encode(event)
        if reason == "decode":
            text = _encode(event)
            return (
                b"\xff\xfe" + rng.bytes(24),  # not UTF-8
                text[: max(1, len(text) // 2)],  # truncated JSON
                orjson.dumps([event["sensor_id"], event["ts"]]),  # JSON, but not an object
                b"reading=" + str(event["ts"]).encode(),  # plain text
            )[variant]
        if reason == "schema":
            if variant == 0:
                del event["sensor_id"]
            elif variant == 1:
                del event["ts"]
            elif variant == 2:
                del event["values"]
            else:
                event["ts"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(event["ts"]))
            return _encode(event)
        if reason == "non_finite":
            return _with_non_finite(event, ("NaN", "Infinity", "-Infinity", "1e999")[variant], rng)
        if reason == "bad_channels":
            steps = max(1, event["values"].shape[0])
            wrong = cfg.channels + 1 if cfg.channels == 1 or variant % 2 else cfg.channels - 1
            event["values"] = rng.normal(size=(steps, wrong)).astype(np.float32)
            return _encode(event)
        if reason == "bad_label":
            event["label"] = cfg.n_classes + int(rng.integers(3)) if variant % 2 else -1 - int(rng.integers(3))
            return _encode(event)
        if reason == "bad_timestamp":
            event["ts"] = now + FUTURE_TS_OFFSET_S * (1.0 + rng.random())
            return _encode(event)
        # "empty" and "too_long" were made by their lengths.
        return _encode(event)


def _ar2_oscillator(omega: np.ndarray, steps: int, rng: np.random.Generator) -> np.ndarray:
    """Stationary AR(2) paths ``[n, steps, C]`` with resonance ``omega`` and unit variance.

    x_t = a1 x_{t-1} + a2 x_{t-2} + e_t with poles rho*exp(+-i omega). The first two values
    are drawn from the stationary distribution, so no burn-in is needed.
    """
    a1 = 2.0 * AR_POLE_RADIUS * np.cos(omega)
    a2 = -(AR_POLE_RADIUS**2)
    lag1_corr = a1 / (1.0 - a2)
    variance_per_innovation = (1.0 - a2) / ((1.0 + a2) * ((1.0 - a2) ** 2 - a1**2))
    innovation_std = 1.0 / np.sqrt(variance_per_innovation)
    n, c = omega.shape
    x = np.empty((n, max(steps, 2), c))
    noise = rng.standard_normal((n, max(steps, 2), c))
    x[:, 0] = noise[:, 0]
    x[:, 1] = lag1_corr * x[:, 0] + np.sqrt(1.0 - lag1_corr**2) * noise[:, 1]
    noise *= innovation_std[:, None, :]
    for t in range(2, steps):
        x[:, t] = a1 * x[:, t - 1] + a2 * x[:, t - 2] + noise[:, t]
    return x[:, :steps]


def _encode(event: dict[str, Any]) -> bytes:
    return orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY)


_SENTINEL = 9.87654321e299
_SENTINEL_TEXT = orjson.dumps(_SENTINEL)


def _with_non_finite(event: dict[str, Any], token: str, rng: np.random.Generator) -> bytes:
    """JSON text with one reading replaced by ``token`` (NaN, Infinity or an overflowing literal).

    orjson refuses to write non-finite numbers, so a sentinel is written and swapped.
    """
    values = np.array(event["values"], dtype=np.float64)
    values.reshape(-1)[int(rng.integers(values.size))] = _SENTINEL
    event["values"] = values
    return _encode(event).replace(_SENTINEL_TEXT, token.encode(), 1)
