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

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from streamtrain.data.collate import collate
from streamtrain.device import inference_stream, to_device_async
from streamtrain.events import NO_LABEL

ForecastReduction = Literal["tokens", "per_sample"]

#: Checkpoints record it in the model config, so one written for another input/output form
#: of the network is refused with a clear line instead of a tensor-shape error.
MODEL_FORM = "level_free_residual/v2"


# --------------------------------------------------------------------------------------------
# Normalization
# --------------------------------------------------------------------------------------------


class RunningNorm:
    """Per-channel running mean and variance over real tokens.

    Batch statistics are merged with Chan's parallel formula in float64, so the result
    equals the statistics of everything seen so far regardless of how it was batched.
    The variance has a floor so that ``std`` is never 0 (a constant channel normalizes
    to 0, not to NaN). Before any data, mean is 0 and std is 1 (identity).

    The statistics never forget, so one valid event with readings near 3e38 would set the
    variance for good and squash every later input to 0. Readings further than
    ``clip_std`` standard deviations from the mean are therefore clamped to that band
    before they are merged (the model still sees them as they are; only the statistics are
    protected). Until ``warmup_count`` tokens are in, the band comes from the batch's own
    median and MAD (no band for a channel whose MAD is 0: half its readings are equal and
    its spread cannot be judged yet). Data without such outliers gets the exact statistics.
    """

    def __init__(
        self, channels: int, var_floor: float = 1e-6, clip_std: float | None = 8.0, warmup_count: int = 1024
    ) -> None:
        if channels < 1:
            raise ValueError(f"RunningNorm: channels must be >= 1, got {channels}")
        if not var_floor > 0:
            raise ValueError(f"RunningNorm: var_floor must be > 0, got {var_floor}")
        if clip_std is not None and not clip_std > 0:
            raise ValueError(f"RunningNorm: clip_std must be > 0 or None, got {clip_std}")
        self.channels = channels
        self.var_floor = float(var_floor)
        self.clip_std = None if clip_std is None else float(clip_std)
        self.warmup_count = int(warmup_count)
        self.clipped = 0  # readings clamped before merging, all time
        self.count = 0
        self._mean = torch.zeros(channels, dtype=torch.float64)
        self._m2 = torch.zeros(channels, dtype=torch.float64)  # sum of squared deviations
        self.frozen = False

    @classmethod
    def from_public(cls, mean: Sequence[float], std: Sequence[float]) -> RunningNorm:
        """A frozen norm from public constants (DP mode: statistics of private data leak)."""
        mean_t = torch.as_tensor(mean, dtype=torch.float64).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float64).reshape(-1)
        if mean_t.shape != std_t.shape or not bool((std_t > 0).all()):
            raise ValueError("RunningNorm.from_public: mean and std need one entry per channel, std > 0")
        norm = cls(int(mean_t.numel()), var_floor=float(std_t.min()) ** 2 * 1e-6)
        norm.count = 1
        norm._mean = mean_t.clone()
        norm._m2 = std_t.square().clone()  # count 1 → var = m2
        norm.frozen = True
        return norm

    @property
    def mean(self) -> torch.Tensor:
        return self._mean.clone()

    @property
    def var(self) -> torch.Tensor:
        if self.count == 0:
            return torch.ones(self.channels, dtype=torch.float64)
        return (self._m2 / self.count).clamp_min(self.var_floor)

    @property
    def std(self) -> torch.Tensor:
        return self.var.sqrt()

    def update(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Merge the statistics of the real tokens of ``values [B, L, C]`` (``mask [B, L]``)."""
        if self.frozen:
            raise RuntimeError("RunningNorm.update: this norm is frozen (public constants); do not update it")
        if values.dim() != 3 or values.shape[-1] != self.channels or values.shape[:2] != mask.shape:
            raise ValueError(
                f"RunningNorm.update: expected values [B, L, {self.channels}] and mask [B, L], "
                f"got {tuple(values.shape)} and {tuple(mask.shape)}"
            )
        real = values.detach()[mask.bool()].to(torch.float64)  # [N, C]
        n = int(real.shape[0])
        if n == 0:
            return
        if self.clip_std is not None:
            real = self._clamp_outliers(real)
        batch_mean = real.mean(dim=0)
        batch_m2 = (real - batch_mean).square().sum(dim=0)
        total = self.count + n
        delta = batch_mean - self._mean
        self._mean = self._mean + delta * (n / total)
        self._m2 = self._m2 + batch_m2 + delta.square() * (self.count * n / total)
        self.count = total

    def _clamp_outliers(self, real: torch.Tensor) -> torch.Tensor:
        if self.count >= self.warmup_count:
            center, scale = self._mean, self.std
        else:
            center = real.median(dim=0).values
            scale = 1.4826 * (real - center).abs().median(dim=0).values  # MAD → std for normal data
            scale = torch.where(scale > 0, scale, torch.full_like(scale, math.inf))
        band = self.clip_std * scale
        clamped = torch.minimum(torch.maximum(real, center - band), center + band)
        self.clipped += int((clamped != real).sum())
        return clamped

    def _as_float(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std in ``x``'s dtype on ``x``'s device; the statistics stay float64 on the host.

        On a GPU both go over in one non-blocking copy from pinned memory: a plain ``.to``
        from pageable memory would make the trainer wait for every queued kernel each step.
        """
        if x.device.type == "cpu":
            return self._mean.to(x.dtype), self.std.to(x.dtype)
        both = to_device_async(torch.stack([self._mean, self.std]).to(x.dtype), x.device)
        return both[0], both[1]

    def normalize(self, x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        if isinstance(x, np.ndarray):
            return (x - self._mean.numpy()) / self.std.numpy()
        mean, std = self._as_float(x)
        return (x - mean) / std

    def denormalize(self, x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        if isinstance(x, np.ndarray):
            return x * self.std.numpy() + self._mean.numpy()
        mean, std = self._as_float(x)
        return x * std + mean

    def state_dict(self) -> dict[str, Any]:
        return {
            "channels": self.channels,
            "var_floor": self.var_floor,
            "clip_std": self.clip_std,
            "warmup_count": self.warmup_count,
            "clipped": self.clipped,
            "count": self.count,
            "mean": self._mean.clone(),
            "m2": self._m2.clone(),
            "frozen": self.frozen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["channels"]) != self.channels:
            raise ValueError(
                f"RunningNorm.load_state_dict: checkpoint has {state['channels']} channels, "
                f"this norm {self.channels}; use the same CHANNELS setting"
            )
        self.var_floor = float(state["var_floor"])
        self.clip_std = None if state.get("clip_std") is None else float(state["clip_std"])
        self.warmup_count = int(state.get("warmup_count", self.warmup_count))
        self.clipped = int(state.get("clipped", 0))
        self.count = int(state["count"])
        self._mean = torch.as_tensor(state["mean"], dtype=torch.float64).clone()
        self._m2 = torch.as_tensor(state["m2"], dtype=torch.float64).clone()
        self.frozen = bool(state.get("frozen", False))


# --------------------------------------------------------------------------------------------
# Network
# --------------------------------------------------------------------------------------------


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


def attention_allowed(mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L] bool: query t may attend key s when s <= t and s is real.

    A row with no allowed key (only for a length-0 sequence) would turn softmax into NaN;
    such rows are opened to all keys. Their output is masked away later anyway.
    """
    length = mask.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    allowed = causal & mask[..., None, :]  # [B, L, L]
    allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
    return allowed[:, None]


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

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        batch, length, d_model = x.shape
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        # One fused kernel (PyTorch's CPU flash attention) instead of scores, mask, softmax
        # and a second matmul: a third less time per forward on CPU, same numbers.
        mixed = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0
        )
        mixed = mixed.transpose(1, 2).reshape(batch, length, d_model)
        return self.out(mixed)


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

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), allowed))
        return x + self.dropout(self.ff_out(F.gelu(self.ff_in(self.ff_norm(x)))))


class SensorModel(nn.Module):
    """Causal Transformer encoder: forecasts the next reading and optionally classifies."""

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

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
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
        x = torch.where(real, x_norm, torch.zeros((), dtype=x_norm.dtype, device=x_norm.device))
        features, scale = level_free_features(x, real)
        hidden = self.input(features) + self.positions[:length]
        allowed = attention_allowed(mask)
        for block in self.blocks:
            hidden = block(hidden, allowed)
        hidden = self.final_norm(hidden)
        # The forecast is the last reading plus a change in the instance's own step scale.
        forecast = (x + scale * self.forecast_head(hidden)) * real
        logits = None
        if self.class_head is not None:
            last = (mask.sum(dim=1) - 1).clamp_min(0)  # real positions come first
            last_hidden = hidden[torch.arange(batch, device=hidden.device), last]
            logits = self.class_head(last_hidden)
        return ModelOutput(forecast=forecast, logits=logits)


SCALE_FLOOR = 0.05  # in units of the running (global) std: a flat instance is not blown up


def level_free_features(x: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-instance, causal features that no level shift changes, and the scale they use.

    Returns ``features [B, L, 2C]`` (each reading minus the instance's mean up to it, and
    its step from the previous reading, both divided by ``scale``) and ``scale [B, L, C]``,
    the instance's mean absolute step up to each position (plus :data:`SCALE_FLOOR`). Adding a constant to an instance changes neither; multiplying it
    by a factor (above the floor) changes only ``scale``. ``x`` is zero at pad positions
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


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def _one_step_errors(
    forecast: torch.Tensor, x_norm: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position squared error (mean over channels) of forecast[t] vs x[t+1]; [B, L] each,
    valid where t and t+1 are both real.

    The target is the input shifted left by one (the last position gets a zero, never
    valid) rather than a ``[:, 1:]`` slice: no tensor is empty for length-1 batches, which
    ONNX Runtime's reductions get wrong, and the exported graph needs no special case.
    """
    mask = mask.bool()
    target = torch.cat([x_norm[:, 1:], torch.zeros_like(x_norm[:, :1])], dim=1)
    valid = mask & torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)
    error = (forecast - target).square().mean(dim=-1)
    error = torch.where(valid, error, torch.zeros((), dtype=error.dtype, device=error.device))
    return error, valid


def _reduce(error: torch.Tensor, valid: torch.Tensor, reduction: ForecastReduction) -> torch.Tensor:
    if reduction == "tokens":
        return error.sum() / valid.sum().clamp_min(1)
    if reduction == "per_sample":
        return error.sum(dim=1) / valid.sum(dim=1).clamp_min(1)
    raise ValueError(f"reduction must be 'tokens' or 'per_sample', got {reduction!r}")


def forecast_loss(
    output: ModelOutput, x_norm: torch.Tensor, mask: torch.Tensor, reduction: ForecastReduction = "tokens"
) -> torch.Tensor:
    """One-step-ahead MSE over positions where t and t+1 are both real.

    ``tokens``: sum over the batch / number of real target tokens (a scalar; non-DP).
    ``per_sample``: each example's own mean (a [B] tensor; 0 for a length-1 sequence) —
    DP-SGD needs a loss in which no example's term depends on the batch.
    """
    error, valid = _one_step_errors(output.forecast, x_norm, mask)
    return _reduce(error, valid, reduction)


def naive_last_value_loss(
    x_norm: torch.Tensor, mask: torch.Tensor, reduction: ForecastReduction = "tokens"
) -> torch.Tensor:
    """The MSE of predicting x[t+1] = x[t]: the baseline a forecaster has to beat."""
    error, valid = _one_step_errors(x_norm, x_norm, mask)
    return _reduce(error, valid, reduction)


def classification_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: ForecastReduction = "tokens"
) -> torch.Tensor:
    """Cross-entropy over labelled examples (labels == -1 are ignored).

    ``tokens`` (the name is shared with forecast_loss): mean over labelled examples, 0 if
    none. ``per_sample``: [B], 0 for unlabelled examples.
    """
    labelled = labels != NO_LABEL
    per_example = F.cross_entropy(logits, labels.clamp_min(0), reduction="none")
    per_example = torch.where(
        labelled, per_example, torch.zeros((), dtype=per_example.dtype, device=per_example.device)
    )
    if reduction == "per_sample":
        return per_example
    if reduction == "tokens":
        return per_example.sum() / labelled.sum().clamp_min(1)
    raise ValueError(f"reduction must be 'tokens' or 'per_sample', got {reduction!r}")


def total_loss(
    output: ModelOutput,
    x_norm: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor | None = None,
    reduction: ForecastReduction = "tokens",
    class_weight: float = 1.0,
) -> torch.Tensor:
    """Forecast loss plus ``class_weight`` × classification loss (when there is a head)."""
    loss = forecast_loss(output, x_norm, mask, reduction)
    if output.logits is not None and labels is not None:
        loss = loss + class_weight * classification_loss(output.logits, labels, reduction)
    return loss


# --------------------------------------------------------------------------------------------
# Inference
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    next: list[float]  # forecast of the reading after the last one, in data units
    anomaly_score: float  # mean squared one-step-ahead error, standardized by the running variance
    probs: list[float] | None = None  # class probabilities when n_classes > 0


class InferenceModel(nn.Module):
    """What a prediction computes, as one module: the model with its input normalization.

    ``forward(values [B, L, C] float32, lengths [B] int64)`` returns ``(next [B, C],
    anomaly_score [B])`` plus ``probs [B, n_classes]`` when the model classifies. Rows
    are real for their first ``lengths[b]`` steps; whatever the padding holds is ignored.
    :func:`predict` runs this module and ``streamtrain export`` writes it to TorchScript
    and ONNX, so the service and an exported model compute the same thing. It only calls
    ``SensorModel.forward``, so a change there reaches both.
    """

    def __init__(self, model: SensorModel, norm: RunningNorm) -> None:
        super().__init__()
        self.model = model
        # The float32 constants RunningNorm.normalize uses for float32 inputs, made on the
        # model's device: no .to() on a module that other threads may be running.
        device = next(model.parameters()).device
        self.register_buffer("mean", to_device_async(norm.mean.float(), device))
        self.register_buffer("std", to_device_async(norm.std.float(), device))
        self.n_classes = model.n_classes

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("next", "anomaly_score", "probs") if self.n_classes > 0 else ("next", "anomaly_score")

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, length = values.shape[0], values.shape[1]
        positions = torch.arange(length, device=values.device)
        mask = positions[None, :] < lengths[:, None]
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        x_norm = torch.where(mask[..., None], (values - self.mean) / self.std, zero)
        output = self.model(x_norm, mask)
        scores = forecast_loss(output, x_norm, mask, reduction="per_sample")
        last = (lengths - 1).clamp_min(0)
        next_norm = output.forecast[torch.arange(batch, device=values.device), last]
        next_values = next_norm * self.std + self.mean
        if output.logits is None:
            return next_values, scores
        return next_values, scores, torch.softmax(output.logits, dim=-1)


@dataclass(frozen=True)
class PredictionArrays:
    """Predictions for N instances as arrays (float32), in request order; slices stay in order."""

    next: np.ndarray  # [N, C]
    anomaly_score: np.ndarray  # [N]
    probs: np.ndarray | None  # [N, n_classes] or None

    def __len__(self) -> int:
        return int(self.anomaly_score.shape[0])

    def __getitem__(self, index: slice) -> PredictionArrays:
        if not isinstance(index, slice):
            raise TypeError("PredictionArrays: index with a slice")
        return PredictionArrays(
            self.next[index], self.anomaly_score[index], None if self.probs is None else self.probs[index]
        )

    def finite_rows(self) -> np.ndarray:
        """[N] bool: every number of the instance's prediction is finite."""
        ok = np.isfinite(self.next).all(axis=1) & np.isfinite(self.anomaly_score)
        if self.probs is not None:
            ok &= np.isfinite(self.probs).all(axis=1)
        return ok

    def to_predictions(self) -> list[Prediction]:
        nexts, scores = self.next.tolist(), self.anomaly_score.tolist()
        probs = self.probs.tolist() if self.probs is not None else [None] * len(scores)
        return [Prediction(next=n, anomaly_score=s, probs=p) for n, s, p in zip(nexts, scores, probs, strict=True)]


PREDICT_MIN_LENGTH_SHARE = 0.75  # a request holds tens of items: filling the training budget pads ~70%


def plan_predict_batches(
    lengths: np.ndarray, token_budget: int, min_length_share: float = PREDICT_MIN_LENGTH_SHARE
) -> list[np.ndarray]:
    """Length-sorted index groups: the padded size (count × longest) fits the budget and
    every item is at least ``min_length_share`` of its group's longest, so little is padded."""
    order = np.argsort(-lengths, kind="stable")
    descending = lengths[order]
    groups: list[np.ndarray] = []
    start = 0
    while start < len(order):
        longest = int(descending[start])  # sorted descending: the first is the longest
        count = max(1, token_budget // max(longest, 1))
        too_short = start + int(np.searchsorted(-descending[start:], -min_length_share * longest, side="right"))
        end = min(start + count, max(too_short, start + 1))
        groups.append(order[start:end])
        start = end
    return groups


def predict_arrays(
    model: SensorModel, norm: RunningNorm, values: Sequence[np.ndarray], token_budget: int
) -> PredictionArrays:
    """No-shuffle inference through :class:`InferenceModel`: one row per input, in order.

    Instances are length-sorted into token-budget micro-batches for speed; since the model
    has no cross-instance op and masks padding, an instance's answer does not depend on
    its company or on the order of the request.
    """
    arrays = [np.asarray(v, dtype=np.float32).reshape(len(v), -1) for v in values]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    if (lengths < 1).any():
        raise ValueError("predict: every instance needs at least one reading")
    count, channels = len(arrays), model.channels
    out_next = np.empty((count, channels), dtype=np.float32)
    out_score = np.empty(count, dtype=np.float32)
    out_probs = np.empty((count, model.n_classes), dtype=np.float32) if model.n_classes > 0 else None
    if not arrays:
        return PredictionArrays(out_next, out_score, out_probs)
    was_training = model.training
    device = model_device(model)
    model.eval()
    try:
        # On a GPU: this thread's own high-priority stream, every micro-batch queued before
        # anything is read back, and one copy back per output at the end.
        with inference_stream(device), torch.inference_mode():
            network = InferenceModel(model, norm)
            groups = plan_predict_batches(lengths, token_budget)
            outputs = []
            for group in groups:
                batch = collate([arrays[i] for i in group])
                outputs.append(network(to_device_async(batch.values, device), to_device_async(batch.lengths, device)))
            order = np.concatenate(groups)
            out_next[order] = torch.cat([o[0] for o in outputs]).cpu().numpy()
            out_score[order] = torch.cat([o[1] for o in outputs]).cpu().numpy()
            if out_probs is not None:
                out_probs[order] = torch.cat([o[2] for o in outputs]).cpu().numpy()
    finally:
        model.train(was_training)
    return PredictionArrays(out_next, out_score, out_probs)


def model_device(model: nn.Module) -> torch.device:
    """The device a model's parameters (else buffers) live on; the CPU for a module with neither."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


def forward_on_model_device(model: SensorModel, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
    """``model(x_norm, mask)`` for host tensors, wherever the model lives; the output back on the host.

    For callers that score on the host in float64 (the quality monitor): the forward runs
    on the model's device (on this thread's inference stream there), the rest stays as it was.
    """
    device = model_device(model)
    if device.type == "cpu":
        return model(x_norm, mask)
    with inference_stream(device):
        output = model(to_device_async(x_norm, device), to_device_async(mask, device))
        return ModelOutput(
            forecast=output.forecast.cpu(), logits=None if output.logits is None else output.logits.cpu()
        )


def predict(model: SensorModel, norm: RunningNorm, values: Sequence[np.ndarray], token_budget: int) -> list[Prediction]:
    """:func:`predict_arrays` as one :class:`Prediction` per input, in request order."""
    if not values:
        return []
    return predict_arrays(model, norm, values, token_budget).to_predictions()
