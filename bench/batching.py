"""Batching strategies side by side: padding, batch mixing, planning speed and memory.

On the same lengths and the same token budget: (a) fixed-size random batches, (b) Hugging
Face's length-grouped megabatches (``get_length_grouped_indices``), (c) lhotse's
``DynamicBucketingSampler`` over synthetic cuts whose duration is the length, with its
default 10 buckets and with ``num_buckets=30``, as a user who cares about padding would
set it (the comparison targets use the 30-bucket setting, the better of the two on
padding), and (d) ours (:func:`streamtrain.data.plan_batches`), seeded and crypto.
Fixed-size strategies get ``budget // mean length`` sequences per batch, the same real tokens per batch a perfectly
packed token budget would hold; their batches may exceed the budget once padded, which
the ``over_budget`` column counts. Every strategy is scored by the same function
(:func:`streamtrain.data.describe_plan`).

Planning throughput is items planned per second, timed the same way for every strategy:
one untimed warm-up run, then the best of ``--repeats`` runs (for lhotse a run builds
the sampler over the in-memory cuts and iterates it). Peak memory is tracemalloc's peak
during a separate planning run; it sees numpy and Python allocations, not torch's (so HF's
``randperm`` buffer is not counted).

The ``loader`` rows justify the prefetch thread over DataLoader worker processes: the time
to plan and collate one batch from a window snapshot in process, a DataLoader with worker
processes over the same passes, and how long a trainer with a fixed step time waits for
data behind a :class:`~streamtrain.data.Prefetcher`.

Run: ``python bench/batching.py [--items N] [--budget TOKENS] [--json]``.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.data import (
    CryptoRandomness,
    Prefetcher,
    SeededRandomness,
    TokenBudget,
    WindowBatchDataset,
    describe_plan,
    plan_batches,
)
from streamtrain.window.snapshot import WindowSnapshot

BENCH = "batching"
LHOTSE = "lhotse_30_buckets"  # the baseline: lhotse as a padding-conscious user configures it
Planner = Callable[[], list[np.ndarray]]


def lognormal_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """The issue's mix: lognormal, median 48, sigma 0.8, clipped to 4..512."""
    return np.clip(np.round(rng.lognormal(np.log(48), 0.8, n)), 4, 512).astype(np.int64)


def bimodal_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """Short bursts and long recordings: 60% lognormal(median 24, 0.4), 40% lognormal(median 320, 0.25)."""
    long = rng.random(n) < 0.4
    medians = np.where(long, 320.0, 24.0)
    sigmas = np.where(long, 0.25, 0.4)
    return np.clip(np.round(medians * np.exp(sigmas * rng.standard_normal(n))), 4, 512).astype(np.int64)


def fixed_random(lengths: np.ndarray, batch_size: int, seed: int) -> Planner:
    def plan() -> list[np.ndarray]:
        order = np.random.default_rng(seed).permutation(lengths.size)
        return np.split(order, np.arange(batch_size, lengths.size, batch_size))

    return plan


def hf_megabatches(lengths: np.ndarray, batch_size: int, seed: int) -> Planner:
    from transformers.trainer_pt_utils import get_length_grouped_indices

    as_list = lengths.tolist()  # what LengthGroupedSampler holds

    def plan() -> list[np.ndarray]:
        generator = torch.Generator().manual_seed(seed)
        order = np.asarray(get_length_grouped_indices(as_list, batch_size, generator=generator), dtype=np.int64)
        return np.split(order, np.arange(batch_size, lengths.size, batch_size))

    return plan


def lhotse_dynamic_bucketing(lengths: np.ndarray, budget: int, seed: int, num_buckets: int = 10) -> Planner:
    from lhotse import CutSet, MonoCut
    from lhotse.dataset import DynamicBucketingSampler

    cuts = CutSet.from_cuts(
        MonoCut(id=str(i), start=0.0, duration=float(length), channel=0) for i, length in enumerate(lengths.tolist())
    )

    def plan() -> list[np.ndarray]:
        with warnings.catch_warnings():  # it suggests a lazy CutSet; the cuts are in memory on purpose
            warnings.simplefilter("ignore", UserWarning)
            sampler = DynamicBucketingSampler(
                cuts, max_duration=float(budget), shuffle=True, seed=seed, num_buckets=num_buckets
            )
            return [np.fromiter((int(cut.id) for cut in batch), dtype=np.int64) for batch in sampler]

    return plan


def ours(lengths: np.ndarray, budget: TokenBudget, seed: int, crypto: bool = False) -> Planner:
    def plan() -> list[np.ndarray]:
        rng = CryptoRandomness() if crypto else SeededRandomness(seed)
        return plan_batches(lengths, budget, rng).batches

    return plan


@dataclass
class Result:
    strategy: str
    padding_share: float
    adjacent_length_corr: float
    items_per_s: float
    peak_mib: float
    batches: int
    mean_sequences: float
    over_budget: int
    covered: bool


def measure(name: str, planner: Planner, lengths: np.ndarray, budget: TokenBudget, repeats: int) -> Result:
    planner()  # warm-up: imports, caches and allocator, outside the timing
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        batches = planner()
        best = min(best, time.perf_counter() - started)
    tracemalloc.start()
    planner()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    diagnostics = describe_plan(batches, lengths, budget)
    widths = budget.padded_length([int(lengths[b].max()) for b in batches])
    sizes = np.array([b.size for b in batches])
    over_budget = int(np.count_nonzero(sizes * widths > budget.max_tokens))
    emitted = np.concatenate(batches)
    return Result(
        strategy=name,
        padding_share=diagnostics.padding_share,
        adjacent_length_corr=diagnostics.adjacent_length_corr,
        items_per_s=lengths.size / best,
        peak_mib=peak / 2**20,
        batches=len(batches),
        mean_sequences=diagnostics.mean_sequences_per_batch,
        over_budget=over_budget,
        covered=emitted.size == lengths.size and np.unique(emitted).size == lengths.size,
    )


def compare(distribution: str, lengths: np.ndarray, args: argparse.Namespace) -> list[Result]:
    budget = TokenBudget(args.budget)
    batch_size = max(1, args.budget // round(float(lengths.mean())))
    strategies: list[tuple[str, Planner]] = [
        ("fixed_random", fixed_random(lengths, batch_size, args.seed)),
        ("hf_megabatch", hf_megabatches(lengths, batch_size, args.seed)),
        ("lhotse_10_buckets", lhotse_dynamic_bucketing(lengths, args.budget, args.seed, num_buckets=10)),
        (LHOTSE, lhotse_dynamic_bucketing(lengths, args.budget, args.seed, num_buckets=30)),
        ("ours_seeded", ours(lengths, budget, args.seed)),
        ("ours_crypto", ours(lengths, budget, args.seed, crypto=True)),
    ]
    return [measure(name, planner, lengths, budget, args.repeats) for name, planner in strategies]


def loader_rows(args: argparse.Namespace) -> list[Row]:
    """Plan + collate cost per batch in process, with worker processes, and behind the prefetch thread."""
    rng = np.random.default_rng(args.seed)
    lengths = lognormal_lengths(args.loader_items, rng)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    n = lengths.size
    snapshot = WindowSnapshot(
        flat_values=rng.standard_normal((int(lengths.sum()), 1)).astype(np.float32),
        starts=starts,
        lengths=lengths,
        ts=np.arange(n, dtype=np.float64),
        labels=np.full(n, -1, np.int64),
        keys=np.zeros(n),
        sensor_ids=np.full(n, "s", dtype=object),
        partitions=np.zeros(n, np.int32),
        offsets=np.arange(n, dtype=np.int64),
    )
    budget = TokenBudget(args.budget)
    passes = 3

    def dataset(**kwargs: object) -> WindowBatchDataset:
        return WindowBatchDataset(lambda: snapshot, budget, seed=args.seed, max_passes=passes, **kwargs)

    started = time.perf_counter()
    batches = sum(1 for _ in dataset())
    in_process = time.perf_counter() - started
    per_batch_ms = 1e3 * in_process / batches

    started = time.perf_counter()
    loader = torch.utils.data.DataLoader(
        dataset(allow_worker_processes=True), batch_size=None, num_workers=args.workers
    )
    worker_batches, first_arrival = 0, 0.0
    for _ in loader:
        worker_batches += 1
        if worker_batches == 1:
            first_arrival = time.perf_counter()
    finished = time.perf_counter()
    assert worker_batches == batches
    startup_s = first_arrival - started
    steady_ms = 1e3 * (finished - first_arrival) / max(1, worker_batches - 1)

    step_s = args.step_ms / 1e3
    with Prefetcher(dataset(), depth=4) as prefetcher:
        for _ in prefetcher:
            time.sleep(step_s)  # the accelerator step; the host thread is free meanwhile
    wait_ms = 1e3 * prefetcher.data_wait_seconds / prefetcher.items_delivered
    return [
        Row(BENCH, f"loader/in_process/ms_per_batch ({n} items, {passes} passes)", per_batch_ms),
        Row(
            BENCH,
            f"loader/dataloader_{args.workers}_workers/ms_per_batch_after_first",
            steady_ms,
            baseline=per_batch_ms,
            target="workers only if < 1x",
        ),
        Row(BENCH, f"loader/dataloader_{args.workers}_workers/seconds_to_first_batch", startup_s),
        Row(
            BENCH,
            f"loader/prefetch_thread/wait_ms_per_batch (step {args.step_ms:g} ms)",
            wait_ms,
            baseline=args.step_ms,
            target="<< step",
        ),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000, help="items per length distribution")
    parser.add_argument("--budget", type=int, default=16_384, help="token budget: sequences x padded length")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per strategy after a warm-up (best counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loader-items", type=int, default=50_000, help="window size for the loader rows")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes in the loader rows")
    parser.add_argument("--step-ms", type=float, default=5.0, help="simulated training step for the prefetch row")
    parser.add_argument("--skip-loader", action="store_true", help="only the planning comparison")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    return parser.parse_args(argv)


def print_side_by_side(distribution: str, results: list[Result], args: argparse.Namespace) -> None:
    print(f"\n{distribution}: {args.items:,} items, budget {args.budget:,} tokens")
    header = (
        f"{'strategy':<16}{'padding':>9}{'adj corr':>10}{'items/s':>14}{'peak MiB':>10}"
        f"{'batches':>9}{'seq/batch':>11}{'over budget':>13}{'exactly once':>14}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.strategy:<16}{r.padding_share:>9.2%}{r.adjacent_length_corr:>10.3f}{r.items_per_s:>14,.0f}"
            f"{r.peak_mib:>10.1f}{r.batches:>9,}{r.mean_sequences:>11.1f}{r.over_budget:>13,}{str(r.covered):>14}"
        )


def result_rows(distribution: str, results: list[Result]) -> list[Row]:
    by_name = {r.strategy: r for r in results}
    lhotse = by_name[LHOTSE]
    rows = []
    for r in results:
        prefix = f"{distribution}/{r.strategy}"
        is_ours = r.strategy.startswith("ours")
        rows += [
            Row(BENCH, f"{prefix}/padding_share (baseline: {LHOTSE})", r.padding_share,
                lhotse.padding_share if is_ours else None,
                "<= 0.03" if is_ours and distribution == "lognormal" else ""),
            Row(BENCH, f"{prefix}/adjacent_length_corr", r.adjacent_length_corr, None,
                "<= 0.15" if is_ours and distribution == "lognormal" else ""),
            Row(BENCH, f"{prefix}/items_per_s (baseline: {LHOTSE})", r.items_per_s,
                lhotse.items_per_s if is_ours else None, ">= 1e6 and >= 10x" if is_ours else ""),
            Row(BENCH, f"{prefix}/peak_mib", r.peak_mib),
            Row(BENCH, f"{prefix}/over_budget_batches", float(r.over_budget)),
        ]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows: list[Row] = []
    failures = []
    for distribution, make in (("lognormal", lognormal_lengths), ("bimodal", bimodal_lengths)):
        lengths = make(args.items, np.random.default_rng(args.seed))
        results = compare(distribution, lengths, args)
        if not args.json:
            print_side_by_side(distribution, results, args)
        rows += result_rows(distribution, results)
        by_name = {r.strategy: r for r in results}
        seeded = by_name["ours_seeded"]
        if distribution == "lognormal" and (seeded.padding_share > 0.03 or abs(seeded.adjacent_length_corr) > 0.15):
            failures.append("lognormal padding or adjacent-batch correlation over target")
        if seeded.items_per_s < max(1e6, 10 * by_name[LHOTSE].items_per_s):
            failures.append(f"{distribution} planning throughput under target")
        failures += [f"{distribution}/{r.strategy} missed or repeated items" for r in results if not r.covered]
    if not args.skip_loader:
        rows += loader_rows(args)
    if not args.json:
        print()
    emit(rows if args.json else [r for r in rows if r.target or r.metric.startswith("loader")], args.json)
    for failure in failures:
        print(f"TARGET MISSED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
