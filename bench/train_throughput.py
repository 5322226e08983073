"""Real tokens trained per second: token-budget buckets vs fixed-size random batches.

Both arms train the same :class:`~streamtrain.model.network.SensorModel` (same settings, same
initial weights, :meth:`streamtrain.training.trainer.Trainer.train_step`: norm update, loss,
backward, clipping, optimizer step) from the same window until the same number of real
(unpadded) tokens has been trained:

* ours: the trainer's own dataset (``Trainer.dataset``: bounded passes of
  ``PASS_MAX_ITEMS``, token-budget batches of :func:`streamtrain.training.trainer.build_budget`) behind
  a :class:`~streamtrain.data.Prefetcher` of the service's ``PREFETCH_DEPTH`` (default 1):
  exactly the trainer thread's pipeline, with the service's default settings;
* fixed: shuffled epochs cut into batches of a fixed size, collated with
  :func:`streamtrain.data.collate`, behind the same Prefetcher. The size is chosen so the
  *mean padded* batch holds about as many tokens as the budget (so both arms do about
  the same work per step and the difference is how much of it is padding).

The window holds lognormal lengths (median 48, sigma 0.8, clipped to 4..512: the mix of
bench/batching.py). The arms run interleaved in ``--segments`` segments so machine
load hits them alike; every segment starts a fresh Prefetcher (a cold start, counted).
Data-wait share is the time the loop blocked on the Prefetcher over wait + step time.
Training FLOPs are counted as issue 24 counts them (``bench/_flops.py``: 6 x parameters
per real token plus causal attention), and set against this run's 1-thread 1024² float32
matmul rate (measured before and after the arms, the higher kept). With ``COMPILE=on``
the arms are timed once their forwards have compiled.
The default of 800k real tokens per arm is about 100 of our steps (and ~400 fixed ones);
the spread of our tokens/s across segments is reported so an unstable figure shows.

On a device (``--device cuda``, or ``--device cpu --amp bf16`` for the CPU's bf16) the
arms run exactly as the trainer thread does there: batches pinned in the producer thread,
copied one batch ahead on a side stream (:class:`~streamtrain.data.prefetch.DevicePrefetcher`),
with the settings the device brings (on a GPU the GPU profile: wider model, 65,536-token
budget, bf16; ``--set NAME=VALUE`` overrides any). Further rows:

* collate cost per batch: the producer thread's time per batch (plan + gather + collate,
  then pinning on a GPU), and :func:`~streamtrain.data.collate.collate_flat` alone on the
  same batches; ``producer batches/s`` against ``steps/s`` says whether the host keeps up;
* what each arm learned from its tokens: its model's one-step MSE on 2,000 fresh events of the
  window's kind over the last value's (so settings that change the steps per token, such as
  ``TOKEN_BUDGET``, compare on learning as well as speed);
* GPU busy share (CUDA only): the union of kernel and copy intervals recorded by
  ``torch.profiler`` over ``--profile-steps`` steps of ours, over the wall time of those
  steps, and NVML's utilization (``torch.cuda.utilization``, sampled every 50 ms) over the
  timed segments as a cross-check.

Run: ``python bench/train_throughput.py [--tokens N] [--threads 1,2] [--device cpu|cuda] [--amp bf16|off]
[--arms ours,fixed] [--set NAME=VALUE] [--json]`` (default: 1 thread, the service default
``TORCH_THREADS``, on the CPU; about 4 minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _flops import matmul_flop_rate, training_flops  # noqa: E402
from _settings import add_set_option, service_settings  # noqa: E402
from _table import Row, emit  # noqa: E402

from streamtrain.cli import leave  # noqa: E402
from streamtrain.config import Settings, load_settings  # noqa: E402
from streamtrain.data import Batch, Prefetcher, collate  # noqa: E402
from streamtrain.data.collate import collate_flat  # noqa: E402
from streamtrain.data.prefetch import DevicePrefetcher, pin_batch  # noqa: E402
from streamtrain.device import describe, is_cuda  # noqa: E402
from streamtrain.events import EventBatch, SensorEvent  # noqa: E402
from streamtrain.metrics import Metrics  # noqa: E402
from streamtrain.quality.scoring import score_events  # noqa: E402
from streamtrain.training.trainer import Trainer  # noqa: E402
from streamtrain.window.reservoir import RecencyWindow
from streamtrain.window.snapshot import WindowSnapshot  # noqa: E402

BENCH = "train_throughput"


def lognormal_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """The issue's mix: lognormal, median 48, sigma 0.8, clipped to 4..512."""
    return np.clip(np.round(rng.lognormal(math.log(48), 0.8, n)), 4, 512).astype(np.int64)


def make_events(n: int, rng: np.random.Generator, ts: float | None = None) -> list[SensorEvent]:
    """Noisy sinusoids (a learnable signal) with lognormal lengths, one random phase/period each."""
    lengths = lognormal_lengths(n, rng)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    step = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)
    omega = np.repeat(rng.uniform(2 * np.pi / 64, 2 * np.pi / 8, n), lengths)
    phase = np.repeat(rng.uniform(0, 2 * np.pi, n), lengths)
    flat = (np.sin(omega * step + phase) + 0.1 * rng.standard_normal(step.size)).astype(np.float32)
    values = np.split(flat.reshape(-1, 1), starts[1:])
    now = time.time() if ts is None else ts
    return [SensorEvent(f"sensor-{i % 64}", now, v) for i, v in enumerate(values)]


def filled_window(items: int, seed: int) -> RecencyWindow:
    window = RecencyWindow(items, math.inf, rng=np.random.default_rng(seed))
    events = make_events(items, np.random.default_rng(seed))
    for i in range(0, items, 5000):
        window.insert_batch(EventBatch.from_events(events[i : i + 5000]))
    return window


def fixed_batch_size(lengths: np.ndarray, budget_tokens: int, seed: int, samples: int = 400) -> int:
    """The batch size whose mean padded batch (size x longest) is closest to the budget."""
    rng = np.random.default_rng(seed)
    best, best_gap = 1, math.inf
    for size in range(1, min(lengths.size, budget_tokens) + 1):
        picks = lengths[rng.integers(0, lengths.size, (samples, size))]
        mean_padded = float((size * picks.max(axis=1)).mean())
        gap = abs(mean_padded - budget_tokens)
        if gap < best_gap:
            best, best_gap = size, gap
        if mean_padded > budget_tokens:
            break
    return best


def fixed_random_batches(snapshot: WindowSnapshot, batch_size: int, seed: int) -> Iterator[Batch]:
    """Endless shuffled epochs in fixed-size batches (the last short batch of an epoch kept)."""
    rng = np.random.default_rng(seed)
    values = snapshot.values
    while True:
        order = rng.permutation(len(snapshot))
        for start in range(0, order.size, batch_size):
            index = order[start : start + batch_size]
            yield collate([values[i] for i in index.tolist()], snapshot.labels[index], snapshot.ts[index])


class ProducerClock:
    """Times the producer thread's work per batch: drawing it from the source, and pinning it."""

    def __init__(self) -> None:
        self.batches = 0
        self.source_seconds = 0.0
        self.pin_seconds = 0.0
        self.samples: list[Batch] = []  # a few batches for timing collate alone afterwards

    def timed(self, source: Iterable[Batch]) -> Iterator[Batch]:
        iterator = iter(source)
        try:
            while True:
                started = time.perf_counter()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                self.source_seconds += time.perf_counter() - started
                self.batches += 1
                if len(self.samples) < 16 and self.batches % 3 == 1:
                    self.samples.append(batch)
                yield batch
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def pin(self, batch: Batch) -> Batch:
        started = time.perf_counter()
        pinned = pin_batch(batch)
        self.pin_seconds += time.perf_counter() - started
        return pinned


@dataclass
class Arm:
    """One training setup and what it has done so far."""

    name: str
    trainer: Trainer
    source: Callable[[], Iterable[Batch]]  # a fresh batch iterable
    real_tokens: int = 0
    flops: float = 0.0  # training FLOPs of the real tokens (bench/_flops.py)
    padded_tokens: int = 0
    steps: int = 0
    sequences: int = 0
    step_seconds: float = 0.0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    segment_rates: list[float] = field(default_factory=list)
    producer: ProducerClock = field(default_factory=ProducerClock)

    def pipeline(self) -> DevicePrefetcher:
        """The trainer thread's pipeline: a Prefetcher (pinning on a GPU), then the device stage."""
        device = self.trainer.device
        prefetcher = Prefetcher(
            self.producer.timed(self.source()),
            depth=self.trainer.settings.prefetch_depth,
            name=f"bench-{self.name}",
            transform=self.producer.pin if is_cuda(device) else None,
        )
        return DevicePrefetcher(prefetcher, device)

    def run_segment(self, until_tokens: int, seconds: float = math.inf) -> None:
        """Train until this arm's real tokens reach ``until_tokens`` or ``seconds`` have passed (a fresh
        pipeline)."""
        started, tokens_before = time.perf_counter(), self.real_tokens
        deadline = started + seconds
        with self.pipeline() as stage:
            while self.real_tokens < until_tokens and time.perf_counter() < deadline:
                waited = time.perf_counter()
                batch = next(stage)
                stepped = time.perf_counter()
                self.trainer.train_step(batch)
                done = time.perf_counter()
                self.wait_seconds += stepped - waited
                self.step_seconds += done - stepped
                self.real_tokens += batch.real_tokens
                self.flops += self.flops_of(batch)
                self.padded_tokens += batch.padded_tokens
                self.sequences += batch.batch_size
                self.steps += 1
        self.wall_seconds += time.perf_counter() - started
        self.segment_rates.append((self.real_tokens - tokens_before) / (time.perf_counter() - started))

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.wall_seconds

    def flops_of(self, batch: Batch) -> float:
        settings = self.trainer.settings
        parameters = sum(p.numel() for p in self.trainer.model.parameters())
        return training_flops(parameters, settings.d_model, settings.n_layers, batch.lengths.numpy())

    @property
    def padding_share(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens

    @property
    def data_wait_share(self) -> float:
        return self.wait_seconds / (self.wait_seconds + self.step_seconds)


def collate_seconds(samples: list[Batch], repeats: int = 3) -> float:
    """Mean time of :func:`collate_flat` alone (the dataset's last stage) on these batches."""
    inputs = [(b.values[b.mask].numpy(), b.lengths.numpy(), b.labels.numpy(), b.ts.numpy()) for b in samples]
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        for flat, lengths, labels, ts in inputs:
            collate_flat(flat, lengths, labels, ts)
        best = min(best, time.perf_counter() - started)
    return best / max(1, len(inputs))


class UtilizationSampler:
    """NVML's GPU utilization (percent of time a kernel ran), sampled on a thread."""

    def __init__(self, device: torch.device, interval_s: float = 0.05) -> None:
        self.device, self.interval_s = device, interval_s
        self.samples: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(float(torch.cuda.utilization(self.device)) / 100.0)
            except Exception as err:  # noqa: BLE001 - no NVML (pynvml) here: the row says so
                self.error = f"{type(err).__name__}: {err}"
                return

    def __enter__(self) -> UtilizationSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def mean(self) -> float:
        return float(np.mean(self.samples)) if self.samples else math.nan


def profiled_busy_share(arm: Arm, steps: int, op_table: bool = False) -> tuple[float, str]:
    """(share of wall time some kernel or copy ran on the GPU, how measured) over ``steps`` steps of ``arm``;
    ``op_table`` also records the host's ops and prints both sides' op tables to stderr."""
    from torch.profiler import ProfilerActivity, profile

    device = arm.trainer.device
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if op_table else [])]
    try:
        with arm.pipeline() as stage:
            next(stage)  # the pipeline's cold start is not part of the steady state
            torch.cuda.synchronize(device)
            with profile(activities=activities) as prof:
                started = time.perf_counter()
                for _ in range(steps):
                    arm.trainer.train_step(next(stage))
                torch.cuda.synchronize(device)
                wall_us = (time.perf_counter() - started) * 1e6
        intervals = sorted(
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
        )
    except Exception as err:  # noqa: BLE001 - CUPTI may be unavailable: the row says why
        return math.nan, f"torch.profiler failed: {type(err).__name__}: {err}"
    if op_table:
        print_op_tables(prof, f"{steps} steps of {arm.name}, wall {wall_us / 1e3:.0f} ms", device_too=True)
    if not intervals:
        return math.nan, "torch.profiler recorded no GPU activity"
    busy, (start, end) = 0.0, intervals[0]
    for a, b in intervals[1:]:
        if a > end:
            busy += end - start
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start
    return busy / wall_us, f"torch.profiler kernel+copy union over {steps} steps"


def print_op_tables(prof: torch.profiler.profile, title: str, device_too: bool, rows: int = 25) -> None:
    """The profile's ops by host time (and by device time), to stderr (a GPU check's log keeps them)."""
    averages = prof.key_averages()
    for key in ("self_cpu_time_total", *(["self_device_time_total"] if device_too else [])):
        print(f"# op table ({title}), by {key}", file=sys.stderr)
        print(averages.table(sort_by=key, row_limit=rows), file=sys.stderr)


def profiled_host_ops(arm: Arm, steps: int) -> None:
    """The host's op table over ``steps`` steps of ``arm`` (CPU), to stderr."""
    from torch.profiler import ProfilerActivity, profile

    with arm.pipeline() as stage:
        next(stage)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                arm.trainer.train_step(next(stage))
            wall_ms = (time.perf_counter() - started) * 1e3
    print_op_tables(prof, f"{steps} steps of {arm.name}, wall {wall_ms:.0f} ms", device_too=False)


def heldout_over_last_value(trainer: Trainer, seed: int, events: int = 2000) -> float:
    """What the arm learned from its tokens: one-step MSE on ``events`` fresh events of the window's
    kind (another seed), over the last value's on the same targets (below 1: it beat the last value)."""
    values = [e.values for e in make_events(events, np.random.default_rng(1000 + seed))]
    scores = score_events(trainer.model, trainer.norm, values, token_budget=trainer.settings.token_budget)
    return float(scores.sse.sum() / scores.naive_sse.sum())


def warm_up(trainer: Trainer, batch: Batch, steps: int = 2) -> None:
    for _ in range(steps):
        trainer.train_step(batch)


def measure(
    settings: Settings,
    window: RecencyWindow,
    tokens: int,
    segments: int,
    seed: int,
    arms: list[str],
    max_seconds: float = math.inf,
) -> tuple[dict[str, Arm], int, float | None]:
    snapshot = window.snapshot()
    batch_size = fixed_batch_size(snapshot.lengths, settings.token_budget, seed)
    built: dict[str, Arm] = {}
    if "ours" in arms:
        trainer = Trainer(settings, window, Metrics())
        built["ours"] = Arm("ours", trainer, lambda: trainer.dataset)  # the trainer thread's own pipeline
    if "fixed" in arms:
        fixed_seed = iter(range(seed, seed + 10_000))
        built["fixed"] = Arm(
            "fixed",
            Trainer(settings, window, Metrics()),
            lambda: fixed_random_batches(snapshot, batch_size, next(fixed_seed)),
        )
    # Compilation (COMPILE=on: a background thread), then allocator and kernel warm-up, outside the timing.
    for arm in built.values():  # at most max_seconds: then timed with whatever runs (the COMPILE row says)
        arm.trainer.forward.compiled.wait(None if math.isinf(max_seconds) else max_seconds)
    for arm in built.values():
        with arm.pipeline() as stage:
            for _ in range(3):
                arm.trainer.train_step(next(stage))
        arm.producer = ProducerClock()
    device = next(iter(built.values())).trainer.device
    sampler = UtilizationSampler(device) if is_cuda(device) else None
    with sampler if sampler is not None else _nothing():
        for segment in range(1, segments + 1):
            goal = tokens * segment // segments
            order = list(built.values())
            for arm in order if segment % 2 else order[::-1]:
                arm.run_segment(goal, max_seconds / segments / len(order))
    return built, batch_size, None if sampler is None else sampler.mean


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=int, default=800_000, help="real tokens each arm trains (per thread count; ~100 steps of ours)"
    )
    parser.add_argument("--threads", default="1", help="torch intra-op thread counts, comma separated (e.g. 1,2)")
    parser.add_argument("--items", type=int, default=20_000, help="window size")
    parser.add_argument("--segments", type=int, default=4, help="interleaved segments per arm")
    parser.add_argument(
        "--device", default="cpu", help="DEVICE: cpu, cuda, cuda:N or auto (a GPU brings the GPU profile)"
    )
    parser.add_argument(
        "--amp", choices=["bf16", "off"], default=None, help="AMP (default: the device's, off on the CPU)"
    )
    parser.add_argument("--arms", default="ours,fixed", help="which arms to run: ours, fixed or both")
    add_set_option(parser)
    parser.add_argument("--profile-steps", type=int, default=30, help="steps of ours under torch.profiler (CUDA)")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=math.inf,
        help="bound on the timed segments together (each arm and segment its share), and on the compile wait",
    )
    parser.add_argument("--op-table", action="store_true", help="print torch.profiler's op tables of ours to stderr")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - {"ours", "fixed"}:
        parser.error("--arms: ours, fixed or ours,fixed")

    overrides = {"device": args.device, **({"amp": args.amp} if args.amp else {}), **service_settings(parser, args.set)}
    settings = load_settings(window_capacity=args.items, seed=args.seed, **overrides)
    window = filled_window(args.items, args.seed)
    device = torch.device(settings.device)
    rows: list[Row] = []
    for threads in (int(t) for t in args.threads.split(",")):
        reference = matmul_flop_rate(threads=1)  # this run's 1-thread fp32 matmul, before and after
        torch.set_num_threads(threads)
        built, batch_size, utilization = measure(
            settings, window, args.tokens, args.segments, args.seed, arms, args.max_seconds
        )
        reference = max(reference, matmul_flop_rate(threads=1))
        ours, fixed = built.get("ours"), built.get("fixed")
        tag = f"{BENCH}[threads={threads}]" if device.type == "cpu" and settings.amp == "off" else (
            f"{BENCH}[{device.type}, amp={settings.amp}, threads={threads}]")  # fmt: skip
        if ours is not None and fixed is not None:
            rows += [
                Row(tag, "real tokens/s (ours vs fixed)", ours.tokens_per_s, fixed.tokens_per_s, ">= 2.0x fixed"),
                Row(tag, "data-wait share of step time (ours)", ours.data_wait_share, None, "<= 0.05"),
                Row(tag, "data-wait share of step time (fixed)", fixed.data_wait_share),
                Row(tag, "padding share (ours vs fixed)", ours.padding_share, fixed.padding_share),
                Row(tag, "padded tokens/step (ours vs fixed)", ours.padded_tokens / ours.steps,
                    fixed.padded_tokens / fixed.steps),
                Row(tag, "sequences/step (ours vs fixed)", ours.sequences / ours.steps, fixed.sequences / fixed.steps),
                Row(tag, f"steps (fixed batch size {batch_size})", ours.steps, fixed.steps),
                Row(tag, "real tokens trained (ours vs fixed)", ours.real_tokens, fixed.real_tokens),
            ]  # fmt: skip
        else:
            arm = ours or fixed
            assert arm is not None
            rows += [
                Row(tag, f"real tokens/s ({arm.name})", arm.tokens_per_s),
                Row(tag, f"data-wait share of step time ({arm.name})", arm.data_wait_share, None, "<= 0.05"),
                Row(tag, f"padding share ({arm.name})", arm.padding_share),
                Row(tag, f"padded tokens/step ({arm.name})", arm.padded_tokens / arm.steps),
                Row(tag, f"steps ({arm.name})", arm.steps),
            ]
        for arm in built.values():
            clock = arm.producer
            rows.append(Row(tag, f"held-out one-step MSE / last value's, 2,000 fresh events ({arm.name})",
                            heldout_over_last_value(arm.trainer, args.seed)))  # fmt: skip
            per_batch = clock.source_seconds / max(1, clock.batches)
            rows += [
                Row(tag, f"producer ms/batch: plan + gather + collate ({arm.name})", 1e3 * per_batch),
                Row(tag, f"collate_flat alone ms/batch ({arm.name})", 1e3 * collate_seconds(clock.samples)),
                Row(tag, f"producer batches/s vs training steps/s ({arm.name})",
                    clock.batches / max(1e-9, clock.source_seconds + clock.pin_seconds),
                    arm.steps / (arm.wait_seconds + arm.step_seconds)),
            ]  # fmt: skip
            if is_cuda(device):
                rows.append(
                    Row(
                        tag,
                        f"pin ms/batch, producer thread ({arm.name})",
                        1e3 * clock.pin_seconds / max(1, clock.batches),
                    )
                )
        if ours is not None:
            rows.append(
                Row(tag, "ours tokens/s, slowest vs fastest segment", min(ours.segment_rates), max(ours.segment_rates))
            )
            if device.type == "cpu":
                rows.append(Row(tag, "training GFLOP/s (ours) vs this run's 1-thread 1024² fp32 matmul GFLOP/s",
                                ours.flops / ours.wall_seconds / 1e9, reference / 1e9, ">= 0.60"))  # fmt: skip
            if args.op_table and not is_cuda(device):
                profiled_host_ops(ours, args.profile_steps)
            if is_cuda(device):
                busy, how = profiled_busy_share(ours, args.profile_steps, args.op_table)
                rows.append(Row(tag, f"GPU busy share ({how})", busy, None, ">= 0.90"))
                rows.append(
                    Row(
                        tag,
                        "GPU utilization, NVML mean over the timed segments",
                        utilization if utilization is not None else math.nan,
                    )
                )
        rows += [
            Row(
                tag,
                f"COMPILE, AMP (the service's): {settings.compile}, {settings.amp}",
                float(next(iter(built.values())).trainer.forward.compiled.compiled),
            ),
            Row(
                tag,
                "compile seconds (training forward, background)",
                next(iter(built.values())).trainer.forward.compiled.compile_seconds or math.nan,
            ),
            Row(tag, "PREFETCH_DEPTH (the service's)", settings.prefetch_depth),
            Row(tag, "PASS_MAX_ITEMS (the service's)", settings.pass_max_items),
            Row(
                tag,
                f"TOKEN_BUDGET, D_MODEL, N_LAYERS (GPU profile: {', '.join(settings.gpu_profile_applied) or 'none'})",
                settings.token_budget,
                None,
                f"d_model={settings.d_model}, n_layers={settings.n_layers}, heads={settings.n_heads}",
            ),
        ]
    if not args.json:
        print(f"# device: {describe(device)}; amp={settings.amp}")
    emit(rows, args.json)


if __name__ == "__main__":
    main()
    # --max-seconds may stop waiting for the compile: the interpreter's teardown under a
    # compile thread aborts (status 134), so leave as the service does
    sys.exit(leave(0))
