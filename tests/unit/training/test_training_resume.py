"""Resuming the trainer from a checkpoint: the same next batches, the configured seed, no stalled passes.

A checkpoint is taken while the prefetch thread has planned passes ahead of the trainer
(the service's situation); the restored trainer must continue with exactly the batches
the uninterrupted one trains next (seeded mode, window unchanged), and its model must
end up bit-identical after the same steps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.config import Settings, load_settings
from streamtrain.data.collate import Batch
from streamtrain.data.prefetch import Prefetcher
from streamtrain.data.randomness import derive_seed
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.metrics import Metrics
from streamtrain.training.trainer import Trainer
from streamtrain.window.reservoir import RecencyWindow

torch.set_num_threads(1)


def settings_for(tmp_path: Path, **overrides: Any) -> Settings:
    base: dict[str, Any] = dict(
        d_model=16, n_heads=2, n_layers=1, max_len=48, token_budget=256, min_window_items=8, warmup_steps=1,
        learning_rate=0.01, publish_interval_s=1000.0, seed=3, pass_max_items=40, pass_fresh_share=0.5,
        window_capacity=1000, half_life_s=math.inf, checkpoint_dir=str(tmp_path / "ckpt"), sampling="sensor_balanced",
    )  # fmt: skip
    return load_settings(**{**base, **overrides})


def filled_window(events: int, seed: int = 0) -> RecencyWindow:
    window = RecencyWindow(1000, math.inf, channels=1, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    now = time.time()
    window.insert_batch(
        EventBatch.from_events(
            [
                SensorEvent(
                    f"s{i % 5 if i % 3 else 0}",
                    now - events + i,
                    np.cumsum(rng.standard_normal((int(n), 1)), axis=0).astype(np.float32),
                )
                for i, n in enumerate(rng.integers(4, 40, events))
            ]
        )
    )
    return window


def restored_window(state: dict[str, Any]) -> RecencyWindow:
    window = RecencyWindow(1000, math.inf, channels=1, rng=np.random.default_rng(99))
    window.load_state_dict(state)
    return window


def train(trainer: Trainer, batches: Prefetcher[Batch], steps: int) -> list[Batch]:
    trained = []
    for _ in range(steps):
        batch = next(batches)
        assert trainer.train_step(batch).applied
        trained.append(batch)
    return trained


def same_batches(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.ts, y.ts) and torch.equal(x.values, y.values) and torch.equal(x.mask, y.mask)
        for x, y in zip(a, b)
    )


def checkpoint(tmp_path: Path, window: RecencyWindow, trainer: Trainer) -> dict[str, Any]:
    """Through the real store: what survives serialization is what a restart sees."""
    store = CheckpointStore(tmp_path / "ckpt")
    with trainer.lock:
        state = {"window": window.state_dict(), "trainer": trainer.state_dict()}
    store.save(state, step=trainer.step)
    loaded = store.load_latest()
    assert loaded is not None
    return loaded.state


@pytest.mark.parametrize("steps_before", [1, 4, 5, 9, 10])
def test_a_restored_trainer_trains_the_same_next_batches_as_an_uninterrupted_one(
    tmp_path: Path, steps_before: int
) -> None:
    settings = settings_for(tmp_path)
    window = filled_window(300)
    original = Trainer(settings, window, Metrics())
    batches = Prefetcher(original.dataset, depth=3)  # plans ahead of the trainer, as in the service
    try:
        trained = train(original, batches, steps_before)
        assert wait_for(lambda: batches.buffered == 3), "the prefetcher should have run ahead of the trainer"
        state = checkpoint(tmp_path, window, original)
        last = trained[-1].position
        assert last is not None and original.dataset.planned_steps > original.step  # passes were drawn ahead
        expected_skip = 0 if last.index + 1 == last.batches else last.index + 1
        assert state["trainer"]["dataset"]["skip_batches"] == expected_skip
        assert set(state["trainer"]["rng"]) == {"torch"}, "the checkpoint claims only generators it restores"
        continued = train(original, batches, 8)
    finally:
        batches.close()

    window_b = restored_window(state["window"])
    resumed = Trainer(settings, window_b, Metrics())
    resumed.load_state_dict(state["trainer"])
    assert torch.equal(torch.get_rng_state(), state["trainer"]["rng"]["torch"])
    batches_b = Prefetcher(resumed.dataset, depth=3)
    try:
        after_restore = train(resumed, batches_b, 8)
    finally:
        batches_b.close()
    assert same_batches(after_restore, continued)
    for a, b in zip(original.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert resumed.step == original.step


def test_a_changed_seed_wins_on_restore_and_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    window = filled_window(300)
    original = Trainer(settings_for(tmp_path), window, Metrics())
    batches = Prefetcher(original.dataset, depth=2)
    try:
        train(original, batches, 3)
        state = checkpoint(tmp_path, window, original)
        continued = train(original, batches, 6)
    finally:
        batches.close()

    reseeded = Trainer(settings_for(tmp_path, seed=4), restored_window(state["window"]), Metrics())
    with caplog.at_level(logging.WARNING, logger="streamtrain.data.dataset"):
        reseeded.load_state_dict(state["trainer"])
    assert "SEED=3" in caplog.text and "SEED=4" in caplog.text
    assert reseeded.dataset.seed == 4 and reseeded.sampler.seed == 4
    assert reseeded.step == 3 and reseeded.dataset.next_pass == state["trainer"]["dataset"]["next_pass"]
    assert torch.initial_seed() == derive_seed(4, 3, purpose="torch")
    batches_b = Prefetcher(reseeded.dataset, depth=2)
    try:
        after_restore = train(reseeded, batches_b, 6)
    finally:
        batches_b.close()
    assert not same_batches(after_restore, continued)


def test_a_checkpoint_of_the_earlier_format_still_loads(tmp_path: Path) -> None:
    window = filled_window(100)
    trainer = Trainer(settings_for(tmp_path), window, Metrics())
    state = trainer.state_dict()
    old = {
        **state,
        "dataset": {"next_pass": 4, "seed": 3},
        "sampler": {"passes": 4, "watermark": 60},
        "rng": {**state["rng"], "numpy": np.zeros(624, np.uint32), "python": [0] * 625},
    }
    restored = Trainer(settings_for(tmp_path), filled_window(100), Metrics())
    restored.load_state_dict(old)
    assert (restored.dataset.next_pass, restored.sampler.passes, restored.sampler.watermark) == (4, 4, 60)


def wait_for(condition, timeout: float = 60.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_passes_smaller_than_the_minimum_window_train_and_never_mark_untrained_events(tmp_path: Path) -> None:
    """0 < PASS_MAX_ITEMS < MIN_WINDOW_ITEMS used to stall: the pass never reached the minimum."""
    settings = settings_for(tmp_path, pass_max_items=8, min_window_items=64, sampling="uniform", train_nice=0)
    small = Trainer(settings, filled_window(50), Metrics())
    looks = threading.Semaphore(0)
    snapshot = small.dataset.snapshot_fn

    def counted_snapshot():  # type: ignore[no-untyped-def]
        looks.release()
        return snapshot()

    small.dataset.snapshot_fn = counted_snapshot
    small.start()
    try:
        for _ in range(3):
            assert looks.acquire(timeout=60), "the trainer never looked at the window"
        assert small.step == 0 and small.sampler.watermark == 0 and small.sampler.passes == 0
    finally:
        small.stop()

    trainer = Trainer(settings, filled_window(100), Metrics())
    trainer.start()
    try:
        # a pass ended (how many steps that takes depends on which items it drew)
        assert wait_for(lambda: trainer.last_pass is not None), f"training stalled: {trainer.last_error}"
    finally:
        trainer.stop()
    assert trainer.step >= 1 and trainer.sampler.watermark == 100
    assert trainer.last_pass is not None and trainer.last_pass.items == 8
