"""Token-budget planning: exactly once, within budget, reproducible, sharded, well mixed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from streamtrain.data.bucketing import (
    BatchPlan,
    TokenBudget,
    auto_pool_size,
    describe_plan,
    equalize_batch_count,
    plan_batches,
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
