"""The service's training step under several settings, side by side on the same batches.

One :class:`~streamtrain.training.trainer.Trainer` per arm (``--arm "compile=off"``, ``--arm
"compile=on,amp=bf16"``, ...; every other setting the service's default), all from the same
seed (the same initial weights), trained on the same batches of the first arm's pipeline
(a window of 20,000 noisy sinusoids of lognormal length, bench/train_throughput.py), one
batch through every arm in turn, the arms' order reversed every round, so load on the
shared machine hits them alike. Arms that compile are timed only after their background
compilation has finished (its seconds are a row). Every arm first trains every batch once,
untimed: oneDNN builds a bf16 matmul kernel per new row count and caches it for the whole
process, so otherwise the first arm would pay for the kernels that the others then reuse
(docs/performance.md, "One matmul kernel per row count"). The arms are thus compared on
warm kernels; what new batch shapes cost a stream is ``bench/row_padding.py``'s.

Rows per arm: CPU milliseconds per step (the thread's CPU time: what the step costs,
robust to other processes taking the core), real tokens per CPU second and per wall
second, the ratio to the first arm, the training loss (EMA) after the run (same batches,
same start: arms that compute the same thing end near the same loss), and the graphs
torch.compile made. One torch thread.

Run: ``python bench/step_ab.py --arm compile=off --arm compile=on [--steps N] [--rounds R] [--json]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402
from train_throughput import filled_window  # noqa: E402

from streamtrain.config import load_settings  # noqa: E402
from streamtrain.metrics import Metrics  # noqa: E402
from streamtrain.model.compiled import compiled_graphs  # noqa: E402
from streamtrain.training.trainer import Trainer  # noqa: E402

BENCH = "step_ab"


def parse_arm(spec: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--arm {spec!r}: expected NAME=VALUE[,NAME=VALUE...]")
        out[name.strip().lower()] = value.strip()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", required=True, help="settings of one arm, NAME=VALUE,...")
    parser.add_argument("--steps", type=int, default=30, help="batches per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--items", type=int, default=20_000, help="window size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    window = filled_window(args.items, args.seed)
    trainers: dict[str, Trainer] = {}
    for spec in args.arm:
        settings = load_settings(window_capacity=args.items, seed=args.seed, device="cpu", **parse_arm(spec))
        trainers[spec] = Trainer(settings, window, Metrics())
    started = time.perf_counter()
    for trainer in trainers.values():
        trainer.forward.compiled.wait()
    warm_up_s = time.perf_counter() - started
    source = iter(next(iter(trainers.values())).dataset)
    batches = [next(source) for _ in range(args.steps)]
    for trainer in trainers.values():
        for batch in batches:  # allocator and kernel warm-up: every batch shape (see the docstring)
            trainer.train_step(batch)
    cpu = dict.fromkeys(trainers, 0.0)
    wall = dict.fromkeys(trainers, 0.0)
    for round_ in range(args.rounds):
        order = list(trainers.items()) if round_ % 2 == 0 else list(trainers.items())[::-1]
        for batch in batches:
            for spec, trainer in order:
                cpu_before, wall_before = time.thread_time(), time.perf_counter()
                trainer.train_step(batch)
                cpu[spec] += time.thread_time() - cpu_before
                wall[spec] += time.perf_counter() - wall_before
    tokens = args.rounds * sum(batch.real_tokens for batch in batches)
    steps = args.rounds * len(batches)
    first = args.arm[0]
    rows: list[Row] = []
    for spec, trainer in trainers.items():
        tag = f"{BENCH}[{spec}]"
        forward = trainer.forward.compiled
        rows += [
            Row(tag, "CPU ms/step (vs the first arm)", 1e3 * cpu[spec] / steps, 1e3 * cpu[first] / steps),
            Row(tag, "real tokens per CPU second (vs the first arm)", tokens / cpu[spec], tokens / cpu[first]),
            Row(tag, "real tokens per wall second", tokens / wall[spec]),
            Row(tag, "training loss EMA after the run (vs the first arm)", trainer.loss_ema or 0.0,
                trainers[first].loss_ema),
            Row(tag, f"compiled: {forward.state}, warm-up s", forward.compile_seconds or 0.0),
        ]  # fmt: skip
    rows.append(Row(BENCH, "graphs torch.compile made (all arms)", compiled_graphs()))
    rows.append(Row(BENCH, "seconds until every arm had compiled", warm_up_s))
    if not args.json:
        print(f"# {steps} steps per arm, one torch thread, torch {torch.__version__}")
    emit(rows, args.json)


if __name__ == "__main__":
    main()
