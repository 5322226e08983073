"""The scaled-out service's own parts, in one process: the lockstep loop, the state split,
the service's wiring for a rank, and the launch errors of ``streamtrain serve``.

Several ranks as real processes: tests/unit/test_distributed.py (the step and the
collectives) and tests/integration/test_scale_out.py (the whole service).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamtrain import scale_out
from streamtrain.config import load_settings
from streamtrain.distributed import EXIT_COLLECTIVE_FAILURE, CollectiveFailure, Collectives, DistContext, capacity_share
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.metrics import Metrics
from streamtrain.scale_out import EXIT_LOOP_FAILURE, LockstepLoop, join_trainer_state, split_trainer_state
from streamtrain.train import Trainer
from streamtrain.window import RecencyWindow

REPO = Path(__file__).resolve().parents[2]


def make_trainer(events: int = 96, seed: int = 0) -> Trainer:
    settings = load_settings(
        d_model=16, n_heads=2, n_layers=1, max_len=32, token_budget=512, min_window_items=8,
        warmup_steps=1, learning_rate=0.01, publish_interval_s=0.05, seed=seed, checkpoint_dir="unused",
    )  # fmt: skip
    window = RecencyWindow(1000, math.inf, channels=1, rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    now = time.time()
    window.insert_batch(
        EventBatch.from_events(
            [
                SensorEvent(f"s{i % 4}", now - i, np.cumsum(rng.standard_normal((int(n), 1)), axis=0).astype(np.float32))
                for i, n in enumerate(rng.integers(4, 32, events))
            ]
        )
    )
    return Trainer(settings, window, Metrics())


class Cuts:
    """A stand-in for the service's collective checkpoint: records what the loop asked for."""

    def __init__(self, trainer: Trainer, fail: BaseException | None = None) -> None:
        self.trainer = trainer
        self.fail = fail
        self.calls: list[tuple[bool, int]] = []

    def __call__(self, final: bool) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append((final, self.trainer.step))


def run_loop(loop: LockstepLoop) -> threading.Thread:
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_loop_trains_publishes_checkpoints_and_stops_when_agreed() -> None:
    trainer = make_trainer()
    cuts = Cuts(trainer)
    stopped = threading.Event()
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=cuts, on_stopped=stopped.set)
    thread = run_loop(loop)
    wait(lambda: trainer.step >= 5 and trainer.published is not None, 60, "training and a first version")
    loop.checkpoint_due.set()
    wait(lambda: cuts.calls, 30, "a checkpoint")
    assert cuts.calls[0][0] is False and not loop.checkpoint_due.is_set()
    loop.stop_requested.set()
    thread.join(30)
    assert not thread.is_alive() and loop.finished.is_set() and stopped.is_set()
    assert cuts.calls[-1] == (True, trainer.step), "the agreed stop cuts one final checkpoint, after the last step"
    # the trainer's counters are the global ones; with one rank the process's metrics equal them
    metrics = trainer.metrics
    assert metrics.train_steps._value.get() == trainer.step
    assert metrics.train_tokens._value.get() == trainer.tokens_trained > 0
    assert trainer.loss_ema is not None and math.isfinite(trainer.loss_ema)
    assert trainer.published is not None and trainer.published.step <= trainer.step
    assert loop.tick >= trainer.step


def test_the_loop_does_not_wait_for_a_window_that_is_still_filling() -> None:
    """A rank with no data goes on ticking (it would hold every other rank back otherwise)."""
    trainer = make_trainer(events=3)  # below MIN_WINDOW_ITEMS
    cuts = Cuts(trainer)
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=cuts)
    thread = run_loop(loop)
    wait(lambda: loop.tick >= 3, 30, "idle ticks")
    loop.checkpoint_due.set()
    wait(lambda: cuts.calls, 30, "a checkpoint while idle")
    started = time.monotonic()
    loop.stop_requested.set()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 5
    assert trainer.step == 0 and trainer.published is None and cuts.calls[-1] == (True, 0)
    assert loop.last_report is not None and loop.last_report.skipped_reason == "stop"


@pytest.mark.parametrize(
    ("error", "code"),
    [(CollectiveFailure("rank 1 of 2: all_gather failed, a peer died"), EXIT_COLLECTIVE_FAILURE), (OSError("disk"), EXIT_LOOP_FAILURE)],
)
def test_an_error_in_the_loop_ends_the_process(monkeypatch: pytest.MonkeyPatch, error: BaseException, code: int) -> None:
    """A rank never resumes alone: the process leaves, non-zero, and the group restarts."""
    exits: list[tuple[str, int]] = []
    monkeypatch.setattr(scale_out, "exit_after_collective_failure", lambda err, code: exits.append((str(err), code)))
    trainer = make_trainer()
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=Cuts(trainer, fail=error))
    loop.checkpoint_due.set()
    loop()  # returns only because the exit is patched out
    assert exits == [(str(error), code)]


def test_trainer_state_splits_into_shared_and_rank_local() -> None:
    trainer = make_trainer()
    state = trainer.state_dict()
    shared, local = split_trainer_state(state)
    assert set(local) == {"dataset", "rng"} and not set(local) & set(shared)
    assert set(shared) | set(local) == set(state)
    again = make_trainer(seed=1)
    assert join_trainer_state(again, shared, local) == {**shared, **local}
    fresh = join_trainer_state(again, {**shared, "dataset": {"next_pass": 9, "seed": 0}}, None)
    assert fresh["dataset"] == again.dataset.state_dict() and fresh["dataset"]["next_pass"] == 0
    again.load_state_dict(fresh)  # a rank without its own state: the shared part, a fresh data stream
    assert again.step == trainer.step
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, again.model.state_dict()[name])


def test_a_rank_of_a_scaled_out_service_is_wired_for_its_share(tmp_path: Path) -> None:
    from streamtrain.service import Service

    settings = load_settings(
        checkpoint_dir=tmp_path, d_model=16, n_heads=2, n_layers=1, max_len=32, window_capacity=1001, min_window_items=10
    )
    ctx = DistContext(rank=1, world_size=3, master_addr="127.0.0.1", master_port=1)
    service = Service(settings, ctx)  # nothing started: no group, no consumer
    assert service.scaled_out and service.loop is not None and service.trainer.loop is service.loop
    assert service.window.capacity == capacity_share(1001, 1, 3) == 334
    assert service.trainer.dataset.min_items == capacity_share(10, 1, 3) == 3
    assert service.trainer.dataset.coordinates == (0, 1)  # passes over its own window, never a share of a plan
    assert service.ingest.owned_partitions is not None and service.ingest.owned_partitions(7) == [1, 4]
    other = Service(settings, DistContext(rank=2, world_size=3, master_addr="127.0.0.1", master_port=1))
    assert other.trainer.dataset.seed != service.trainer.dataset.seed, "each rank draws its own passes"
    assert b'streamtrain_rank_info{rank="1",world_size="3"} 1.0' in service.metrics.exposition()
    one = Service(settings)
    assert not one.scaled_out and one.loop is None and one.window.capacity == 1001 and one.ingest.owned_partitions is None
    assert one.trainer.dataset.seed == settings.seed
    assert b'streamtrain_rank_info{rank="0",world_size="1"} 1.0' in one.metrics.exposition()


def serve(extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_") and k not in ("WORLD_SIZE", "RANK")}
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "serve"], env=env, capture_output=True, text=True, timeout=180, cwd=REPO
    )


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0"}, "needs MASTER_ADDR and MASTER_PORT"),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "STREAMTRAIN_DP": "on",
             "STREAMTRAIN_SHUFFLE": "crypto"},
            "DP=on with WORLD_SIZE=2",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
             "STREAMTRAIN_HTTP_PORT": "8123"},
            "2 ranks share this host",
        ),
    ],
    ids=["no-master", "dp", "one-port-two-ranks"],
)  # fmt: skip
def test_a_launch_that_cannot_work_stops_in_one_line(env: dict[str, str], says: str, tmp_path: Path) -> None:
    done = serve({**env, "STREAMTRAIN_CHECKPOINT_DIR": str(tmp_path)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("streamtrain: ") and says in lines[0], done.stderr
