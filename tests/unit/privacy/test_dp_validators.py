"""Every refuse-list case is refused at start-up, with one line naming the setting and the fix."""

from __future__ import annotations

import dataclasses
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


# --- every range at its edges, each refusal in full (what the first mutation run of the validators asked) ---


def ranges_refusal(**changes: object) -> str:
    from streamtrain.privacy.validators import check_ranges

    with pytest.raises(DPConfigError) as raised:
        check_ranges(DPConfig(**{**SAFE, **changes}))
    return str(raised.value)


@pytest.mark.parametrize(
    "changes",
    [
        {"noise_multiplier": 0.3},
        {"noise_multiplier": 1000.0},
        {"clip_norm": 1e-6},
        {"clip_norm": 1e6},
        {"q0": 1.0},
        {"half_life_steps": math.inf},
        {"eligible_steps": 1, "delta": 1e-9},
        {"eligible_steps": 1_000_000, "admit_per_step": 1, "delta": 1e-9},
        {"admit_per_step": 1},
        {"admit_per_step": 500_000, "delta": 1e-9},
        {"admit_per_step": 10, "eligible_steps": 1_000_000, "delta": 1e-9},  # R·K = 10^7, the bound itself
        {"step_rate_hz": 1000.0},
        {"unit": "sensor", "sensor_events": 1024},
        {"sensor_events": 1},
        {"expected_units": 1.0},
        {"delta": 1e-5, "expected_units": 1000.0},  # δ × units = 0.01, allowed
        {"target_epsilon": 1e-9},
        {"expected_batch_size": 1e-9},
        {"expected_batch_size": None},
        {"norm_mean": [0.0], "norm_std": [1e-12]},
    ],
)
def test_every_range_holds_its_edges(changes: dict) -> None:
    from streamtrain.privacy.validators import check_ranges

    check_ranges(DPConfig(**{**SAFE, **changes}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"noise_multiplier": 0.299}, "STREAMTRAIN_DP_NOISE_MULTIPLIER=0.299: the noise multiplier σ must be in "
         "[0.3, 1000]; below that a step leaks too much for any useful ε; set a σ in range"),
        ({"noise_multiplier": 1000.5}, "STREAMTRAIN_DP_NOISE_MULTIPLIER=1000.5: the noise multiplier σ must be in "
         "[0.3, 1000]; below that a step leaks too much for any useful ε; set a σ in range"),
        ({"clip_norm": 2e6}, "STREAMTRAIN_DP_CLIP_NORM=2000000.0: the clip norm C must be finite and in "
         "[1e-06, 1e+06]; set a positive clip norm (1.0 is a good start)"),
        ({"clip_norm": 5e-7}, "STREAMTRAIN_DP_CLIP_NORM=5e-07: the clip norm C must be finite and in "
         "[1e-06, 1e+06]; set a positive clip norm (1.0 is a good start)"),
        ({"clip_norm": math.nan}, "STREAMTRAIN_DP_CLIP_NORM=nan: the clip norm C must be finite and in "
         "[1e-06, 1e+06]; set a positive clip norm (1.0 is a good start)"),
        ({"q0": math.inf}, "STREAMTRAIN_DP_Q0=inf: the sampling probability q0 must be in (0, 1]; set e.g. 0.05"),
        ({"half_life_steps": -1.0}, "STREAMTRAIN_DP_HALF_LIFE_STEPS=-1.0: the half-life must be > 0 steps; "
         "use inf for constant q"),
        ({"eligible_steps": 1_000_001}, "STREAMTRAIN_DP_ELIGIBLE_STEPS=1000001: K must be in [1, 1000000]; "
         "set the steps an event stays eligible"),
        ({"admit_per_step": 1_000_001}, "STREAMTRAIN_DP_ADMIT_PER_STEP=1000001: R must be in [1, 1000000]; "
         "set the admissions per step"),
        ({"admit_per_step": 11, "eligible_steps": 1_000_000, "delta": 1e-9}, "STREAMTRAIN_DP_ADMIT_PER_STEP=11: "
         "R·K = 11000000 events exceeds the DP window's bound of 10000000; lower STREAMTRAIN_DP_ADMIT_PER_STEP "
         "or STREAMTRAIN_DP_ELIGIBLE_STEPS"),
        ({"step_rate_hz": 1000.5}, "STREAMTRAIN_DP_STEP_RATE_HZ=1000.5: the step rate must be in (0, 1000] Hz; "
         "set e.g. 2"),
        ({"step_rate_hz": math.inf}, "STREAMTRAIN_DP_STEP_RATE_HZ=inf: the step rate must be in (0, 1000] Hz; "
         "set e.g. 2"),
        ({"unit": "fleet"}, "STREAMTRAIN_DP_UNIT='fleet': the privacy unit must be one of ('event', 'sensor'); "
         "set event or sensor"),
        ({"sensor_events": 0}, "STREAMTRAIN_DP_SENSOR_EVENTS=0: b must be in [1, 1024]; "
         "set the most events of one sensor in the DP window"),
        ({"sensor_events": 1025}, "STREAMTRAIN_DP_SENSOR_EVENTS=1025: b must be in [1, 1024]; "
         "set the most events of one sensor in the DP window"),
        ({"expected_units": 0.5}, "STREAMTRAIN_DP_EXPECTED_UNITS=0.5: the expected number of privacy units must be "
         "finite and >= 1; set how many events (or sensors) the deployment will admit over its whole life, e.g. 1e10"),
        ({"expected_units": math.inf}, "STREAMTRAIN_DP_EXPECTED_UNITS=inf: the expected number of privacy units "
         "must be finite and >= 1; set how many events (or sensors) the deployment will admit over its whole life, "
         "e.g. 1e10"),
        ({"delta": 1 / 320}, "STREAMTRAIN_DP_DELTA=0.003125: δ must be in (0, 1/(R·K)) = (0, 0.00313); a δ near "
         "1/(window size) allows releasing a record in the clear; use e.g. 1e-12"),
        ({"delta": 2e-5, "expected_units": 1000.0}, "STREAMTRAIN_DP_DELTA=2e-05: δ is too large for the stream's "
         "lifetime: δ × STREAMTRAIN_DP_EXPECTED_UNITS = 2e-05 × 1000 = 0.02 units could lose their guarantee (at "
         "most 0.01 allowed); set δ <= 1e-05"),
        ({"target_epsilon": math.inf}, "STREAMTRAIN_DP_TARGET_EPSILON=inf: the target ε must be finite and > 0; "
         "set e.g. 8"),
        ({"expected_batch_size": 0.0}, "STREAMTRAIN_DP_EXPECTED_BATCH_SIZE=0.0: the public divisor must be finite "
         "and > 0; unset it to use sum_j R·q_j"),
        ({"expected_batch_size": math.inf}, "STREAMTRAIN_DP_EXPECTED_BATCH_SIZE=inf: the public divisor must be "
         "finite and > 0; unset it to use sum_j R·q_j"),
        ({"norm_mean": [math.nan], "norm_std": [1.0]}, "STREAMTRAIN_DP_NORM_MEAN=(nan,): public normalization "
         "constants must be finite; fix the values"),
        ({"norm_mean": [0.0], "norm_std": [math.inf]}, "STREAMTRAIN_DP_NORM_STD=(inf,): public normalization "
         "constants must be finite; fix the values"),
        ({"norm_mean": [0.0], "norm_std": [0.0]}, "STREAMTRAIN_DP_NORM_STD=(0.0,): every public std must be > 0; "
         "fix the values"),
    ],
)  # fmt: skip
def test_every_range_refuses_just_past_its_edges_with_the_whole_message(changes: dict, message: str) -> None:
    assert ranges_refusal(**changes) == message


@pytest.mark.parametrize(
    "changes",
    [
        {"half_life_steps": 0.5},
        {"admit_per_step": 1_000_000, "eligible_steps": 1, "delta": 1e-9},
        {"step_rate_hz": 0.5},
    ],
)
def test_ranges_hold_their_lower_edges_too(changes: dict) -> None:
    from streamtrain.privacy.validators import check_ranges

    check_ranges(DPConfig(**{**SAFE, **changes}))


def test_a_target_epsilon_of_zero_is_refused_by_its_range() -> None:
    assert ranges_refusal(target_epsilon=0.0) == (
        "STREAMTRAIN_DP_TARGET_EPSILON=0.0: the target ε must be finite and > 0; set e.g. 8"
    )


def test_the_start_up_refusals_in_full_and_the_accountant_they_return() -> None:
    from streamtrain.privacy.accounting import MAX_DIMENSION

    config = DPConfig(**SAFE)
    with pytest.raises(DPConfigError) as raised:
        check_dp_safety(config, "seeded")
    assert str(raised.value) == (
        "STREAMTRAIN_DP=on requires STREAMTRAIN_SHUFFLE=crypto, got SHUFFLE='seeded': a seeded shuffle is "
        "predictable and voids the privacy guarantee; set SHUFFLE=crypto"
    )
    for norm in (RunningNorm(1), object()):  # running statistics, or anything that does not say it is frozen
        with pytest.raises(DPConfigError) as raised:
            check_dp_safety(config, "crypto", input_norm=norm)
        assert str(raised.value) == (
            "input normalization from running statistics of private events is refused under DP (the statistics "
            "are released without noise); use public constants STREAMTRAIN_DP_NORM_MEAN / STREAMTRAIN_DP_NORM_STD"
        )
    with pytest.raises(DPConfigError) as raised:
        check_dp_safety(DPConfig(**SAFE, norm_mean=[0.0, 0.0], norm_std=[1.0, 1.0]), "crypto", model())
    assert str(raised.value) == (
        "STREAMTRAIN_DP_NORM_MEAN=(0.0, 0.0): needs one value per channel (1); give CHANNELS values"
    )
    net = model()
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert check_dp_safety(config, "crypto", net).dimension == trainable
    assert check_dp_safety(config, "crypto").dimension == MAX_DIMENSION
    exact = check_dp_safety(config, "crypto", net).epsilon_cap
    assert check_dp_safety(DPConfig(**{**SAFE, "target_epsilon": exact}), "crypto", net).epsilon_cap == exact


@pytest.mark.parametrize(("unit", "named"), [("event", "event"), ("sensor", "sensor group")])
def test_an_unreachable_target_names_the_privacy_unit(unit: str, named: str) -> None:
    config = DPConfig(**{**SAFE, "unit": unit, "target_epsilon": 0.01})
    with pytest.raises(DPConfigError) as raised:
        check_dp_safety(config, "crypto")
    message = str(raised.value)
    assert message.startswith(f"STREAMTRAIN_DP_TARGET_EPSILON=0.01 cannot be met: this schedule gives each {named} ε=")
    assert message.endswith(
        "at δ=1e-06 (σ=1, q0=0.05, half-life=inf steps, K=20); raise STREAMTRAIN_DP_NOISE_MULTIPLIER or lower "
        "STREAMTRAIN_DP_Q0, STREAMTRAIN_DP_ELIGIBLE_STEPS or STREAMTRAIN_DP_HALF_LIFE_STEPS"
    )


def test_a_model_that_does_not_declare_its_input_shape_gets_the_static_checks_only() -> None:
    class NoChannels(nn.Module):
        max_len = 8

        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)

    check_dp_safety(DPConfig(**SAFE), "crypto", NoChannels())
    with pytest.raises(DPConfigError, match="batch statistics"):
        check_dp_safety(DPConfig(**SAFE), "crypto", nn.Sequential(nn.BatchNorm1d(1)))


# --- the probe's refusals in full, what it feeds the model, and what it compares (the second mutation run) ---


def static_refusal(model: nn.Module) -> str:
    from streamtrain.privacy.validators import check_model_static

    with pytest.raises(DPConfigError) as raised:
        check_model_static(model)
    return str(raised.value)


class LazyBuffer(nn.Module):
    """Holds a buffer whose shape is not known yet (and no parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stats", nn.parameter.UninitializedBuffer())


def tiny_with(extra: nn.Module) -> Tiny:
    net = Tiny()
    net.extra = nn.Sequential(extra)
    return net


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: tiny_with(nn.BatchNorm1d(16)), "module 'extra.0' (BatchNorm1d) normalizes with batch statistics, "
         "which mixes examples and has no per-sample gradient; replace it with LayerNorm or GroupNorm"),
        (lambda: nn.BatchNorm1d(1), "module '<root>' (BatchNorm1d) normalizes with batch statistics, which mixes "
         "examples and has no per-sample gradient; replace it with LayerNorm or GroupNorm"),
        (lambda: tiny_with(nn.InstanceNorm1d(16, track_running_stats=True)), "module 'extra.0' (InstanceNorm1d) "
         "keeps running statistics over examples; construct it with track_running_stats=False"),
        (lambda: tiny_with(nn.LazyLinear(4)), "module 'extra.0' (LazyLinear) has uninitialized lazy parameters; "
         "use the non-lazy layer"),
        (lambda: tiny_with(LazyBuffer()), "module 'extra.0' (LazyBuffer) has uninitialized lazy parameters; "
         "use the non-lazy layer"),
    ],
    ids=["batch norm inside", "batch norm as the model", "instance norm with running stats", "lazy parameter",
         "lazy buffer"],
)  # fmt: skip
def test_the_static_refusals_name_the_module_that_holds_the_layer(build, message: str) -> None:
    """The module named is the one that holds the layer (not its parents): the fix goes there."""
    assert static_refusal(build()) == message


def test_instance_norm_without_running_statistics_is_not_refused_statically() -> None:
    from streamtrain.privacy.validators import check_model_static

    check_model_static(tiny_with(nn.InstanceNorm1d(16)))


def mixed(x: torch.Tensor) -> torch.Tensor:
    """Each example plus the batch mean: every example's values depend on the others'."""
    return x + x.mean(dim=0, keepdim=True)


class Sink(nn.Module):
    """Takes anything and returns nothing per example: only its input shows what reaches it."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.zeros(())


class Echo(nn.Module):
    """Returns its argument as it is: the structure reaches both its input and its output."""

    def forward(self, value: object) -> object:
        return value


class SideChannel(Tiny):
    """Hands ``side(x_norm)`` to a submodule whose result is unused: the outputs never show it."""

    def __init__(self, module: nn.Module, side, **call: object) -> None:
        super().__init__()
        self.sink = module
        self.side = side
        self.call = call

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        argument = self.side(x_norm)
        self.sink(**{name: argument for name in self.call}) if self.call else self.sink(argument)
        return super().forward(x_norm, mask)


@dataclasses.dataclass
class Carrier:
    payload: torch.Tensor
    name: str = "carrier"


def mixing_message(what: str, model: str = "SideChannel", kept: int = 0, changed: int = 1, mode: str = "train") -> str:
    return (
        f"model {model}: example {kept}'s {what} changes when example {changed} changes ({mode} mode), so it mixes "
        "examples (cross-example statistics); remove the layer or operation that does"
    )


SINK_INPUT = "hidden state (the input of module 'sink' (Sink))"


def probe_refusal(net: nn.Module) -> str:
    from streamtrain.privacy.validators import check_model_probe

    torch.manual_seed(0)
    with pytest.raises(DPConfigError) as raised:
        check_model_probe(net, 1, 32)
    return str(raised.value)


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda t: [t], id="list"),
        pytest.param(lambda t: (t.detach(), t), id="tuple"),
        pytest.param(lambda t: {"h": t}, id="mapping"),
        pytest.param(lambda t: Carrier(t), id="dataclass"),
        pytest.param(lambda t: {"rows": [Carrier(t)]}, id="nested"),
    ],
)
def test_mixing_inside_any_structure_a_submodule_takes_or_returns_is_refused(wrap) -> None:
    net = SideChannel(Echo(), lambda x: wrap(mixed(x)))
    assert probe_refusal(net) == mixing_message("hidden state (the input of module 'sink' (Echo))")


def test_mixing_that_only_enters_a_submodule_as_a_keyword_is_refused() -> None:
    assert probe_refusal(SideChannel(Sink(), mixed, value=True)) == mixing_message(SINK_INPUT)


@pytest.mark.parametrize(
    "side",
    [
        pytest.param(lambda x: mixed(x).reshape(-1), id="token rows, one value each"),
        pytest.param(lambda x: mixed(x).sum(dim=(1, 2)), id="one value per example"),
    ],
)
def test_mixing_in_one_dimensional_hidden_state_is_refused(side) -> None:
    """``[B * L]`` (a value per position, examples one after another) and ``[B]`` are per example too."""
    assert probe_refusal(SideChannel(Sink(), side)) == mixing_message(SINK_INPUT)


def test_mixing_at_the_output_is_refused_with_the_whole_message() -> None:
    torch.manual_seed(0)
    assert probe_refusal(FirstRowLeaks()) == mixing_message("output", model="FirstRowLeaks", kept=1, changed=0)


class MixesWhenEvaluating(Tiny):
    """Subtracts the batch mean in eval mode only, as a layer with a batch-level eval path would."""

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        out = super().forward(x_norm, mask)
        return out if self.training else ModelOutput(mixed(out.forecast), out.logits)


def test_mixing_in_eval_mode_only_is_refused_naming_the_mode() -> None:
    assert probe_refusal(MixesWhenEvaluating()) == mixing_message("output", model="MixesWhenEvaluating", mode="eval")


LARGE = 3.0  # the probe's reference batch stays below it (max |x| ≈ 2.1); its replaced examples do not


class BranchesOnTheBatch(Tiny):
    """Takes a path (an extra submodule, or an extra output) that depends on the whole batch."""

    def __init__(self, extra_output: bool) -> None:
        super().__init__()
        self.extra = nn.Linear(1, 1)
        self.extra_output = extra_output

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        out = super().forward(x_norm, mask)
        if x_norm.abs().max() <= LARGE:
            return out
        if self.extra_output:
            return ModelOutput(out.forecast, torch.zeros(len(x_norm), 1))
        return ModelOutput(self.extra(out.forecast), out.logits)


@pytest.mark.parametrize("extra_output", [False, True], ids=["an extra submodule", "an extra output"])
def test_a_path_that_depends_on_another_example_is_refused(extra_output: bool) -> None:
    """Refused as mixing, with the whole message, however the path differs (an output that appears
    or disappears included, which must not surface as a ValueError of a zip)."""
    path = "path through the modules (or the shapes of its tensors)"
    assert probe_refusal(BranchesOnTheBatch(extra_output)) == mixing_message(path, model="BranchesOnTheBatch")


class RecordsTheProbe(Tiny):
    """Records every batch of two it is run on (the traces; not the per-sample gradient's one-example calls)."""

    def __init__(self, max_len: int = 32) -> None:
        super().__init__()
        self.max_len = max_len
        self.seen: list[tuple[torch.Tensor, torch.Tensor, bool]] = []

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        if x_norm.shape[0] == 2:
            self.seen.append((x_norm.clone(), mask.clone(), self.training))
        return super().forward(x_norm, mask)


@pytest.mark.parametrize(("max_len", "length"), [(32, 8), (5, 5)])
def test_the_probe_feeds_two_examples_one_padded_each_replaced_in_turn_in_both_modes(max_len: int, length: int) -> None:
    from streamtrain.privacy.validators import check_model_probe

    net = RecordsTheProbe(max_len)
    check_model_probe(net, 1, max_len)
    assert [training for _, _, training in net.seen] == [True] * 3 + [False] * 3
    padded = torch.tensor([[True] * length, [True] * (length // 2) + [False] * (length - length // 2)])
    for x, mask, _ in net.seen:
        assert x.shape == (2, length, 1) and x.dtype == torch.float32
        assert mask.dtype == torch.bool and torch.equal(mask, padded)
    reference = net.seen[0][0]
    for (x, _, _), kept, replaced in zip(net.seen[1:3], (0, 1), (1, 0), strict=True):
        assert torch.equal(x[kept], reference[kept]) and not torch.equal(x[replaced], reference[replaced])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(net.seen[:3], net.seen[3:], strict=True))


def test_the_probe_is_the_same_whatever_the_global_seed() -> None:
    """A fixed probe: a refusal must not come and go with the seed the service happens to run under."""
    from streamtrain.privacy.validators import check_model_probe

    runs = []
    for seed in (0, 1):
        net = RecordsTheProbe()
        torch.manual_seed(seed)
        check_model_probe(net, 1, 32)
        runs.append(torch.stack([x for x, _, _ in net.seen]))
    assert torch.equal(runs[0], runs[1])


class OneAtATimeFails(Tiny):
    """Works on the probe's batches of two, fails on the one-example calls per-sample gradients make."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        if x_norm.shape[0] == 1:
            raise RuntimeError(self.message)
        return super().forward(x_norm, mask)


@pytest.mark.parametrize(
    ("message", "shown"),
    [("cannot run one example\nsecond line of detail", "cannot run one example"), ("", "")],
    ids=["its first line", "no message"],
)
def test_a_model_without_per_sample_gradients_is_refused_with_the_errors_first_line(message: str, shown: str) -> None:
    assert probe_refusal(OneAtATimeFails(message)) == (
        f"model OneAtATimeFails has a layer without per-sample gradients under torch.func (RuntimeError: {shown}); "
        "use layers built from Linear/LayerNorm/elementwise ops"
    )


class NonFiniteGradient(Tiny):
    """Adds 0·sqrt(p) at p = 0: a finite forward whose gradient for p is 0·inf = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1))

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        out = super().forward(x_norm, mask)
        return ModelOutput(out.forecast + 0.0 * torch.sqrt(self.p), out.logits)


def test_a_non_finite_per_sample_gradient_is_refused_naming_the_parameter() -> None:
    assert probe_refusal(NonFiniteGradient()) == (
        "parameter 'p' gets a non-finite per-sample gradient on a probe batch; fix the model"
    )


def test_the_probe_compares_floats_within_its_tolerance_and_the_rest_exactly() -> None:
    from streamtrain.privacy.validators import PROBE_TOLERANCE, _same_row

    zeros = torch.zeros(2, 3)
    assert _same_row(zeros, zeros + PROBE_TOLERANCE / 2, 0)  # near zero: the absolute tolerance
    assert not _same_row(zeros, zeros + PROBE_TOLERANCE * 2, 0)
    big = torch.full((2, 3), 1e3)
    assert _same_row(big, big * (1 + PROBE_TOLERANCE / 2), 0)  # far from zero: the relative one
    assert not _same_row(big, big * (1 + PROBE_TOLERANCE * 3), 0)
    nan = torch.tensor([[math.nan, 1.0], [0.0, 0.0]])
    assert _same_row(nan, nan.clone(), 0)  # the same NaN in both runs is not a change
    counts = torch.tensor([[3, 4], [5, 6]])
    assert _same_row(counts, counts.clone(), 0) and not _same_row(counts, counts + torch.tensor([[0, 1], [0, 0]]), 0)
    assert _same_row(counts, counts + torch.tensor([[0, 0], [1, 0]]), 0)  # only the kept row is compared
    assert not _same_row(torch.tensor([[True], [True]]), torch.tensor([[False], [True]]), 0)


def test_a_model_that_declares_channels_but_no_length_gets_the_static_checks_only() -> None:
    class NoLength(nn.Module):
        channels = 1

        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

    assert check_dp_safety(DPConfig(**SAFE), "crypto", NoLength()).dimension == 1  # one scalar: d = 1


def test_a_model_with_nothing_trainable_is_accounted_at_one_dimension() -> None:
    net = model()
    net.requires_grad_(False)
    assert check_dp_safety(DPConfig(**SAFE), "crypto", net).dimension == 1


@pytest.mark.parametrize("unit", ["event", "sensor"])
def test_a_target_met_exactly_by_one_record_or_one_sensor_group_is_accepted(unit: str) -> None:
    """At the sensor unit the same ε is one group's: a target equal to it allows exactly one group."""
    from streamtrain.privacy.accounting import SensorLifetimeAccountant

    cap = check_dp_safety(DPConfig(**{**SAFE, "unit": unit}), "crypto").epsilon_cap
    accountant = check_dp_safety(DPConfig(**{**SAFE, "unit": unit, "target_epsilon": cap}), "crypto")
    assert accountant.epsilon_cap == cap
    assert SensorLifetimeAccountant(accountant, cap).max_groups == 1
