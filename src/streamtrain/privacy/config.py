"""DP-SGD configuration: the public schedule every per-event guarantee is computed from.

Everything here is public: the privacy unit, the schedule (σ, C, q0, half-life, K, R, b,
step rate), δ with the deployment's expected number of units, and the constant the noisy
gradient sum is divided by. Nothing is derived from the data.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from streamtrain.config import Settings

#: Where each field comes from in the service's Settings (``STREAMTRAIN_`` + upper case).
SETTING_NAMES: dict[str, str] = {
    "noise_multiplier": "dp_noise_multiplier",
    "clip_norm": "dp_clip_norm",
    "q0": "dp_q0",
    "half_life_steps": "dp_half_life_steps",
    "eligible_steps": "dp_eligible_steps",
    "admit_per_step": "dp_admit_per_step",
    "step_rate_hz": "dp_step_rate_hz",
    "delta": "dp_delta",
    "target_epsilon": "dp_target_epsilon",
    "expected_batch_size": "dp_expected_batch_size",
    "unit": "dp_unit",
    "sensor_events": "dp_sensor_events",
    "expected_units": "dp_expected_units",
    "norm_mean": "dp_norm_mean",
    "norm_std": "dp_norm_std",
}


def _default(field: str) -> Any:
    """The service setting's default: Settings is the one place DP defaults are written."""
    return Settings.model_fields[SETTING_NAMES[field]].default


def env_name(field: str) -> str:
    """``noise_multiplier`` -> ``STREAMTRAIN_DP_NOISE_MULTIPLIER`` (for error messages)."""
    return "STREAMTRAIN_" + SETTING_NAMES[field].upper()


class DPConfigError(ValueError):
    """A DP setting is unsafe or inconsistent; ``str(error)`` is one line naming it and the fix."""


class DPConfig(BaseModel):
    """The DP schedule. Ranges are checked by :func:`streamtrain.privacy.check_dp_safety`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    noise_multiplier: float = Field(
        _default("noise_multiplier"), description="σ: noise std as a multiple of the clip norm"
    )
    clip_norm: float = Field(
        _default("clip_norm"), description="C: each example's whole gradient is clipped to this L2 norm"
    )
    q0: float = Field(_default("q0"), description="Sampling probability of an eligible event of age 0")
    half_life_steps: float = Field(
        _default("half_life_steps"), description="q_j = q0 * 2**(-j / half_life_steps); inf = constant"
    )
    eligible_steps: int = Field(
        _default("eligible_steps"), description="K: steps an admitted event stays eligible, then removed"
    )
    admit_per_step: int = Field(
        _default("admit_per_step"), description="R: at most this many arrivals admitted per clock step"
    )
    step_rate_hz: float = Field(_default("step_rate_hz"), description="The public clock: DP steps per second")
    delta: float = Field(_default("delta"), description="δ of the per-event (ε, δ) guarantee")
    target_epsilon: float = Field(
        _default("target_epsilon"), description="Start-up refuses a schedule whose per-event ε exceeds this"
    )
    expected_batch_size: float | None = Field(
        _default("expected_batch_size"),
        description="Public divisor of the noisy sum; default sum_j R * q_j (full window)",
    )
    unit: str = Field(
        _default("unit"), description="The privacy unit: 'event' (one event) or 'sensor' (all of a sensor's events)"
    )
    sensor_events: int = Field(
        _default("sensor_events"), description="b: sensor unit, most events of one sensor in the window"
    )
    expected_units: float = Field(
        _default("expected_units"), description="Privacy units the deployment will admit over its life (for δ)"
    )
    norm_mean: tuple[float, ...] | None = Field(
        _default("norm_mean"), description="Public input mean per channel (default 0)"
    )
    norm_std: tuple[float, ...] | None = Field(
        _default("norm_std"), description="Public input std per channel (default 1)"
    )

    @field_validator("half_life_steps", mode="before")
    @classmethod
    def _inf_words(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in {"inf", "infinity", "none", "off"}:
            return math.inf
        return value

    @classmethod
    def from_settings(cls, settings: Any) -> DPConfig:
        """Read the ``dp_*`` fields of a Settings object; absent optional ones keep defaults."""
        values = {
            field: getattr(settings, name)
            for field, name in SETTING_NAMES.items()
            if getattr(settings, name, None) is not None
        }
        return cls(**values)

    def sampling_schedule(self) -> np.ndarray:
        """q_j for ages j = 0..K-1 (float64 [K])."""
        ages = np.arange(self.eligible_steps, dtype=np.float64)
        if math.isinf(self.half_life_steps):
            return np.full(self.eligible_steps, self.q0)
        return self.q0 * np.exp2(-ages / self.half_life_steps)

    @property
    def divisor(self) -> float:
        """The public constant the noisy gradient sum is divided by (never the actual batch size)."""
        if self.expected_batch_size is not None:
            return float(self.expected_batch_size)
        return float(self.admit_per_step * self.sampling_schedule().sum())

    def schedule_key(self) -> tuple[float, float, float, int]:
        """The fields the per-record ε depends on (a checkpoint must agree on them)."""
        return (self.noise_multiplier, self.q0, self.half_life_steps, self.eligible_steps)
