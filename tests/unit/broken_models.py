"""Models for the invariant tests: one that computes something, and copies broken on purpose.

``SensorModel`` starts with a zero forecast head, so an untrained model forecasts exactly
the last reading whatever its body computes: an invariant checked on it says nothing about
the body. The tests check each model-level invariant on :func:`computing_model` (random
body and a random, non-zero head) and run the same check on a variant broken against it,
which must fail: the test that catches a bug is itself tested.

Each variant is a deep copy of a good model with one hook (or one zeroed layer) that
breaks one thing, so everything else it computes is the good model's. The hooks fire
wherever the model runs (``forward``, ``predict``, an export's trace).
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamtrain.model.network import CausalSelfAttention, ModelOutput, SensorModel, pad_rows

HEAD_STD = 0.3  # a head of this size moves forecasts by about one step scale: far above any test tolerance


def randomize_head(model: SensorModel, seed: int = 0, std: float = HEAD_STD) -> SensorModel:
    """Give ``model`` a non-zero random forecast head (in place, seeded): its body now reaches the forecast."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.forecast_head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model


def computing_model(
    channels: int = 2, n_classes: int = 3, seed: int = 0, d_model: int = 32, n_heads: int = 4,
    n_layers: int = 2, max_len: int = 64,
) -> SensorModel:  # fmt: skip
    """A small SensorModel in eval mode whose random body and random head both shape every output."""
    torch.manual_seed(seed)
    model = SensorModel(channels, n_classes=n_classes, d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                        max_len=max_len)  # fmt: skip
    return randomize_head(model, seed).eval()


# ---------------------------------------------------------------------------- broken variants


def _sees_the_future(attention: CausalSelfAttention, x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """``CausalSelfAttention.forward`` without the causal mask."""
    heads = (attention._heads(layer(x), batch, length) for layer in (attention.query, attention.key, attention.value))
    mixed = F.scaled_dot_product_attention(*heads)  # every query meets every key
    return attention.out(pad_rows(mixed.transpose(1, 2).reshape(batch * length, -1), x.shape[0]))


def non_causal(model: SensorModel) -> SensorModel:
    """A copy whose attention lets every position see every other, the future included."""
    broken = copy.deepcopy(model)
    for block in broken.blocks:
        block.attn.forward = types.MethodType(_sees_the_future, block.attn)  # type: ignore[method-assign]
    return broken


def _plus_batch_mean(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
    if isinstance(output, ModelOutput):
        logits = None if output.logits is None else output.logits + output.logits.mean(dim=0, keepdim=True)
        return ModelOutput(output.forecast + output.forecast.mean(dim=0, keepdim=True), logits)
    return output + output.mean(dim=0, keepdim=True)


def mixes_batch(model: nn.Module, at: str = "final_norm") -> nn.Module:
    """A copy that adds the batch mean to the output of submodule ``at``.

    ``"final_norm"``: the hidden state right before the heads; ``"blocks.0"``: inside the
    body (both token rows: the mean over every instance's positions); ``""``: the model's own
    outputs (after the heads).
    """
    broken = copy.deepcopy(model)
    broken.get_submodule(at).register_forward_hook(_plus_batch_mean)
    return broken


def pools_over_padding(model: SensorModel) -> SensorModel:
    """A copy that adds the unmasked mean over all positions to the hidden state before the heads,
    so a real forecast depends on how much padding follows it."""
    broken = copy.deepcopy(model)
    shape: dict[str, int] = {}

    def remember_shape(_module: nn.Module, args: tuple[Any, ...]) -> None:
        shape["batch"], shape["length"] = args[1].shape

    def plus_mean_over_positions(_module: nn.Module, _args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        batch, length = shape["batch"], shape["length"]  # the hidden state is token rows, [B * L (+ pad rows), D]
        positions = output[: batch * length].view(batch, length, -1)
        pooled = positions + positions.mean(dim=1, keepdim=True)  # the padding counts as positions
        return torch.cat([pooled.reshape(batch * length, -1), output[batch * length :]])

    broken.register_forward_pre_hook(remember_shape)
    broken.final_norm.register_forward_hook(plus_mean_over_positions)
    return broken


def _every_position_real(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    x_norm, mask = args
    return x_norm, torch.ones_like(mask)


def reads_padding(model: SensorModel) -> SensorModel:
    """A copy that ignores the mask: whatever the padding holds is read as readings."""
    broken = copy.deepcopy(model)
    broken.register_forward_pre_hook(_every_position_real)
    return broken


def head_dropped(model: SensorModel) -> SensorModel:
    """A copy without the forecast head's contribution: what an export that lost the head computes.

    On a zero-head model this is the model itself, which is why exports are checked on
    :func:`computing_model`.
    """
    broken = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in broken.forecast_head.parameters():
            parameter.zero_()
    return broken
