"""Every refuse-list case is refused at start-up, with one line naming the setting and the fix."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from streamtrain.data.randomness import SeededRandomness
from streamtrain.model.network import ModelOutput, SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.privacy import DPConfig, DPConfigError, DPEngine, check_dp_safety

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit: the shared model fixtures
from broken_models import mixes_batch, randomize_head  # noqa: E402

SAFE = dict(noise_multiplier=1.0, q0=0.05, eligible_steps=20, admit_per_step=16, delta=1e-6, target_epsilon=20.0,
            expected_units=1e3)  # fmt: skip


def model(n_classes: int = 0) -> SensorModel:
    torch.manual_seed(0)
    return SensorModel(1, n_classes=n_classes, d_model=16, n_heads=2, n_layers=1, max_len=32)


def refused(match: str, **kwargs) -> DPConfigError:
    with pytest.raises(DPConfigError, match=match) as info:
        check_dp_safety(**kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return info.value


def test_safe_configuration_passes_and_returns_the_accountant() -> None:
    accountant = check_dp_safety(DPConfig(**SAFE), "crypto", model(), input_norm=RunningNorm.from_public([0.0], [1.0]))
    assert 0 < accountant.epsilon_cap <= SAFE["target_epsilon"]


def test_seeded_shuffle_is_refused_naming_shuffle_and_crypto() -> None:
    error = refused("SHUFFLE", config=DPConfig(**SAFE), shuffle_mode="seeded")
    assert "crypto" in str(error)


def test_running_input_norm_from_private_data_is_refused() -> None:
    refused("NORM_MEAN", config=DPConfig(**SAFE), shuffle_mode="crypto", input_norm=RunningNorm(1))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("noise_multiplier", 0.1), ("noise_multiplier", math.inf),
        ("noise_multiplier", math.nan), ("noise_multiplier", -1.0),
        ("q0", 0.0), ("q0", 1.5), ("q0", math.nan),
        ("clip_norm", 0.0), ("clip_norm", -1.0), ("clip_norm", math.inf),
        ("half_life_steps", 0.0), ("eligible_steps", 0), ("admit_per_step", 0), ("admit_per_step", 1_000_000),
        ("step_rate_hz", 0.0), ("delta", 0.0), ("delta", 0.01), ("target_epsilon", 0.0),
        ("expected_batch_size", 0.0), ("norm_std", (0.0,)), ("unit", "user"), ("sensor_events", 0),
        ("expected_units", 0.5), ("expected_units", math.inf),
    ],
)  # fmt: skip
def test_out_of_range_settings_are_refused(field: str, value: object) -> None:
    config = DPConfig(**{**SAFE, field: value})
    error = refused(f"STREAMTRAIN_DP_{field.upper()}", config=config, shuffle_mode="crypto")
    assert "; " in str(error)  # the rule, then the fix


def test_delta_too_large_for_the_streams_lifetime_is_refused() -> None:
    """δ against the units the deployment admits over its life, not against the window."""
    config = DPConfig(**{**SAFE, "expected_units": 1e5})  # δ·N = 0.1 expected exposures
    error = refused("too large for the stream's lifetime", config=config, shuffle_mode="crypto")
    assert "STREAMTRAIN_DP_DELTA" in str(error) and "EXPECTED_UNITS" in str(error) and "1e-07" in str(error)
    check_dp_safety(DPConfig(**{**SAFE, "expected_units": 1e4}), "crypto")  # δ·N = 0.01: allowed


def test_unreachable_target_epsilon_is_refused() -> None:
    error = refused(
        "TARGET_EPSILON=0.5 cannot be met", config=DPConfig(**{**SAFE, "target_epsilon": 0.5}), shuffle_mode="crypto"
    )
    assert "NOISE_MULTIPLIER" in str(error)


def test_norm_constants_need_one_value_per_channel() -> None:
    refused("NORM_MEAN", config=DPConfig(**{**SAFE, "norm_mean": (0.0, 1.0)}), shuffle_mode="crypto", model=model())


class Tiny(SensorModel):
    def __init__(self) -> None:
        super().__init__(1, d_model=16, n_heads=2, n_layers=1, max_len=32)


class WithBatchNorm(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(16)


class WithInstanceNorm(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.inorm = nn.InstanceNorm1d(16, track_running_stats=True)


class BatchMeanMixer(Tiny):
    """Subtracts the batch mean: mixes examples without any BatchNorm module."""

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        out = super().forward(x_norm, mask)
        return ModelOutput(out.forecast - out.forecast.mean(dim=0, keepdim=True), out.logits)


class RunningBuffer(Tiny):
    """Updates a buffer in forward, as running statistics do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        if self.training:
            self.seen.add_(1.0)
        return super().forward(x_norm, mask)


class NoPerSampleGradient(Tiny):
    """Leaves autograd via .item() (per example, no mixing): torch.func cannot vmap over it."""

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        out = super().forward(x_norm, mask)
        return ModelOutput(out.forecast * float(out.forecast.abs().sum().item() >= 0), out.logits)


class FirstRowLeaks(Tiny):
    """Example 1's output depends on example 0 (one direction only)."""

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        out = super().forward(x_norm, mask)
        return ModelOutput(
            out.forecast + out.forecast[:1].mean() * torch.arange(len(x_norm))[:, None, None], out.logits
        )


@pytest.mark.parametrize(
    ("model_class", "match"),
    [
        (WithBatchNorm, "BatchNorm1d"),
        (WithInstanceNorm, "track_running_stats"),
        (BatchMeanMixer, "mixes examples"),
        (FirstRowLeaks, "example 1's output changes when example 0"),
        (RunningBuffer, "buffer 'seen'"),
        (NoPerSampleGradient, "without per-sample gradients"),
    ],
)
def test_unsafe_models_are_refused(model_class: type, match: str) -> None:
    torch.manual_seed(0)
    refused(match, config=DPConfig(**SAFE), shuffle_mode="crypto", model=model_class())


MIXING_PLACES = [
    pytest.param("blocks.0", id="in the body"),
    pytest.param("final_norm", id="right before the head"),
    pytest.param("", id="after the head"),
]


@pytest.mark.parametrize("n_classes", [0, 3], ids=["no classes", "3 classes"])
@pytest.mark.parametrize("at", MIXING_PLACES)
def test_a_model_that_mixes_examples_anywhere_is_refused_at_every_class_count(at: str, n_classes: int) -> None:
    """The untrained head is zero, so at N_CLASSES=0 mixing in the body never reaches an output:
    the probe compares the hidden state too, and names where the mixing shows."""
    error = refused(
        "mixes examples", config=DPConfig(**SAFE), shuffle_mode="crypto", model=mixes_batch(model(n_classes), at)
    )
    assert (f"the output of module '{at}'" if at else "output changes") in str(error)


@pytest.mark.parametrize("n_classes", [0, 3], ids=["no classes", "3 classes"])
@pytest.mark.parametrize("head", ["zero", "random"])
def test_a_clean_model_is_accepted_at_every_class_count(n_classes: int, head: str) -> None:
    """Every tensor of one example is compared, so the probe must not refuse a model that keeps them apart."""
    net = model(n_classes) if head == "zero" else randomize_head(model(n_classes))
    check_dp_safety(DPConfig(**SAFE), "crypto", net, input_norm=RunningNorm.from_public([0.0], [1.0]))


def test_engine_refuses_seeded_randomness_and_unsafe_model() -> None:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(DPConfigError, match="SHUFFLE"):
        DPEngine(net, optimizer, DPConfig(**SAFE), 512, randomness=SeededRandomness(0))
    torch.manual_seed(0)
    bad = WithBatchNorm()
    with pytest.raises(DPConfigError, match="BatchNorm"):
        DPEngine(bad, torch.optim.SGD(bad.parameters(), lr=0.1), DPConfig(**SAFE), 512)
