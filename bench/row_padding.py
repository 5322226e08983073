"""The training step on a fresh stream with its token rows padded to a multiple, or not.

oneDNN builds (and caches, 1,024 at most) a bf16 matmul kernel for every row count it meets,
and the planner's batches rarely repeat a row count (``B x L``), so a stream of new batches
keeps paying for kernels that a bench replaying the same batches never sees. Each arm here
is a process of its own (the kernel cache is per process): the service's
:class:`~streamtrain.training.trainer.Trainer` (its defaults, compiled, the given AMP) on
a window of 20,000 lognormal-length sinusoids (bench/train_throughput.py), whose token rows
are padded to a multiple of ``--multiples`` (``1``: none; ``auto``: what the service
picks, :func:`streamtrain.model.compiled.training_row_multiple`), trained on ``--segments``
segments of ``--steps`` new batches after ``--warm-up`` steps; the arms alternate over
``--rounds`` rounds (the same seed, so the same batches), so the machine's drifts hit them
alike.

Rows per arm: the median over its runs of real tokens per CPU second of the training
thread (its segments' median), the ratio to the first arm, the spread over runs, and the
process's peak RSS (the kernel cache lives there).

Run: ``python bench/row_padding.py [--multiples 1,auto] [--amp bf16] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = "row_padding"


def child(multiple: str, amp: str, warm_up: int, segments: int, steps: int, seed: int) -> None:
    """One arm's run: prints a JSON object of its segments' real tokens per CPU second and peak RSS."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_throughput import filled_window

    import streamtrain.training.trainer as trainer_module
    from streamtrain.config import load_settings
    from streamtrain.metrics import Metrics

    torch.set_num_threads(1)
    rule = trainer_module.training_row_multiple
    if multiple != "auto":
        trainer_module.training_row_multiple = lambda *_: int(multiple)
    window = filled_window(20_000, seed)
    settings = load_settings(window_capacity=20_000, seed=seed, device="cpu", amp=amp)
    trainer = trainer_module.Trainer(settings, window, Metrics())
    trainer_module.training_row_multiple = rule
    trainer.forward.compiled.wait()
    source = iter(trainer.dataset)
    for _ in range(warm_up):
        trainer.train_step(next(source))
    rates = []
    for _ in range(segments):
        batches = [next(source) for _ in range(steps)]
        started = time.thread_time()
        for batch in batches:
            trainer.train_step(batch)
        rates.append(sum(batch.real_tokens for batch in batches) / (time.thread_time() - started))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"multiple": trainer.forward.row_multiple, "rates": rates, "peak_rss_mb": peak_mb}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--multiples", default="1,auto", help="row multiples, comma separated (1: no padding)")
    parser.add_argument("--amp", choices=["bf16", "off"], default="bf16")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every arm, alternating")
    parser.add_argument("--warm-up", type=int, default=200, help="steps before the timed segments")
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--steps", type=int, default=250, help="new batches per segment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.amp, args.warm_up, args.segments, args.steps, args.seed)
        return

    from _table import Row, emit

    arms = [arm.strip() for arm in args.multiples.split(",") if arm.strip()]
    runs: dict[str, list[dict[str, object]]] = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        for arm in arms if round_ % 2 == 0 else arms[::-1]:
            sizes = ["--warm-up", str(args.warm_up), "--segments", str(args.segments), "--steps", str(args.steps)]
            command = [sys.executable, __file__, "--child", arm, "--amp", args.amp, *sizes, "--seed", str(args.seed)]
            done = subprocess.run(command, capture_output=True, text=True, check=True, env=os.environ.copy())
            runs[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {arm: [statistics.median(run["rates"]) for run in runs[arm]] for arm in arms}  # type: ignore[arg-type]
    first = statistics.median(medians[arms[0]])
    rows: list[Row] = []
    for arm in arms:
        tag = f"{BENCH}[amp={args.amp}, rows padded to a multiple of {runs[arm][0]['multiple']} ({arm})]"
        rows += [
            Row(tag, "real tokens per CPU second, median of runs (vs the first arm)", statistics.median(medians[arm]),
                first),
            Row(tag, "real tokens per CPU second, slowest run", min(medians[arm])),
            Row(tag, "real tokens per CPU second, fastest run", max(medians[arm])),
            Row(tag, "peak RSS MB, largest run", max(float(run["peak_rss_mb"]) for run in runs[arm])),  # type: ignore[arg-type]
        ]  # fmt: skip
    if not args.json:
        print(f"# {args.rounds} runs per arm, {args.segments} x {args.steps} new batches each after {args.warm_up}")
    emit(rows, args.json)


if __name__ == "__main__":
    main()
