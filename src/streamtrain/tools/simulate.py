"""A synthetic sensor fleet that pushes events to Kafka (``streamtrain simulate``).

The fleet exists to exercise the service end to end: its readings are learnable (a
model beats the naive last-value forecast by a wide margin), its labels are visible in
the readings, it drifts on a schedule so the recency window has something to follow,
and a configurable share of its messages break exactly one rule of docs/contract.md, section 1, so
every rejection path runs. Generation is separate from sending: :class:`SensorFleet`
makes message bytes without Kafka, :func:`run_simulation` paces and sends them.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import signal
import sys
import threading
import time
import tomllib
import types
import typing
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
import orjson
from kafka.errors import KafkaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streamtrain.events import REASONS

logger = logging.getLogger(__name__)

#: Every rejection reason of docs/contract.md, section 1; the fleet can produce a message for each.
MALFORMED_REASONS: tuple[str, ...] = REASONS

ENV_PREFIX = "STREAMTRAIN_"
#: Environment variables shared with the service (docs/contract.md, section 4) -> simulation field.
ENV_SETTINGS: dict[str, str] = {
    "KAFKA_BOOTSTRAP": "bootstrap",
    "TOPIC": "topic",
    "CHANNELS": "channels",
    "N_CLASSES": "n_classes",
    "MAX_LEN": "max_len",
    "MAX_MESSAGE_BYTES": "max_message_bytes",
}
#: Service setting names accepted in a TOML file for the simulation field they mean.
TOML_ALIASES: dict[str, str] = {"kafka_bootstrap": "bootstrap"}

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
# Worst-case JSON bytes per reading as orjson writes float32 ("-1.2345678e-5" plus comma),
# used to refuse configurations whose valid events could exceed max_message_bytes.
JSON_BYTES_PER_NUMBER = 16
JSON_BYTES_PER_STEP = 2
JSON_BYTES_ENVELOPE = 512


class SimulationConfigError(ValueError):
    """A simulation setting is invalid; ``str(error)`` is one line that names it."""


class SimulationConfig(BaseModel):
    """Every knob of the simulated fleet. Field descriptions double as ``--help`` text."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap: str = Field(
        "localhost:9092", min_length=1, description="Kafka bootstrap servers, host:port[,host:port...]"
    )
    topic: str = Field("sensor-events", min_length=1, max_length=249, description="topic the events go to")
    rate: float = Field(
        100.0, ge=0, description="events per second (token-bucket paced); 0 = as fast as Kafka takes them"
    )
    sensors: int = Field(16, ge=1, le=1_000_000, description="number of simulated sensors (distinct sensor_id keys)")
    channels: int = Field(1, ge=1, le=64, description="numbers per time step (C); must match the service's channels")
    n_classes: int = Field(0, ge=0, le=10_000, description="label classes; 0 = events carry no label")
    length_median: float = Field(64.0, gt=0, description="median time steps per event (lognormal lengths)")
    length_sigma: float = Field(
        0.5, ge=0, le=5, description="sigma of log(length); 0 = every event has the median length"
    )
    max_len: int = Field(
        512, ge=1, le=100_000, description="most time steps per valid event; must match the service's max_len"
    )
    malformed_share: float = Field(
        0.0, ge=0, le=1, description="share of messages that break one rule of the event format"
    )
    malformed_reasons: tuple[str, ...] = Field(
        MALFORMED_REASONS,
        min_length=1,
        description="rejection reasons malformed messages are drawn from, uniformly (bad_label needs n_classes > 0)",
    )
    drift: Literal["none", "abrupt", "recurring"] = Field(
        "none",
        description="none; abrupt = a new regime at each --drift-at-s time; recurring = regimes cycle every --drift-period-s",
    )
    drift_period_s: float = Field(
        300.0, gt=0, description="recurring: seconds per regime; abrupt without --drift-at-s: time of the single change"
    )
    drift_at_s: tuple[float, ...] = Field((), description="abrupt: seconds after start at which the regime changes")
    drift_regimes: int = Field(2, ge=2, le=1000, description="recurring: number of regimes cycled through")
    process: Literal["mixed", "ar", "seasonal"] = Field(
        "mixed", description="sensor signal kind: AR(2) oscillators, seasonal sinusoids + noise, or a mix"
    )
    duration_s: float | None = Field(None, gt=0, description="stop after this many seconds; unset = no time limit")
    count: int | None = Field(None, ge=0, description="stop after this many messages; unset = no count limit")
    seed: int = Field(0, ge=0, description="seed of the fleet's numpy Generator: same seed, same messages")
    event_ids: bool = Field(False, description="add a unique 'event_id' field (\"<run_id>-<n>\") to every JSON event")
    run_id: str | None = Field(
        None, min_length=1, max_length=64, description="prefix of event ids; unset = random per run"
    )
    max_message_bytes: int = Field(
        1 << 20, ge=1024, description="the service's message size limit; too_large messages exceed it"
    )
    progress_interval_s: float = Field(5.0, gt=0, description="seconds between progress log lines")

    @model_validator(mode="after")
    def _consistent(self) -> SimulationConfig:
        unknown = sorted(set(self.malformed_reasons) - set(MALFORMED_REASONS))
        if unknown:
            raise ValueError(
                f"malformed_reasons has unknown reason(s) {unknown}; choose from {list(MALFORMED_REASONS)}"
            )
        if self.malformed_share > 0 and not self.applicable_malformed_reasons:
            raise ValueError(
                "malformed_reasons holds only bad_label but n_classes is 0; set --n-classes or add other reasons"
            )
        if any(t < 0 for t in self.drift_at_s) or list(self.drift_at_s) != sorted(self.drift_at_s):
            raise ValueError(f"drift_at_s must be non-negative and ascending, got {list(self.drift_at_s)}")
        worst_bytes = (
            self.longest_message_steps * (self.channels * JSON_BYTES_PER_NUMBER + JSON_BYTES_PER_STEP)
            + JSON_BYTES_ENVELOPE
        )
        if worst_bytes > self.max_message_bytes:
            raise ValueError(
                f"an event of {self.longest_message_steps} steps (max_len={self.max_len}, too_long messages up to 1/8 more) "
                f"x channels={self.channels} can reach {worst_bytes} bytes, over max_message_bytes={self.max_message_bytes}; "
                "lower max_len or raise max_message_bytes"
            )
        return self

    @property
    def applicable_malformed_reasons(self) -> tuple[str, ...]:
        """Reasons the fleet can actually trigger: a label is only checked when n_classes > 0."""
        return tuple(r for r in self.malformed_reasons if r != "bad_label" or self.n_classes > 0)

    @property
    def longest_message_steps(self) -> int:
        """Most steps in any message: too_long ones exceed max_len by at most an eighth."""
        return self.max_len + max(1, self.max_len // 8)

    @property
    def change_times_s(self) -> tuple[float, ...]:
        """Abrupt drift's change times (one change at drift_period_s when none are given)."""
        return self.drift_at_s or (self.drift_period_s,)


def load_simulation_config(
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> SimulationConfig:
    """Merge defaults < TOML file < ``STREAMTRAIN_*`` environment < ``overrides`` (CLI flags).

    The TOML file may hold the keys at top level (shared with the service's config: keys
    that are not simulation settings are left to the service) or in a ``[simulate]``
    section, whose keys must all be simulation settings. Raises
    :class:`SimulationConfigError` with one line naming the bad setting and its source.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(name: str, value: Any, source: str) -> None:
        values[name] = value
        sources[name] = source

    if config_file is not None:
        for name, value, source in _toml_settings(Path(config_file)):
            put(name, value, source)
    for env_name, name in ENV_SETTINGS.items():
        raw = (os.environ if environ is None else environ).get(ENV_PREFIX + env_name)
        if raw is not None:
            put(name, raw, f"environment {ENV_PREFIX}{env_name}")
    for name, value in (overrides or {}).items():
        put(name, value, f"--{name.replace('_', '-')}")
    try:
        return SimulationConfig(**values)
    except ValidationError as exc:
        raise SimulationConfigError(_one_line(exc, sources)) from None


def _toml_settings(path: Path) -> Iterator[tuple[str, Any, str]]:
    if not path.is_file():
        raise SimulationConfigError(f"config file {path} does not exist; pass an existing TOML file to --config")
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SimulationConfigError(f"config file {path} is not valid TOML: {exc}") from None
    fields = SimulationConfig.model_fields
    for key, value in document.items():
        name = TOML_ALIASES.get(key, key)
        if name in fields and not isinstance(value, dict):
            yield name, value, f"{path}"
    section = document.get("simulate", {})
    if not isinstance(section, dict):
        raise SimulationConfigError(
            f"config file {path}: 'simulate' must be a table ([simulate]), got {type(section).__name__}"
        )
    for key, value in section.items():
        name = TOML_ALIASES.get(key, key)
        if name not in fields:
            raise SimulationConfigError(
                f"config file {path}: unknown setting {key!r} in [simulate]; known settings: {', '.join(fields)}"
            )
        yield name, value, f"{path} [simulate]"


def _one_line(exc: ValidationError, sources: Mapping[str, str]) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    name = loc[0] if loc else ""
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    if not name:
        return f"invalid simulation settings: {err['msg']}{more}"
    if err.get("type") == "extra_forbidden":
        return f"unknown simulation setting {name!r} (from {sources.get(name, 'arguments')}); known: {', '.join(SimulationConfig.model_fields)}"
    origin = sources.get(name, "default")
    return f"invalid simulation setting {name}={err.get('input')!r} (from {origin}): {err['msg']}{more}"


# --------------------------------------------------------------------------------------
# The fleet: message bytes without Kafka
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Pacing and sending
# --------------------------------------------------------------------------------------


class TokenBucket:
    """Paces a sender at ``rate`` tokens/s with bursts of at most ``burst`` tokens.

    Reservation style: :meth:`reserve` takes tokens at once (the balance may go
    negative) and says how long to wait before using them, so a sender sleeps once per
    chunk instead of spinning or sleeping per message, and the long-run rate is exact.
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not burst > 0:
            raise ValueError(f"TokenBucket needs rate > 0 and burst > 0, got rate={rate}, burst={burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._stamp = clock()

    def reserve(self, n: float) -> float:
        """Take ``n`` tokens; return the seconds to wait before they may be spent."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate) - n
        self._stamp = now
        return max(0.0, -self._tokens / self.rate)


class _Future(Protocol):
    def add_errback(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


class Producer(Protocol):
    """The part of ``kafka.KafkaProducer`` the simulation uses (fakes in tests)."""

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None) -> _Future: ...

    def flush(self, timeout: float | None = None) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


def kafka_producer(config: SimulationConfig) -> Producer:
    """A KafkaProducer whose request limit lets too_large messages reach the broker.

    gzip (zlib, in C) keeps record batches small: kafka-python falls back to a pure-Python
    CRC32C over every batch it writes (~0.35 s per MiB without the ``crc32c`` package), so
    compressing first makes the checksum, and the consumer's check of it, cheap.
    """
    from kafka import KafkaProducer

    from streamtrain.ingest.security import KafkaSecurity, client_options, watch

    security = KafkaSecurity.from_environment()
    watch(security)  # a refused login is said once (run_cli), not logged on every retry
    return KafkaProducer(
        bootstrap_servers=[s.strip() for s in config.bootstrap.split(",")],
        client_id="streamtrain-simulate",
        compression_type="gzip",
        linger_ms=10,
        batch_size=256 * 1024,
        max_request_size=max(1 << 20, config.max_message_bytes + (64 << 10)),
        max_block_ms=15_000,
        # the service's STREAMTRAIN_KAFKA_SECURITY_PROTOCOL, _SASL_*, _SSL_* (docs/contract.md, section 8)
        **client_options(security),
    )


@dataclass
class SimulationReport:
    """What a run sent; ``delivery_errors`` counts records Kafka did not acknowledge."""

    sent: int = 0
    malformed: int = 0
    malformed_by_reason: dict[str, int] = field(default_factory=dict)
    delivery_errors: int = 0
    first_delivery_error: str | None = None
    elapsed_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.sent / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        share = self.malformed / self.sent if self.sent else 0.0
        return (
            f"sent {self.sent} in {self.elapsed_s:.1f}s ({self.rate:.1f}/s), "
            f"malformed {self.malformed} ({share:.1%}), delivery errors {self.delivery_errors}"
        )


class _DeliveryErrors:
    """Counts failed sends; errbacks run on the producer's IO thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.first: str | None = None

    def __call__(self, exc: BaseException) -> None:
        with self._lock:
            self.count += 1
            if self.first is None:
                self.first = f"{type(exc).__name__}: {exc}"


def chunk_size(rate: float) -> int:
    """Records per send chunk: about a tenth of a second's worth, 1..512."""
    return 512 if rate <= 0 else int(min(512, max(1, rate // 10)))


def run_simulation(
    config: SimulationConfig,
    producer_factory: Callable[[SimulationConfig], Producer] = kafka_producer,
    *,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    sleep: Callable[[float], Any] | None = None,
) -> SimulationReport:
    """Send the fleet's records until ``count``, ``duration_s`` or ``stop``, whichever comes first.

    ``sleep`` defaults to ``stop.wait`` (so a stop request cuts a pacing wait short) or
    ``time.sleep``. Injecting ``clock``/``sleep`` makes pacing testable without waiting.
    """
    stop = stop or threading.Event()
    sleep = sleep or stop.wait
    fleet = SensorFleet(config)
    chunk = chunk_size(config.rate)
    bucket = TokenBucket(config.rate, burst=chunk, clock=clock) if config.rate > 0 else None
    errors = _DeliveryErrors()
    by_reason: Counter[str] = Counter()
    report = SimulationReport()
    producer = producer_factory(config)
    start = clock()
    next_progress = start + config.progress_interval_s
    logger.info(
        "simulating %d sensors to %s on %s at %s events/s (run id %s)",
        config.sensors,
        config.topic,
        config.bootstrap,
        config.rate or "max",
        fleet.run_id,
    )
    try:
        while not stop.is_set():
            n = chunk if config.count is None else min(chunk, config.count - report.sent)
            if n <= 0 or (config.duration_s is not None and clock() - start >= config.duration_s):
                break
            if bucket is not None:
                delay = bucket.reserve(n)
                if delay > 0:
                    sleep(delay)
                    if stop.is_set():
                        break
            batch = fleet.generate_batch(n, now=wall_clock(), elapsed_s=clock() - start)
            for key, value in zip(batch.keys, batch.values):
                try:
                    producer.send(config.topic, value=value, key=key).add_errback(errors)
                except KafkaError as exc:  # a refused record (timeout, size) is counted, the run goes on
                    errors(exc)
            by_reason.update(r for r in batch.reasons if r is not None)
            report.sent += n
            if clock() >= next_progress:
                next_progress = clock() + config.progress_interval_s
                _fill(report, by_reason, errors, clock() - start)
                logger.info("progress: %s", report.summary())
    finally:
        try:
            producer.flush(timeout=30)
        finally:
            producer.close(timeout=10)
    _fill(report, by_reason, errors, clock() - start)
    logger.info("done: %s", report.summary())
    return report


def _fill(report: SimulationReport, by_reason: Counter[str], errors: _DeliveryErrors, elapsed_s: float) -> None:
    report.malformed = sum(by_reason.values())
    report.malformed_by_reason = dict(sorted(by_reason.items()))
    report.delivery_errors = errors.count
    report.first_delivery_error = errors.first
    report.elapsed_s = elapsed_s


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------

DESCRIPTION = (
    "Push synthetic sensor events to Kafka: K sensors (AR(2) oscillators or noisy sinusoids), "
    "lognormal lengths, optional labels, scheduled drift and a share of malformed messages. "
    "Settings come from defaults < --config TOML ([simulate] section or top-level keys) < "
    "STREAMTRAIN_KAFKA_BOOTSTRAP/TOPIC/CHANNELS/N_CLASSES/MAX_LEN/MAX_MESSAGE_BYTES < flags."
)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse subparsers object; ``args.func(args)`` runs it."""
    parser = subparsers.add_parser("simulate", help="push synthetic sensor events to Kafka", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per :class:`SimulationConfig` field, plus ``--config``; sets ``func``."""
    env_of = {name: ENV_PREFIX + env for env, name in ENV_SETTINGS.items()}
    parser.add_argument(
        "--config",
        dest="config_path",
        metavar="FILE",
        type=Path,
        default=None,
        help="TOML file with the settings (a [simulate] section or top-level keys)",
    )
    for name, info in SimulationConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = info.default
        shown = (
            "unset"
            if default is None
            else (" ".join(map(str, default)) or "none")
            if isinstance(default, tuple)
            else default
        )
        help_text = f"{info.description} (default: {shown}"
        help_text += f"; env {env_of[name]})" if name in env_of else ")"
        parser.add_argument(
            flag, dest=name, default=argparse.SUPPRESS, help=help_text, **_argparse_kind(info.annotation)
        )
    parser.set_defaults(func=run_cli)


def _argparse_kind(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field type: bool flags, choices, lists, numbers."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _argparse_kind(next(a for a in args if a is not type(None)))
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(args)}
    if origin is tuple:
        return {"nargs": "*", "type": args[0], "metavar": args[0].__name__.upper()}
    return {"type": annotation, "metavar": annotation.__name__.upper()}


def run_cli(args: argparse.Namespace) -> int:
    """Handler of ``streamtrain simulate``: 0 when every record was acknowledged, 1 if not, 2 on bad settings."""
    overrides = {name: value for name, value in vars(args).items() if name in SimulationConfig.model_fields}
    try:
        config = load_simulation_config(getattr(args, "config_path", None), os.environ, overrides)
        from streamtrain.ingest.security import KafkaSecurity

        KafkaSecurity.from_environment()  # refused here in one line, not by the producer
    except (SimulationConfigError, ValueError) as exc:
        print(f"streamtrain simulate: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    previous = _install_stop_handlers(stop)
    try:
        report = run_simulation(config, stop=stop)
    except KafkaError as exc:  # e.g. NoBrokersAvailable: one line, not a traceback
        from streamtrain.ingest.security import current_failure

        cause = current_failure()
        if cause is not None:
            print(f"streamtrain simulate: cannot produce to {config.bootstrap}: {cause}", file=sys.stderr)
            return 1
        print(
            f"streamtrain simulate: cannot produce to {config.bootstrap} ({type(exc).__name__}: {exc}); "
            "check --bootstrap / STREAMTRAIN_KAFKA_BOOTSTRAP and that the broker runs",
            file=sys.stderr,
        )
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if report.delivery_errors:
        print(
            f"streamtrain simulate: {report.delivery_errors} of {report.sent} records were not delivered "
            f"(first: {report.first_delivery_error})",
            file=sys.stderr,
        )
        return 1
    return 0


def _install_stop_handlers(stop: threading.Event) -> dict[int, Any]:
    """SIGINT/SIGTERM end the run cleanly (flush, report); only possible on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda *_: stop.set())
    return previous


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m streamtrain.tools.simulate [options]``: the same as ``streamtrain simulate``."""
    parser = argparse.ArgumentParser(prog="python -m streamtrain.tools.simulate", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
