"""Scale-out: real tokens/s of N ranks against 1, the collectives' share, checkpoint times.

Every arm trains the service's default model (``Settings()``: d_model 64, 2 layers,
token budget 8192) with the service's pipeline per rank (a local
:class:`~streamtrain.data.WindowBatchDataset` behind a depth-1
:class:`~streamtrain.data.Prefetcher`) through :class:`streamtrain.distributed.data_parallel.DataParallelStep`,
one torch thread per rank, on one synthetic stream: lognormal lengths (median 48,
sigma 0.8, 4..512) in ``--partitions`` partitions; rank ``r`` keeps the partitions
``p mod N == r`` in its window share. Ranks are real processes launched as torchrun
launches them (``WORLD_SIZE``, ``RANK``, ... ; gloo over localhost).

* throughput: global real (unpadded) tokens trained per second, until ``--tokens`` real
  tokens were trained (after two warm-up steps), N ranks against 1 rank;
* collectives: the agreement plus the gradient all-reduce, as a share of step time (the
  largest over the ranks);
* checkpoints: a collective write of a ``--ckpt-items`` window (the service default,
  100k items, split over the ranks) with the model and optimizer, and its restore, per
  world size; plus a restore of the 2-rank checkpoint by 1 rank (a rescale).

On a 2-core machine 2 ranks x 1 thread can at best double 1 x 1; the target is 1.7x on an
idle machine. A busy machine (other jobs) shows less: say so when quoting it. The CPU
seconds per 1k real tokens (summed over the ranks' processes, all their threads) do not
depend on the load: equal figures for 1 and 2 ranks mean scale-out adds no work, and the
idle-machine ratio is then bounded only by the ranks waiting for each other.

Run: ``python bench/scale.py [--worlds 1,2] [--tokens N] [--ckpt-worlds 1,2,4] [--json]``
(about 2 minutes by default; ``--tokens 40000 --ckpt-items 20000`` for a quick check).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.checkpoint.collective import DistributedCheckpointer  # noqa: E402
from streamtrain.checkpoint.manifest import read_manifest  # noqa: E402
from streamtrain.checkpoint.rescale import restore_share  # noqa: E402
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore  # noqa: E402
from streamtrain.config import load_settings  # noqa: E402
from streamtrain.data import Prefetcher, WindowBatchDataset  # noqa: E402
from streamtrain.distributed.collectives import Collectives  # noqa: E402
from streamtrain.distributed.data_parallel import DataParallelStep  # noqa: E402
from streamtrain.distributed.launch import DistContext, free_port  # noqa: E402
from streamtrain.distributed.lockstep import join_trainer_state, split_trainer_state  # noqa: E402
from streamtrain.distributed.wire import StepSignals  # noqa: E402
from streamtrain.events import EventBatch  # noqa: E402
from streamtrain.metrics import Metrics  # noqa: E402
from streamtrain.training.trainer import Trainer, build_budget  # noqa: E402
from streamtrain.window.reservoir import RecencyWindow  # noqa: E402

BENCH = "scale"
TOPIC = "bench-scale"


def stream(items: int, partitions: int, seed: int) -> EventBatch:
    """Noisy sinusoids with lognormal lengths (median 48), in partitions round robin."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(math.log(48), 0.8, items)), 4, 512).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    step = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    omega = np.repeat(rng.uniform(2 * np.pi / 64, 2 * np.pi / 8, items), lengths)
    phase = np.repeat(rng.uniform(0, 2 * np.pi, items), lengths)
    values = (np.sin(omega * step + phase) + 0.1 * rng.standard_normal(step.size)).astype(np.float32)
    now = time.time()
    return EventBatch(
        sensor_ids=np.array([f"sensor-{i % 64}" for i in range(items)], dtype=object),
        ts=now - np.arange(items, 0, -1, dtype=np.float64) * 1e-3,
        labels=np.full(items, -1, dtype=np.int64),
        lengths=lengths,
        values=values.reshape(-1, 1),
        partitions=(np.arange(items) % partitions).astype(np.int32),
        offsets=(np.arange(items) // partitions).astype(np.int64),
    )


def rank_window(batch: EventBatch, ctx: DistContext, capacity: int, partitions: int) -> RecencyWindow:
    """This rank's window share, filled with the events of the partitions it owns."""
    owned = np.isin(batch.partitions, ctx.owned_partitions(partitions))
    index = np.flatnonzero(owned)
    starts = batch.starts
    flat = np.concatenate(
        [batch.values[s : s + n] for s, n in zip(starts[index].tolist(), batch.lengths[index].tolist())]
    )
    mine = EventBatch(
        sensor_ids=batch.sensor_ids[index],
        ts=batch.ts[index],
        labels=batch.labels[index],
        lengths=batch.lengths[index],
        values=flat,
        partitions=batch.partitions[index],
        offsets=batch.offsets[index],
    )
    window = RecencyWindow(ctx.capacity_share(capacity), math.inf, rng=np.random.default_rng(ctx.rank))
    next_offsets = {int(p): int(mine.offsets[mine.partitions == p].max()) + 1 for p in np.unique(mine.partitions)}
    window.insert_batch(mine, next_offsets)
    return window


def worker(args: argparse.Namespace) -> None:
    """One rank: train until the global token target, then time a checkpoint and a restore."""
    torch.set_num_threads(1)
    ctx = DistContext.from_env()
    collectives = Collectives(ctx, backend="gloo", timeout_s=120).start()
    settings = load_settings(seed=args.seed)
    out: dict[str, float] = {}
    if args.tokens > 0:
        window = rank_window(stream(args.items, args.partitions, args.seed), ctx, args.items, args.partitions)
        trainer = Trainer(settings, window, Metrics())
        collectives.broadcast_module(trainer.model)
        dp = DataParallelStep(
            collectives,
            trainer.model,
            trainer.norm,
            trainer.optimizer,
            grad_clip_norm=settings.grad_clip_norm,
            scheduler=trainer.scheduler,
        )
        # a local plan over this rank's own window (seeded per rank), as the service will run it
        dataset = WindowBatchDataset(
            window.snapshot,
            build_budget(settings),
            pool_size=settings.pool_size,
            seed=args.seed + ctx.rank,
            rank=0,
            world_size=1,
        )
        with Prefetcher(dataset, depth=settings.prefetch_depth, name="bench-prefetch") as batches:
            for step in range(2):  # warm-up, not timed
                dp.step(next(batches), step=step)
            collectives.barrier()
            tokens = steps = 0
            step_s = comm_s = wait_s = 0.0
            started, cpu_started = time.perf_counter(), time.process_time()
            while True:
                waited = time.perf_counter()
                batch = next(batches)
                stepped = time.perf_counter()
                report = dp.step(batch, step=2 + steps, signals=StepSignals(stop=tokens >= args.tokens))
                done = time.perf_counter()
                if report.skipped_reason == "stop":
                    break
                wait_s += stepped - waited
                step_s += done - stepped
                comm_s += report.agree_seconds + report.allreduce_seconds
                tokens += report.real_tokens
                steps += 1
            wall = time.perf_counter() - started
            cpu = time.process_time() - cpu_started  # this process, all its threads
        pure_s = pure_allreduce_seconds(collectives, trainer.model)
        shares = collectives.all_gather_rows(
            torch.tensor([comm_s / step_s, wait_s / (wait_s + step_s), cpu], dtype=torch.float64)
        )
        out.update(
            tokens=tokens,
            steps=steps,
            wall_s=wall,
            tokens_per_s=tokens / wall,
            comm_share=float(shares[:, 0].max()),
            allreduce_ms=pure_s * 1e3,
            allreduce_share=pure_s / (step_s / max(steps, 1)),
            gradient_kb=sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / 1024,
            wait_share=float(shares[:, 1].max()),
            cpu_s_per_ktok=float(shares[:, 2].sum()) / tokens * 1e3,
        )
    if args.ckpt_items > 0:
        out.update(checkpoint_times(args, ctx, collectives, settings))
    if ctx.rank == 0:
        Path(args.out).write_text(json.dumps(out))
    collectives.close()


def pure_allreduce_seconds(collectives: Collectives, model: torch.nn.Module, repeats: int = 20) -> float:
    """Median time of the gradient all-reduce alone, every rank starting together (no straggler wait)."""
    tail = torch.zeros(4, dtype=torch.float64)
    times = []
    for _ in range(repeats):
        collectives.barrier()
        started = time.perf_counter()
        collectives.allreduce_gradients(model.parameters(), tail)
        times.append(time.perf_counter() - started)
    return collectives_max(collectives, float(np.median(times)))


def checkpoint_times(
    args: argparse.Namespace, ctx: DistContext, collectives: Collectives, settings: object
) -> dict[str, float]:
    window = rank_window(stream(args.ckpt_items, args.partitions, args.seed + 1), ctx, args.ckpt_items, args.partitions)
    trainer = Trainer(settings, window, Metrics())  # type: ignore[arg-type]
    store = ShardedCheckpointStore(Path(args.ckpt_dir), keep=1)
    checkpointer = DistributedCheckpointer(store, collectives, topic=TOPIC)
    collectives.barrier()
    started = time.perf_counter()
    state = window.state_dict()
    shared, local = split_trainer_state(trainer.state_dict())  # as the service cuts it
    result = checkpointer.save(
        step=1,
        partition_count=args.partitions,
        window_state=state,
        common_state={"trainer": shared} if ctx.rank == 0 else None,
        rank_state=local,
    )
    write_s = collectives_max(collectives, time.perf_counter() - started)
    assert result.ok, result.error
    collectives.barrier()
    started = time.perf_counter()
    share = checkpointer.restore(partition_count=args.partitions)
    again = RecencyWindow(window.capacity, math.inf)
    assert share is not None
    again.load_state_dict(share.window_state)
    trainer.load_state_dict(join_trainer_state(trainer, share.common["trainer"], share.rank_state))
    restore_s = collectives_max(collectives, time.perf_counter() - started)
    size = sum(p.stat().st_size for p in result.path.iterdir())
    return {
        "ckpt_write_s": write_s,
        "ckpt_restore_s": restore_s,
        "ckpt_bytes": float(size),
        "ckpt_path": str(result.path),
    }  # type: ignore[dict-item]


def collectives_max(collectives: Collectives, seconds: float) -> float:
    return float(collectives.all_gather_rows(torch.tensor([seconds], dtype=torch.float64)).max())


def launch(world: int, args: argparse.Namespace, out: Path, *, tokens: int, ckpt_items: int, ckpt_dir: Path) -> dict:
    port = free_port()
    script = Path(__file__).resolve()
    src = script.parents[1] / "src"
    processes = []
    for rank in range(world):
        env = dict(
            os.environ,
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
        )
        command = [
            sys.executable,
            str(script),
            "--worker",
            "--out", str(out),
            "--tokens", str(tokens),
            "--items", str(args.items),
            "--partitions", str(args.partitions),
            "--ckpt-items", str(ckpt_items),
            "--ckpt-dir", str(ckpt_dir),
            "--seed", str(args.seed),
        ]  # fmt: skip
        processes.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in processes]
    if codes != [0] * world:
        raise SystemExit(f"scale bench: a {world}-rank run failed (exit codes {codes})")
    return json.loads(out.read_text())


def rescale_restore_s(ckpt_path: str, partitions: int) -> float:
    started = time.perf_counter()
    share = restore_share(read_manifest(ckpt_path), rank=0, world_size=1, partition_count=partitions, topic=TOPIC)
    RecencyWindow(max(1, len(share.window_state["lengths"])), math.inf).load_state_dict(share.window_state)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2", help="world sizes to train with; the first is the baseline")
    parser.add_argument("--tokens", type=int, default=400_000, help="real tokens each arm trains (timed)")
    parser.add_argument("--items", type=int, default=20_000, help="events in the training stream (all ranks)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--ckpt-worlds", default="1,2,4", help="world sizes to time checkpoints with")
    parser.add_argument("--ckpt-items", type=int, default=100_000, help="window items checkpointed (all ranks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    worlds = [int(w) for w in args.worlds.split(",") if w]
    ckpt_worlds = [int(w) for w in args.ckpt_worlds.split(",") if w]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="streamtrain-scale-") as tmp:
        root = Path(tmp)
        trained = {
            w: launch(w, args, root / f"train-{w}.json", tokens=args.tokens, ckpt_items=0, ckpt_dir=root / "unused")
            for w in (worlds if args.tokens > 0 else [])
        }
        base = trained[worlds[0]] if trained else {}
        for w in trained:
            r = trained[w]
            tag = f"{BENCH}[ranks={w}x1 thread]"
            target = ">= 1.7x (idle 2-core)" if w == 2 and worlds[0] == 1 else ""
            rows += [
                Row(tag, f"real tokens/s vs {worlds[0]} rank(s)", r["tokens_per_s"], base["tokens_per_s"], target),
                Row(
                    tag,
                    "collectives share of step time (agree + all-reduce, incl. waiting for the slower rank)",
                    r["comm_share"],
                ),
                Row(tag, f"gradient all-reduce alone, ms ({r['gradient_kb']:.0f} KiB)", r["allreduce_ms"]),
                Row(tag, "gradient all-reduce alone, share of mean step time", r["allreduce_share"]),
                Row(tag, "data-wait share of step time", r["wait_share"]),
                Row(
                    tag,
                    f"CPU s per 1k real tokens, all ranks (vs {worlds[0]} rank(s); load-independent)",
                    r["cpu_s_per_ktok"],
                    base["cpu_s_per_ktok"],
                ),
                Row(
                    tag,
                    "steps (global tokens per step)",
                    r["steps"],
                    None,
                    f"{r['tokens'] / max(r['steps'], 1):.0f} tokens/step",
                ),
            ]
        ckpts = {}
        if args.ckpt_items <= 0:
            ckpt_worlds = []
        for w in ckpt_worlds:
            ckpts[w] = launch(
                w, args, root / f"ckpt-{w}.json", tokens=0, ckpt_items=args.ckpt_items, ckpt_dir=root / f"ckpt-{w}"
            )
        base_ckpt = ckpts[ckpt_worlds[0]] if ckpt_worlds else {}
        for w in ckpt_worlds:
            c = ckpts[w]
            tag = f"{BENCH}[checkpoint {args.ckpt_items} items, ranks={w}]"
            rows += [
                Row(
                    tag,
                    f"write s (all shards + manifest) vs {ckpt_worlds[0]} rank(s)",
                    c["ckpt_write_s"],
                    base_ckpt["ckpt_write_s"],
                ),
                Row(
                    tag,
                    f"restore s (same ranks) vs {ckpt_worlds[0]} rank(s)",
                    c["ckpt_restore_s"],
                    base_ckpt["ckpt_restore_s"],
                ),
                Row(tag, "checkpoint MB", c["ckpt_bytes"] / 1e6),
            ]
        for w in ckpt_worlds:
            if w > 1:
                rows.append(
                    Row(
                        f"{BENCH}[checkpoint {args.ckpt_items} items, rescale {w}->1]",
                        "restore s by 1 rank (window only)",
                        rescale_restore_s(ckpts[w]["ckpt_path"], args.partitions),
                    )
                )
    emit(rows, args.json)


if __name__ == "__main__":
    main()
