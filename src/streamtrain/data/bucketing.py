"""Token-budget batch planning: shuffled pools, sorted by length, cut greedily, batch order shuffled.

One pass over a window snapshot is planned in a handful of vectorized numpy calls:

1. a uniformly random permutation of the snapshot;
2. consecutive runs of that order form pools of (about) ``pool_size`` items, so each pool
   is a uniform random sample of the window; there is no global sort;
3. each pool is sorted by padded length; equal lengths keep their (random) permuted
   order, which is the random tie-break;
4. each pool is cut greedily into batches with ``sequences * cost(padded length) <=
   max_tokens`` (and at most ``max_sequences``); an item that does not fit on its own
   gets a batch of its own and is counted as oversize, never dropped;
5. the batch order is shuffled, so short batches do not all come first.

Stratified plans (``stratify=True``, for the ``stratified`` sampling policy) keep every
batch's label mix close to the pass's. The pass's slots get classes by a low-discrepancy
sequence (:func:`label_sequence`: every prefix holds each of ``C`` classes within
``1 - 1/(2C - 2)`` items of its share, Tijdeman's bound), consecutive runs of slots are
the pools, a class's items (in the random order) take its slots in turn, and inside a
pool a class's items go on its slots from the shortest to the longest. Any run of
consecutive items, hence every batch, then holds every class within ``2 - 1/(C - 1)``
items (less than two) of its share of the pass, for any lengths and budget, and items
of similar within-class length quantiles. Batches are then cut greedily along that order
by the same token budget (a running maximum of the padded length, one numpy call per
batch); padding grows where the classes' lengths differ, which is the price of the mix.
Splitting a batch for equal rank counts keeps the bound (a half is still a run); items
withheld for equal counts shift the emitted mix, not the batches.

The greedy cut needs no Python loop per item. Within a sorted pool the capacity
``cap[j] = budget // cost(len[j])`` is non-increasing, so ``g[j] = j + 1 - cap[j]`` is
strictly increasing, and the batch that starts at ``i`` ends at the largest ``j`` of the
same pool with ``g[j] <= i``. Counting the ``g[j] <= i`` (a bincount and a prefix sum)
gives that end for every ``i`` at once; a walk over the batch starts then takes one
Python step per batch, not per item.

For data-parallel training every rank plans the same pass from the same seed and takes
every ``world_size``-th batch; the batch count is first made a multiple of
``world_size`` (see :func:`equalize_batch_count`) so ranks stay in lockstep.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
from numpy.typing import ArrayLike

from streamtrain.data._validate import require_int
from streamtrain.data.randomness import Randomness

#: Default pool size, in batches: padding falls roughly as 1 / (batches per pool) because
#: each batch covers a narrower length range; 128 gives about 1.6% on the lognormal mix
#: (bench/batching.py) while a 100k-item window still splits into several pools.
DEFAULT_BATCHES_PER_POOL: Final = 128


@dataclass(frozen=True)
class TokenBudget:
    """How much one batch may hold, as lhotse's constraint objects express it.

    A batch of ``n`` sequences padded to length ``L`` costs ``n * cost(L)`` with
    ``cost(L) = L + L**2 / quadratic_length`` (the second term only when set, to charge
    attention's quadratic work as lhotse's ``quadratic_duration`` does). An empty
    sequence is charged as length 1: it still takes a row.
    """

    max_tokens: int
    max_sequences: int | None = None
    pad_to_multiple_of: int = 1
    quadratic_length: float | None = None

    def __post_init__(self) -> None:
        require_int(self.max_tokens, "TokenBudget.max_tokens", 1)
        require_int(self.max_sequences, "TokenBudget.max_sequences", 1, optional=True)
        require_int(self.pad_to_multiple_of, "TokenBudget.pad_to_multiple_of", 1)
        if self.quadratic_length is not None and not (np.isfinite(self.quadratic_length) and self.quadratic_length > 0):
            raise ValueError(
                f"TokenBudget.quadratic_length must be None or a positive finite number, got {self.quadratic_length!r}"
            )

    def padded_length(self, lengths: ArrayLike) -> np.ndarray:
        """Lengths rounded up to ``pad_to_multiple_of`` (int64)."""
        multiple = self.pad_to_multiple_of
        lengths = np.asarray(lengths, dtype=np.int64)
        return lengths if multiple == 1 else -(-lengths // multiple) * multiple

    def cost(self, padded_lengths: ArrayLike) -> np.ndarray:
        """Budget cost of one sequence at each (already padded) length, float64."""
        length = np.asarray(padded_lengths, dtype=np.float64)
        if self.quadratic_length is None:
            return length
        return length + length * length / self.quadratic_length

    def capacity(self, padded_lengths: ArrayLike) -> np.ndarray:
        """How many sequences of each padded length fit in one batch (0: too long alone)."""
        padded = np.maximum(np.asarray(padded_lengths, dtype=np.int64), 1)  # an empty item still takes a row
        if self.quadratic_length is None:
            fit = self.max_tokens // padded
        else:
            cost = self.cost(padded)
            fit = np.floor(self.max_tokens / cost).astype(np.int64)
            fit -= fit * cost > self.max_tokens  # a quotient rounded up to an integer

        if self.max_sequences is not None:
            fit = np.minimum(fit, self.max_sequences)
        return fit

    def fits(self, n_sequences: int, max_length: int) -> bool:
        """Whether ``n_sequences`` items whose longest is ``max_length`` fit in one batch."""
        if self.max_sequences is not None and n_sequences > self.max_sequences:
            return False
        return n_sequences <= int(self.capacity(self.padded_length(max_length)))


@dataclass(frozen=True)
class PassDiagnostics:
    """What one pass looked like; every field is a number ready to export as a metric."""

    items: int  # items in the snapshot
    emitted_items: int  # items placed in a batch this pass (items - withheld_items)
    batches: int
    real_tokens: int
    padded_tokens: int  # sum over batches of sequences * padded length
    padding_share: float  # 1 - real / padded
    mean_sequences_per_batch: float
    min_sequences_per_batch: int
    max_sequences_per_batch: int
    oversize_items: int  # emitted items too long for the budget even alone (a batch of their own)
    adjacent_length_corr: float  # Pearson corr of consecutive batches' mean lengths (NaN < 3 batches)
    order_rank_corr: float  # Spearman corr of window position vs emitted position (NaN < 2 items)
    # What the planner knows beyond the batches themselves:
    partial_batches: int = 0  # batches ended by the end of their pool rather than by the budget
    split_batches: int = 0  # extra batches made by splitting so ranks get equal counts
    withheld_items: int = 0  # items left for the next pass because ranks could not be evened
    pool_size: int = 0  # items per pool (0: not a pooled plan)
    plan_seconds: float = 0.0
    pass_index: int | None = None
    snapshot_version: int | None = None
    # Label mix (when labels are given): total-variation distance between a batch's label
    # shares and the pass's, 0 = the same mix, 1 = disjoint; mean and max over batches.
    # NaN when fewer than two label values (unlabeled counts as one) are present.
    label_deviation: float = math.nan
    label_deviation_max: float = math.nan
    # What the pass sampler chose (streamtrain.data.passes); a whole-window pass has
    # window_items == items. Concentration is over the window's sensors: sensor_hhi is the
    # normalized Herfindahl index of the pass's sensor shares (0 = every sensor the same
    # share, 1 = one sensor only), window_sensor_hhi the same over the window.
    window_items: int = 0
    fresh_items: int = 0  # events new since the last pass that this pass took as fresh
    fresh_deferred: int = 0  # new events beyond the fresh share, left to the replay
    sensors: int = 0
    sensor_top_share: float = math.nan
    sensor_hhi: float = math.nan
    window_sensor_hhi: float = math.nan
    curriculum_beta: float = 0.0  # the curriculum's bias against difficult items (0: none)

    def as_metrics(self) -> dict[str, float]:
        """Every field as a float, for gauges (None becomes NaN)."""
        return {name: float("nan") if value is None else float(value) for name, value in asdict(self).items()}


@dataclass(frozen=True)
class BatchPlan:
    """One pass: batches of snapshot indices in the order they are emitted, plus diagnostics."""

    batches: list[np.ndarray] = field(repr=False)
    diagnostics: PassDiagnostics
    world_size: int = 1

    def for_rank(self, rank: int) -> list[np.ndarray]:
        """This rank's share: every ``world_size``-th batch, the same count on every rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return self.batches[rank :: self.world_size]


def label_codes(labels: ArrayLike) -> tuple[np.ndarray, int]:
    """Dense int64 codes of label values (unlabeled, -1, is a value of its own) and how many."""
    values, codes = np.unique(np.asarray(labels), return_inverse=True)
    return codes.astype(np.int64).reshape(-1), int(values.size)


def rank_within_groups(groups: np.ndarray) -> np.ndarray:
    """For each position, how many earlier positions hold the same group (0, 1, 2, ...)."""
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    first = np.searchsorted(sorted_groups, sorted_groups, side="left")
    ranks = np.empty(groups.size, dtype=np.int64)
    ranks[order] = np.arange(groups.size) - first
    return ranks


def label_deviation(emitted: np.ndarray, sizes: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(mean, max) over batches of the total-variation distance to the emitted items' label mix.

    ``TV_b = 1/2 sum_c |f_bc - p_c|`` computed over the (batch, label) pairs that occur:
    ``TV_b = 1/2 (1 + sum_{c in b} (|f_bc - p_c| - p_c))``, so memory stays O(items) for
    any number of classes.
    """
    if sizes.size == 0:
        return math.nan, math.nan
    codes, classes = label_codes(labels[emitted])
    if classes < 2:
        return math.nan, math.nan
    pass_mix = np.bincount(codes, minlength=classes) / codes.size
    batch_of = np.repeat(np.arange(sizes.size), sizes)
    pairs, counts = np.unique(batch_of * classes + codes, return_counts=True)
    batch, label = pairs // classes, pairs % classes
    share = counts / sizes[batch]
    excess = np.bincount(batch, weights=np.abs(share - pass_mix[label]) - pass_mix[label], minlength=sizes.size)
    tv = np.clip(0.5 * (1.0 + excess), 0.0, 1.0)
    return float(tv.mean()), float(tv.max())


def _sort_by_pool_then_length(pool_sizes: np.ndarray, padded: np.ndarray) -> np.ndarray:
    """Stable order by (pool, padded length) of positions whose pools are consecutive runs.

    numpy's stable argsort is a radix sort for 16-bit keys, so (pool, length) goes into one
    16-bit key when it fits (it does for windows of a few hundred pools), else two passes.
    """
    n_pools = pool_sizes.size
    length_span = int(padded.max()) + 1
    if n_pools * length_span <= 2**16:
        pool_base = np.repeat((np.arange(n_pools) * length_span).astype(np.uint16), pool_sizes)
        return np.argsort(pool_base + padded.astype(np.uint16), kind="stable")
    by_length = np.argsort(padded, kind="stable")
    pool_of_position = np.repeat(np.arange(n_pools), pool_sizes)
    return by_length[np.argsort(pool_of_position[by_length], kind="stable")]


def _capacity_by_table(padded: np.ndarray, budget: TokenBudget) -> np.ndarray:
    """``budget.capacity(padded)``; few distinct lengths, so a table lookup replaces n divisions."""
    return budget.capacity(np.arange(int(padded.max()) + 1))[padded]


def auto_pool_size(lengths: ArrayLike, budget: TokenBudget, batches_per_pool: int = DEFAULT_BATCHES_PER_POOL) -> int:
    """Items per pool so that a pool cuts into about ``batches_per_pool`` batches, in at least two pools.

    An item of capacity ``c`` takes ``1 / c`` of a batch (a whole one when it does not fit).
    A small window (a warm-up) still gets two pools: with one, the sort would be global and
    an item's batch-mates the same every pass; two pools cost some padding instead.
    """
    padded = budget.padded_length(lengths)
    if padded.size == 0:
        return 1
    batches_per_item = float(np.mean(1.0 / np.maximum(_capacity_by_table(padded, budget), 1)))
    return max(1, min(math.ceil(batches_per_pool / batches_per_item), math.ceil(padded.size / 2)))


def _batch_ends(padded_sorted: np.ndarray, pool_start: np.ndarray, budget: TokenBudget) -> np.ndarray:
    """For every position ``i`` of the pool-sorted order, the last position of a batch starting at ``i``."""
    n = padded_sorted.size
    positions = np.arange(n)
    capacity = _capacity_by_table(padded_sorted, budget)
    # Strictly increasing inside a pool; clamping to the pool start makes it non-decreasing
    # over the whole array and keeps a batch from reaching into the next pool.
    first_feasible_start = np.maximum(positions + 1 - capacity, pool_start)
    # ends[i] = (number of j with first_feasible_start[j] <= i) - 1: a counting sort's prefix sum.
    ends = np.cumsum(np.bincount(first_feasible_start, minlength=n + 1)[:n]) - 1
    return np.maximum(ends, positions)  # an oversize item (capacity 0) ends its own batch


def _walk_batch_starts(ends: np.ndarray) -> list[int]:
    starts = []
    position, n = 0, ends.size
    while position < n:
        starts.append(position)
        position = int(ends[position]) + 1
    return starts


def equalize_batch_count(
    emitted: np.ndarray, sizes: np.ndarray, world_size: int, rng: Randomness
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Make the batch count a multiple of ``world_size`` without repeating or silently dropping items.

    Batches are given flat: ``emitted`` holds them back to back, ``sizes`` their lengths.
    Splitting the largest batch in two keeps every batch within budget and every item
    exactly once (the items do not move, only the sizes change). When splits cannot reach
    a multiple (fewer items than the next multiple, e.g. fewer items than ranks),
    ``count % world_size`` batches among the smallest (random among equals) are withheld
    from this pass instead and counted; the window still holds them for the next pass.
    Returns (emitted, sizes, extra batches from splits, withheld items).
    """
    remainder = sizes.size % world_size
    if remainder == 0:
        return emitted, sizes, 0, 0
    splits_needed = world_size - remainder
    if sizes.size + splits_needed <= emitted.size:
        sizes = sizes.copy()
        for _ in range(splits_needed):  # fewer than world_size steps
            largest = int(np.argmax(sizes))
            half = int(sizes[largest]) // 2
            sizes = np.insert(sizes, largest + 1, sizes[largest] - half)
            sizes[largest] = half
        return emitted, sizes, splits_needed, 0
    withheld = np.lexsort((rng.random(sizes.size), sizes))[:remainder]
    keep = np.ones(sizes.size, dtype=bool)
    keep[withheld] = False
    return emitted[np.repeat(keep, sizes)], sizes[keep], 0, int(sizes[withheld].sum())


def _correlation(x: np.ndarray, y: np.ndarray) -> float:
    if x.size < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def describe_plan(
    batches: list[np.ndarray],
    lengths: np.ndarray,
    budget: TokenBudget,
    labels: np.ndarray | None = None,
    **planner_facts: Any,
) -> PassDiagnostics:
    """Diagnostics of any list of index batches over ``lengths`` (baselines use it too).

    ``labels`` (per item) add the label-mix deviation; ``planner_facts`` fill the fields
    only the planner knows (``partial_batches``, ...).
    """
    sizes = np.fromiter(map(len, batches), dtype=np.int64, count=len(batches))
    emitted = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    return _describe_flat(emitted, sizes, lengths, budget, labels, **planner_facts)


def _describe_flat(
    emitted: np.ndarray,
    sizes: np.ndarray,
    lengths: np.ndarray,
    budget: TokenBudget,
    labels: np.ndarray | None = None,
    **planner_facts: Any,
) -> PassDiagnostics:
    """:func:`describe_plan` for batches given back to back (``emitted``) with their ``sizes``."""
    n_items = int(lengths.size)
    planner_facts.setdefault("window_items", n_items)
    if labels is not None:
        planner_facts["label_deviation"], planner_facts["label_deviation_max"] = label_deviation(
            emitted, sizes, np.asarray(labels)
        )
    if sizes.size == 0:
        nan = float("nan")
        return PassDiagnostics(
            items=n_items, emitted_items=0, batches=0, real_tokens=0, padded_tokens=0, padding_share=0.0,
            mean_sequences_per_batch=0.0, min_sequences_per_batch=0, max_sequences_per_batch=0, oversize_items=0,
            adjacent_length_corr=nan, order_rank_corr=nan, **planner_facts,
        )  # fmt: skip
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    emitted_lengths = lengths[emitted]
    batch_width = budget.padded_length(np.maximum.reduceat(emitted_lengths, offsets))
    fits_alone = np.flatnonzero(budget.capacity(budget.padded_length(np.arange(int(emitted_lengths.max()) + 1))))
    longest_fitting = int(fits_alone[-1]) if fits_alone.size else -1  # capacity falls with length
    oversize_items = int(np.count_nonzero(emitted_lengths > longest_fitting))
    real_tokens = int(emitted_lengths.sum())
    padded_tokens = int((sizes * batch_width).sum())
    mean_lengths = np.add.reduceat(emitted_lengths, offsets) / sizes
    adjacent = _correlation(mean_lengths[:-1], mean_lengths[1:]) if sizes.size >= 3 else float("nan")

    # Spearman between window order and emitted order. Both sides are ranks 0..m-1 without
    # ties, so rho = 1 - 6 * sum(d**2) / (m * (m**2 - 1)).
    if emitted.size == n_items:
        window_rank = emitted
    else:  # some items withheld: rank the emitted ones among themselves
        in_pass = np.zeros(n_items, dtype=bool)
        in_pass[emitted] = True
        window_rank = (np.cumsum(in_pass) - 1)[emitted]
    m = float(emitted.size)
    rank_gap = (window_rank - np.arange(emitted.size)).astype(np.float64)
    order_corr = 1.0 - 6.0 * float(rank_gap @ rank_gap) / (m * (m * m - 1.0)) if m >= 2 else float("nan")
    return PassDiagnostics(
        items=n_items,
        emitted_items=int(emitted.size),
        batches=int(sizes.size),
        real_tokens=real_tokens,
        padded_tokens=padded_tokens,
        padding_share=1.0 - real_tokens / padded_tokens if padded_tokens else 0.0,
        mean_sequences_per_batch=float(sizes.mean()),
        min_sequences_per_batch=int(sizes.min()),
        max_sequences_per_batch=int(sizes.max()),
        oversize_items=oversize_items,
        adjacent_length_corr=adjacent,
        order_rank_corr=order_corr,
        **planner_facts,
    )


def label_sequence(counts: ArrayLike) -> np.ndarray:
    """A class for every slot, each class ``counts[c]`` times, every prefix close to the mix.

    With ``C`` classes of shares ``p_c = counts[c] / N``, every prefix of ``m`` slots holds
    class ``c`` within ``1 - 1/(2C - 2)`` of ``p_c * m`` (exactly for ``C = 1``), so every
    run of consecutive slots holds it within twice that, less than two. This is
    Tijdeman's bound for the chairman assignment problem (1980), met by earliest-deadline
    scheduling: the ``j``-th slot of class ``c`` may come no earlier than
    ``ceil((j - B) / p_c)`` and no later than ``floor((j - 1 + B) / p_c) + 1`` (slots from
    1, ``B`` the bound), and each slot goes to the released class with the earliest deadline.
    The windows are computed in integers (exact); the walk is one heap step per slot over
    at most ``C`` entries (about 1 us per slot), the one per-item Python loop of the planner.
    """
    counts = np.asarray(counts, dtype=np.int64)
    present = np.flatnonzero(counts)
    n = int(counts.sum())
    if present.size <= 1:
        return np.full(n, present[0] if present.size else 0, dtype=np.int64)
    sizes = counts[present]
    den, num = 2 * present.size - 2, 2 * present.size - 3  # B = num / den
    first = np.cumsum(sizes) - sizes
    cls = np.repeat(np.arange(present.size), sizes)
    j = np.arange(n, dtype=np.int64) - first[cls] + 1  # 1-based rank within the class
    size = sizes[cls]
    # (j * den) * n stays below 2**63 while n * n * den does; else exact Python integers.
    ints: Any = np.int64 if n * n * den < 2**62 else object
    j, size = j.astype(ints), size.astype(ints)
    release = np.maximum(-((num - j * den) * n // (den * size)), 1).tolist()
    deadline = (((j - 1) * den + num) * n // (den * size) + 1).tolist()
    following = release[1:] + [0]  # the release of the class's next job; 0 after its last
    for last in (first + sizes - 1).tolist():
        following[last] = 0
    pending = [(release[k], k) for k in first.tolist()]  # (release, job): the next job of each class
    heapq.heapify(pending)
    ready: list[tuple[int, int]] = []
    jobs = [0] * n
    push, pop = heapq.heappush, heapq.heappop
    for slot in range(1, n + 1):
        while pending and pending[0][0] <= slot:
            k = pop(pending)[1]
            push(ready, (deadline[k], k))
        k = pop(ready)[1]
        jobs[slot - 1] = k
        if following[k]:
            push(pending, (following[k], k + 1))
    return present[cls[np.asarray(jobs, dtype=np.int64)]]


def _stratified_pool_order(codes: np.ndarray, padded: np.ndarray, n_pools: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (of the permuted items) in stratified order, and the pools' sizes.

    The pass's slots get classes by :func:`label_sequence`; consecutive runs of slots
    form ``n_pools`` equal pools. A class's items, in the random order, take that class's
    slots in turn (so each pool gets a random share of every class, in proportion);
    inside a pool, a class's items are put on its slots from the shortest to the longest.
    A run of consecutive items then holds every class within two items of its share and
    items of similar length quantiles within their classes.
    """
    n = codes.size
    classes = int(codes.max()) + 1
    slot_class = label_sequence(np.bincount(codes, minlength=classes))
    pool_starts = -(-np.arange(n_pools) * n // n_pools)
    pool_sizes = np.diff(np.append(pool_starts, n))
    slot_pool = np.repeat(np.arange(n_pools), pool_sizes)
    # slots by (class, position); the r-th item of a class (random order) gets its r-th slot
    slots_by_class = np.argsort(slot_class, kind="stable")
    items_by_class = np.argsort(codes, kind="stable")
    item_pool = np.empty(n, dtype=np.int64)
    item_pool[items_by_class] = slot_pool[slots_by_class]
    # inside each (pool, class): slots in position order, items from the shortest (ties: random order)
    slot_group = slot_pool * classes + slot_class
    item_group = item_pool * classes + codes
    slots = np.argsort(slot_group, kind="stable")
    items = np.lexsort((padded, item_group))
    order = np.empty(n, dtype=np.int64)
    order[slots] = items
    return order, pool_sizes


def _cut_in_order(
    padded: np.ndarray, pool_starts: np.ndarray, pool_sizes: np.ndarray, budget: TokenBudget
) -> tuple[np.ndarray, int]:
    """Greedy token-budget batches along ``padded`` as given (not sorted), never across a pool.

    A batch of ``k`` items starting at ``i`` fits when ``k <= capacity(max(padded[i:i+k]))``;
    that test is monotone in ``k`` (the count grows, the capacity of the running maximum
    falls), so the longest fitting run is one ``maximum.accumulate`` and one ``argmin``.
    Returns the batch starts and how many batches a pool's end cut short.
    """
    capacity_of = budget.capacity(np.arange(int(padded.max()) + 1))
    starts: list[int] = []
    partial = 0
    for pool_start, pool_size in zip(pool_starts.tolist(), pool_sizes.tolist(), strict=True):
        pool_end = pool_start + pool_size
        if pool_size == 0:
            continue
        longest_run = max(1, int(capacity_of[int(padded[pool_start:pool_end].min())]))
        position = pool_start
        while position < pool_end:
            running_max = np.maximum.accumulate(padded[position : min(pool_end, position + longest_run)])
            fits = np.arange(1, running_max.size + 1) <= capacity_of[running_max]
            take = running_max.size if fits.all() else max(1, int(np.argmin(fits)))
            if position + take == pool_end and take < capacity_of[running_max[take - 1]]:
                partial += 1
            starts.append(position)
            position += take
    return np.asarray(starts, dtype=np.int64), partial


def plan_batches(
    lengths: ArrayLike,
    budget: TokenBudget,
    rng: Randomness,
    *,
    pool_size: int | None = None,
    world_size: int = 1,
    labels: ArrayLike | None = None,
    stratify: bool = False,
) -> BatchPlan:
    """Plan one pass over items of the given ``lengths``; batches hold indices into ``lengths``.

    ``pool_size`` is in items; ``None`` picks :func:`auto_pool_size` for this snapshot.
    ``labels`` (one per item) add the label-mix deviation to the diagnostics; with
    ``stratify=True`` they also shape the batches (see the module docstring).

    Every item appears exactly once over all batches, except items counted in
    ``diagnostics.withheld_items`` (only possible with ``world_size > 1``).
    """
    started = time.perf_counter()
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not (lengths.size == 0 or np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(f"lengths must be a 1-D integer array, got dtype {lengths.dtype} and shape {lengths.shape}")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"lengths must be >= 0, got minimum {lengths.min()}")
    pool_size = require_int(pool_size, "pool_size (None: automatic)", 1, optional=True)
    world_size = require_int(world_size, "world_size", 1)
    label_array = None if labels is None else np.asarray(labels).reshape(-1)
    if label_array is not None and label_array.size != lengths.size:
        raise ValueError(f"labels has {label_array.size} entries for {lengths.size} items; give one per item")
    if stratify and label_array is None:
        raise ValueError("stratify=True needs labels: one label per item")
    lengths = lengths.astype(np.int64, copy=False)
    n = lengths.size
    if n == 0:
        diagnostics = describe_plan([], lengths, budget, label_array, plan_seconds=time.perf_counter() - started)
        return BatchPlan([], diagnostics, world_size)

    if pool_size is None:
        pool_size = auto_pool_size(lengths, budget)
    permutation = rng.permutation(n)
    padded = budget.padded_length(lengths[permutation])
    n_pools = -(-n // pool_size)
    if stratify:
        codes = label_codes(label_array[permutation])[0]  # type: ignore[index]
        order, pool_sizes = _stratified_pool_order(codes, padded, n_pools)
        pool_starts = np.cumsum(pool_sizes) - pool_sizes
        items = permutation[order]
        start_array, partial_batches = _cut_in_order(padded[order], pool_starts, pool_sizes, budget)
    else:
        pool_starts = -(-np.arange(n_pools) * n // n_pools)  # equal pools (sizes differ by at most one)
        pool_sizes = np.diff(np.append(pool_starts, n))
        order = _sort_by_pool_then_length(pool_sizes, padded)
        items = permutation[order]
        padded_sorted = padded[order]
        ends = _batch_ends(padded_sorted, np.repeat(pool_starts, pool_sizes), budget)
        start_array = np.asarray(_walk_batch_starts(ends), dtype=np.int64)
        end_array = ends[start_array]
        # A partial batch ends at its pool's last item with room left (a pool's "short last batch").
        ends_a_pool = np.isin(end_array, pool_starts[1:] - 1) | (end_array == n - 1)
        room_left = end_array - start_array + 1 < budget.capacity(padded_sorted[end_array])
        partial_batches = int(np.count_nonzero(ends_a_pool & room_left))

    # Shuffle the batch order and lay the batches out back to back in that order.
    plan_sizes = np.diff(np.append(start_array, n))
    batch_order = rng.permutation(start_array.size)
    sizes = plan_sizes[batch_order]
    emitted_offsets = np.cumsum(sizes) - sizes
    emitted = items[np.repeat(start_array[batch_order] - emitted_offsets, sizes) + np.arange(n)]
    emitted, sizes, split_batches, withheld_items = equalize_batch_count(emitted, sizes, world_size, rng)
    bounds = np.append(0, np.cumsum(sizes)).tolist()
    batches = [emitted[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    diagnostics = _describe_flat(
        emitted,
        sizes,
        lengths,
        budget,
        label_array,
        partial_batches=partial_batches,
        split_batches=split_batches,
        withheld_items=withheld_items,
        pool_size=pool_size,
        plan_seconds=time.perf_counter() - started,
    )
    return BatchPlan(batches, diagnostics, world_size)
