"""Token-budget planning: exactly once, within budget, reproducible, sharded, well mixed."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from streamtrain.data.bucketing import (
    BatchPlan,
    TokenBudget,
    _cut_in_order,
    _sort_by_pool_then_length,
    _stratified_pool_order,
    auto_pool_size,
    describe_plan,
    equalize_batch_count,
    label_deviation,
    label_sequence,
    plan_batches,
    rank_within_groups,
)
from streamtrain.data.randomness import CryptoRandomness, SeededRandomness

CRYPTO_ALPHA = 1e-6


def assert_exactly_once(plan: BatchPlan, n_items: int) -> None:
    emitted = np.concatenate(plan.batches) if plan.batches else np.zeros(0, np.int64)
    assert np.unique(emitted).size == emitted.size, "an item was emitted twice"
    assert emitted.size + plan.diagnostics.withheld_items == n_items
    if plan.diagnostics.withheld_items == 0:
        assert np.array_equal(np.sort(emitted), np.arange(n_items))


def assert_within_budget(plan: BatchPlan, lengths: np.ndarray, budget: TokenBudget) -> None:
    oversize_batches = 0
    for batch in plan.batches:
        assert batch.size >= 1
        width = int(budget.padded_length(lengths[batch].max()))
        if budget.max_sequences is not None:
            assert batch.size <= budget.max_sequences
        if batch.size * float(budget.cost(max(width, 1))) > budget.max_tokens:  # an empty item takes a row
            assert batch.size == 1 and int(budget.capacity(width)) == 0, "over budget without being oversize"
            oversize_batches += 1
    assert oversize_batches == plan.diagnostics.oversize_items


budgets = st.builds(
    TokenBudget,
    max_tokens=st.integers(1, 4096),
    max_sequences=st.none() | st.integers(1, 64),
    pad_to_multiple_of=st.sampled_from([1, 2, 8]),
    quadratic_length=st.none() | st.floats(8.0, 2048.0),
)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 600), min_size=0, max_size=400).map(lambda xs: np.array(xs, dtype=np.int64)),
    budget=budgets,
    pool_size=st.none() | st.integers(1, 500),
    world_size=st.integers(1, 5),
    seed=st.integers(0, 2**32),
)
def test_every_item_once_and_every_batch_within_budget(
    lengths: np.ndarray, budget: TokenBudget, pool_size: int | None, world_size: int, seed: int
) -> None:
    plan = plan_batches(lengths, budget, SeededRandomness(seed), pool_size=pool_size, world_size=world_size)
    assert_exactly_once(plan, lengths.size)
    assert_within_budget(plan, lengths, budget)
    assert len(plan.batches) % world_size == 0
    shards = [plan.for_rank(r) for r in range(world_size)]
    assert len({len(shard) for shard in shards}) <= 1, "ranks got different batch counts"
    if plan.diagnostics.withheld_items == 0:
        expected_oversize = int(np.count_nonzero(budget.capacity(budget.padded_length(lengths)) == 0))
        assert plan.diagnostics.oversize_items == expected_oversize


def test_oversize_items_get_their_own_counted_batch() -> None:
    lengths = np.array([10, 700, 20, 900, 30])
    plan = plan_batches(lengths, TokenBudget(512), SeededRandomness(0))
    singles = sorted(int(b[0]) for b in plan.batches if b.size == 1 and lengths[b[0]] > 512)
    assert singles == [1, 3] and plan.diagnostics.oversize_items == 2
    assert_exactly_once(plan, lengths.size)


def test_greedy_cut_fills_batches_up_to_the_budget() -> None:
    plan = plan_batches(np.full(100, 10), TokenBudget(max_tokens=95), SeededRandomness(0), pool_size=100)
    assert sorted(b.size for b in plan.batches) == [1] + [9] * 11
    assert plan.diagnostics.partial_batches == 1 and plan.diagnostics.padding_share == 0.0


def test_quadratic_cost_and_padding_multiple() -> None:
    budget = TokenBudget(max_tokens=1000, quadratic_length=100.0)
    assert float(budget.cost(100)) == 200.0 and int(budget.capacity(100)) == 5
    assert budget.fits(5, 100) and not budget.fits(6, 100)
    padded = TokenBudget(max_tokens=1000, quadratic_length=100.0, pad_to_multiple_of=8)
    assert padded.padded_length(np.array([1, 8, 9])).tolist() == [8, 8, 16]
    assert not padded.fits(5, 100)  # 100 pads to 104, which costs 212.16 per sequence
    assert int(TokenBudget(100, max_sequences=3).capacity(1)) == 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10, "max_sequences": 0}, "max_sequences"),
        ({"max_tokens": 10, "pad_to_multiple_of": 0}, "pad_to_multiple_of"),
        ({"max_tokens": 10, "quadratic_length": -1.0}, "quadratic_length"),
    ],
)
def test_budget_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TokenBudget(**kwargs)


def test_plan_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="1-D integer"):
        plan_batches(np.array([1.5, 2.0]), TokenBudget(10), SeededRandomness(0))
    with pytest.raises(ValueError, match=">= 0"):
        plan_batches(np.array([3, -1]), TokenBudget(10), SeededRandomness(0))
    with pytest.raises(ValueError, match="pool_size"):
        plan_batches(np.array([3]), TokenBudget(10), SeededRandomness(0), pool_size=0)


def test_seeded_plans_repeat_and_depend_on_the_seed(lognormal: Callable[..., np.ndarray]) -> None:
    lengths = lognormal(5000)
    budget = TokenBudget(2048)
    first = plan_batches(lengths, budget, SeededRandomness(4, 2))
    again = plan_batches(lengths, budget, SeededRandomness(4, 2))
    other = plan_batches(lengths, budget, SeededRandomness(4, 3))
    assert len(first.batches) == len(again.batches)
    assert all(np.array_equal(a, b) for a, b in zip(first.batches, again.batches, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first.batches, other.batches, strict=False))


def test_crypto_plans_are_not_reproducible(lognormal: Callable[..., np.ndarray]) -> None:
    lengths = lognormal(2000)
    a = plan_batches(lengths, TokenBudget(2048), CryptoRandomness())
    b = plan_batches(lengths, TokenBudget(2048), CryptoRandomness())
    assert not all(np.array_equal(x, y) for x, y in zip(a.batches, b.batches, strict=False))


def test_crypto_plan_places_a_tagged_item_uniformly() -> None:
    # 12 equal items, 3 per batch: the emitted position of item 0 must be uniform over 0..11,
    # which needs the item permutation, the tie-breaks and the batch order all uniform.
    n, passes = 12, 6000
    positions = np.zeros(n)
    for _ in range(passes):
        plan = plan_batches(np.full(n, 5), TokenBudget(15), CryptoRandomness(), pool_size=n)
        positions[int(np.flatnonzero(np.concatenate(plan.batches) == 0)[0])] += 1
    assert stats.chisquare(positions).pvalue > CRYPTO_ALPHA


def test_batches_never_cross_a_pool(lognormal: Callable[..., np.ndarray]) -> None:
    lengths = lognormal(3000)
    plan = plan_batches(lengths, TokenBudget(1024), SeededRandomness(8), pool_size=700)
    # The planner's first draw is the item permutation; pools are its consecutive runs.
    permutation = SeededRandomness(8).permutation(lengths.size)
    n_pools = -(-lengths.size // 700)
    pool_of_item = np.empty(lengths.size, np.int64)
    pool_of_item[permutation] = np.arange(lengths.size) * n_pools // lengths.size
    assert all(np.unique(pool_of_item[batch]).size == 1 for batch in plan.batches)
    assert plan.diagnostics.pool_size == 700


def test_lognormal_mix_has_little_padding_and_mixed_order(lognormal: Callable[..., np.ndarray]) -> None:
    lengths = lognormal(100_000)
    budget = TokenBudget(16_384)
    diagnostics = plan_batches(lengths, budget, SeededRandomness(0)).diagnostics
    assert diagnostics.padding_share <= 0.03
    assert abs(diagnostics.adjacent_length_corr) <= 0.15
    assert abs(diagnostics.order_rank_corr) <= 0.02
    assert diagnostics.pool_size < lengths.size, "the default pool must not be a global sort"
    assert diagnostics.real_tokens == int(lengths.sum())
    assert diagnostics.padding_share == pytest.approx(1 - diagnostics.real_tokens / diagnostics.padded_tokens)


def test_auto_pool_size_targets_a_number_of_batches() -> None:
    assert auto_pool_size(np.full(1000, 10), TokenBudget(100), batches_per_pool=16) == 160
    assert auto_pool_size(np.full(10, 500), TokenBudget(100), batches_per_pool=4) == 4  # oversize: one each
    # Never a single pool over the whole window: at most half of it.
    assert auto_pool_size(np.full(1000, 10), TokenBudget(100), batches_per_pool=1000) == 500
    assert auto_pool_size(np.zeros(0, np.int64), TokenBudget(100)) == 1


def test_describe_plan_measures_padding_and_order() -> None:
    lengths = np.array([2, 4, 4, 8])
    diagnostics = describe_plan([np.array([0, 1]), np.array([2, 3])], lengths, TokenBudget(100))
    assert diagnostics.padded_tokens == 2 * 4 + 2 * 8 and diagnostics.real_tokens == 18
    assert diagnostics.order_rank_corr == pytest.approx(1.0)
    reversed_order = describe_plan([np.array([3, 2, 1, 0])], lengths, TokenBudget(100))
    assert reversed_order.order_rank_corr == pytest.approx(-1.0)
    assert all(isinstance(v, float) for v in diagnostics.as_metrics().values())


def test_ranks_split_batches_to_equal_counts_disjoint_and_covering(lognormal: Callable[..., np.ndarray]) -> None:
    lengths = lognormal(1003)
    for world_size in (2, 3, 7):
        plan = plan_batches(lengths, TokenBudget(4096), SeededRandomness(1), world_size=world_size)
        shards = [np.concatenate(plan.for_rank(r)) for r in range(world_size)]
        counts = {len(plan.for_rank(r)) for r in range(world_size)}
        assert len(counts) == 1
        everything = np.concatenate(shards)
        assert np.array_equal(np.sort(everything), np.arange(lengths.size))
    with pytest.raises(ValueError, match="rank"):
        plan.for_rank(world_size)


def test_equalizing_splits_the_largest_batch_or_withholds_when_it_cannot() -> None:
    rng = SeededRandomness(0)
    emitted = np.arange(9)
    same, sizes, extra, withheld = equalize_batch_count(emitted, np.array([6, 2, 1]), 4, rng)
    assert sizes.tolist() == [3, 3, 2, 1] and extra == 1 and withheld == 0 and same is emitted
    # Three single items cannot become four batches: one batch is withheld, and counted.
    kept, sizes, extra, withheld = equalize_batch_count(np.array([7, 8, 9]), np.array([1, 1, 1]), 2, rng)
    assert sizes.tolist() == [1, 1] and kept.size == 2 and set(kept) < {7, 8, 9} and extra == 0 and withheld == 1
    # Withholding prefers the smallest batches: 4 batches of 5 items cannot become 6.
    kept, sizes, _, withheld = equalize_batch_count(np.arange(5), np.array([1, 1, 1, 2]), 3, rng)
    assert sizes.tolist() == [1, 1, 2] and kept[-2:].tolist() == [3, 4] and withheld == 1


def test_fewer_items_than_ranks_withholds_everything_visibly() -> None:
    plan = plan_batches(np.array([5, 6, 7]), TokenBudget(100), SeededRandomness(0), world_size=4)
    assert plan.batches == [] and plan.diagnostics.withheld_items == 3


def test_empty_snapshot_gives_an_empty_plan() -> None:
    plan = plan_batches(np.zeros(0, np.int64), TokenBudget(100), SeededRandomness(0))
    assert plan.batches == [] and plan.diagnostics.items == 0 and plan.diagnostics.batches == 0


# --------------------------------------------------------------------------------------- what the mutation run asked


def test_cost_is_float_and_fits_counts_sequences_up_to_max_sequences() -> None:
    assert TokenBudget(100).cost(np.array([3, 5])).dtype == np.float64
    budget = TokenBudget(1000, max_sequences=4)
    assert budget.fits(4, 10) and not budget.fits(5, 10) and not budget.fits(4, 300)


def test_pass_diagnostics_as_metrics_are_floats_with_nan_for_unknowns() -> None:
    metrics = describe_plan([np.array([0, 1])], np.array([2, 3]), TokenBudget(10)).as_metrics()
    assert metrics["items"] == 2.0 and type(metrics["items"]) is float and math.isnan(metrics["pass_index"])


def test_rank_within_groups_counts_earlier_members_of_each_group() -> None:
    ranks = rank_within_groups(np.array([3, 1, 3, 3, 0, 1]))
    assert ranks.dtype == np.int64 and ranks.tolist() == [0, 0, 1, 2, 0, 1]


def test_label_deviation_of_batches_with_the_pass_mix_is_exactly_zero() -> None:
    """Nine classes in one batch: 1 - sum of nine shares of 1/9 rounds to -1e-16, clipped to 0."""
    labels = np.arange(9)
    assert label_deviation(np.arange(9), np.array([9]), labels) == (0.0, 0.0)
    mean, worst = label_deviation(np.array([0, 1, 2, 3]), np.array([2, 2]), np.array([0, 0, 1, 1]))
    assert (mean, worst) == (0.5, 0.5)  # each batch one class of two equal ones
    assert all(math.isnan(v) for v in label_deviation(np.zeros(0, np.int64), np.zeros(0, np.int64), labels))


def reference_pool_length_order(pool_sizes: np.ndarray, padded: np.ndarray) -> np.ndarray:
    pool_of = np.repeat(np.arange(pool_sizes.size), pool_sizes)
    return np.lexsort((np.arange(padded.size), padded, pool_of))  # pool, then length, then position


@pytest.mark.parametrize(
    ("pool_sizes", "max_length"),
    [([2, 2], None), ([40, 41, 39], 100), ([40, 41, 39], 21_844), ([40, 41, 39], 30_000), ([600, 7], 300)],
    ids=["longest-next-to-empty", "one-key", "at-2**16", "two-passes", "wide"],
)
def test_pools_are_sorted_by_length_and_ties_keep_their_order(pool_sizes: list[int], max_length: int | None) -> None:
    """One 16-bit radix key while pools x (longest + 1) fit 2**16, two stable passes past it; the same order."""
    sizes = np.array(pool_sizes)
    if max_length is None:
        padded = np.array([10, 3, 0, 1])  # the longest item of pool 0 must not sort among pool 1's short ones
    else:
        padded = np.random.default_rng(max_length).integers(0, 6, sizes.sum()) * (max_length // 5)
        padded[0] = max_length  # ties everywhere: equal lengths keep their (random) order
    order = _sort_by_pool_then_length(sizes, padded)
    assert order.tolist() == reference_pool_length_order(sizes, padded).tolist()


def test_a_window_of_one_item_has_pools_of_one() -> None:
    assert auto_pool_size(np.array([5]), TokenBudget(100)) == 1


def test_describe_plan_passes_labels_and_what_the_planner_knows() -> None:
    diagnostics = describe_plan(
        [np.array([0, 1]), np.array([2, 3])], np.array([1, 1, 1, 1]), TokenBudget(10), np.array([0, 0, 1, 1]),
        partial_batches=3, pool_size=7,
    )  # fmt: skip
    assert (diagnostics.label_deviation, diagnostics.label_deviation_max) == (0.5, 0.5)
    assert (diagnostics.partial_batches, diagnostics.pool_size) == (3, 7)


@pytest.mark.parametrize(
    ("padded", "pool_sizes", "max_tokens", "starts", "partial"),
    [
        ([1, 1, 1, 1, 1], [5], 3, [0, 3], 1),  # the pool's last batch has room for one more
        ([1, 1, 1, 1, 1, 1], [6], 3, [0, 3], 0),  # ... or is full
        ([1, 1, 1, 1, 1, 1, 1, 1], [3, 5], 3, [0, 3, 6], 1),  # full, full, then 2 of 3
        ([1, 1, 1, 1, 1, 1], [2, 4], 3, [0, 2, 5], 2),  # both pools end short
        ([1, 1, 1, 1, 1, 2], [6], 6, [0, 5], 1),  # six would pad to 2: 12 > 6; the 2 alone has room for 2 more
        ([2, 1, 1, 3, 1, 1], [6], 6, [0, 3, 5], 1),  # the running maximum sets each batch's capacity
        ([1, 3], [2], 6, [0], 0),  # two padded to 3 fill 6: full, though its first item alone allows 6
        ([1, 4, 1], [3], 6, [0, 1, 2], 1),  # 1 then 4: 2 x 4 > 6, so 1 alone; 4 alone; 1 alone at the end
    ],
)
def test_the_ordered_cut_takes_the_longest_run_that_fits_and_counts_short_pool_ends(
    padded: list[int], pool_sizes: list[int], max_tokens: int, starts: list[int], partial: int
) -> None:
    sizes = np.array(pool_sizes)
    got_starts, got_partial = _cut_in_order(np.array(padded), np.cumsum(sizes) - sizes, sizes, TokenBudget(max_tokens))
    assert (got_starts.tolist(), got_partial) == (starts, partial)


def test_stratified_order_puts_each_class_in_each_pool_from_the_shortest_on_its_slots() -> None:
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 3, 300)
    padded = rng.integers(0, 50, 300)
    order, pool_sizes = _stratified_pool_order(codes, padded, 4)
    assert sorted(order.tolist()) == list(range(300)) and pool_sizes.tolist() == [75] * 4
    pool_of_slot = np.repeat(np.arange(4), pool_sizes)
    for pool in range(4):
        for code in range(3):
            on_slots = order[(pool_of_slot == pool) & (codes[order] == code)]
            assert np.all(np.diff(padded[on_slots]) >= 0), (pool, code)  # shortest first along the slots


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "TokenBudget.max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": 10, "max_sequences": 0}, "TokenBudget.max_sequences must be None or an integer >= 1, got 0"),
        ({"max_tokens": 10, "pad_to_multiple_of": 0}, "TokenBudget.pad_to_multiple_of must be an integer >= 1, got 0"),
        (
            {"max_tokens": 10, "quadratic_length": 0.0},
            "TokenBudget.quadratic_length must be None or a positive finite number, got 0.0",
        ),
    ],
)
def test_budget_refusals_say_the_field_the_rule_and_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        TokenBudget(**kwargs)
    assert str(refused.value) == message


def test_budget_lengths_padding_and_a_capacity_rounded_by_the_float_cost() -> None:
    assert TokenBudget(10, quadratic_length=0.5).cost(2) == 10.0  # any positive scale, below 1 too
    padded = TokenBudget(10, pad_to_multiple_of=2).padded_length(np.array([1, 2, 3], dtype=np.int32))
    assert padded.tolist() == [2, 2, 4] and padded.dtype == np.int64
    assert TokenBudget(10).padded_length(np.array([1, 2], dtype=np.int32)).dtype == np.int64
    # 990 / (15 + 15**2 / 7) rounds to 21.0 exactly, yet 21 such sequences cost 990.0000000000001
    assert int(TokenBudget(990, quadratic_length=7.0).capacity(15)) == 20


def test_describe_plan_of_no_batches_and_of_a_few() -> None:
    lengths = np.array([4, 1, 2, 3])
    empty = describe_plan([], lengths, TokenBudget(10))
    numbers = (empty.items, empty.window_items, empty.emitted_items, empty.batches, empty.real_tokens)
    assert numbers == (4, 4, 0, 0, 0)
    assert (empty.padded_tokens, empty.padding_share, empty.mean_sequences_per_batch) == (0, 0.0, 0.0)
    assert (empty.min_sequences_per_batch, empty.max_sequences_per_batch, empty.oversize_items) == (0, 0, 0)
    assert math.isnan(empty.adjacent_length_corr) and math.isnan(empty.order_rank_corr)
    three = describe_plan([np.array([0]), np.array([1, 2]), np.array([3])], lengths, TokenBudget(10))
    assert (three.items, three.window_items, three.emitted_items, three.batches) == (4, 4, 4, 3)
    assert (three.mean_sequences_per_batch, three.min_sequences_per_batch, three.max_sequences_per_batch) == (
        4 / 3, 1, 2)  # fmt: skip
    assert three.adjacent_length_corr == pytest.approx(-1.0)  # batch means 4, 1.5, 3: pairs (4, 1.5), (1.5, 3)
    two = describe_plan([np.array([1, 0])], lengths[:2], TokenBudget(10))
    assert two.order_rank_corr == pytest.approx(-1.0)
    zero = describe_plan([np.array([0, 1])], np.array([0, 0]), TokenBudget(10))
    assert (zero.padded_tokens, zero.padding_share) == (0, 0.0)


def test_adjacent_length_correlation_uses_each_batchs_mean_length() -> None:
    lengths = np.array([1, 1, 1, 9, 2, 2, 5, 5, 5, 5])
    batches = [np.array([0, 1, 2]), np.array([3]), np.array([4, 5]), np.array([6, 7, 8, 9])]
    means = np.array([1.0, 9.0, 2.0, 5.0])
    expected = float(np.corrcoef(means[:-1], means[1:])[0, 1])
    assert describe_plan(batches, lengths, TokenBudget(100)).adjacent_length_corr == pytest.approx(expected)


def test_order_correlation_ranks_the_emitted_items_among_themselves_when_some_are_withheld() -> None:
    lengths = np.ones(5, dtype=np.int64)
    # items 0 and 2 withheld; emitted 4, 1, 3 are window ranks 2, 0, 1 among the emitted: d = 2, -1, -1
    diagnostics = describe_plan([np.array([4, 1]), np.array([3])], lengths, TokenBudget(10))
    assert diagnostics.order_rank_corr == pytest.approx(1 - 6 * 6 / (3 * 8))


def test_items_too_long_for_any_batch_are_all_oversize() -> None:
    """max_tokens 1 with a quadratic term: even an empty item (one row) costs 1.125, so nothing fits alone."""
    plan = plan_batches(np.array([0, 1, 5]), TokenBudget(1, quadratic_length=8.0), SeededRandomness(0))
    assert plan.diagnostics.oversize_items == 3 and sorted(b.size for b in plan.batches) == [1, 1, 1]


@pytest.mark.parametrize(
    ("n", "pool_size", "partial"),
    [(40, 20, 2), (36, 18, 0), (34, 17, 2)],
    ids=["room-of-7", "full", "room-of-1"],
)
def test_partial_batches_are_pool_ends_with_room_left(n: int, pool_size: int, partial: int) -> None:
    """Items of length 10 under 95 tokens: 9 a batch. Pools of 20 end 9, 9, 2; of 18, 9, 9; of 17, 9, 8."""
    plan = plan_batches(np.full(n, 10), TokenBudget(95), SeededRandomness(0), pool_size=pool_size)
    assert plan.diagnostics.partial_batches == partial


def test_plan_diagnostics_say_the_splits_and_the_time_taken() -> None:
    plan = plan_batches(np.full(9, 10), TokenBudget(95), SeededRandomness(0), pool_size=9, world_size=2)
    assert plan.diagnostics.split_batches == 1 and sorted(b.size for b in plan.batches) == [4, 5]
    for made in (plan, plan_batches(np.zeros(0, np.int64), TokenBudget(10), SeededRandomness(0))):
        assert 0.0 < made.diagnostics.plan_seconds < 10.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pool_size": 0}, "pool_size (None: automatic) must be None or an integer >= 1, got 0"),
        ({"world_size": 0}, "world_size must be an integer >= 1, got 0"),
        ({"labels": [1, 2, 3]}, "labels has 3 entries for 2 items; give one per item"),
        ({"stratify": True}, "stratify=True needs labels: one label per item"),
    ],
)
def test_plan_refusals_name_the_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        plan_batches(np.array([3, 4]), TokenBudget(10), SeededRandomness(0), **kwargs)
    assert str(refused.value) == message


def test_lengths_must_be_integers_unless_there_are_none() -> None:
    with pytest.raises(ValueError, match="1-D integer"):
        plan_batches(np.array([2.5]), TokenBudget(10), SeededRandomness(0))
    assert plan_batches(np.zeros(0), TokenBudget(10), SeededRandomness(0)).batches == []


def test_labels_may_come_as_a_column() -> None:
    lengths, labels = np.arange(1, 41) % 7, np.arange(40) % 3
    flat = plan_batches(lengths, TokenBudget(30), SeededRandomness(2), labels=labels, stratify=True)
    column = plan_batches(lengths, TokenBudget(30), SeededRandomness(2), labels=labels[:, None], stratify=True)
    assert [b.tolist() for b in flat.batches] == [b.tolist() for b in column.batches]
    assert flat.diagnostics.label_deviation == column.diagnostics.label_deviation


@pytest.mark.parametrize("lengths", [[2, 2, 5], [5, 2, 2]], ids=["first-pairs-constant", "second-pairs-constant"])
def test_a_constant_side_gives_no_adjacent_correlation_and_no_warning(lengths: list[int]) -> None:
    batches = [np.array([0]), np.array([1]), np.array([2])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns when it divides by a zero spread
        diagnostics = describe_plan(batches, np.array(lengths), TokenBudget(10))
    assert math.isnan(diagnostics.adjacent_length_corr)
    spread_of_one = describe_plan(batches, np.array([2, 3, 2]), TokenBudget(10))  # pairs (2, 3), (3, 2)
    assert spread_of_one.adjacent_length_corr == pytest.approx(-1.0)


def test_equalizing_needs_no_change_for_a_multiple_and_splits_down_to_single_items() -> None:
    rng = SeededRandomness(0)
    assert equalize_batch_count(np.arange(6), np.array([3, 3]), 2, rng)[2:] == (0, 0)
    _, sizes, extra, withheld = equalize_batch_count(np.arange(3), np.array([2, 1]), 3, rng)
    assert sizes.tolist() == [1, 1, 1] and (extra, withheld) == (1, 0)  # as many batches as items: still a split


def test_label_sequence_of_one_class_is_that_class_without_arithmetic_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert label_sequence(np.array([0, 4])).tolist() == [1, 1, 1, 1]
