"""Real tokens trained per second: token-budget buckets vs fixed-size random batches.

Both arms train the same :class:`~streamtrain.model.SensorModel` (same settings, same
initial weights, :meth:`streamtrain.train.Trainer.train_step`: norm update, loss,
backward, clipping, optimizer step) from the same window until the same number of real
(unpadded) tokens has been trained:

* ours: the trainer's own dataset (``Trainer.dataset``: bounded passes of
  ``PASS_MAX_ITEMS``, token-budget batches of :func:`streamtrain.train.build_budget`) behind
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
The default of 800k real tokens per arm is about 100 of our steps (and ~400 fixed ones);
the spread of our tokens/s across segments is reported so an unstable figure shows.

Run: ``python bench/train_throughput.py [--tokens N] [--threads 1,2] [--json]`` (default: 1 thread,
the service default ``TORCH_THREADS``; about 4 minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.config import Settings, load_settings  # noqa: E402
from streamtrain.data import Batch, Prefetcher, collate  # noqa: E402
from streamtrain.events import EventBatch, SensorEvent  # noqa: E402
from streamtrain.metrics import Metrics  # noqa: E402
from streamtrain.train import Trainer  # noqa: E402
from streamtrain.window import RecencyWindow, WindowSnapshot  # noqa: E402

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


@dataclass
class Arm:
    """One training setup and what it has done so far."""

    name: str
    trainer: Trainer
    source: object  # a zero-argument callable returning a fresh batch iterable
    real_tokens: int = 0
    padded_tokens: int = 0
    steps: int = 0
    sequences: int = 0
    step_seconds: float = 0.0
    wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    segment_rates: list[float] = field(default_factory=list)

    def run_segment(self, until_tokens: int) -> None:
        """Train until this arm's real tokens reach ``until_tokens`` (a fresh Prefetcher)."""
        started, tokens_before = time.perf_counter(), self.real_tokens
        depth = self.trainer.settings.prefetch_depth
        with Prefetcher(self.source(), depth=depth, name=f"bench-{self.name}") as prefetcher:
            while self.real_tokens < until_tokens:
                waited = time.perf_counter()
                batch = next(prefetcher)
                stepped = time.perf_counter()
                self.trainer.train_step(batch)
                done = time.perf_counter()
                self.wait_seconds += stepped - waited
                self.step_seconds += done - stepped
                self.real_tokens += batch.real_tokens
                self.padded_tokens += batch.padded_tokens
                self.sequences += batch.batch_size
                self.steps += 1
        self.wall_seconds += time.perf_counter() - started
        self.segment_rates.append((self.real_tokens - tokens_before) / (time.perf_counter() - started))

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.wall_seconds

    @property
    def padding_share(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens

    @property
    def data_wait_share(self) -> float:
        return self.wait_seconds / (self.wait_seconds + self.step_seconds)


def warm_up(trainer: Trainer, batch: Batch, steps: int = 2) -> None:
    for _ in range(steps):
        trainer.train_step(batch)


def measure(settings: Settings, window: RecencyWindow, tokens: int, segments: int, seed: int) -> tuple[Arm, Arm, int]:
    snapshot = window.snapshot()
    batch_size = fixed_batch_size(snapshot.lengths, settings.token_budget, seed)
    trainer = Trainer(settings, window, Metrics())
    ours = Arm("ours", trainer, lambda: trainer.dataset)  # the trainer thread's own pipeline
    fixed_seed = iter(range(seed, seed + 10_000))
    fixed = Arm(
        "fixed",
        Trainer(settings, window, Metrics()),
        lambda: fixed_random_batches(snapshot, batch_size, next(fixed_seed)),
    )
    # Allocator and kernel warm-up on a batch of each shape family, outside the timing.
    warm_up(ours.trainer, next(iter(trainer.dataset)))
    warm_up(fixed.trainer, next(fixed_random_batches(snapshot, batch_size, seed)))
    for segment in range(1, segments + 1):
        goal = tokens * segment // segments
        for arm in (ours, fixed) if segment % 2 else (fixed, ours):
            arm.run_segment(goal)
    return ours, fixed, batch_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens", type=int, default=800_000, help="real tokens each arm trains (per thread count; ~100 steps of ours)"
    )
    parser.add_argument("--threads", default="1", help="torch intra-op thread counts, comma separated (e.g. 1,2)")
    parser.add_argument("--items", type=int, default=20_000, help="window size")
    parser.add_argument("--segments", type=int, default=4, help="interleaved segments per arm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    settings = load_settings(window_capacity=args.items, seed=args.seed)
    window = filled_window(args.items, args.seed)
    rows: list[Row] = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        ours, fixed, batch_size = measure(settings, window, args.tokens, args.segments, args.seed)
        tag = f"{BENCH}[threads={threads}]"
        rows += [
            Row(tag, "real tokens/s (ours vs fixed)", ours.tokens_per_s, fixed.tokens_per_s, ">= 2.0x fixed"),
            Row(tag, "data-wait share of step time (ours)", ours.data_wait_share, None, "<= 0.05"),
            Row(tag, "data-wait share of step time (fixed)", fixed.data_wait_share),
            Row(tag, "padding share (ours vs fixed)", ours.padding_share, fixed.padding_share),
            Row(tag, "padded tokens/step (ours vs fixed)", ours.padded_tokens / ours.steps,
                fixed.padded_tokens / fixed.steps),
            Row(tag, "sequences/step (ours vs fixed)", ours.sequences / ours.steps, fixed.sequences / fixed.steps),
            Row(tag, f"steps (fixed batch size {batch_size})", ours.steps, fixed.steps),
            Row(tag, "ours tokens/s, slowest vs fastest segment", min(ours.segment_rates), max(ours.segment_rates)),
            Row(tag, "PREFETCH_DEPTH (the service's)", settings.prefetch_depth),
            Row(tag, "PASS_MAX_ITEMS (the service's)", settings.pass_max_items),
            Row(tag, "real tokens trained (ours vs fixed)", ours.real_tokens, fixed.real_tokens),
        ]  # fmt: skip
    emit(rows, args.json)


if __name__ == "__main__":
    main()
