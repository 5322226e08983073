"""Scoring events with a frozen model: one-step forecast errors, beside the last value's.

Prequential (test-then-train) evaluation: before an accepted event reaches the window,
the model that serves scores it, so every scored event is one the scoring model has not
trained on. The score of an event is its one-step-ahead forecast MSE over its real steps
(mean over channels, in the serving model's normalized units, as the training loss), next
to the last-value forecast's MSE on the same steps; a labelled event adds its log-loss and
whether the top class was right. Scoring never updates the model: it runs in inference
mode and leaves the module's train/eval mode as it found it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from streamtrain.data.collate import collate
from streamtrain.events import NO_LABEL
from streamtrain.model.inference import evaluating, forward_on_model_device, plan_predict_batches
from streamtrain.model.network import ModelOutput, SensorModel
from streamtrain.model.normalization import RunningNorm


class Scorable(Protocol):
    """A published model: what scoring needs (training.publishing.PublishedModel has it).

    ``model`` is the network; ``served`` the module whose forecasts serve (the network,
    or the forecaster chosen beside it: :class:`streamtrain.model.forecasters.ServedModel`).
    """

    @property
    def model(self) -> SensorModel: ...

    @property
    def norm(self) -> RunningNorm: ...

    @property
    def version(self) -> int: ...

    @property
    def served(self) -> torch.nn.Module: ...


@dataclass(frozen=True)
class EventScores:
    """Per-event scores; events with one reading have ``steps == 0`` and score nothing."""

    steps: np.ndarray  # int64 [n]: one-step targets (length - 1)
    sse: np.ndarray  # float64 [n]: model's summed squared error over the steps (mean over channels)
    naive_sse: np.ndarray  # float64 [n]: the last-value forecast's, same steps
    log_loss: np.ndarray  # float64 [n]: cross-entropy of the label; NaN when unlabelled or no head
    correct: np.ndarray  # float64 [n]: 1.0 / 0.0 top-class hit; NaN when unlabelled or no head


def forward_in_data_units(
    module: torch.nn.Module, norm: RunningNorm, values: torch.Tensor, mask: torch.Tensor
) -> tuple[ModelOutput, torch.Tensor]:
    """``module``'s output on padded ``values`` (data units), and its forecast back in data units (float64).

    The forward runs wherever the module lives (a serving copy may be on a GPU); the
    inputs and outputs stay on the host.
    """
    x_norm = norm.normalize(values).float() * mask[..., None]
    output = forward_on_model_device(module, x_norm, mask)
    return output, norm.denormalize(output.forecast.double())


def score_events(
    model: torch.nn.Module,
    norm: RunningNorm,
    values: Sequence[np.ndarray],
    labels: Sequence[int] | np.ndarray | None = None,
    token_budget: int = 2048,
    units: RunningNorm | None = None,
) -> EventScores:
    """Score ``values`` (each ``[L, C]``) with ``model`` in inference mode, no update.

    Squared errors are in the normalized units of ``units`` (default: ``norm``, the
    model's own), so two models scored with the same ``units`` are compared on one scale.
    """
    n = len(values)
    labels_arr = np.full(n, NO_LABEL, dtype=np.int64) if labels is None else np.asarray(labels, dtype=np.int64)
    out = EventScores(
        steps=np.zeros(n, dtype=np.int64),
        sse=np.zeros(n),
        naive_sse=np.zeros(n),
        log_loss=np.full(n, math.nan),
        correct=np.full(n, math.nan),
    )
    if n == 0:
        return out
    units = norm if units is None else units
    unit_std = units.std.float()
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    with evaluating(model), torch.inference_mode():
        for group in plan_predict_batches(lengths, token_budget):
            batch = collate([values[i] for i in group])
            mask = batch.mask
            output, forecast = forward_in_data_units(model, norm, batch.values, mask)
            data = batch.values
            valid = (mask[:, :-1] & mask[:, 1:]).double()
            # In the common units: (forecast - target) / unit std.
            err = ((forecast.float()[:, :-1] - data[:, 1:]) / unit_std).double().square().mean(-1) * valid
            naive = ((data[:, :-1] - data[:, 1:]) / unit_std).double().square().mean(-1) * valid
            out.steps[group] = valid.sum(1).long().numpy()
            out.sse[group] = err.sum(1).numpy()
            out.naive_sse[group] = naive.sum(1).numpy()
            if output.logits is not None:
                group_labels = torch.from_numpy(labels_arr[group])
                labelled = group_labels != NO_LABEL
                if bool(labelled.any()):
                    logits = output.logits.double()
                    ce = F.cross_entropy(logits, group_labels.clamp_min(0), reduction="none")
                    hit = (logits.argmax(-1) == group_labels).double()
                    rows = group[labelled.numpy()]
                    out.log_loss[rows] = ce[labelled].numpy()
                    out.correct[rows] = hit[labelled].numpy()
    return out
