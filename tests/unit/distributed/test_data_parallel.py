"""The data-parallel step in one process: Chan's merge of the normalization moments, the
loss counts, and a one-rank step that is the plain single-process PyTorch step bit for bit
(``Trainer.train_step`` is that one-rank step; :func:`reference_step` is written out here,
independently of it).

Several ranks as real processes: test_distributed_processes.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.config import load_settings
from streamtrain.data import collate
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.data_parallel import (
    DataParallelStep,
    LossCounts,
    Moments,
    apply_moments,
    batch_moments,
    merge_all,
)
from streamtrain.distributed.launch import DistContext
from streamtrain.distributed.wire import StepSignals
from streamtrain.metrics import Metrics
from streamtrain.model.normalization import RunningNorm
from streamtrain.training.trainer import Trainer
from streamtrain.window.reservoir import RecencyWindow


def _moments_of(values: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    real = values.astype(np.float64)
    mean = real.mean(axis=0)
    return real.shape[0], mean, ((real - mean) ** 2).sum(axis=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(0, 2**31 - 1), st.floats(-1e4, 1e4))
def test_chan_merge_equals_the_union(sizes: list[int], seed: int, center: float) -> None:
    rng = np.random.default_rng(seed)
    parts = [rng.normal(center, 3.0, (n, 2)) for n in sizes]
    merged = merge_all(
        [
            Moments(n, torch.from_numpy(m), torch.from_numpy(m2)) if n else Moments.empty(2)
            for n, m, m2 in (_moments_of(p) if len(p) else (0, None, None) for p in parts)
        ]
    )
    union = np.concatenate(parts)
    assert merged.count == union.shape[0]
    if union.shape[0]:
        count, mean, m2 = _moments_of(union)
        np.testing.assert_allclose(merged.mean.numpy(), mean, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(merged.m2.numpy(), m2, rtol=1e-9, atol=1e-7)


def test_batch_moments_then_apply_is_running_norm_update() -> None:
    rng = np.random.default_rng(1)
    reference, ours = RunningNorm(2, warmup_count=50), RunningNorm(2, warmup_count=50)
    for step in range(6):
        items = [rng.normal(3.0, 2.0, (int(rng.integers(1, 30)), 2)).astype(np.float32) for _ in range(8)]
        if step == 4:
            items[0][0] = 1e30  # an outlier after warm-up: clamped by the running band
        batch = collate(items)
        reference.update(batch.values, batch.mask)
        before = ours.state_dict()
        moments = batch_moments(ours, batch.values, batch.mask)
        assert ours.state_dict()["count"] == before["count"] and ours.clipped == before["clipped"]
        apply_moments(ours, moments)
    for key, value in reference.state_dict().items():
        other = ours.state_dict()[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
    assert ours.clipped >= 1


def test_moments_payload_round_trip() -> None:
    moments = Moments(
        5, torch.tensor([1.5, -2.0], dtype=torch.float64), torch.tensor([3.0, 4.0], dtype=torch.float64), 2
    )
    back = Moments.from_payload(moments.as_payload(), 2)
    assert back.count == 5 and back.clipped == 2
    assert torch.equal(back.mean, moments.mean) and torch.equal(back.m2, moments.m2)
    with pytest.raises(ValueError, match="6 numbers"):
        Moments.from_payload(np.zeros(5), 2)


def test_loss_counts() -> None:
    batch = collate([np.ones((3, 1), np.float32), np.ones((1, 1), np.float32)], labels=[2, -1])
    assert LossCounts.of(batch) == LossCounts(
        real_tokens=4, forecast_targets=2, labelled=1, sequences=2, padded_tokens=6
    )
    assert LossCounts.of(None) == LossCounts(0, 0, 0, 0, 0)


def _trainer(**overrides: object) -> Trainer:
    return Trainer(load_settings(window_capacity=1000, seed=3, **overrides), RecencyWindow(1000, math.inf), Metrics())


def reference_step(
    trainer: Trainer, batch: collate.Batch, fault: object = None, row_multiple: int = 1
) -> tuple[bool, str | None, float]:
    """One plain single-process step, written out: normalize with the batch merged in, forward
    (under the configured autocast, its token rows padded to ``row_multiple``), total loss, refuse a
    non-finite loss or gradient (leaving the norm as it was), clip, AdamW and scheduler step.
    (applied, reason, loss)."""
    from streamtrain.device import autocast
    from streamtrain.model.losses import total_loss
    from streamtrain.model.network import ModelOutput

    model, norm, optimizer = trainer.model, trainer.norm, trainer.optimizer
    norm_before = norm.state_dict()
    norm.update(batch.values, batch.mask)
    x = norm.normalize(batch.values).float() * batch.mask[..., None]
    with autocast(trainer.device, trainer.settings.amp):
        output = model(x, batch.mask, row_multiple=row_multiple)
    logits = None if output.logits is None else output.logits.float()
    output = ModelOutput(forecast=output.forecast.float(), logits=logits)
    loss = total_loss(output, x, batch.mask, batch.labels)
    if callable(fault):
        loss = fault(loss)
    reason = None
    if not torch.isfinite(loss):
        reason = "non_finite_loss"
    else:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.settings.grad_clip_norm)
        if not torch.isfinite(grad_norm):
            reason = "non_finite_grad"
        else:
            optimizer.step()
            trainer.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if reason is not None:
        norm.load_state_dict(norm_before)
    return reason is None, reason, float(loss.detach())


def test_one_rank_step_is_the_plain_step_bit_for_bit() -> None:
    torch.set_num_threads(1)
    reference, ours = _trainer(n_classes=3), _trainer(n_classes=3)
    dp = DataParallelStep(
        Collectives(DistContext()),
        ours.model,
        ours.norm,
        ours.optimizer,
        grad_clip_norm=ours.settings.grad_clip_norm,
        scheduler=ours.scheduler,
    )
    rng = np.random.default_rng(0)
    for step in range(5):
        items = [rng.normal(2, 3, (int(rng.integers(1, 60)), 1)).astype(np.float32) for _ in range(12)]
        batch = collate(items, labels=rng.integers(-1, 3, len(items)))
        nan = step == 2
        dp.fault_injector = injector = (lambda loss: loss * math.nan) if nan else None
        applied, reason, loss = reference_step(reference, batch, injector)
        report = dp.step(batch, step=step)
        assert report.applied == applied
        assert report.skipped_reason == reason
        if applied:
            assert report.loss == pytest.approx(loss, rel=1e-6)
    for (name, a), b in zip(reference.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(reference.norm.mean, ours.norm.mean) and reference.norm.count == ours.norm.count


def test_trainer_train_step_is_the_one_rank_step() -> None:
    """The trainer's own step: the same weights and report as the plain step, and its counters."""
    torch.set_num_threads(1)
    reference, trainer = _trainer(), _trainer()
    rng = np.random.default_rng(2)
    tokens = 0
    for _ in range(3):
        batch = collate([rng.normal(0, 1, (int(rng.integers(2, 40)), 1)).astype(np.float32) for _ in range(8)])
        # the trainer pads its token rows as the service does: on some CPUs a matmul's result depends
        # on its row count in the last bits, so the reference pads them alike
        applied, _, loss = reference_step(reference, batch, row_multiple=trainer.forward.row_multiple)
        report = trainer.train_step(batch)
        assert report.applied == applied and report.loss == pytest.approx(loss, rel=1e-6)
        tokens += int(batch.lengths.sum())
    assert trainer.step == 3 and trainer.tokens_trained == tokens
    for a, b in zip(reference.model.parameters(), trainer.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("staged", [False, True], ids=["host-batch", "staged-batch"])
def test_one_rank_step_under_bf16_autocast_is_the_plain_step_bit_for_bit(staged: bool) -> None:
    """AMP=bf16 (CPU autocast runs bf16): the step's forward runs under the same autocast as
    the plain step's, with the batch as the lockstep loop stages it or as a host batch."""
    from streamtrain.data.prefetch import stage_batch

    torch.set_num_threads(1)
    reference, ours = _trainer(amp="bf16"), _trainer(amp="bf16")
    dp = DataParallelStep(
        Collectives(DistContext()), ours.model, ours.norm, ours.optimizer,
        grad_clip_norm=ours.settings.grad_clip_norm, scheduler=ours.scheduler, amp="bf16",
    )  # fmt: skip
    rng = np.random.default_rng(4)
    for step in range(4):
        batch = collate([rng.normal(1, 2, (int(rng.integers(2, 50)), 1)).astype(np.float32) for _ in range(10)])
        _, _, loss = reference_step(reference, batch)
        report = dp.step(stage_batch(batch, torch.device("cpu")).ready() if staged else batch, step=step)
        assert report.applied and report.loss == pytest.approx(loss, rel=1e-6)
    for (name, a), b in zip(reference.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(a, b), name
        assert b.dtype == torch.float32  # master weights stay float32
    plain = _trainer()
    DataParallelStep(Collectives(DistContext()), plain.model, plain.norm, plain.optimizer, grad_clip_norm=1.0).step(
        batch, step=0
    )
    assert not torch.equal(next(plain.model.parameters()), next(_trainer().model.parameters()))


def test_an_agreed_optimizer_reset_clears_adamw_at_that_step() -> None:
    trainer = _trainer()
    dp = DataParallelStep(
        Collectives(DistContext()), trainer.model, trainer.norm, trainer.optimizer, grad_clip_norm=1.0
    )
    batch = collate([np.arange(12, dtype=np.float32)[:, None]])
    dp.step(batch, step=0)
    assert trainer.optimizer.state
    report = dp.step(None, step=1, signals=StepSignals(reset_optimizer=True))
    assert report.agreement.reset_optimizer and report.skipped_reason == "no_data" and not trainer.optimizer.state
    dp.step(batch, step=2)
    assert trainer.optimizer.state and not dp.step(batch, step=3).agreement.reset_optimizer


def test_no_data_anywhere_is_an_idle_step() -> None:
    trainer = _trainer()
    dp = DataParallelStep(
        Collectives(DistContext()), trainer.model, trainer.norm, trainer.optimizer, grad_clip_norm=1.0
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    report = dp.step(None, step=0, signals=StepSignals(publish_due=True))
    assert (report.applied, report.skipped_reason, report.agreement.publish) == (False, "no_data", True)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert dp.step(None, step=1, signals=StepSignals(stop=True)).skipped_reason == "stop"
