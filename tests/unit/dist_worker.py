"""One rank of the multi-process tests in test_distributed.py, launched as torchrun would.

The parent sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT and runs
``python dist_worker.py SCENARIO OUT_DIR``; this process joins the gloo group through
``env://`` (streamtrain.distributed), runs the scenario and writes what it saw to
OUT_DIR/rank{RANK}.* for the parent to check. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from streamtrain.config import load_settings
from streamtrain.data import collate
from streamtrain.distributed import Collectives, DistContext, LockstepError, StepSignals, exit_after_collective_failure
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.metrics import Metrics
from streamtrain.parallel import DataParallelStep
from streamtrain.sharded_checkpoint import DistributedCheckpointer, ShardedCheckpointStore
from streamtrain.train import Trainer
from streamtrain.window import RecencyWindow

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


def stream_batch(partitions: list[int], per_partition: int, start: int, rng: np.random.Generator) -> tuple[EventBatch, dict[int, int]]:
    events, parts, offsets = [], [], []
    for p in partitions:
        for k in range(per_partition):
            events.append(SensorEvent(f"s{p}-{k}", 1e9 + k, rng.normal(size=(int(rng.integers(1, 9)), 1)).astype(np.float32)))
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
    """Two collective checkpoints of a 3-partition window; the newer one's shard 1 is damaged."""
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
            window_state=window.state_dict(),
            common_state={"trainer": trainer.state_dict()} if rank == 0 else None,
        )
        snap = window.snapshot()
        saved[step] = {
            "ok": result.ok,
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


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    ctx = DistContext.from_env()
    timeout_s = float(os.environ.get("TEST_DIST_TIMEOUT_S", "30"))
    if scenario != "train":
        failure(ctx.rank, out, scenario, timeout_s)
        return
    collectives = Collectives(ctx, backend="gloo", timeout_s=timeout_s).start()
    train(collectives, ctx.rank, out)
    collectives.close()


if __name__ == "__main__":
    main()
