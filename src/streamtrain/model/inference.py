"""Inference: what a prediction computes, and no-shuffle batching of a request's instances.

Invariants:

* One module computes a prediction, :class:`InferenceModel` (input normalization, the
  served model, the output heads): :func:`predict_arrays` runs it and ``streamtrain export``
  writes it, so the service and an exported model answer the same.
* An instance's answer depends on nothing but the instance: the model mixes no instances
  and masks padding, so the length-sorted token-budget micro-batches of
  :func:`plan_predict_batches` change no answer, and answers come back in request order.
* Predicting leaves the model in the training mode it was in.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch
from torch import nn

from streamtrain.data.collate import collate
from streamtrain.device import inference_stream, to_device_async
from streamtrain.model.compiled import CompiledForward, example_batches, pad_rows_and_positions
from streamtrain.model.forecasters import ServedModel
from streamtrain.model.losses import forecast_loss
from streamtrain.model.network import ModelOutput, SensorModel
from streamtrain.model.normalization import RunningNorm

#: What predict and export run: the network alone, or the network with the forecaster chosen beside it.
ServableModel: TypeAlias = SensorModel | ServedModel


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

    mean: torch.Tensor  # float32 [C], on the model's device
    std: torch.Tensor  # float32 [C], on the model's device

    def __init__(self, model: ServableModel, norm: RunningNorm) -> None:
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
        x_norm = ((values - self.mean) / self.std).masked_fill(~mask[..., None], 0.0)
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


#: ``forward(network, values, lengths)``: what runs an :class:`InferenceModel` on one micro-batch.
InferenceForward: TypeAlias = Callable[[InferenceModel, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


def run_inference(network: InferenceModel, values: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The eager :data:`InferenceForward`."""
    return network(values, lengths)


class CompiledInference:
    """The :data:`InferenceForward` of the service: compiled (once warmed up on a model like
    ``template``) for a network that serves alone; eager for a forecaster chosen beside it
    (its blend weight would be compiled in as a constant, a graph per publication), and
    when compiling is off. Inputs are padded as :mod:`streamtrain.model.compiled` says."""

    def __init__(self, template: SensorModel, *, enabled: bool) -> None:
        template = copy.deepcopy(template).eval().requires_grad_(False)  # published models are frozen

        def warm_up(run: InferenceForward) -> None:
            with torch.inference_mode():  # inputs made here too: predict's are inference tensors, guarded on
                network = InferenceModel(template, RunningNorm(template.channels))
                for values, mask in example_batches(template.channels, template.max_len, model_device(template)):
                    run(network, values, mask.sum(dim=1))

        self.compiled = CompiledForward(run_inference, name="predict forward", enabled=enabled, warm_up=warm_up)

    def __call__(
        self, network: InferenceModel, values: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        if not (self.compiled.compiled and isinstance(network.model, SensorModel)):
            return run_inference(network, values, lengths)
        batch = values.shape[0]
        padded_values, padded_lengths = pad_rows_and_positions(values, lengths)
        if padded_values is values:
            return self.compiled(network, values, lengths)
        return tuple(output[:batch] for output in self.compiled(network, padded_values, padded_lengths))


def predict_arrays(
    model: ServableModel,
    norm: RunningNorm,
    values: Sequence[np.ndarray],
    token_budget: int,
    forward: InferenceForward = run_inference,
) -> PredictionArrays:
    """No-shuffle inference through :class:`InferenceModel`: one row per input, in order.

    Instances are length-sorted into token-budget micro-batches for speed; since the model
    has no cross-instance op and masks padding, an instance's answer does not depend on
    its company or on the order of the request. ``forward`` runs each micro-batch (the
    service passes its :class:`CompiledInference`).
    """
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    if (lengths < 1).any():  # before the reshape below, which cannot size an empty instance
        raise ValueError("predict: every instance needs at least one reading")
    arrays = [np.asarray(v, dtype=np.float32).reshape(len(v), -1) for v in values]
    count, channels = len(arrays), model.channels
    out_next = np.empty((count, channels), dtype=np.float32)
    out_score = np.empty(count, dtype=np.float32)
    out_probs = np.empty((count, model.n_classes), dtype=np.float32) if model.n_classes > 0 else None
    if not arrays:
        return PredictionArrays(out_next, out_score, out_probs)
    device = model_device(model)
    # On a GPU: this thread's own high-priority stream, every micro-batch queued before
    # anything is read back, and one copy back per output at the end.
    with evaluating(model), inference_stream(device), torch.inference_mode():
        network = InferenceModel(model, norm)
        groups = plan_predict_batches(lengths, token_budget)
        outputs = []
        for group in groups:
            batch = collate([arrays[i] for i in group])
            on_device = to_device_async(batch.values, device), to_device_async(batch.lengths, device)
            outputs.append(forward(network, *on_device))
        order = np.concatenate(groups)
        out_next[order] = torch.cat([o[0] for o in outputs]).cpu().numpy()
        out_score[order] = torch.cat([o[1] for o in outputs]).cpu().numpy()
        if out_probs is not None:
            out_probs[order] = torch.cat([o[2] for o in outputs]).cpu().numpy()
    return PredictionArrays(out_next, out_score, out_probs)


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` in eval mode for the block, back in training mode after when it was in it.

    A module already in eval mode is not touched: a published model is frozen in eval mode and
    answers several threads at once (predict workers, scoring, the publication's selection);
    writing its mode, even to the same value and back, races with them and with the compiled
    forward's guards on it.
    """
    if not module.training:
        yield module
        return
    module.eval()
    try:
        yield module
    finally:
        module.train()


def model_device(model: nn.Module) -> torch.device:
    """The device a model's parameters (else buffers) live on; the CPU for a module with neither."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


def forward_on_model_device(model: nn.Module, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
    """``model(x_norm, mask)`` for host tensors, wherever the model lives; the output back on the host.

    For callers that score on the host in float64 (the quality monitor): the forward runs
    on the model's device (on this thread's inference stream there), the rest stays as it was.
    """
    device = model_device(model)
    with inference_stream(device):  # on the host: no stream, no copy (``.cpu()`` of a host tensor is itself)
        output = model(to_device_async(x_norm, device), to_device_async(mask, device))
        return ModelOutput(
            forecast=output.forecast.cpu(), logits=None if output.logits is None else output.logits.cpu()
        )


def predict(
    model: ServableModel, norm: RunningNorm, values: Sequence[np.ndarray], token_budget: int
) -> list[Prediction]:
    """:func:`predict_arrays` as one :class:`Prediction` per input, in request order."""
    if not values:
        return []
    return predict_arrays(model, norm, values, token_budget).to_predictions()
