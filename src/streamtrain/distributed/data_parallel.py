"""One optimizer step over the union of every rank's batch: data-parallel training.

Each rank trains on token-budget batches from its own window (the partitions it owns).
A step must equal the single-process step over the union of the ranks' batches, for any
split, including a rank with no data at all that step. Three things make that so:

* **Global normalization of the loss.** :func:`streamtrain.model.losses.total_loss` divides the
  forecast error by the batch's count of forecast targets (positions whose next reading
  is real) and the classification loss by its count of labelled events. Each rank
  scales its local means by ``local count / global count`` instead, so the losses of the
  ranks *add up* to the loss of the union; the gradients are then *summed* over the
  ranks (:meth:`~streamtrain.distributed.collectives.Collectives.allreduce_gradients`), not averaged.
  The global counts are known before the forward pass (they depend only on the masks
  and labels), so they travel in the step's one small agreement collective.
* **Normalization statistics merged before they are used.** Every rank computes the
  moments (count, mean, M2 in float64) of its batch's real readings, all ranks gather
  them, merge them in rank order with Chan's formula and fold the result into their
  :class:`~streamtrain.model.normalization.RunningNorm`, so every rank normalizes with the statistics
  of the union, bit for bit the same on every rank.
* **A rank with no data contributes zeros**, a zero gradient and zero counts, and still
  takes part in both collectives: nobody waits for it, and it applies the same update.

One step costs two collectives: the agreement (tens of float64 per rank, gathered) and
the gradient sum (one flat all-reduce per 25 MiB bucket, with the loss sums and the
non-finite flag riding along). Every decision that follows (skip a non-finite step, clip,
step the optimizer, publish, checkpoint, stop) is taken from those identical results,
so ranks never diverge.

With one rank both collectives are local and the step is the single-process step of
:meth:`streamtrain.training.trainer.Trainer.train_step` (tested to agree, also under bf16 autocast).

Devices: the model may live on a GPU. A batch arrives as the lockstep loop stages it (a
:class:`~streamtrain.data.prefetch.StagedBatch`: pinned host tensors plus their copy on
the device, made one tick ahead on a side stream), or as a plain host batch, which is
copied here. The counts and the normalization moments are always taken from the host
tensors in float64; the forward, the loss and the backward run on the device, the
forward under ``AMP``'s autocast as in ``Trainer.train_step``; the loss sums stay on the
device until they ride in the gradient all-reduce, so a step reads the device back once
for its decision (and once more for the clipped norm).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from streamtrain.data.collate import Batch
from streamtrain.data.prefetch import place_batch
from streamtrain.device import Precision
from streamtrain.distributed.collectives import DEFAULT_BUCKET_BYTES, Collectives
from streamtrain.distributed.wire import StepAgreement, StepSignals
from streamtrain.model.compiled import training_forward
from streamtrain.model.losses import classification_loss, forecast_loss, naive_last_value_loss
from streamtrain.model.network import ModelOutput, SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.model.normalization import merge_moments as merge_norm_moments
from streamtrain.training.protocol import StepOutcome

# ----------------------------------------------------------------------------------------
# normalization statistics


@dataclass(frozen=True)
class Moments:
    """Count, mean and sum of squared deviations (M2) of real readings per channel, float64."""

    count: int
    mean: torch.Tensor  # float64 [C]
    m2: torch.Tensor  # float64 [C]
    clipped: int = 0  # readings clamped to the outlier band before these moments were taken

    @classmethod
    def empty(cls, channels: int) -> Moments:
        zeros = torch.zeros(channels, dtype=torch.float64)
        return cls(0, zeros, zeros.clone())

    @property
    def channels(self) -> int:
        return int(self.mean.numel())

    def as_payload(self) -> np.ndarray:
        """``[count, clipped, mean..., m2...]`` for the step's agreement collective."""
        head = np.array([self.count, self.clipped], dtype=np.float64)
        return np.concatenate([head, self.mean.numpy(), self.m2.numpy()])

    @classmethod
    def from_payload(cls, row: np.ndarray, channels: int) -> Moments:
        row = np.asarray(row, dtype=np.float64)
        if row.shape != (2 + 2 * channels,):
            raise ValueError(
                f"a moments payload for {channels} channels has {2 + 2 * channels} numbers, got {row.shape}"
            )
        return cls(
            count=int(round(row[0])),
            clipped=int(round(row[1])),
            mean=torch.from_numpy(row[2 : 2 + channels].copy()),
            m2=torch.from_numpy(row[2 + channels :].copy()),
        )


def merge_moments(a: Moments, b: Moments) -> Moments:
    """The moments of the union of two disjoint samples (:func:`~streamtrain.model.normalization.merge_moments`)."""
    count, mean, m2 = merge_norm_moments(a.count, a.mean, a.m2, b.count, b.mean, b.m2)
    return Moments(count=count, mean=mean, m2=m2, clipped=a.clipped + b.clipped)


def merge_all(parts: Sequence[Moments]) -> Moments:
    """Fold ``parts`` left to right (rank order), so every rank gets bit-identical moments."""
    if not parts:
        raise ValueError("merge_all needs at least one Moments")
    merged = parts[0]
    for part in parts[1:]:
        merged = merge_moments(merged, part)
    return merged


def batch_moments(norm: RunningNorm, values: torch.Tensor, mask: torch.Tensor) -> Moments:
    """The moments :meth:`RunningNorm.update` would merge for this batch, without merging them.

    Readings are clamped to the norm's outlier band first, as ``update`` does. After the
    norm's warm-up the band comes from its running statistics (the same on every rank);
    during warm-up it comes from each rank's own batch (median and MAD), so only a batch
    with outliers in the first ``warmup_count`` tokens can differ from the single-process
    statistics. ``norm`` is left unchanged.
    """
    count, mean, m2, clipped = norm.batch_moments(values, mask)
    return Moments(count=count, mean=mean, m2=m2, clipped=clipped)


def apply_moments(norm: RunningNorm, moments: Moments) -> None:
    """Fold ``moments`` into ``norm`` exactly as :meth:`RunningNorm.update` folds a batch."""
    if moments.count == 0 and moments.clipped == 0:
        return
    norm.merge(moments.count, moments.mean, moments.m2, moments.clipped)


# ----------------------------------------------------------------------------------------
# the counts that normalize the loss


@dataclass(frozen=True)
class LossCounts:
    """What a batch holds, as the loss and the counters count it."""

    real_tokens: int  # readings (the trainer's tokens_trained counts these)
    forecast_targets: int  # positions t with t and t+1 real: the forecast loss's denominator
    labelled: int  # events with a label: the classification loss's denominator
    sequences: int
    padded_tokens: int

    @classmethod
    def of(cls, batch: Batch | None) -> LossCounts:
        if batch is None:
            return cls(0, 0, 0, 0, 0)
        lengths = batch.lengths
        return cls(
            real_tokens=int(lengths.sum()),
            forecast_targets=int((lengths - 1).clamp_min(0).sum()),
            labelled=int((batch.labels >= 0).sum()),
            sequences=batch.batch_size,
            padded_tokens=batch.padded_tokens,
        )

    def as_dict(self) -> dict[str, int]:
        return {
            "real_tokens": self.real_tokens,
            "forecast_targets": self.forecast_targets,
            "labelled": self.labelled,
            "sequences": self.sequences,
            "padded_tokens": self.padded_tokens,
        }


def globally_normalized_loss(
    output: Any,
    x_norm: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor | None,
    local: LossCounts,
    totals: dict[str, int],
    class_weight: float = 1.0,
) -> torch.Tensor:
    """This rank's share of the union's :func:`~streamtrain.model.losses.total_loss`.

    ``total_loss`` is ``forecast mean + class_weight × classification mean`` over one
    batch; the shares of all ranks add up to it over the union: each local mean is
    weighted by ``local count / global count`` of its own denominator.
    """
    loss = forecast_loss(output, x_norm, mask) * (local.forecast_targets / max(totals["forecast_targets"], 1))
    if output.logits is not None and labels is not None:
        class_part = classification_loss(output.logits, labels) * (local.labelled / max(totals["labelled"], 1))
        loss = loss + class_weight * class_part
    return loss


# ----------------------------------------------------------------------------------------
# the step


#: ``forward(model, x_norm, mask)``: the step's forward under AMP's autocast, the output in ``x_norm``'s
#: dtype (:func:`streamtrain.model.compiled.training_forward`; :class:`~streamtrain.model.compiled.ModelForward`
#: compiles it).
StepForward = Callable[[SensorModel, torch.Tensor, torch.Tensor], ModelOutput]


@dataclass(frozen=True)
class ParallelStepReport:
    """What one data-parallel step did; every field but ``local_*`` and the timings is global."""

    agreement: StepAgreement
    applied: bool
    skipped_reason: str | None  # None, "stop", "no_data", "non_finite_loss", "non_finite_grad"
    loss: float  # the union's total_loss (nan when no step ran)
    forecast_loss: float  # the union's forecast MSE (normalized units)
    naive_loss: float  # the last-value forecast's MSE on the same batches
    grad_norm: float  # global gradient norm before clipping (nan when not computed)
    real_tokens: int
    padded_tokens: int
    sequences: int
    local_real_tokens: int
    seconds: float
    agree_seconds: float  # the agreement collective
    allreduce_seconds: float  # the gradient all-reduce

    def outcome(self) -> StepOutcome:
        """The step as the trainer counts it (:meth:`~streamtrain.training.trainer.Trainer.apply_step`)."""
        return StepOutcome(
            applied=self.applied,
            skipped_reason=self.skipped_reason,
            seconds=self.seconds,
            real_tokens=self.real_tokens,  # global: every rank counts the same
            forecast_loss=self.forecast_loss,
            naive_loss=self.naive_loss,
        )


class DataParallelStep:
    """Runs lockstep optimizer steps: ``step(batch or None, step=..., signals=...)``.

    Holds no state of its own: the model, norm, optimizer and scheduler are the
    trainer's (rank 0 checkpoints them once; they are identical on every rank). Every
    rank must call it once per step, with or without a batch; the returned agreement
    tells all of them alike whether to publish, checkpoint, roll back or stop. An agreed
    optimizer reset (a drift reaction on some rank) clears AdamW's moments on every rank
    before this step's update.
    """

    def __init__(
        self,
        collectives: Collectives,
        model: SensorModel,
        norm: RunningNorm,
        optimizer: torch.optim.Optimizer,
        *,
        grad_clip_norm: float,
        scheduler: Any | None = None,
        class_weight: float = 1.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        fault_injector: Callable[[torch.Tensor], torch.Tensor] | None = None,
        amp: Precision = "off",
        forward: StepForward | None = None,
    ) -> None:
        self.collectives = collectives
        self.model = model
        self.norm = norm
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip_norm = float(grad_clip_norm)
        self.class_weight = float(class_weight)
        self.bucket_bytes = int(bucket_bytes)
        self.fault_injector = fault_injector  # tests make one rank's loss non-finite here
        self.amp: Precision = amp
        self.forward: StepForward = forward or functools.partial(training_forward, amp=amp)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def step(self, batch: Batch | None, *, step: int, signals: StepSignals | None = None) -> ParallelStepReport:
        started = time.perf_counter()
        if batch is not None and batch.batch_size == 0:
            batch = None
        device = self.device
        on_device: Batch | None = None
        if batch is not None:
            batch, on_device = place_batch(batch, device)
        signals = replace(signals or StepSignals(), has_data=batch is not None)
        local = LossCounts.of(batch)
        channels = self.norm.channels
        moments = Moments.empty(channels)
        if batch is not None and not self.norm.frozen:
            moments = batch_moments(self.norm, batch.values, batch.mask)  # host, float64

        agreed_at = time.perf_counter()
        agreement = self.collectives.agree(step, signals, local.as_dict(), moments.as_payload())
        agree_seconds = time.perf_counter() - agreed_at
        totals = agreement.totals
        if agreement.reset_optimizer:
            self.optimizer.state.clear()  # every rank at this step: the moments stay identical

        def report(applied: bool, reason: str | None, **values: float) -> ParallelStepReport:
            return ParallelStepReport(
                agreement=agreement,
                applied=applied,
                skipped_reason=reason,
                loss=values.get("loss", math.nan),
                forecast_loss=values.get("forecast_loss", math.nan),
                naive_loss=values.get("naive_loss", math.nan),
                grad_norm=values.get("grad_norm", math.nan),
                real_tokens=totals["real_tokens"],
                padded_tokens=totals["padded_tokens"],
                sequences=totals["sequences"],
                local_real_tokens=local.real_tokens,
                seconds=time.perf_counter() - started,
                agree_seconds=agree_seconds,
                allreduce_seconds=values.get("allreduce_seconds", 0.0),
            )

        if agreement.stop:
            return report(False, "stop")
        if not agreement.has_data:
            return report(False, "no_data")

        norm_before = self.norm.state_dict()  # a refused step must not move the normalization
        if not self.norm.frozen:
            parts = [Moments.from_payload(row, channels) for row in agreement.per_rank]
            apply_moments(self.norm, merge_all(parts))

        self.optimizer.zero_grad(set_to_none=True)
        # non-finite flag, loss, forecast sum, naive sum: on the device, read back once after the all-reduce
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        if batch is not None:
            assert on_device is not None
            mask = on_device.mask
            dtype = next(self.model.parameters()).dtype  # float32 in the service, as Trainer.train_step
            # the loss, its gradient seed and the sums in the weights' dtype (the forward's output is in its input's)
            x_norm = self.norm.normalize(on_device.values).to(dtype) * mask[..., None]
            output = self.forward(self.model, x_norm, mask)
            loss = globally_normalized_loss(output, x_norm, mask, on_device.labels, local, totals, self.class_weight)
            if self.fault_injector is not None:
                loss = self.fault_injector(loss)
            # A non-finite loss's gradient is summed with the others and then thrown away with
            # the step (every rank skips it): no host read is needed to decide on backward.
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            with torch.no_grad():
                sums[0] = (~torch.isfinite(loss)).to(torch.float64)
                sums[1] = loss.detach().to(torch.float64)
                sums[2] = forecast_loss(output, x_norm, mask).detach().to(torch.float64) * local.forecast_targets
                sums[3] = naive_last_value_loss(x_norm, mask).detach().to(torch.float64) * local.forecast_targets

        reduced_at = time.perf_counter()
        reduced = self.collectives.allreduce_gradients(self.model.parameters(), sums, bucket_bytes=self.bucket_bytes)
        allreduce_seconds = time.perf_counter() - reduced_at
        assert reduced is not None
        flag, loss_value, forecast_sum, naive_sum = (float(v) for v in reduced.tolist())
        targets = max(totals["forecast_targets"], 1)
        values = {
            "loss": loss_value,
            "forecast_loss": forecast_sum / targets,
            "naive_loss": naive_sum / targets,
            "allreduce_seconds": allreduce_seconds,
        }

        skipped: str | None = None
        if flag > 0:
            skipped = "non_finite_loss"
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
            values["grad_norm"] = float(grad_norm)
            if not torch.isfinite(grad_norm):
                skipped = "non_finite_grad"
            else:
                self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if skipped is not None:
            self.norm.load_state_dict(norm_before)
        return report(skipped is None, skipped, **values)
