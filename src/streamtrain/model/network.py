"""The network: a small causal Transformer over variable-length sensor sequences.

Everything here is per instance. No BatchNorm or other op that mixes examples, positions
are a fixed sinusoidal buffer and attention is written with ``nn.Linear`` projections, so
that (a) an instance's output never depends on its batch company or on padding, which the
no-shuffle predict endpoint relies on, and (b) per-sample gradients exist for every
parameter, which DP-SGD relies on (``torch.func`` and Opacus hooks both work).

Forecasts survive level shifts. A network that maps absolute levels to absolute
forecasts through statistics frozen on the past breaks on the first level it has not
seen, where the last value simply follows. So, inside :meth:`SensorModel.forward` and per
instance: every position is centred on the instance's own running (causal) mean and
described by its step from the previous reading, both in units of the instance's own
running step size, and the network forecasts the *change* from the last reading in those
units (a residual over the last-value forecast, with a zero-initialised
head, so an untrained model is exactly the last-value forecast). Adding a constant to an
instance's readings adds it to every forecast and changes nothing else; no statistic
looks ahead, so training on every position sees what serving sees. Everything stays in
tensor ops (cumulative sums, no per-instance Python), so ``predict``, the losses, the DP
per-sample gradients and an ONNX export all get it from the same forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

#: Checkpoints record it in the model config, so one written for another input/output form
#: of the network is refused with a clear line instead of a tensor-shape error.
MODEL_FORM = "level_free_residual/v2"


@dataclass(frozen=True)
class ModelOutput:
    forecast: torch.Tensor  # [B, L, C]: at position t, the prediction of x[t+1]
    logits: torch.Tensor | None  # [B, n_classes] or None when n_classes == 0


def sinusoidal_positions(max_len: int, d_model: int) -> torch.Tensor:
    """The fixed encoding of "Attention Is All You Need"; [max_len, d_model]."""
    position = torch.arange(max_len, dtype=torch.float64)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)[:, : d_model // 2]
    return table.float()


#: Attention kernels allowed on a GPU, in PyTorch's order of preference (cuDNN's left out).
CUDA_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def _heads(self, x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """Rows ``[:batch * length]`` of ``x`` (token rows, pad rows after them) as ``[B, H, L, head_dim]``."""
        return x[: batch * length].view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """``x``: ``[R, d_model]`` token rows, the first ``batch * length`` of them the batch's
        positions in order and any after them pad rows (:func:`pad_rows`), which mix with nothing."""
        q, k, v = (self._heads(layer(x), batch, length) for layer in (self.query, self.key, self.value))
        dropout = self.dropout if self.training else 0.0
        # Causal attention needs no padding mask: real positions come first, so every key a
        # real query may see (s <= t) is real; pad queries see pad keys, and their outputs are
        # masked away. One fused kernel (PyTorch's flash attention), no [B, L, L] mask.
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # Under CPU bf16 autocast only the linears gain (AMX); this kernel is several times
            # slower in bfloat16 than in float32 at these head sizes (docs/performance.md).
            with torch.autocast("cpu", enabled=False):
                mixed = F.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), dropout_p=dropout, is_causal=True
                ).to(q.dtype)
        elif x.device.type == "cuda":
            # Not cuDNN's kernel: it builds a plan on the host for every new (batch, length),
            # and the planner's batches rarely repeat one (docs/accelerators.md: 4 ms of host
            # time per call on an H200, most of the step)
            with sdpa_kernel(CUDA_ATTENTION_BACKENDS):
                mixed = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            mixed = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        mixed = mixed.transpose(1, 2).reshape(batch * length, -1)
        return self.out(pad_rows(mixed, x.shape[0]))


class Block(nn.Module):
    """Pre-LN Transformer block: x + attn(LN(x)), then x + ffn(LN(x))."""

    def __init__(self, d_model: int, n_heads: int, ff_mult: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ff_norm = nn.LayerNorm(d_model)
        self.ff_in = nn.Linear(d_model, ff_mult * d_model)
        self.ff_out = nn.Linear(ff_mult * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """``x``: ``[R, d_model]`` token rows, as :meth:`CausalSelfAttention.forward` takes them."""
        x = x + self.dropout(self.attn(self.attn_norm(x), batch, length))
        return x + self.dropout(self.ff_out(F.gelu(self.ff_in(self.ff_norm(x)))))


class SensorModel(nn.Module):
    """Causal Transformer encoder: forecasts the next reading and optionally classifies."""

    positions: torch.Tensor  # [max_len, d_model], a non-persistent buffer (not in the state_dict)

    def __init__(
        self,
        channels: int,
        n_classes: int = 0,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        ff_mult: int = 4,
        max_len: int = 512,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if channels < 1 or n_classes < 0 or n_layers < 1 or max_len < 1:
            raise ValueError(
                f"SensorModel: need channels >= 1, n_classes >= 0, n_layers >= 1, max_len >= 1; "
                f"got {channels}, {n_classes}, {n_layers}, {max_len}"
            )
        self.channels = channels
        self.n_classes = n_classes
        self.max_len = max_len
        self.config = {
            "channels": channels, "n_classes": n_classes, "d_model": d_model, "n_heads": n_heads,
            "n_layers": n_layers, "ff_mult": ff_mult, "max_len": max_len, "dropout": dropout,
            "form": MODEL_FORM,
        }  # fmt: skip
        self.input = nn.Linear(2 * channels, d_model)  # [centred on the causal mean, step from the previous]
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, ff_mult, dropout) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.forecast_head = nn.Linear(d_model, channels)
        nn.init.zeros_(self.forecast_head.weight)  # untrained = the last-value forecast
        nn.init.zeros_(self.forecast_head.bias)
        self.class_head = nn.Linear(d_model, n_classes) if n_classes > 0 else None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SensorModel:
        """The network a saved ``config`` describes; refuses one of another input/output form."""
        arguments = dict(config)
        form = arguments.pop("form", None)
        if form != MODEL_FORM:
            raise ValueError(
                f"this model was saved in form {form!r}; this streamtrain builds {MODEL_FORM!r}, whose "
                "inputs and outputs differ: export or serve it with the streamtrain version that trained it"
            )
        return cls(**arguments)

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor, row_multiple: int = 1) -> ModelOutput:
        """Forecasts (and logits) of ``x_norm [B, L, C]`` whose real positions ``mask [B, L]`` marks.

        The body runs on the batch's ``B * L`` positions as token rows, padded up to a multiple
        of ``row_multiple`` (pad rows mix with nothing and are cut off). On a CPU the matmul
        kernels are built for each new row count (oneDNN's bf16 ones cost more to build than to
        run); a few row counts keep them cached (docs/performance.md, "One matmul kernel per
        row count"). 1 leaves the rows as they are.
        """
        batch, length, channels = x_norm.shape
        if channels != self.channels or mask.shape != (batch, length):
            raise ValueError(
                f"SensorModel.forward: expected x_norm [B, L, {self.channels}] and mask [B, L], "
                f"got {tuple(x_norm.shape)} and {tuple(mask.shape)}"
            )
        if length > self.max_len:
            raise ValueError(f"SensorModel.forward: length {length} exceeds max_len {self.max_len}")
        mask = mask.bool()
        real = mask[..., None]
        # Pad values are arbitrary; zero them so no NaN/inf pad can leak through 0 * inf.
        x = x_norm.masked_fill(~real, 0.0)
        features, scale = level_free_features(x, real)
        n_positions = batch * length
        rows = n_positions + (-n_positions) % row_multiple
        hidden = self.input(pad_rows(features.reshape(n_positions, -1), rows))
        hidden = hidden + pad_rows(self.positions[:length].repeat(batch, 1), rows)
        for block in self.blocks:
            hidden = block(hidden, batch, length)
        hidden = self.final_norm(hidden)
        # The forecast is the last reading plus a change in the instance's own step scale.
        change = self.forecast_head(hidden)[:n_positions].view(batch, length, channels)
        forecast = (x + scale * change) * real
        logits = None
        if self.class_head is not None:
            last = (mask.sum(dim=1) - 1).clamp_min(0)  # real positions come first
            last_hidden = hidden[:n_positions].view(batch, length, -1)[torch.arange(batch, device=hidden.device), last]
            logits = self.class_head(last_hidden)
        return ModelOutput(forecast=forecast, logits=logits)


def pad_rows(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows [N, D]`` followed by zero rows up to ``count``. Eagerly, ``rows`` itself when none is
    missing; a size torch.compile traces is padded whatever it is (a copy of no pad rows), so the
    graph holds no branch on it to guard."""
    missing = count - rows.shape[0]
    if isinstance(missing, int) and missing == 0:
        return rows
    return F.pad(rows, (0, 0, 0, missing))


SCALE_FLOOR = 0.05  # in units of the running (global) std: a flat instance is not blown up


def level_free_features(x: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-instance, causal features that no level shift changes, and the scale they use.

    Returns ``features [B, L, 2C]`` (each reading minus the instance's mean up to it, and
    its step from the previous reading, both divided by ``scale``) and ``scale [B, L, C]``,
    the instance's mean absolute step up to each position (plus :data:`SCALE_FLOOR`).
    Adding a constant to an instance changes neither; multiplying it by a factor (above
    the floor) changes only ``scale``. ``x`` is zero at pad positions
    and real positions come first, so running sums over real positions are plain cumsums.
    """
    count = torch.cumsum(real.to(x.dtype), dim=1).clamp_min(1.0)
    centred = (x - torch.cumsum(x, dim=1) / count) * real
    previous = torch.cat([x[:, :1], x[:, :-1]], dim=1)  # the first reading has no step: 0
    step = (x - previous) * real
    steps_seen = (count - 1.0).clamp_min(1.0)
    # Mean absolute step (x 1.25: the RMS of Gaussian steps): one jump inflates it far less
    # than a root mean square would, so the positions after a level jump keep their scale.
    scale = 1.25 * torch.cumsum(step.abs(), dim=1) / steps_seen + SCALE_FLOOR
    return torch.cat([centred / scale, step / scale], dim=-1), scale


def build_model(settings: Any) -> SensorModel:
    """A SensorModel from a Settings object (channels, n_classes, d_model, ...)."""
    return SensorModel(
        channels=settings.channels,
        n_classes=settings.n_classes,
        d_model=settings.d_model,
        n_heads=settings.n_heads,
        n_layers=settings.n_layers,
        max_len=settings.max_len,
    )
