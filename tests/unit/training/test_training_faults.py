"""Non-finite training signals: a NaN/Inf loss or gradient skips the step and is counted.

The trainer's ``fault_injector`` sees the loss before the finiteness check, so a test can
turn it non-finite (NaN, +Inf, -Inf) or leave its value finite and poison only its
gradient (a backward hook on the loss). A skipped step must leave the model, the
optimizer, the LR schedule and every training counter exactly as they were, count the
skip under its reason, and the next clean step must train as usual.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from small_trainer import make_small_trainer

from streamtrain.data.collate import Batch, collate
from streamtrain.training.trainer import Trainer

torch.set_num_threads(1)

Injector = Callable[[torch.Tensor], torch.Tensor]


def _scale_loss(factor: float) -> Injector:
    return lambda loss: loss * factor


def _poison_gradient(value: float) -> Injector:
    """Keep the loss finite; make d(loss)/d(loss) non-finite, so every gradient is too."""

    def inject(loss: torch.Tensor) -> torch.Tensor:
        loss.register_hook(lambda grad: torch.full_like(grad, value))
        return loss

    return inject


FAULTS: dict[str, tuple[Injector, str]] = {
    "nan_loss": (_scale_loss(math.nan), "non_finite_loss"),
    "inf_loss": (_scale_loss(math.inf), "non_finite_loss"),
    "neg_inf_loss": (_scale_loss(-math.inf), "non_finite_loss"),
    "nan_grad": (_poison_gradient(math.nan), "non_finite_grad"),
    "inf_grad": (_poison_gradient(math.inf), "non_finite_grad"),
}
SKIP_REASONS = ("non_finite_loss", "non_finite_grad")


def make_trainer(events: int = 96, seed: int = 0) -> Trainer:
    return make_small_trainer(events, seed)


def a_batch(trainer: Trainer, size: int = 16) -> Batch:
    snapshot = trainer.window.snapshot()
    return collate(snapshot.values[:size], ts=snapshot.ts[:size])


def everything(trainer: Trainer) -> dict[str, Any]:
    """Deep copies of all state a step may touch: parameters, optimizer, schedule, counters."""
    optimizer = trainer.optimizer.state_dict()
    return {
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": {
            index: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            for index, state in optimizer["state"].items()
        },
        "lr": [group["lr"] for group in optimizer["param_groups"]],
        "schedule": trainer.scheduler.state_dict()["last_epoch"],
        "step": trainer.step,
        "tokens": trainer.tokens_trained,
        "loss_ema": trainer.loss_ema,
        "grads": [p.grad for p in trainer.model.parameters()],
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["params"].keys() == after["params"].keys()
    for name, tensor in before["params"].items():
        assert torch.equal(tensor, after["params"][name]), f"parameter {name} changed on a skipped step"
    assert before["optimizer"].keys() == after["optimizer"].keys()
    for index, state in before["optimizer"].items():
        for key, value in state.items():
            other = after["optimizer"][index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, f"optimizer {index}.{key}"
    for key in ("lr", "schedule", "step", "tokens", "loss_ema"):
        assert before[key] == after[key], key
    assert all(g is None for g in after["grads"]), "a skipped step must not leave gradients behind"


def counters(trainer: Trainer) -> dict[str, float]:
    registry = trainer.metrics.registry
    out = {reason: registry.get_sample_value("streamtrain_train_skipped_steps_total", {"reason": reason}) or 0.0
           for reason in SKIP_REASONS}  # fmt: skip
    out["steps"] = registry.get_sample_value("streamtrain_train_steps_total") or 0.0
    out["tokens"] = registry.get_sample_value("streamtrain_train_tokens_total") or 0.0
    return out


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_non_finite_step_is_skipped_counted_and_changes_nothing(fault: str) -> None:
    injector, reason = FAULTS[fault]
    trainer = make_trainer()
    batch = a_batch(trainer)
    assert trainer.train_step(batch).applied  # optimizer state exists: the comparison covers it
    before, counted = everything(trainer), counters(trainer)

    trainer.fault_injector = injector
    report = trainer.train_step(batch)

    assert not report.applied and report.skipped_reason == reason
    assert report.step == before["step"]
    assert_same(before, everything(trainer))
    after = counters(trainer)
    assert after[reason] == counted[reason] + 1
    assert {k: v for k, v in after.items() if k != reason} == {k: v for k, v in counted.items() if k != reason}

    trainer.fault_injector = None  # the next clean step trains as usual
    clean = trainer.train_step(batch)
    assert clean.applied and clean.step == before["step"] + 1
    changed = everything(trainer)["params"]
    assert any(not torch.equal(before["params"][k], changed[k]) for k in changed)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_skipped_step_publishes_the_same_model() -> None:
    trainer = make_trainer()
    batch = a_batch(trainer)
    trainer.train_step(batch)
    published = trainer.publish()
    trainer.fault_injector = FAULTS["nan_grad"][0]
    assert not trainer.train_step(batch).applied
    again = trainer.publish()
    assert again.step == published.step
    assert all(
        torch.equal(a, b) for a, b in zip(published.model.state_dict().values(), again.model.state_dict().values())
    )


def test_a_skipped_step_leaves_the_normalization_unchanged() -> None:
    trainer = make_trainer()
    batch = a_batch(trainer)
    trainer.train_step(batch)
    before = trainer.norm.state_dict()
    trainer.fault_injector = FAULTS["nan_loss"][0]
    assert not trainer.train_step(a_batch(trainer, size=40)).applied
    after = trainer.norm.state_dict()
    assert after["count"] == before["count"]
    assert torch.equal(after["mean"], before["mean"]) and torch.equal(after["m2"], before["m2"])


def test_the_training_loop_survives_intermittent_faults_and_counts_each() -> None:
    """On the trainer's own thread: every third loss is NaN, every fifth gradient is Inf."""
    trainer = make_trainer()
    calls = {"n": 0}

    def sometimes(loss: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            return loss * math.nan
        if calls["n"] % 5 == 0:
            return FAULTS["inf_grad"][0](loss)
        return loss

    trainer.fault_injector = sometimes
    trainer.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and calls["n"] < 30:
            time.sleep(0.05)
    finally:
        trainer.stop()
    assert calls["n"] >= 30 and trainer.running is False and trainer.last_error is None
    seen = calls["n"]
    expected_nan = seen // 3
    expected_inf = sum(1 for i in range(1, seen + 1) if i % 5 == 0 and i % 3 != 0)
    counted = counters(trainer)
    assert counted["non_finite_loss"] == expected_nan
    assert counted["non_finite_grad"] == expected_inf
    assert counted["steps"] == trainer.step == seen - expected_nan - expected_inf
    assert trainer.published is not None and trainer.published.step <= trainer.step
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_stop_is_prompt_while_waiting_for_the_window_to_fill() -> None:
    import time

    trainer = make_trainer()
    trainer.dataset.min_items = 10**9  # the window never holds enough: the trainer waits
    trainer.start()
    time.sleep(0.5)
    started = time.monotonic()
    trainer.stop(timeout=10)
    assert not trainer.running
    assert time.monotonic() - started < 3.0
