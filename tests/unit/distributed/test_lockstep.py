"""The scaled-out service's own parts, in one process: the lockstep loop, the state split,
the service's wiring for a rank, and the launch errors of ``streamtrain serve``.

Several ranks as real processes: test_distributed_processes.py (the step and the
collectives) and tests/integration/test_scale_out.py (the whole service).
"""

from __future__ import annotations

import json
import logging
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
from small_trainer import make_small_trainer
from thread_ranks import ThreadHub, on_ranks

from streamtrain.config import load_settings
from streamtrain.distributed import lockstep as scale_out
from streamtrain.distributed.collectives import EXIT_COLLECTIVE_FAILURE, CollectiveFailure, Collectives
from streamtrain.distributed.launch import DistContext, capacity_share
from streamtrain.distributed.lockstep import EXIT_LOOP_FAILURE, LockstepLoop, join_trainer_state, split_trainer_state
from streamtrain.distributed.wire import AgreedRollback, AskedRollback, SettingsMismatch
from streamtrain.metrics import Metrics
from streamtrain.training.trainer import Trainer
from streamtrain.window.reservoir import RecencyWindow

REPO = Path(__file__).resolve().parents[3]


def make_trainer(events: int = 96, seed: int = 0, **overrides: Any) -> Trainer:
    return make_small_trainer(events, seed, **{"amp": "off", "max_batch_sequences": 1024, **overrides})


def make_wired_loop(**overrides: Any) -> tuple[Trainer, LockstepLoop]:
    """A trainer built with its lockstep loop (one rank), as the service builds a scaled-out rank's."""
    trainer = make_small_trainer(
        96, 0, loop=lambda t: LockstepLoop(t, Collectives(DistContext()), checkpoint=Cuts(t)),
        **{"amp": "off", "max_batch_sequences": 1024, **overrides},
    )  # fmt: skip
    assert isinstance(trainer.loop, LockstepLoop)
    return trainer, trainer.loop


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


@pytest.mark.parametrize("ahead", [False, True], ids=["as-ready", "staged-ahead"])
def test_the_loop_trains_publishes_checkpoints_and_stops_when_agreed(
    ahead: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``ahead``: the GPU path's one-tick-ahead staging, run on the CPU (the same code path)."""
    caplog.set_level(logging.INFO, logger=scale_out.__name__)
    trainer = make_trainer()
    cuts = Cuts(trainer)
    stopped = threading.Event()
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=cuts, on_stopped=stopped.set, stage_ahead=ahead)
    thread = run_loop(loop)
    wait(lambda: trainer.step >= 5 and trainer.published is not None, 60, "training and a first version")
    if ahead:  # a batch is staged early only when the planner has the next one ready at that moment
        wait(lambda: loop.stager is not None and loop.stager.staged_ahead > 0, 60, "a batch staged ahead")
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
    assert loop.stager is not None and (loop.stager.staged_ahead > 0) == ahead
    assert trainer.scheduler.last_epoch == trainer.step  # the learning-rate schedule follows every agreed step
    assert trainer.data_wait_seconds == metrics.train_data_wait_seconds._value.get()
    stops = [r.getMessage() for r in caplog.records if "agreed to stop" in r.getMessage()]
    assert stops == [f"rank 0: the ranks agreed to stop at tick {loop.tick} (step {trainer.step})"]


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
    [
        (CollectiveFailure("rank 1 of 2: all_gather failed, a peer died"), EXIT_COLLECTIVE_FAILURE),
        (OSError("disk"), EXIT_LOOP_FAILURE),
    ],
)
def test_an_error_in_the_loop_ends_the_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: BaseException, code: int
) -> None:
    """A rank never resumes alone: the process leaves, non-zero, and the group restarts."""
    caplog.set_level(logging.INFO, logger=scale_out.__name__)
    exits: list[tuple[str, int]] = []
    monkeypatch.setattr(scale_out, "exit_after_collective_failure", lambda err, code: exits.append((str(err), code)))
    trainer = make_trainer()
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=Cuts(trainer, fail=error))
    loop.checkpoint_due.set()
    loop()  # returns only because the exit is patched out
    assert exits == [(str(error), code)]
    # the rank's own error is logged with its traceback; a failed collective says so itself
    failed = [(r.getMessage(), r.exc_info is not None) for r in caplog.records if r.levelno >= logging.ERROR]
    assert failed == ([] if code == EXIT_COLLECTIVE_FAILURE else [("rank 0: the lockstep loop failed", True)])


def test_trainer_state_splits_into_shared_and_rank_local() -> None:
    trainer = make_trainer()
    state = trainer.state_dict()
    shared, local = split_trainer_state(state)
    assert set(local) == {"dataset", "rng", "quality"} and not set(local) & set(shared)
    assert set(shared) | set(local) == set(state)
    again = make_trainer(seed=1)
    assert join_trainer_state(again, shared, local) == {**shared, **local}
    fresh = join_trainer_state(again, {**shared, "dataset": {"next_pass": 9, "seed": 0}, "quality": {}}, None)
    assert fresh["dataset"] == again.dataset.state_dict() and fresh["dataset"]["next_pass"] == 0
    assert "quality" not in fresh, "another ownership: each rank's quality monitor starts afresh"
    # a shard written before the quality monitor was rank-local: its stream, a fresh monitor
    older = join_trainer_state(again, shared, {"dataset": local["dataset"], "rng": local["rng"]})
    assert older["dataset"] == local["dataset"] and "quality" not in older
    again.load_state_dict(fresh)  # a rank without its own state: the shared part, a fresh data stream
    assert again.step == trainer.step
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, again.model.state_dict()[name])


def test_a_rank_of_a_scaled_out_service_is_wired_for_its_share(tmp_path: Path) -> None:
    from streamtrain.runtime.service import Service

    settings = load_settings(
        checkpoint_dir=tmp_path,
        d_model=16,
        n_heads=2,
        n_layers=1,
        max_len=32,
        window_capacity=1001,
        min_window_items=10,
    )
    ctx = DistContext(rank=1, world_size=3, master_addr="127.0.0.1", master_port=1)
    service = Service(settings, ctx)  # nothing started: no group, no consumer
    assert service.scaled_out and service.loop is not None and service.trainer.loop is service.loop
    assert service.window.capacity == capacity_share(1001, 1, 3) == 334
    assert service.trainer.dataset.min_items == capacity_share(10, 1, 3) == 3
    assert service.trainer.dataset.coordinates == (0, 1)  # passes over its own window, never a share of a plan
    assert service.ingest.owned_partitions is not None and service.ingest.owned_partitions(7) == [1, 4]
    # rollbacks and the gate go through the ranks' agreement; gloo on the CPU
    assert service.trainer.quality is not None and service.trainer.quality.combine == service.loop.sum_rows
    assert service.collectives.backend == "gloo" and service.settings.device == "cpu"
    other = Service(settings, DistContext(rank=2, world_size=3, master_addr="127.0.0.1", master_port=1))
    assert other.trainer.dataset.seed != service.trainer.dataset.seed, "each rank draws its own passes"
    assert b'streamtrain_rank_info{rank="1",world_size="3"} 1.0' in service.metrics.exposition()
    one = Service(settings)
    assert (
        not one.scaled_out and one.loop is None and one.window.capacity == 1001 and one.ingest.owned_partitions is None
    )
    assert one.trainer.dataset.seed == settings.seed
    assert one.trainer.quality is not None and one.trainer.quality.combine is None
    assert b'streamtrain_rank_info{rank="0",world_size="1"} 1.0' in one.metrics.exposition()


def serve(extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_") and k not in ("WORLD_SIZE", "RANK")}
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0"}, "needs MASTER_ADDR and MASTER_PORT"),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "STREAMTRAIN_DP": "on",
             "STREAMTRAIN_SHUFFLE": "crypto", "STREAMTRAIN_DP_ADMIT_PER_STEP": "1"},
            "DP_ADMIT_PER_STEP=1 with WORLD_SIZE=2",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29999", "STREAMTRAIN_HTTP_PORT": "8123"},
            "2 ranks share this host",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
             "STREAMTRAIN_DIST_BACKEND": "nccl", "STREAMTRAIN_DEVICE": "cpu"},
            "DIST_BACKEND=nccl needs training on CUDA (DEVICE=cuda)",
        ),
    ],
    ids=["no-master", "dp", "one-port-two-ranks", "nccl-on-cpu"],
)  # fmt: skip
def test_a_launch_that_cannot_work_stops_in_one_line(env: dict[str, str], says: str, tmp_path: Path) -> None:
    done = serve({**env, "STREAMTRAIN_CHECKPOINT_DIR": str(tmp_path)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("streamtrain: ") and says in lines[0], (
        done.stderr
    )


# ----------------------------------------------------------------------------------------
# batches on the training device (the CPU runs the same path)


def test_the_stager_hands_out_every_batch_once_in_order_staged_one_ahead() -> None:
    from streamtrain.data import collate
    from streamtrain.data.prefetch import Prefetcher, StagedBatch

    rng = np.random.default_rng(5)
    batches = [
        collate([rng.normal(size=(int(rng.integers(2, 9)), 1)).astype(np.float32) for _ in range(3)]) for _ in range(12)
    ]
    stager = scale_out.DeviceStager(Prefetcher(iter(batches), depth=4), torch.device("cpu"), ahead=True)
    got: list[Any] = []
    deadline = time.monotonic() + 30
    with pytest.raises(StopIteration):  # the source's end, after its last batch
        while time.monotonic() < deadline:
            batch = stager.poll(0.05)
            if batch is not None:
                got.append(batch)
    stager.close()
    assert len(got) == len(batches) and all(isinstance(b, StagedBatch) and b.on_device is not None for b in got)
    for staged, original in zip(got, batches, strict=True):
        assert torch.equal(staged.values, original.values) and torch.equal(staged.on_device.values, original.values)
    assert stager.staged_ahead > 0


class ListSource:
    """A prefetcher stand-in whose batches are always ready; it records each poll's timeout and, after
    its batches, raises ``end`` once (then has nothing), as a prefetcher's end or error comes out once."""

    def __init__(self, batches: list[Any], end: BaseException) -> None:
        self.batches, self.end, self.timeouts, self.closed = list(batches), end, [], False

    def poll(self, timeout_s: float) -> Any:
        self.timeouts.append(timeout_s)
        if self.batches:
            return self.batches.pop(0)
        end, self.end = self.end, None
        if end is not None:
            raise end
        return None

    def close(self, timeout: float = 0.5) -> None:
        self.closed = True


@pytest.mark.parametrize("end", [StopIteration(), RuntimeError("the planner failed")], ids=["end", "error"])
def test_the_stager_looks_ahead_without_waiting_and_keeps_the_sources_end_for_after_the_batch_in_hand(
    end: BaseException,
) -> None:
    from streamtrain.data import collate

    batches = [collate([np.full((n, 1), n, dtype=np.float32)]) for n in (2, 3, 4)]
    source = ListSource(batches, end)
    stager = scale_out.DeviceStager(source, torch.device("cpu"), ahead=True)  # type: ignore[arg-type]
    got = [stager.poll(0.05) for _ in batches]
    assert [int(b.lengths[0]) for b in got] == [2, 3, 4]  # type: ignore[union-attr]
    assert stager.staged_ahead == 2 and source.timeouts == [0.05, 0.0, 0.0, 0.0]  # a look-ahead never waits
    with pytest.raises(type(end)):  # after the last batch in hand, not instead of it
        stager.poll(0.05)
    assert stager.poll(0.05) is None  # the end comes out once, as from the source itself
    stager.close()
    assert source.closed


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device on this machine (torch.cuda.is_available() is False); runs on a GPU: scripts/gpu-check.sh",
)
def test_on_a_gpu_the_loop_stages_pinned_batches_ahead_and_trains_as_the_cpu() -> None:
    from streamtrain.data import collate
    from streamtrain.distributed.data_parallel import DataParallelStep

    trainer = make_trainer(device="cuda")
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=Cuts(trainer))
    thread = run_loop(loop)
    wait(lambda: trainer.step >= 10 and trainer.published is not None, 120, "training on the GPU")
    loop.stop_requested.set()
    thread.join(60)
    assert loop.stager is not None and loop.stager.ahead and loop.stager.staged_ahead > 0
    assert next(trainer.model.parameters()).device.type == "cuda" and trainer.loss_ema is not None
    # one step on the GPU equals the CPU's within float32 kernel differences, bf16 within its precision
    rng = np.random.default_rng(1)
    batch = collate([rng.normal(size=(20, 1)).astype(np.float32) for _ in range(8)])
    results = {}
    for device, amp in (("cpu", "off"), ("cuda:0", "off"), ("cuda:0", "bf16")):
        t = make_trainer(device=device, amp=amp)
        dp = DataParallelStep(Collectives(DistContext()), t.model, t.norm, t.optimizer, grad_clip_norm=1.0, amp=amp)  # type: ignore[arg-type]
        results[(device, amp)] = dp.step(batch, step=0).loss
    assert results[("cuda:0", "off")] == pytest.approx(results[("cpu", "off")], rel=1e-4)
    assert results[("cuda:0", "bf16")] == pytest.approx(results[("cpu", "off")], rel=5e-2)


# ----------------------------------------------------------------------------------------
# agreed rollbacks and the collective gate, in one process (two: test_distributed.py)


def test_the_loop_rolls_back_at_one_tick_and_publishes_nothing_then(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=scale_out.__name__)
    trainer, loop = make_wired_loop()
    assert trainer.quality.combine == loop.sum_rows
    published_at: list[int] = []  # the ticks that published
    publish = trainer.publish
    trainer.publish = lambda: (published_at.append(loop.tick - 1), publish())[1]  # type: ignore[method-assign]
    thread = run_loop(loop)
    try:
        wait(lambda: len(trainer.registry.versions()) >= 3, 60, "three versions")
        target = trainer.registry.versions()[0]
        outcome = loop.request_rollback(target, "admin", "asked by the test").wait(30)
        assert outcome is not None and outcome.applied and outcome.version == target and outcome.rank == 0
        assert outcome.from_version is not None and outcome.from_version > target
        assert loop.rollbacks == [outcome] and outcome.tick not in published_at
        assert outcome.why_not is None and outcome.unknown_version is False
        taken = [(r["to_version"], r["trigger"], r["reason"]) for r in trainer.quality.rollbacks]
        assert taken == [(target, "admin", f"asked by the test (agreed at tick {outcome.tick}, asked by rank 0)")]
        assert trainer.metrics.model_rollbacks.labels("admin")._value.get() == 1
        again = loop.request_rollback(trainer.registry.versions()[1]).wait(30)  # an admin's, as the route asks
        assert again is not None and again.applied
        assert (
            trainer.quality.rollbacks[-1]["reason"]
            == f"asked by an admin (agreed at tick {again.tick}, asked by rank 0)"
        )

        missing = loop.request_rollback(10_000).wait(30)
        assert missing is not None and not missing.applied and missing.unknown_version is True
        assert missing.trigger == "admin" and missing.from_version is not None
        # an automatic request lapses once the version it judged no longer serves
        stale = scale_out.RollbackTicket(AskedRollback(target, "automatic", 9_999), "judged long ago")
        with loop._rollback_lock:
            loop._rollback_queue.append(stale)
        lapsed = stale.wait(30)
        assert lapsed is not None and not lapsed.applied and lapsed.unknown_version is False
        assert lapsed.why_not == f"version 9999 no longer serves (version {lapsed.from_version} does)"
        warnings = [
            r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == scale_out.__name__
        ]
        assert warnings == [
            f"admin rollback to version 10000 asked by rank 0 not taken: {missing.why_not}",
            f"automatic rollback to version {target} asked by rank 0 not taken: {lapsed.why_not}",
        ]
        # the quality monitor's rule asks, with the version that serves, instead of rolling back here
        serving = trainer.published
        assert serving is not None and trainer._auto_rollback(target, "the test's rule") is True
        asking = f"rank 0 asks every rank to roll back from version {serving.version} to {target}: the test's rule"
        assert asking in [r.getMessage() for r in caplog.records]
        wait(lambda: len(loop.rollbacks) >= 5, 30, "the automatic request taken")
        asked = loop.rollbacks[4]
        assert asked.trigger == "automatic" and asked.version == target
        assert asked.applied == (asked.from_version == serving.version)  # applied unless a publication came first
        if asked.applied:
            reason = f"the test's rule (agreed at tick {asked.tick}, asked by rank 0)"
            assert trainer.quality.rollbacks[-1]["trigger"] == "automatic"
            assert trainer.quality.rollbacks[-1]["reason"] == reason
    finally:
        loop.stop_requested.set()
        thread.join(30)


def test_a_stopped_loop_answers_waiting_rollbacks() -> None:
    trainer = make_trainer(events=3)
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=Cuts(trainer))
    loop.stop_requested.set()
    automatic = loop.request_rollback(3, "automatic", "the rule")  # asked first, but an admin's goes first
    first, second = loop.request_rollback(1), loop.request_rollback(2)
    assert automatic.wait(0.01) is None  # not taken yet: a wait that times out says so
    loop()  # one tick, the agreed stop: it takes one request (nothing is kept), the others wait in vain
    taken = first.wait(1)
    assert taken is not None and taken.unknown_version and taken.tick == 0
    why = "the ranks stopped before taking it"
    assert [automatic.wait(1), second.wait(1)] == [
        scale_out.AppliedRollback(1, 0, "automatic", 3, None, False, why),
        scale_out.AppliedRollback(1, 0, "admin", 2, None, False, why),
    ]


def test_a_rank_takes_another_ranks_rollback_and_keeps_its_own_request() -> None:
    trainer = make_trainer(events=3)
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=Cuts(trainer))
    own = loop.request_rollback(1)
    outcome = loop._roll_back(4, AgreedRollback(rank=1, request=AskedRollback(2)), own)  # rank 1's won this tick
    assert (outcome, loop.rollbacks[0].rank, loop.rollbacks[0].version) == (False, 1, 2)
    assert own.outcome is None and loop._pending_rollback() is own  # asked again at the next tick


class CountingEvent(threading.Event):
    """An event that counts its waits (the loop's idle waits)."""

    waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_a_refused_step_moves_the_stream_past_its_batch_and_a_stop_leaves_the_batch_in_hand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a resume starts after: every batch a tick applied or refused, never the one in hand at the stop.
    And how long a tick waits: for a batch only after a tick that had one, idle only after a tick without."""
    polls: list[float] = []

    class RecordingStager(scale_out.DeviceStager):
        def poll(self, timeout_s: float) -> Any:
            polls.append(timeout_s)
            return super().poll(timeout_s)

    monkeypatch.setattr(scale_out, "DeviceStager", RecordingStager)
    trainer = make_trainer(events=24)  # a small window: passes run dry, so some ticks are idle
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=Cuts(trainer))
    loop.stop_requested = CountingEvent()
    # the trainer's own step: its (compiled) forward, its schedule, its precision
    assert (loop.step.forward, loop.step.scheduler) == (trainer.forward, trainer.scheduler)
    bf16 = make_trainer(events=3, amp="bf16")
    assert LockstepLoop(bf16, Collectives(DistContext()), checkpoint=Cuts(bf16)).step.amp == "bf16"
    marked: list[Any] = []
    mark = trainer.dataset.mark_trained
    trainer.dataset.mark_trained = lambda batch: (marked.append(batch), mark(batch))[1]  # type: ignore[method-assign]
    trainer.fault_injector = lambda loss: loss * float("nan")
    ticks: list[tuple[bool, str | None]] = []  # (a batch in hand, why the step was skipped)
    step = loop.step.step

    def recorded_step(batch: Any, **kwargs: Any) -> Any:
        report = step(batch, **kwargs)
        ticks.append((batch is not None, report.skipped_reason))
        return report

    loop.step.step = recorded_step  # type: ignore[method-assign]
    thread = run_loop(loop)
    try:
        wait(lambda: len(marked) >= 3, 60, "three refused steps")
        assert trainer.step == 0
        trainer.fault_injector = None
        wait(lambda: trainer.step >= 3, 60, "clean steps again")
    finally:
        loop.stop_requested.set()
        thread.join(30)
    refused = sum(1 for _, why in ticks if why == "non_finite_loss")
    assert refused >= 3 and trainer.metrics.train_steps._value.get() == trainer.step
    assert ticks[-1][1] == "stop" and len(ticks) == loop.tick
    # applied or refused, the stream moves past a batch; the stop tick's, if it had one, trains after a resume
    assert len(marked) == trainer.step + refused == sum(1 for held, why in ticks if held and why != "stop")
    assert loop.stager is not None and loop.stager.source.depth == trainer.settings.prefetch_depth == 1
    held = [h for h, _ in ticks]
    assert polls == [0.0] + [scale_out._BATCH_WAIT_S if h else 0.0 for h in held[:-1]]
    assert loop.stop_requested.waits == sum(1 for h in held[:-1] if not h)  # not after the stop tick


def test_the_data_wait_is_what_a_training_rank_waited_for_its_next_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source 0.15 s per batch: each tick after a step waits up to 0.05 s for the next; idle ticks count nothing."""
    from streamtrain.data.prefetch import Prefetcher

    def slowly(batches: Any) -> Any:
        for batch in batches:
            time.sleep(0.15)
            yield batch

    class SlowPrefetcher(Prefetcher[Any]):
        def __init__(self, iterable: Any, **kwargs: Any) -> None:
            super().__init__(slowly(iterable), **kwargs)

    monkeypatch.setattr(scale_out, "Prefetcher", SlowPrefetcher)
    trainer = make_trainer()
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=Cuts(trainer))
    started = time.monotonic()
    thread = run_loop(loop)
    try:
        wait(lambda: trainer.step >= 8, 60, "eight steps")
    finally:
        loop.stop_requested.set()
        thread.join(30)
    elapsed = time.monotonic() - started
    assert 0.0 < trainer.data_wait_seconds < elapsed
    assert trainer.metrics.train_data_wait_seconds._value.get() == trainer.data_wait_seconds


def test_an_automatic_rollback_needs_a_version_that_serves() -> None:
    trainer, loop = make_wired_loop()
    assert trainer.published is None
    assert loop.request_automatic_rollback(1, "the rule") is False and loop._pending_rollback() is None


def test_the_loop_publishes_once_per_interval_and_agrees_optimizer_resets() -> None:
    trainer = make_trainer(publish_interval_s=3600.0, drift_reaction="reset_optimizer")
    trainer.publish()  # as a restored trainer serves before its loop starts
    loop = LockstepLoop(trainer, Collectives(DistContext()), checkpoint=Cuts(trainer))
    thread = run_loop(loop)
    try:
        wait(lambda: trainer.step >= 5 and trainer.published is not None, 60, "training and a first version")
        trainer._on_drift(None)  # type: ignore[arg-type]
        reset_at = trainer.step
        wait(lambda: trainer.step >= reset_at + 5, 60, "training after the reset")
    finally:
        loop.stop_requested.set()
        thread.join(30)
    # the first tick publishes (the loop has not yet), then not again within the interval
    assert trainer.registry.versions() == [1, 2] and trainer.published.version == 2  # type: ignore[union-attr]
    moments = trainer.optimizer.state[next(trainer.model.parameters())]
    assert 0 < int(moments["step"]) <= trainer.step - reset_at + 1  # counted again from the agreed reset


def test_a_restored_version_is_published_over_at_the_first_tick_on_a_machine_booted_a_moment_ago(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The monotonic clock starts at the machine's boot: a fresh VM's first minutes are no past publication."""
    trainer, loop = make_wired_loop(publish_interval_s=3600.0)
    trainer.publish()  # as a restored trainer serves before its loop starts
    monkeypatch.setattr(scale_out.time, "monotonic", lambda: 5.0)
    assert loop._publish_due()
    loop._last_publish = 5.0 - 3599.0
    assert not loop._publish_due()


def _gate_models() -> tuple[Any, Any, Any]:
    import dist_worker

    return dist_worker.gate_models()


class ThreadRanks:
    """``world`` ranks in threads of one process: ``combine(rank)`` adds a vector over them, as all_reduce does."""

    def __init__(self, world: int) -> None:
        self.hub = ThreadHub(world, timeout=None)

    def combine(self, rank: int) -> Any:
        def add(row: np.ndarray) -> np.ndarray:
            return np.sum(self.hub.exchange(rank, np.asarray(row, dtype=np.float64)), axis=0)

        return add


@pytest.mark.parametrize("events", [0, 5, 40])
def test_the_choice_on_summed_holdouts_is_the_choice_of_one_process_holding_the_union(events: int) -> None:
    """Every rank takes the gate's verdict and the forecaster one process holding every rank's holdout
    and window sample would take (sums added over ranks), alike on every rank."""
    import dist_worker

    serving, worse, same = _gate_models()
    broken = type(serving)(model=copy_with_nan(serving.model), norm=serving.norm, version=4, served=None)
    broken.served = broken.model
    holdouts = [dist_worker.walks(31 + r, events) for r in range(2)]
    samples = [dist_worker.training_events(r) for r in range(2)]
    union = dist_worker.gate_monitor(holdouts[0] + holdouts[1])
    for candidate in (worse, same, broken):
        ranks = ThreadRanks(2)
        got: list[Any] = [None, None]

        def run(rank: int, candidate: Any = candidate, ranks: ThreadRanks = ranks, got: list[Any] = got) -> None:
            monitor = dist_worker.gate_monitor(holdouts[rank])
            monitor.combine = ranks.combine(rank)
            got[rank] = dist_worker.selection_dict(monitor.select(candidate, serving, lambda: (samples[rank], 1.0)))

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        expected = dist_worker.selection_dict(union.select(candidate, serving, lambda: (samples[0] + samples[1], 1.0)))
        assert json.dumps(got[0], sort_keys=True, default=float) == json.dumps(
            got[1], sort_keys=True, default=float
        )  # NaN alike
        for key in ("publish", "reason", "holdout_events", "kind"):
            assert got[0][key] == expected[key], key
        mses = [
            [math.nan if d[k] is None else d[k] for k in ("candidate_mse", "serving_mse")] for d in (got[0], expected)
        ]
        np.testing.assert_allclose(mses[0], mses[1], rtol=1e-6)  # float32 forwards, batched otherwise
        if 2 * events >= dist_worker.GATE.holdout_min_events and candidate is broken:
            assert not got[0]["publish"]


def copy_with_nan(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    broken = copy.deepcopy(model)
    with torch.no_grad():
        next(broken.parameters()).fill_(math.nan)
    return broken


def test_the_monitor_gates_on_what_the_ranks_add_up() -> None:
    """With ``combine`` set, the gate counts every rank's holdout (here: two ranks holding the same)."""
    import dist_worker

    serving, worse, _ = _gate_models()
    monitor = dist_worker.gate_monitor(dist_worker.walks(9, 20))
    alone = monitor.select(worse, serving, lambda: ([], 1.0)).decision
    assert alone.publish and alone.holdout_events == 20
    monitor.combine = lambda row: row * 2
    together = monitor.select(worse, serving, lambda: ([], 1.0)).decision
    assert not together.publish and together.holdout_events == 40


def test_a_drift_reaction_is_taken_once_by_the_loop() -> None:
    trainer = Trainer(
        load_settings(drift_reaction="reset_optimizer", checkpoint_dir="unused"), RecencyWindow(10, math.inf), Metrics()
    )
    assert trainer.take_optimizer_reset() is False
    trainer._on_drift(None)  # type: ignore[arg-type]
    assert trainer.take_optimizer_reset() is True and trainer.take_optimizer_reset() is False


def test_ranks_started_with_different_shared_settings_refuse_to_start() -> None:
    settings = [load_settings(checkpoint_dir="unused", d_model=d) for d in (64, 32)]
    results = on_ranks(2, lambda rank, c: scale_out.check_settings_agree(c, settings[rank]))
    assert all(
        isinstance(r, SettingsMismatch) and str(r).startswith("D_MODEL differs between the ranks") for r in results
    )
    assert on_ranks(2, lambda rank, c: scale_out.check_settings_agree(c, settings[0])) == [None, None]


def test_settings_every_rank_must_share() -> None:
    fingerprint = scale_out.settings_fingerprint(load_settings(checkpoint_dir="unused"))
    assert set(fingerprint) == set(scale_out.AGREED_SETTINGS)
    assert {"d_model", "amp", "holdout_share", "model_versions_keep", "window_capacity"} <= set(fingerprint)
    assert "http_port" not in fingerprint and "device" not in fingerprint  # may differ per rank
    # DP: the ranks' engines are one mechanism, accounted once: its settings must be the same everywhere
    for name, other in (("dp_noise_multiplier", 2.0), ("dp_admit_per_step", 3), ("dp_unit", "sensor")):
        changed = scale_out.settings_fingerprint(load_settings(checkpoint_dir="unused", **{name: other}))
        assert changed != fingerprint and changed[name] != fingerprint[name], name
