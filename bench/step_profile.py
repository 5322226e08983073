"""Where a training step's time goes: torch.profiler per op and per stage of the service's step.

The trainer is the service's (:class:`~streamtrain.training.trainer.Trainer`, its default
settings unless ``--set``), fed by its own pipeline (a Prefetcher over ``Trainer.dataset``)
from a window of 20,000 noisy sinusoids of lognormal length (median 48, the mix of
bench/train_throughput.py), and it runs as the trainer thread does: wait for a batch, train
it, publish when due. One torch thread.

Stages are ``torch.profiler.record_function`` scopes wrapped around the service's own
functions for the duration of the profile (nothing in the service changes): a stage's time
is the time inside its scope that no inner stage claims, Python included. The backward is
split by the autograd node that ran (``AddmmBackward0`` counts as linears, and so on).
With ``COMPILE=on`` (the default) the step is profiled once compiled: the compiled forward
and backward are one stage each (their largest ops say what they run).
Planning and collating run on the prefetch thread, overlapped with the step: their rows are
that thread's time per step, not part of the step's wall time.

Rows: ms per step for each stage and its share of the unprofiled step, then the ops with
the most self time. With ``--compare`` (default on) the same batches are also timed
unprofiled, eager and compiled, interleaved, so the profile's step time has a reference.

Run: ``python bench/step_profile.py [--steps N] [--set NAME=VALUE] [--ops N] [--json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import threading
import time
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _flops import matmul_flop_rate, training_flops  # noqa: E402
from _settings import add_set_option, service_settings  # noqa: E402
from _table import Row, emit, print_columns  # noqa: E402
from train_throughput import filled_window  # noqa: E402

import streamtrain.data.dataset as dataset_module  # noqa: E402
import streamtrain.distributed.data_parallel as data_parallel  # noqa: E402
import streamtrain.model.network as network  # noqa: E402
import streamtrain.training.publishing as publishing  # noqa: E402
from streamtrain.config import load_settings  # noqa: E402
from streamtrain.data import Prefetcher  # noqa: E402
from streamtrain.data.collate import Batch  # noqa: E402
from streamtrain.distributed.collectives import Collectives  # noqa: E402
from streamtrain.metrics import Metrics  # noqa: E402
from streamtrain.model.normalization import RunningNorm  # noqa: E402
from streamtrain.training.trainer import Trainer  # noqa: E402
from streamtrain.window.snapshot import WindowSnapshot  # noqa: E402

BENCH = "step_profile"
STAGE = "stage: "
_NODE = "autograd::engine::evaluate_function: "
_MISSING = object()
PRODUCER_STAGES = ("batch planning", "gather + collate")

#: The autograd nodes of each backward stage (by prefix of the node's name).
BACKWARD_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("linears", ("AddmmBackward", "MmBackward", "TBackward", "LinearBackward")),
    ("attention", ("ScaledDotProduct",)),
    ("layer norms", ("NativeLayerNormBackward",)),
    ("GELU", ("GeluBackward",)),
    ("accumulate grads", ("torch::autograd::AccumulateGrad",)),
    ("compiled graph", ("CompiledFunctionBackward",)),
)


def backward_stage(node: str) -> str:
    for stage, prefixes in BACKWARD_KINDS:
        if node.startswith(prefixes):
            return f"backward: {stage}"
    return "backward: features, loss, residuals, views"


#: Seconds spent in each producer-thread stage (the profiler records the stepping thread only).
producer_seconds: dict[str, float] = defaultdict(float)


def _scoped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                producer_seconds[name] += time.perf_counter() - started
        with record_function(STAGE + name):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def stage_scopes(trainer: Trainer) -> Iterator[None]:
    """Wrap the service's functions in stage scopes; everything is put back on exit."""
    functional = types.SimpleNamespace(**{k: getattr(torch.nn.functional, k) for k in dir(torch.nn.functional)})
    functional.gelu = _scoped("GELU", torch.nn.functional.gelu)
    copying = types.SimpleNamespace(deepcopy=_scoped("publish: model copy", publishing.copy.deepcopy))
    targets: list[tuple[Any, str, str]] = [
        (dataset_module.WindowBatchDataset, "_draw", "batch planning"),
        (WindowSnapshot, "gather_values", "gather + collate"),
        (dataset_module, "collate_flat", "gather + collate"),
        (Trainer, "train_step", "step glue (counters, metrics, stream position)"),
        (data_parallel, "batch_moments", "normalization statistics"),
        (data_parallel, "apply_moments", "normalization statistics"),
        (RunningNorm, "state_dict", "normalization statistics"),
        (RunningNorm, "load_state_dict", "normalization statistics"),
        (RunningNorm, "normalize", "input normalization"),
        (Collectives, "agree", "collectives (one rank: local)"),
        (Collectives, "allreduce_gradients", "collectives (one rank: local)"),
        (data_parallel, "globally_normalized_loss", "loss"),
        (data_parallel, "forecast_loss", "loss"),
        (data_parallel, "naive_last_value_loss", "loss"),
        (torch.Tensor, "backward", "backward: engine"),
        (torch.nn.utils, "clip_grad_norm_", "gradient clipping"),
        (trainer.optimizer, "step", "optimizer"),  # the instance: the LR scheduler wraps its bound step
        (trainer.optimizer, "zero_grad", "optimizer"),
        (Trainer, "apply_step", "step glue (counters, metrics, stream position)"),
        (publishing.ModelTrainer, "publish", "publish: registry, swap"),
        (Trainer, "_select", "publish: gate and forecaster choice"),
    ]
    compiled = trainer.forward.compiled.compiled
    if compiled:  # the compiled graph calls none of the model's Python functions: one stage
        targets.append((trainer._one_rank, "forward", "forward: compiled graph"))
    else:
        targets += [
            (network.SensorModel, "forward", "forward: embedding, residuals, heads"),
            (network, "level_free_features", "level-free features"),
            (network.CausalSelfAttention, "forward", "attention"),
            (nn.Linear, "forward", "linears"),
            (nn.LayerNorm, "forward", "layer norms"),
        ]
    if hasattr(network, "attention_allowed"):
        targets.append((network, "attention_allowed", "attention mask"))
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, attribute, stage in targets:
            own = owner.__dict__ if isinstance(owner, type) else vars(owner) if hasattr(owner, "__dict__") else {}
            saved.append((owner, attribute, own.get(attribute, _MISSING)))
            setattr(owner, attribute, _scoped(stage, getattr(owner, attribute)))
        if not compiled:
            saved.append((network, "F", network.F))
            network.F = functional  # type: ignore[assignment]
        saved.append((publishing, "copy", publishing.copy))
        publishing.copy = copying  # type: ignore[assignment]
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)


def stage_of(event: Any) -> str | None:
    """The stage an op's self time belongs to: its nearest stage scope or autograd node."""
    node = event
    while node is not None:
        name = node.name
        if name.startswith(STAGE):
            return str(name[len(STAGE) :])
        if name.startswith(_NODE):
            return backward_stage(name[len(_NODE) :])
        node = node.cpu_parent
    return None


def run_steps(trainer: Trainer, stage: Prefetcher[Batch], steps: int) -> tuple[float, float, int, list[np.ndarray]]:
    """The trainer thread's loop for ``steps`` steps: (wall s, data wait s, real tokens, lengths per batch)."""
    wait = 0.0
    tokens = 0
    lengths: list[np.ndarray] = []
    started = time.perf_counter()
    for _ in range(steps):
        waited = time.perf_counter()
        with record_function(STAGE + "data wait"):
            batch = next(stage)
        wait += time.perf_counter() - waited
        trainer.train_step(batch)
        trainer._publish_if_due()
        tokens += batch.real_tokens
        lengths.append(batch.lengths.numpy())
    return time.perf_counter() - started, wait, tokens, lengths


def profile_steps(trainer: Trainer, steps: int) -> tuple[Any, float, float, int, list[np.ndarray]]:
    with Prefetcher(trainer.dataset, depth=trainer.settings.prefetch_depth, name="profile-prefetch") as stage:
        run_steps(trainer, stage, 3)  # warm-up: allocator, kernels (and compilation, when on)
        with stage_scopes(trainer), profile(activities=[ProfilerActivity.CPU]) as prof:
            wall, wait, tokens, lengths = run_steps(trainer, stage, steps)
    return prof, wall, wait, tokens, lengths


def timed_steps(trainer: Trainer, steps: int) -> tuple[float, float, int, list[np.ndarray]]:
    """The unprofiled reference, timed after as many warm-up steps: the first steps of a fresh
    trainer build a matmul kernel for each row count and pay the first publications (a warm-up of
    3 steps timed 66-129 ms a step against 27-34 ms under the profiler afterwards)."""
    with Prefetcher(trainer.dataset, depth=trainer.settings.prefetch_depth, name="timed-prefetch") as stage:
        run_steps(trainer, stage, steps)
        return run_steps(trainer, stage, steps)


def stage_table(prof: Any) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(µs per stage, µs per op within each stage) of the stepping thread over the profile."""
    step: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in prof.events():
        stage = stage_of(event) or "outside any stage"
        step[stage] += event.self_cpu_time_total
        if not event.name.startswith((STAGE, _NODE)):
            ops[stage][event.name] += event.self_cpu_time_total
    return dict(step), ops


def main_ops(ops: dict[str, float], count: int = 3) -> str:
    """The ``count`` ops with the most self time in a stage, with their share of it."""
    total = sum(ops.values())
    top = sorted(ops.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{name.removeprefix('aten::')} {us / total:.0%}" for name, us in top if total > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="profiled steps")
    parser.add_argument("--items", type=int, default=20_000, help="window size")
    parser.add_argument("--ops", type=int, default=20, help="ops listed by self time")
    add_set_option(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    settings = load_settings(
        window_capacity=args.items, seed=args.seed, device="cpu", **service_settings(parser, args.set)
    )
    window = filled_window(args.items, args.seed)
    trainer = Trainer(settings, window, Metrics())
    trainer.forward.compiled.wait()  # COMPILE=on: profile the compiled step, not the eager one before it
    reference = matmul_flop_rate()
    wall, wait, tokens, lengths = timed_steps(trainer, args.steps)
    producer_seconds.clear()
    prof, profiled_wall, _, _, _ = profile_steps(trainer, args.steps)
    reference = max(reference, matmul_flop_rate())
    step_us, stage_ops = stage_table(prof)

    steps = args.steps
    unprofiled_ms = 1e3 * wall / steps
    parameters = sum(p.numel() for p in trainer.model.parameters())
    flops = sum(training_flops(parameters, settings.d_model, settings.n_layers, n) for n in lengths)
    tag = f"{BENCH}[compile={settings.compile}, amp={settings.amp}]"
    rows = [
        Row(tag, "ms/step, unprofiled (wall, data wait included)", unprofiled_ms),
        Row(tag, "ms/step under the profiler", 1e3 * profiled_wall / steps),
        Row(tag, "real tokens/s, unprofiled", tokens / wall),
        Row(tag, "training GFLOP/s vs 1024² fp32 matmul GFLOP/s", flops / wall / 1e9, reference / 1e9, ">= 0.60"),
        Row(tag, "data-wait share, unprofiled", wait / wall, None, "<= 0.05"),
    ]
    if not args.json:
        print(f"# {steps} steps, {parameters:,} parameters, torch {torch.__version__}, 1 thread")
    emit(rows, args.json)

    total_step = sum(step_us.values())
    order = sorted(step_us, key=lambda s: -step_us[s])
    body = [
        (stage, f"{step_us[stage] / 1e3 / steps:.2f}", f"{step_us[stage] / total_step:.1%}", main_ops(stage_ops[stage]))
        for stage in order
        if step_us[stage] / total_step >= 0.0005
    ]
    body.append(("(step thread, all stages)", f"{total_step / 1e3 / steps:.2f}", "100%", ""))
    body += [
        (f"producer thread: {stage}", f"{1e3 * producer_seconds[stage] / steps:.2f}", "(overlapped)", "")
        for stage in PRODUCER_STAGES
    ]
    ops = prof.key_averages()
    ops_sorted = sorted(ops, key=lambda o: -o.self_cpu_time_total)[: args.ops]
    op_body = [
        (
            o.key[:70],
            f"{o.self_cpu_time_total / 1e3 / steps:.2f}",
            f"{o.self_cpu_time_total / total_step:.1%}",
            f"{o.count / steps:.1f}",
        )
        for o in ops_sorted
    ]
    if args.json:
        for stage, ms, share, _ in body:
            print(f'{{"bench": "{tag}", "stage": "{stage}", "ms_per_step": {ms}, "share": "{share}"}}')
        return
    print()
    print_columns(("stage (profiled)", "ms/step", "share of step thread", "its largest ops"), body)
    print()
    print_columns(("op (self time, profiled)", "ms/step", "share of step thread", "calls/step"), op_body)


if __name__ == "__main__":
    main()
