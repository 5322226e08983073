"""One rank of the multi-process tests in distributed/test_distributed_processes.py, launched as torchrun would.

The parent sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT and runs
``python dist_worker.py SCENARIO OUT_DIR``; this process joins the gloo group through
``env://`` (streamtrain.distributed.launch), runs the scenario and writes what it saw to
OUT_DIR/rank{RANK}.* for the parent to check. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.config import load_settings
from streamtrain.data import collate
from streamtrain.distributed.collectives import Collectives, exit_after_collective_failure
from streamtrain.distributed.data_parallel import DataParallelStep
from streamtrain.distributed.launch import DistContext
from streamtrain.distributed.lockstep import LockstepLoop, check_settings_agree
from streamtrain.distributed.wire import AskedRollback, LockstepError, SettingsMismatch, StepSignals
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.metrics import Metrics
from streamtrain.model.inference import predict
from streamtrain.model.network import build_model
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.config import QualityConfig
from streamtrain.quality.monitor import QualityMonitor
from streamtrain.training.protocol import LoopFactory
from streamtrain.training.trainer import Trainer
from streamtrain.window.reservoir import RecencyWindow

STEPS = 7
WORLD = 2
NAN_STEP = 3  # rank 1's loss is made NaN here: every rank must skip the step
SETTINGS = {"window_capacity": 1000, "seed": 7, "warmup_steps": 3, "learning_rate": 3e-3}


def schedule(seed: int = 0) -> list[list[list[np.ndarray] | None]]:
    """Per step, per rank: the items of its batch (None: no data). Sizes differ by rank."""
    rng = np.random.default_rng(seed)
    steps = []
    for step in range(STEPS):
        per_rank: list[list[np.ndarray] | None] = []
        for rank in range(WORLD):
            empty = (step, rank) in {(2, 1), (4, 0), (5, 0), (5, 1)}
            count = int(rng.integers(1, 12 + 20 * rank))
            items = [
                rng.normal(5.0 + rank, 2.0, (int(rng.integers(1, 70)), 1)).astype(np.float32) for _ in range(count)
            ]
            per_rank.append(None if empty else items)
        steps.append(per_rank)
    return steps


def signals_for(step: int, rank: int) -> StepSignals:
    return StepSignals(checkpoint_due=(step, rank) == (1, 1), publish_due=(step, rank) == (3, 0))


def double_trainer() -> Trainer:
    trainer = Trainer(load_settings(**SETTINGS), RecencyWindow(1000, math.inf), Metrics())
    trainer.model.double()  # float64: the comparison measures the algorithm, not float32 rounding
    return trainer


def stream_batch(
    partitions: list[int], per_partition: int, start: int, rng: np.random.Generator
) -> tuple[EventBatch, dict[int, int]]:
    events, parts, offsets = [], [], []
    for p in partitions:
        for k in range(per_partition):
            events.append(
                SensorEvent(f"s{p}-{k}", 1e9 + k, rng.normal(size=(int(rng.integers(1, 9)), 1)).astype(np.float32))
            )
            parts.append(p)
            offsets.append(start + k)
    return EventBatch.from_events(events, parts, offsets), {p: start + per_partition for p in partitions}


def train(collectives: Collectives, rank: int, out: Path) -> None:
    trainer = double_trainer()
    collectives.broadcast_module(trainer.model)
    injector = (lambda loss: loss * math.nan) if rank == 1 else None
    dp = DataParallelStep(
        collectives,
        trainer.model,
        trainer.norm,
        trainer.optimizer,
        grad_clip_norm=trainer.settings.grad_clip_norm,
        scheduler=trainer.scheduler,
    )
    reports = []
    for step, per_rank in enumerate(schedule()):
        items = per_rank[rank]
        dp.fault_injector = injector if step == NAN_STEP else None
        report = dp.step(collate(items) if items else None, step=step, signals=signals_for(step, rank))
        a = report.agreement
        reports.append(
            {
                "applied": report.applied,
                "skipped": report.skipped_reason,
                "loss": report.loss,
                "forecast_loss": report.forecast_loss,
                "real_tokens": report.real_tokens,
                "local_real_tokens": report.local_real_tokens,
                "checkpoint": a.checkpoint,
                "publish": a.publish,
                "stop": a.stop,
                "ranks_with_data": a.ranks_with_data,
            }
        )
    in_sync = collectives.check_in_sync(trainer.model)
    try:  # a rank one step ahead of the other is caught, on both
        collectives.agree(100 + rank, StepSignals())
        lockstep_error = None
    except LockstepError as err:
        lockstep_error = str(err)
    stop = collectives.agree(200, StepSignals(stop=rank == 1))
    np.savez(
        out / f"rank{rank}-params.npz",
        **{name: p.detach().numpy() for name, p in trainer.model.named_parameters()},
        norm_count=np.array(trainer.norm.count),
        norm_mean=trainer.norm.mean.numpy(),
        norm_m2=trainer.norm.state_dict()["m2"].numpy(),
    )
    checkpoints = checkpoint_round_trip(collectives, rank, out, trainer)
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "reports": reports,
                "in_sync": in_sync,
                "lockstep_error": lockstep_error,
                "stop_agreed": stop.stop,
                "checkpoints": checkpoints,
            }
        )
    )


def checkpoint_round_trip(collectives: Collectives, rank: int, out: Path, trainer: Trainer) -> dict:
    """Two collective checkpoints of a 3-partition window, each rank's newer shard a delta on its
    older one; the newer one's shard 1 is damaged."""
    rng = np.random.default_rng(100 + rank)
    owned = [p for p in range(3) if p % WORLD == rank]
    window = RecencyWindow(10_000, math.inf, rng=np.random.default_rng(rank))
    store = ShardedCheckpointStore(out / "checkpoints", keep=3)
    checkpointer = DistributedCheckpointer(store, collectives, topic="dist-test")
    saved = {}
    for step, start in ((10, 0), (20, 25)):
        batch, offsets = stream_batch(owned, 25, start, rng)
        window.insert_batch(batch, offsets)
        result = checkpointer.save(
            step=step,
            partition_count=3,
            window_state=window.capture_state(),  # the newer shard a delta on the older
            common_state={"trainer": trainer.state_dict()} if rank == 0 else None,
        )
        snap = window.snapshot()
        saved[step] = {
            "ok": result.ok,
            "kind": result.kind,
            "path": str(result.path),
            "next_offsets": {str(k): v for k, v in result.next_offsets.items()},
            "items": sorted(zip(snap.partitions.tolist(), snap.offsets.tolist())),
        }
    collectives.barrier()
    if rank == 0:  # flip one byte in the middle of rank 1's newest shard (inside a section)
        shard = Path(saved[20]["path"]) / "shard-00001.stsh"
        data = bytearray(shard.read_bytes())
        data[len(data) * 2 // 3] ^= 0x40
        shard.write_bytes(bytes(data))
    collectives.barrier()
    share = checkpointer.restore(partition_count=3)
    restored = RecencyWindow(10_000, math.inf)
    restored.load_state_dict(share.window_state)
    snap = restored.snapshot()
    return {
        "saved": saved,
        "restored_step": share.step,
        "restored_items": sorted(zip(snap.partitions.tolist(), snap.offsets.tolist())),
        "restored_offsets": {str(k): v for k, v in share.next_offsets.items()},
        "topology_changed": share.topology_changed,
        "common_step": int(share.common["trainer"]["step"]),
    }


def failure(rank: int, out: Path, mode: str, timeout_s: float) -> None:
    """Rank 1 dies (SIGKILL) or hangs after two steps; rank 0 must fail within the timeout.

    Everything slow (building and warming up the trainer) happens before the group is
    joined, so on a loaded machine only the failure, not a slow start, trips the short
    timeout; rank 1 also joins late (TEST_START_DELAY_S), which must not count as a failure.
    """
    trainer = Trainer(load_settings(**SETTINGS), RecencyWindow(1000, math.inf), Metrics())
    batch = collate([np.ones((8, 1), np.float32) * (rank + 1)])

    def parallel(collectives: Collectives) -> DataParallelStep:
        return DataParallelStep(
            collectives, trainer.model, trainer.norm, trainer.optimizer, grad_clip_norm=1.0, scheduler=trainer.scheduler
        )

    parallel(Collectives(DistContext())).step(batch, step=-1)  # warm-up, alone
    time.sleep(float(os.environ.get("TEST_START_DELAY_S", "0")))
    collectives = Collectives(DistContext.from_env(), backend="gloo", timeout_s=timeout_s).start()
    dp = parallel(collectives)
    for step in range(2):
        dp.step(batch, step=step)
    if rank == 1:
        (out / "rank1.ready").write_text("ok")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # a hang: alive, silent (the parent kills it once rank 0 is done)
        return
    last_ok = time.monotonic()
    try:
        for step in range(2, 10_000):
            dp.step(batch, step=step)
            last_ok = time.monotonic()
        outcome = {"error": None}
    except Exception as err:  # noqa: BLE001 - the point: what the survivor sees
        outcome = {"error": f"{type(err).__name__}: {err}"[:500]}
    outcome["seconds_after_last_step"] = time.monotonic() - last_ok
    (out / "rank0.json").write_text(json.dumps(outcome))
    if outcome["error"]:
        exit_after_collective_failure(RuntimeError(outcome["error"]))
    sys.exit(0)


# ----------------------------------------------------------------------------------------
# scenario "quality": the publish gate, rollbacks and drift reactions, agreed by the ranks

GATE = QualityConfig(holdout_share=0.1, holdout_min_events=32, publish_gate_tolerance=0.05)
GATE_EVENTS_PER_RANK = 20  # below HOLDOUT_MIN_EVENTS alone, above it together
LOOP_SETTINGS = {
    "d_model": 16, "n_heads": 2, "n_layers": 1, "max_len": 32, "token_budget": 512, "min_window_items": 8,
    "warmup_steps": 1, "learning_rate": 0.01, "publish_interval_s": 0.1, "model_versions_keep": 50, "seed": 7,
    "holdout_share": 0.05, "holdout_min_events": 8, "drift_reaction": "reset_optimizer",
}  # fmt: skip


def walks(seed: int, count: int, low: int = 4, high: int = 32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        np.cumsum(rng.standard_normal((int(n), 1)), axis=0).astype(np.float32) for n in rng.integers(low, high, count)
    ]


def gate_models() -> tuple[Any, Any, Any]:
    """(serving, a candidate much worse on random walks, a candidate as good): the same in every process."""
    settings = load_settings(
        **{k: v for k, v in LOOP_SETTINGS.items() if k in ("d_model", "n_heads", "n_layers", "max_len")}
    )
    torch.manual_seed(11)
    model = build_model(settings).eval()
    norm = RunningNorm(1)
    data = torch.from_numpy(np.concatenate(walks(5, 50)))[None]
    norm.update(data, torch.ones(data.shape[:2], dtype=torch.bool))
    worse = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(12)
        for parameter in worse.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    make = lambda m, v: SimpleNamespace(model=m, norm=norm, version=v, served=m)  # noqa: E731
    return make(model, 1), make(worse, 2), make(copy.deepcopy(model), 3)


def holdout_events(rank: int) -> list[np.ndarray]:
    return walks(500 + rank, GATE_EVENTS_PER_RANK)


def training_events(rank: int) -> list[np.ndarray]:
    """Each rank's window sample for the linear forecaster (its union is what one process would fit on)."""
    return walks(700 + rank, 30)


def gate_monitor(values: list[np.ndarray]) -> QualityMonitor:
    monitor = QualityMonitor(GATE, Metrics(), lambda: None)
    monitor.holdout.values.extend(values)
    monitor.holdout.labels.extend([-1] * len(values))
    monitor.holdout.sensors.extend(f"s{i}" for i in range(len(values)))
    return monitor


def selection_dict(selection: Any) -> dict[str, Any]:
    forecaster = selection.forecaster
    coefficients = None if forecaster.coefficients is None else np.asarray(forecaster.coefficients).tolist()
    return {**dataclass_dict(selection.decision), "kind": forecaster.kind, "coefficients": coefficients}


def collective_gate(collectives: Collectives, rank: int) -> dict[str, Any]:
    serving, worse, same = gate_models()
    monitor = gate_monitor(holdout_events(rank))
    monitor.combine = collectives.sum_rows
    alone = gate_monitor(holdout_events(rank))
    out = {}
    for name, candidate in (("worse", worse), ("same", same)):
        out[name] = selection_dict(monitor.select(candidate, serving, lambda: (training_events(rank), 1.0)))
        out[f"{name}_alone"] = selection_dict(alone.select(candidate, serving, lambda: (training_events(rank), 1.0)))
    return out


def dataclass_dict(value: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(value)


def loop_trainer(rank: int, out: Path, loop: LoopFactory | None = None) -> Trainer:
    settings = load_settings(**LOOP_SETTINGS, checkpoint_dir=out / "unused")
    window = RecencyWindow(1000, math.inf, channels=1, rng=np.random.default_rng(rank))
    now = time.time()
    window.insert_batch(
        EventBatch.from_events([SensorEvent(f"s{rank}-{i}", now - i, v) for i, v in enumerate(walks(900 + rank, 96))])
    )
    trainer = Trainer(settings, window, Metrics(), data_seed=100 + rank, min_items=8, loop=loop)
    holdout = walks(700 + rank, 10)
    trainer.quality.holdout.values.extend(holdout)
    trainer.quality.holdout.labels.extend([-1] * len(holdout))
    trainer.quality.holdout.sensors.extend(f"s{i}" for i in range(len(holdout)))
    return trainer


def wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def quality(collectives: Collectives, rank: int, out: Path) -> None:
    """Rank 1 was started with another D_MODEL for the first check; then every agreement in turn."""
    mismatch = None
    try:
        check_settings_agree(collectives, load_settings(d_model=32 if rank == 1 else 64, n_heads=2))
    except SettingsMismatch as err:
        mismatch = str(err)
    check_settings_agree(collectives, load_settings(**LOOP_SETTINGS))  # the same: no error
    # one rollback wins per step: an admin's before an automatic one, then the lowest rank's
    asks = [
        {0: AskedRollback(3, "automatic", 5), 1: AskedRollback(2, "admin")},
        {0: AskedRollback(3, "automatic", 5), 1: AskedRollback(4, "automatic", 5)},
        {1: AskedRollback(4, "automatic", 5)},
        {},
    ]
    agreed = []
    for step, ask in enumerate(asks):
        a = collectives.agree(300 + step, StepSignals(rollback=ask.get(rank), reset_optimizer=(step, rank) == (3, 1)))
        agreed.append(
            {
                "rollback": None if a.rollback is None else [a.rollback.rank, dataclass_dict(a.rollback.request)],
                "reset": a.reset_optimizer,
            }
        )
    gate = collective_gate(collectives, rank)

    trainer = loop_trainer(
        rank, out, loop=lambda t: LockstepLoop(t, collectives, checkpoint=lambda final: None, stage_ahead=True)
    )
    collectives.broadcast_module(trainer.model)
    assert isinstance(trainer.loop, LockstepLoop)
    loop = trainer.loop
    resets: list[int] = []
    original = loop.step.step

    def recording(batch: Any, *, step: int, signals: StepSignals | None = None) -> Any:
        report = original(batch, step=step, signals=signals)
        if report.agreement.reset_optimizer:
            resets.append(step)
        return report

    loop.step.step = recording  # type: ignore[method-assign]
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    wait(lambda: len(trainer.registry.versions()) >= 3, 120, "three published versions")
    ticket = None
    if rank == 1:  # an admin's rollback, asked of this rank only
        ticket = loop.request_rollback(trainer.registry.versions()[0], "admin", "asked by the test")
    else:  # this rank's automatic rule fires (what QualityMonitor calls), at about the same time
        versions = trainer.registry.versions()
        trainer._auto_rollback(versions[-2], "the test's rule")
    wait(lambda: len(loop.rollbacks) >= 2, 120, "both rollbacks taken")
    if rank == 0:
        trainer._on_drift(None)  # type: ignore[arg-type]  # a drift reaction on this rank only
    top = max(trainer.registry.versions())
    wait(lambda: max(trainer.registry.versions()) >= top + 2, 120, "two more publications")
    if rank == 0:
        loop.stop_requested.set()
    thread.join(120)
    assert not thread.is_alive(), "the loop did not stop"
    in_sync = collectives.check_in_sync(trainer.model)
    serving = trainer.published
    assert serving is not None
    answers = predict(serving.model, serving.norm, walks(42, 8), 512)
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "mismatch": mismatch,
                "agreed": agreed,
                "gate": gate,
                "rollbacks": [dataclass_dict(r) for r in loop.rollbacks],
                "ticket": None if ticket is None or ticket.outcome is None else dataclass_dict(ticket.outcome),
                "resets": resets,
                "registry": [[v, trainer.registry.get(v).step] for v in trainer.registry.versions()],
                "serving": serving.version,
                "last_gate": None if trainer.last_gate is None else dataclass_dict(trainer.last_gate),
                "in_sync": in_sync,
                "steps": trainer.step,
                "staged_ahead": loop.stager.staged_ahead if loop.stager is not None else 0,
                "answers": [[float(v) for v in np.ravel(a.next)] for a in answers],
            }
        )
    )


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    ctx = DistContext.from_env()
    timeout_s = float(os.environ.get("TEST_DIST_TIMEOUT_S", "30"))
    if scenario in ("kill", "hang"):
        failure(ctx.rank, out, scenario, timeout_s)
        return
    collectives = Collectives(ctx, backend="gloo", timeout_s=timeout_s).start()
    {"train": train, "quality": quality}[scenario](collectives, ctx.rank, out)
    collectives.close()


if __name__ == "__main__":
    main()
