"""Start-up refusals: every configuration under which the DP guarantee would not hold.

Each refusal is a :class:`DPConfigError` whose message is one line naming the setting
(or module), the rule, and the fix. The service calls :func:`check_dp_safety` before it
starts consuming; :class:`streamtrain.privacy.DPEngine` calls it again on construction.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from streamtrain.privacy.accounting import PerEventAccountant, expected_exposures
from streamtrain.privacy.config import DPConfig, DPConfigError, env_name
from streamtrain.privacy.window import UNITS

NOISE_MULTIPLIER_RANGE = (0.3, 1000.0)
CLIP_NORM_RANGE = (1e-6, 1e6)
MAX_WINDOW_EVENTS = 10_000_000  # R·K: the DP window's memory bound
MAX_STEP_RATE_HZ = 1000.0
PROBE_TOLERANCE = 1e-5
#: δ times the units a deployment admits over its life: the expected number of units whose
#: guarantee may fail. A mechanism that publishes each unit in the clear with probability δ
#: is (0, δ)-DP, so this is what δ allows; start-up refuses more than this.
MAX_EXPECTED_EXPOSURES = 0.01
MAX_SENSOR_EVENTS = 1024


def _range_error(field: str, value: Any, rule: str, fix: str) -> DPConfigError:
    return DPConfigError(f"{env_name(field)}={value!r}: {rule}; {fix}")


def check_ranges(config: DPConfig) -> None:
    """Refuse out-of-range or inconsistent DP settings."""
    sigma_low, sigma_high = NOISE_MULTIPLIER_RANGE
    if not (math.isfinite(config.noise_multiplier) and sigma_low <= config.noise_multiplier <= sigma_high):
        raise _range_error(
            "noise_multiplier",
            config.noise_multiplier,
            f"the noise multiplier σ must be in [{sigma_low:g}, {sigma_high:g}]",
            "below that a step leaks too much for any useful ε; set a σ in range",
        )
    if not (math.isfinite(config.clip_norm) and CLIP_NORM_RANGE[0] <= config.clip_norm <= CLIP_NORM_RANGE[1]):
        raise _range_error(
            "clip_norm",
            config.clip_norm,
            f"the clip norm C must be finite and in [{CLIP_NORM_RANGE[0]:g}, {CLIP_NORM_RANGE[1]:g}]",
            "set a positive clip norm (1.0 is a good start)",
        )
    if not (math.isfinite(config.q0) and 0.0 < config.q0 <= 1.0):
        raise _range_error("q0", config.q0, "the sampling probability q0 must be in (0, 1]", "set e.g. 0.05")
    if not (config.half_life_steps > 0):  # inf allowed
        raise _range_error(
            "half_life_steps", config.half_life_steps, "the half-life must be > 0 steps", "use inf for constant q"
        )
    if not 1 <= config.eligible_steps <= 1_000_000:
        raise _range_error(
            "eligible_steps",
            config.eligible_steps,
            "K must be in [1, 1000000]",
            "set the steps an event stays eligible",
        )
    if not 1 <= config.admit_per_step <= 1_000_000:
        raise _range_error(
            "admit_per_step", config.admit_per_step, "R must be in [1, 1000000]", "set the admissions per step"
        )
    window_events = config.admit_per_step * config.eligible_steps
    if window_events > MAX_WINDOW_EVENTS:
        raise _range_error(
            "admit_per_step", config.admit_per_step,
            f"R·K = {window_events} events exceeds the DP window's bound of {MAX_WINDOW_EVENTS}",
            "lower STREAMTRAIN_DP_ADMIT_PER_STEP or STREAMTRAIN_DP_ELIGIBLE_STEPS",
        )  # fmt: skip
    if not (math.isfinite(config.step_rate_hz) and 0 < config.step_rate_hz <= MAX_STEP_RATE_HZ):
        raise _range_error(
            "step_rate_hz", config.step_rate_hz, f"the step rate must be in (0, {MAX_STEP_RATE_HZ:g}] Hz", "set e.g. 2"
        )
    if config.unit not in UNITS:
        raise _range_error("unit", config.unit, f"the privacy unit must be one of {UNITS}", "set event or sensor")
    if not 1 <= config.sensor_events <= MAX_SENSOR_EVENTS:
        raise _range_error(
            "sensor_events", config.sensor_events, f"b must be in [1, {MAX_SENSOR_EVENTS}]",
            "set the most events of one sensor in the DP window",
        )  # fmt: skip
    if not (math.isfinite(config.expected_units) and config.expected_units >= 1):
        raise _range_error(
            "expected_units", config.expected_units, "the expected number of privacy units must be finite and >= 1",
            "set how many events (or sensors) the deployment will admit over its whole life, e.g. 1e10",
        )  # fmt: skip
    if not (0.0 < config.delta < 1.0 / window_events):
        raise _range_error(
            "delta", config.delta, f"δ must be in (0, 1/(R·K)) = (0, {1.0 / window_events:.3g})",
            "a δ near 1/(window size) allows releasing a record in the clear; use e.g. 1e-12",
        )  # fmt: skip
    exposures = expected_exposures(config.delta, config.expected_units)
    if exposures > MAX_EXPECTED_EXPOSURES:
        raise _range_error(
            "delta", config.delta,
            f"δ is too large for the stream's lifetime: δ × STREAMTRAIN_DP_EXPECTED_UNITS = {config.delta:g} × "
            f"{config.expected_units:g} = {exposures:.3g} units could lose their guarantee (at most "
            f"{MAX_EXPECTED_EXPOSURES:g} allowed)",
            f"set δ <= {MAX_EXPECTED_EXPOSURES / config.expected_units:.3g}",
        )  # fmt: skip
    if not (math.isfinite(config.target_epsilon) and config.target_epsilon > 0):
        raise _range_error("target_epsilon", config.target_epsilon, "the target ε must be finite and > 0", "set e.g. 8")
    if config.expected_batch_size is not None and not (
        math.isfinite(config.expected_batch_size) and config.expected_batch_size > 0
    ):
        raise _range_error(
            "expected_batch_size", config.expected_batch_size, "the public divisor must be finite and > 0",
            "unset it to use sum_j R·q_j",
        )  # fmt: skip
    for field in ("norm_mean", "norm_std"):
        given = getattr(config, field)
        if given is not None and not all(math.isfinite(v) for v in given):
            raise _range_error(field, given, "public normalization constants must be finite", "fix the values")
    if config.norm_std is not None and not all(v > 0 for v in config.norm_std):
        raise _range_error("norm_std", config.norm_std, "every public std must be > 0", "fix the values")


def _describe(name: str, module: nn.Module) -> str:
    return f"module '{name or '<root>'}' ({type(module).__name__})"


def _has_uninitialized_params(module: nn.Module) -> bool:
    """A lazy (shape not yet known) parameter or buffer of the module's own: what
    ``LazyModuleMixin.has_uninitialized_params`` tests, for any module that holds one."""
    own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
    return any(is_lazy(tensor) for tensor in own)


def check_model_static(model: nn.Module) -> None:
    """Refuse layers with cross-example statistics or that would be built lazily."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise DPConfigError(
                f"{_describe(name, module)} normalizes with batch statistics, which mixes examples "
                "and has no per-sample gradient; replace it with LayerNorm or GroupNorm"
            )
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            raise DPConfigError(
                f"{_describe(name, module)} keeps running statistics over examples; "
                "construct it with track_running_stats=False"
            )
        if _has_uninitialized_params(module):
            raise DPConfigError(f"{_describe(name, module)} has uninitialized lazy parameters; use the non-lazy layer")


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's arguments or result: tensors, sequences, mappings, dataclasses."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for field in dataclasses.fields(value) for t in _tensors(getattr(value, field.name))]
    return []


def _trace(
    model: nn.Module, x: torch.Tensor, mask: torch.Tensor
) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """One forward: every tensor entering or leaving a submodule, in the order they appear
    (labelled), and the model's outputs.

    The submodules' tensors are the hidden state: a zero-initialised head hides the body
    from the outputs, so mixing in the body shows only there.
    """
    seen: list[tuple[str, torch.Tensor]] = []

    def recorder(label: str) -> Any:
        def record(_module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            seen.extend((f"the input of {label}", t.detach().clone()) for t in _tensors((args, kwargs)))
            seen.extend((f"the output of {label}", t.detach().clone()) for t in _tensors(output))

        return record

    handles = [
        module.register_forward_hook(recorder(_describe(name, module)), with_kwargs=True)
        for name, module in model.named_modules()
        if name  # the root's outputs are compared on their own
    ]
    try:
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(0)  # same dropout masks for both probe batches
            output = model(x, mask)
    finally:
        for handle in handles:
            handle.remove()
    return seen, [t for t in (output.forecast, output.logits) if t is not None]


def _same_row(a: torch.Tensor, b: torch.Tensor, row: int) -> bool:
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a[row], b[row], atol=PROBE_TOLERANCE, rtol=PROBE_TOLERANCE, equal_nan=True)
    return torch.equal(a[row], b[row])


def _shapes(seen: list[tuple[str, torch.Tensor]], outputs: list[torch.Tensor]) -> list[tuple[str, torch.Size]]:
    """The path of one forward: each labelled tensor's shape, then the outputs' (their number too)."""
    return [(label, t.shape) for label, t in seen] + [("the output", t.shape) for t in outputs]


def _mixing_error(model: nn.Module, kept_row: int, changed_row: int, training: bool, what: str) -> DPConfigError:
    return DPConfigError(
        f"model {type(model).__name__}: example {kept_row}'s {what} changes when example {changed_row} changes "
        f"({'train' if training else 'eval'} mode), so it mixes examples (cross-example statistics); "
        "remove the layer or operation that does"
    )


def _check_no_mixing(model: nn.Module, x: torch.Tensor, changed: dict[int, torch.Tensor], mask: torch.Tensor,
                     training: bool) -> None:  # fmt: skip
    """Each example's hidden state and outputs are the same whatever the other example holds.

    Hidden states are compared per example where they are batch-first (``[B, ...]``) or token
    rows (``[B * L, ...]``, an example's positions one after another, as SensorModel's body
    runs: its rows ``[i * L, (i + 1) * L)`` are example ``i``'s)."""
    batch, length = int(x.shape[0]), int(x.shape[1])
    reference_seen, reference_outputs = _trace(model, x, mask)
    for changed_row, kept_row in ((1, 0), (0, 1)):
        seen, outputs = _trace(model, changed[changed_row], mask)
        if _shapes(seen, outputs) != _shapes(reference_seen, reference_outputs):
            raise _mixing_error(
                model, kept_row, changed_row, training, "path through the modules (or the shapes of its tensors)"
            )
        for (label, a), (_, b) in zip(reference_seen, seen, strict=True):
            if a.dim() >= 1 and a.shape[0] == batch * length != batch:  # token rows: per example
                a, b = (t.reshape(batch, length, *t.shape[1:]) for t in (a, b))
            if a.dim() >= 1 and a.shape[0] == batch and not _same_row(a, b, kept_row):  # batch-first tensors only
                raise _mixing_error(model, kept_row, changed_row, training, f"hidden state ({label})")
        for a, b in zip(reference_outputs, outputs, strict=True):
            if not _same_row(a, b, kept_row):
                raise _mixing_error(model, kept_row, changed_row, training, "output")


def check_model_probe(model: nn.Module, channels: int, max_len: int) -> None:
    """Run a SensorModel-like model (input ``[B, L <= max_len, channels]``) on probe batches
    of two that differ in one example.

    Refused: the other example's outputs, or any tensor entering or leaving any of its
    submodules, change (cross-example computation anywhere in the network, in train or eval
    mode, whether or not a head shows it); a buffer changes in a training forward (running
    statistics); per-sample gradients fail or are non-finite.
    """
    from streamtrain.privacy.per_sample import PerSampleGradients

    length = min(8, max_len)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, length, channels, generator=generator)
    changed = {row: x.clone() for row in (0, 1)}  # example `row` replaced, the other kept
    for row, batch in changed.items():
        batch[row] = torch.randn(length, channels, generator=generator) * 3
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, length // 2 :] = False
    labels = torch.zeros(2, dtype=torch.long)
    buffers_before = {name: b.detach().clone() for name, b in model.named_buffers()}
    was_training = model.training
    try:
        for training in (True, False):
            model.train(training)
            _check_no_mixing(model, x, changed, mask, training)
        buffers_after = dict(model.named_buffers())
        for name, before in buffers_before.items():
            after = buffers_after[name]
            if after.shape != before.shape or not torch.equal(after, before):
                raise DPConfigError(
                    f"model buffer '{name}' changes during a forward pass (cross-example statistics); freeze it"
                )
        model.train()
        try:
            gradients = PerSampleGradients(model, clip_norm=1.0).per_sample(x, mask, labels)
        except Exception as error:  # noqa: BLE001 — any failure means no per-sample gradient
            message = str(error).splitlines()[0] if str(error) else ""
            raise DPConfigError(
                f"model {type(model).__name__} has a layer without per-sample gradients under torch.func "
                f"({type(error).__name__}: {message}); use layers built from Linear/LayerNorm/elementwise ops"
            ) from error
    finally:
        model.train(was_training)
    for name, gradient in gradients.items():
        if not bool(torch.isfinite(gradient).all()):
            raise DPConfigError(
                f"parameter '{name}' gets a non-finite per-sample gradient on a probe batch; fix the model"
            )


def check_dp_safety(
    config: DPConfig,
    shuffle_mode: str,
    model: nn.Module | None = None,
    input_norm: Any | None = None,
) -> PerEventAccountant:
    """Refuse every unsafe DP configuration; return the accountant of the schedule.

    ``input_norm``: the input normalization the DP path will use; it must be frozen
    (public constants), since statistics of private data would be released unnoised.
    """
    if shuffle_mode != "crypto":
        raise DPConfigError(
            f"STREAMTRAIN_DP=on requires STREAMTRAIN_SHUFFLE=crypto, got SHUFFLE={shuffle_mode!r}: a seeded "
            "shuffle is predictable and voids the privacy guarantee; set SHUFFLE=crypto"
        )
    check_ranges(config)
    if input_norm is not None and not getattr(input_norm, "frozen", False):
        raise DPConfigError(
            "input normalization from running statistics of private events is refused under DP (the statistics "
            "are released without noise); use public constants STREAMTRAIN_DP_NORM_MEAN / STREAMTRAIN_DP_NORM_STD"
        )
    if model is not None:
        check_model_static(model)
        # the probe needs the input shape; a model that does not declare it gets the static checks only
        channels, max_len = getattr(model, "channels", None), getattr(model, "max_len", None)
        if channels is not None and max_len is not None:
            check_model_probe(model, int(channels), int(max_len))
        for field in ("norm_mean", "norm_std"):
            given = getattr(config, field)
            if given is not None and channels is not None and len(given) != channels:
                raise _range_error(field, given, f"needs one value per channel ({channels})", "give CHANNELS values")
    # d: the coordinates that get discrete Gaussian noise (every trainable parameter); without a
    # model the accountant assumes its upper bound MAX_DIMENSION (the slack only grows with d)
    dimension = None if model is None else max(1, sum(p.numel() for p in model.parameters() if p.requires_grad))
    accountant = PerEventAccountant.for_config(config, dimension=dimension)
    unit = "event" if config.unit == "event" else "sensor group"
    if accountant.epsilon_cap > config.target_epsilon:
        raise DPConfigError(
            f"STREAMTRAIN_DP_TARGET_EPSILON={config.target_epsilon:g} cannot be met: this schedule gives each {unit} "
            f"ε={accountant.epsilon_cap:.3f} at δ={config.delta:g} (σ={config.noise_multiplier:g}, q0={config.q0:g}, "
            f"half-life={config.half_life_steps:g} steps, K={config.eligible_steps}); raise "
            "STREAMTRAIN_DP_NOISE_MULTIPLIER or lower STREAMTRAIN_DP_Q0, STREAMTRAIN_DP_ELIGIBLE_STEPS or "
            "STREAMTRAIN_DP_HALF_LIFE_STEPS"
        )
    return accountant
