"""The training losses: one-step-ahead forecast MSE, classification cross-entropy, their sum.

Every loss has two reductions. ``tokens`` divides the batch's summed error by its count
of real targets (a scalar, what the trainer minimizes). ``per_sample`` gives each example
its own mean (a ``[B]`` tensor) in which no example's term depends on the rest of the
batch: DP-SGD clips and noises per example and needs exactly that. A position counts only
when it and its target (the next position) are both real, so padding never does.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from streamtrain.events import NO_LABEL
from streamtrain.model.network import ModelOutput

ForecastReduction = Literal["tokens", "per_sample"]


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
    return error.masked_fill(~valid, 0.0), valid


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
    per_example = per_example.masked_fill(~labelled, 0.0)
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
