"""The settings of the simulated fleet (``streamtrain simulate``) and where they come from.

Precedence: defaults < TOML file < ``STREAMTRAIN_*`` environment (the variables shared with
the service, docs/contract.md, section 4) < command-line flags. A configuration is refused
when its valid events could exceed the service's message size limit, or when it asks for a
malformed kind the fleet cannot produce; every refusal is one line that names the setting
and its source.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streamtrain.events import REASONS

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
        description=(
            "none; abrupt = a new regime at each --drift-at-s time; recurring = regimes cycle every --drift-period-s"
        ),
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
    close_timeout_s: float = Field(
        10.0,
        ge=0,
        description="seconds a finished or stopped run waits for Kafka to acknowledge the records in flight; "
        "a second Ctrl-C stops waiting",
    )

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
                f"an event of {self.longest_message_steps} steps (max_len={self.max_len}, "
                f"too_long messages up to 1/8 more) x channels={self.channels} can reach {worst_bytes} bytes, "
                f"over max_message_bytes={self.max_message_bytes}; lower max_len or raise max_message_bytes"
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
    table: dict[str, Any] = section  # TOML keys are strings
    for key, value in table.items():
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
    origin = sources[name]  # defaults are not validated: every value refused came with a source
    if err.get("type") == "extra_forbidden":
        known = ", ".join(SimulationConfig.model_fields)
        return f"unknown simulation setting {name!r} (from {origin}); known: {known}"
    return f"invalid simulation setting {name}={err.get('input')!r} (from {origin}): {err['msg']}{more}"
