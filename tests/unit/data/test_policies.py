"""Sampling policies: each keeps a pass exactly-once, its fresh rule and its own promise, in both randomness modes."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy import stats

from streamtrain.data import policies as policies_module
from streamtrain.data.bucketing import TokenBudget, label_codes, label_deviation, label_sequence, plan_batches
from streamtrain.data.passes import PassSampler
from streamtrain.data.policies import (
    CurriculumPolicy,
    PassCandidates,
    SensorBalancedPolicy,
    StratifiedPolicy,
    UniformPolicy,
    concentration,
    group_codes,
    gumbel_top_k,
    length_difficulty,
    make_policy,
    systematic_round,
    water_fill,
)
from streamtrain.data.randomness import CryptoRandomness, Randomness, SeededRandomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window.reservoir import RecencyWindow
from streamtrain.window.snapshot import WindowSnapshot
from streamtrain.window.storage import SensorCodes

MODES = ["seeded", "crypto"]


def snapshot_of(
    lengths: np.ndarray, sensors: np.ndarray, labels: np.ndarray, seq: np.ndarray | None = None
) -> WindowSnapshot:
    n = lengths.size
    starts = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return WindowSnapshot(
        flat_values=np.zeros((int(lengths.sum()), 1), np.float32),
        starts=starts,
        lengths=lengths.astype(np.int64),
        ts=np.arange(n, dtype=np.float64),
        labels=labels.astype(np.int64),
        keys=np.zeros(n),
        sensor_ids=np.array([f"sensor-{s}" for s in sensors], dtype=object),
        partitions=np.zeros(n, np.int32),
        offsets=np.arange(n, dtype=np.int64),
        seq=np.arange(n, dtype=np.int64) if seq is None else seq,
    )


@st.composite
def windows(draw: st.DrawFn) -> tuple[WindowSnapshot, int]:
    """A window with skewed sensors, labels and arrival numbers, and a watermark inside it."""
    n = draw(st.integers(1, 300))
    n_sensors = draw(st.integers(1, 8))
    skew = draw(st.floats(0.0, 3.0))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    share = np.arange(1, n_sensors + 1, dtype=np.float64) ** -skew
    sensors = rng.choice(n_sensors, n, p=share / share.sum())
    labels = rng.integers(-1, draw(st.integers(1, 4)), n)
    lengths = rng.integers(0, draw(st.integers(1, 200)), n)
    seq = rng.permutation(n).astype(np.int64) * draw(st.integers(1, 3))  # any order, gaps allowed
    watermark = draw(st.integers(0, int(seq.max()) + 2))
    return snapshot_of(lengths, sensors, labels, seq), watermark


policies = st.sampled_from(["uniform", "sensor_balanced", "stratified", "curriculum"]).flatmap(
    lambda name: st.builds(
        make_policy,
        st.just(name),
        sensor_temperature=st.sampled_from([0.5, 1.0, 2.0, 5.0, math.inf]),
        curriculum_strength=st.floats(0.0, 20.0),
        curriculum_half_life_steps=st.sampled_from([1.0, 100.0, math.inf]),
    )
)


@settings(max_examples=300, deadline=None)
@given(
    window=windows(),
    policy=policies,
    max_items=st.integers(0, 320),
    fresh_share=st.floats(0.0, 1.0),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**31),
    planned_steps=st.integers(0, 10_000),
)
def test_every_policy_takes_each_chosen_item_once_and_keeps_the_fresh_rule(
    window: tuple[WindowSnapshot, int],
    policy,
    max_items: int,
    fresh_share: float,
    mode: str,
    seed: int,
    planned_steps: int,
) -> None:
    snapshot, watermark = window
    n = len(snapshot)
    sampler = PassSampler(max_items, fresh_share, mode, seed, policy)  # type: ignore[arg-type]
    sampler.watermark = watermark
    selection = sampler.select(snapshot, planned_steps=planned_steps)
    index = selection.index
    bounded = 0 < max_items < n

    assert np.array_equal(index, np.unique(index)), "an item twice, or not in ascending order"
    assert index.size == (max_items if bounded else n)
    assert index.min() >= 0 and index.max() < n
    is_fresh = snapshot.seq >= watermark
    assert np.all(is_fresh[selection.fresh]) and np.isin(selection.fresh, index).all()
    assert selection.facts["fresh_items"] == selection.fresh.size
    assert selection.facts["fresh_deferred"] == np.count_nonzero(is_fresh) - selection.fresh.size
    assert sampler.watermark == max(watermark, int(snapshot.seq.max()) + 1)
    assert sampler.passes == 1
    if not bounded:
        assert selection.fresh.size == np.count_nonzero(is_fresh)
        return
    cap = int(max_items * fresh_share)
    assert selection.fresh.size <= cap
    if policy.name in ("uniform", "curriculum"):
        # the newest fresh items, as many as the fresh share allows
        newest = np.flatnonzero(is_fresh)[np.argsort(-snapshot.seq[is_fresh], kind="stable")][:cap]
        assert np.array_equal(np.sort(newest), selection.fresh)
    else:
        groups = label_codes(snapshot.labels)[0] if policy.name == "stratified" else sensor_codes(snapshot)
        for group in np.unique(groups[selection.fresh]):
            # inside a group, fresh items are taken newest first
            group_fresh = np.flatnonzero(is_fresh & (groups == group))
            taken = np.intersect1d(selection.fresh, group_fresh)
            newest = group_fresh[np.argsort(-snapshot.seq[group_fresh], kind="stable")][: taken.size]
            assert np.array_equal(np.sort(newest), taken)


def sensor_codes(snapshot: WindowSnapshot) -> np.ndarray:
    return np.unique(snapshot.sensor_ids.astype(str), return_inverse=True)[1]


@settings(max_examples=200, deadline=None)
@given(
    window=windows(),
    temperature=st.sampled_from([0.5, 1.0, 2.0, 4.0, math.inf]),
    max_items=st.integers(1, 300),
    fresh_share=st.floats(0.0, 1.0),
    mode=st.sampled_from(MODES),
)
def test_sensor_balanced_gives_every_sensor_its_tempered_quota(
    window: tuple[WindowSnapshot, int], temperature: float, max_items: int, fresh_share: float, mode: str
) -> None:
    snapshot, watermark = window
    n = len(snapshot)
    if max_items >= n:
        return
    sampler = PassSampler(max_items, fresh_share, mode, 1, SensorBalancedPolicy(temperature))  # type: ignore[arg-type]
    sampler.watermark = watermark
    selection = sampler.select(snapshot)
    codes = sensor_codes(snapshot)
    in_window = np.bincount(codes)
    in_pass = np.bincount(codes[selection.index], minlength=in_window.size)
    weights = in_window ** (1 / temperature) if math.isfinite(temperature) else np.ones(in_window.size)
    target = water_fill(weights, in_window, max_items)
    assert np.all(in_pass <= in_window)
    assert np.all(np.abs(in_pass - target) < 1.0), "a sensor's items are off its quota by a whole item"


@settings(max_examples=200, deadline=None)
@given(window=windows(), max_items=st.integers(1, 300), fresh_share=st.floats(0.0, 1.0), mode=st.sampled_from(MODES))
def test_stratified_pass_has_the_window_label_mix(
    window: tuple[WindowSnapshot, int], max_items: int, fresh_share: float, mode: str
) -> None:
    snapshot, watermark = window
    n = len(snapshot)
    if max_items >= n:
        return
    sampler = PassSampler(max_items, fresh_share, mode, 2, StratifiedPolicy())  # type: ignore[arg-type]
    sampler.watermark = watermark
    selection = sampler.select(snapshot)
    assert selection.stratify
    codes, classes = label_codes(snapshot.labels)
    in_pass = np.bincount(codes[selection.index], minlength=classes)
    assert np.all(np.abs(in_pass - max_items * np.bincount(codes) / n) < 1.0)


def assert_plan_is_stratified(plan, lengths: np.ndarray, labels: np.ndarray, budget: TokenBudget) -> None:
    emitted = np.concatenate(plan.batches) if plan.batches else np.zeros(0, np.int64)
    assert np.unique(emitted).size == emitted.size
    assert emitted.size + plan.diagnostics.withheld_items == lengths.size
    codes, classes = label_codes(labels)
    mix = np.bincount(codes, minlength=classes) / max(codes.size, 1)  # the pass's mix (all items planned)
    bound = 2.0 - 1.0 / (classes - 1) if classes > 1 else 0.0  # twice Tijdeman's prefix bound
    for batch in plan.batches:
        width = max(int(budget.padded_length(lengths[batch].max())), 1)
        assert batch.size <= max(1, int(budget.capacity(width))), "a batch over the token budget"
        deviation = np.abs(np.bincount(codes[batch], minlength=classes) - mix * batch.size)
        assert deviation.max() <= bound + 1e-9, (
            f"batch of {batch.size} is {deviation.max():.2f} items off its label share"
        )


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(0, 60) | st.integers(0, 3), min_size=1, max_size=12).map(np.array),
)
def test_label_sequence_keeps_every_prefix_within_tijdemans_bound(counts: np.ndarray) -> None:
    sequence = label_sequence(counts)
    assert np.array_equal(np.bincount(sequence, minlength=counts.size), counts)
    present = np.count_nonzero(counts)
    if present < 2:
        return
    n = int(counts.sum())
    held = np.cumsum(np.eye(counts.size, dtype=np.int64)[sequence], axis=0)
    deviation = np.abs(held - np.outer(np.arange(1, n + 1), counts / n))
    assert deviation.max() <= 1.0 - 1.0 / (2 * present - 2) + 1e-9


def test_label_sequence_by_hand() -> None:
    # shares 1/2, 1/4, 1/4 (bound 3/4): class 0 every other slot, the others alternate
    assert label_sequence(np.array([2, 1, 1])).tolist() == [0, 1, 0, 2]
    assert label_sequence(np.array([0, 3, 0])).tolist() == [1, 1, 1]
    assert label_sequence(np.zeros(3, np.int64)).size == 0
    big = label_sequence(np.array([60_000, 30_000, 10_000]))  # fast enough for whole-window passes
    assert np.bincount(big).tolist() == [60_000, 30_000, 10_000]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 400),
    classes=st.integers(1, 6),
    max_length=st.integers(1, 300),
    budget=st.builds(
        TokenBudget,
        max_tokens=st.integers(1, 4096),
        max_sequences=st.none() | st.integers(1, 64),
        pad_to_multiple_of=st.sampled_from([1, 8]),
        quadratic_length=st.none() | st.floats(8.0, 2048.0),
    ),
    pool_size=st.none() | st.integers(1, 500),
    world_size=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    crypto=st.booleans(),
)
# the per-pool quantile order this planner used before put a batch of 6 at 3.03 items off its share here
@example(n=61, classes=6, max_length=1, budget=TokenBudget(6), pool_size=1, world_size=1, seed=55, crypto=False)
def test_stratified_batches_keep_the_budget_and_every_class_within_two_items_of_its_share(
    n: int,
    classes: int,
    max_length: int,
    budget: TokenBudget,
    pool_size: int | None,
    world_size: int,
    seed: int,
    crypto: bool,
) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.choice(classes, n, p=rng.dirichlet(np.ones(classes))) - 1  # -1: unlabeled is a class too
    lengths = rng.integers(0, max_length + 1, n)
    randomness: Randomness = CryptoRandomness() if crypto else SeededRandomness(seed)
    plan = plan_batches(
        lengths, budget, randomness, pool_size=pool_size, world_size=world_size, labels=labels, stratify=True
    )
    assert_plan_is_stratified(plan, lengths, labels, budget)
    assert len(plan.batches) % world_size == 0


def test_stratified_batches_mix_labels_that_length_bucketing_would_separate() -> None:
    rng = np.random.default_rng(0)
    labels = rng.choice(3, 6000, p=[0.6, 0.3, 0.1])
    lengths = np.clip(np.round(rng.lognormal(np.log(24) + 0.7 * labels, 0.5)), 2, 512).astype(np.int64)
    budget = TokenBudget(4096)
    plain = plan_batches(lengths, budget, SeededRandomness(0), labels=labels).diagnostics
    stratified = plan_batches(lengths, budget, SeededRandomness(0), labels=labels, stratify=True).diagnostics
    assert plain.label_deviation > 0.3, "the lengths were meant to separate the classes"
    assert stratified.label_deviation < 0.05 and stratified.label_deviation_max < 0.25
    assert stratified.padding_share > plain.padding_share  # the price, reported


def test_label_deviation_by_hand() -> None:
    labels = np.array([0, 0, 1, 1, 0, 1])
    # pass mix: half and half. Batch [0, 1] is all 0 (TV 1/2), batch [2, 4] is even (0), [3, 5] all 1 (1/2).
    emitted = np.array([0, 1, 2, 4, 3, 5])
    mean, largest = label_deviation(emitted, np.array([2, 2, 2]), labels)
    assert mean == pytest.approx(1 / 3) and largest == pytest.approx(0.5)
    assert all(math.isnan(x) for x in label_deviation(emitted, np.array([6]), np.zeros(6, np.int64)))
    diagnostics = plan_batches(
        np.full(6, 3), TokenBudget(6), SeededRandomness(0), pool_size=6, labels=labels
    ).diagnostics
    assert diagnostics.batches == 3 and 0.0 <= diagnostics.label_deviation <= diagnostics.label_deviation_max <= 1.0


def test_concentration_by_hand() -> None:
    assert concentration(np.array([0, 0, 1, 1]), 2) == (0.5, 0.0)
    assert concentration(np.array([0, 0, 0, 0]), 2) == (1.0, 1.0)
    top, hhi = concentration(np.array([0, 0, 0, 1]), 4)  # shares .75 .25 0 0 of four sensors
    assert top == 0.75 and hhi == pytest.approx((0.75**2 + 0.25**2 - 0.25) / 0.75)
    assert math.isnan(concentration(np.array([0, 0]), 1)[1]) and math.isnan(concentration(np.zeros(0, int), 3)[0])


# ------------------------------------------------------------------------------ building blocks
@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(st.just(0.0) | st.floats(1e-6, 1e6), min_size=1, max_size=12),
    caps=st.lists(st.integers(0, 50), min_size=12, max_size=12),
    share=st.floats(0.0, 1.2),
)
def test_water_fill_spends_the_total_within_caps_at_one_level(
    weights: list[float], caps: list[int], share: float
) -> None:
    w = np.array(weights)
    c = np.array(caps[: w.size], dtype=np.float64)
    total = share * c.sum()
    q = water_fill(w, c, total)
    assert np.all(q >= 0) and np.all(q <= c + 1e-9)
    reachable = c.sum() if total >= c.sum() else min(total, c[w > 0].sum())
    assert q.sum() == pytest.approx(reachable, abs=1e-6)
    free = (q < c - 1e-9) & (w > 0)
    if free.any() and total < c.sum():
        level = q[free] / w[free]
        assert np.allclose(level, level[0]), "uncapped groups must share one level"
        capped = (q >= c - 1e-9) & (w > 0)
        assert np.all(c[capped] / w[capped] <= level[0] + 1e-9), "a group capped below the level"


@settings(max_examples=300, deadline=None)
@given(
    quotas=st.lists(st.floats(0.0, 40.0), min_size=1, max_size=20).map(np.array),
    seed=st.integers(0, 2**32 - 1),
    crypto=st.booleans(),
)
def test_systematic_rounding_keeps_the_total_and_stays_within_one(quotas: np.ndarray, seed: int, crypto: bool) -> None:
    quotas = quotas * (np.round(quotas.sum()) / quotas.sum()) if quotas.sum() > 0 else quotas  # a whole total
    out = systematic_round(quotas, CryptoRandomness() if crypto else SeededRandomness(seed))
    assert out.sum() == round(quotas.sum())
    assert np.all(out >= np.floor(quotas - 1e-6)) and np.all(out <= np.ceil(quotas + 1e-6))


def test_systematic_rounding_is_unbiased() -> None:
    quotas = np.array([0.3, 2.5, 1.2, 0.0, 3.0, 0.7, 0.3])  # total 8
    draws = np.array([systematic_round(quotas, SeededRandomness(5, p)) for p in range(8000)])
    # each count is floor + Bernoulli(fraction): standard error sqrt(f(1-f)/8000) <= 0.0056
    assert np.all(np.abs(draws.mean(axis=0) - quotas) < 0.025)
    assert np.all(draws.sum(axis=1) == 8)


def test_gumbel_top_k_draws_like_successive_weighted_draws() -> None:
    weights = np.array([1.0, 2.0, 3.0, 4.0])
    k, draws = 2, 20_000
    # exact inclusion probabilities of Plackett-Luce draws without replacement
    exact = np.zeros(4)
    for first, second in itertools.permutations(range(4), 2):
        p = weights[first] / weights.sum() * weights[second] / (weights.sum() - weights[first])
        exact[[first, second]] += p
    counts = np.zeros(4)
    for d in range(draws):
        counts[gumbel_top_k(np.arange(4), np.log(weights), k, SeededRandomness(11, d))] += 1
    assert counts.sum() == k * draws
    # k items per draw: compare each item's inclusion count with its binomial law
    z = (counts - draws * exact) / np.sqrt(draws * exact * (1 - exact))
    assert np.all(np.abs(z) < 4.5), z


# ------------------------------------------------------------------------------ each policy's effect
def skewed_fleet(n: int = 4000, seed: int = 0) -> WindowSnapshot:
    """One chatty sensor with ~half the events, nine quiet ones sharing the rest."""
    rng = np.random.default_rng(seed)
    share = np.array([20.0] + [2.2] * 9)
    sensors = rng.choice(10, n, p=share / share.sum())
    lengths = np.clip(np.round(rng.lognormal(np.log(48), 0.8, n)), 4, 512).astype(np.int64)
    return snapshot_of(lengths, sensors, rng.integers(0, 3, n))


@pytest.mark.parametrize("mode", MODES)
def test_sensor_balancing_flattens_a_chatty_sensor_and_temperature_one_keeps_the_window_mix(mode: str) -> None:
    window = skewed_fleet()

    def shares(policy) -> tuple[float, float]:
        facts = PassSampler(500, 0.0, mode, 3, policy).select(window).facts  # type: ignore[arg-type]
        return facts["sensor_top_share"], facts["sensor_hhi"]

    window_top, window_hhi = concentration(sensor_codes(window), 10)
    uniform_top, _ = shares(UniformPolicy())
    as_window_top, as_window_hhi = shares(SensorBalancedPolicy(1.0))
    equal_top, equal_hhi = shares(SensorBalancedPolicy(math.inf))
    # a uniform 500-item sample without replacement: the chatty sensor's count is hypergeometric;
    # crypto mode cannot fix its seed, so the band is where a correct sampler falls outside once in a million
    low, high = stats.hypergeom(len(window), round(window_top * len(window)), 500).interval(1 - 1e-6)
    assert low / 500 <= uniform_top <= high / 500
    assert abs(as_window_top - window_top) < 0.005 and abs(as_window_hhi - window_hhi) < 0.005  # quotas: exact
    assert equal_top == pytest.approx(0.1, abs=0.003) and equal_hhi < 1e-4
    assert shares(SensorBalancedPolicy(2.0))[0] < window_top - 0.1


def test_curriculum_prefers_short_items_and_anneals_to_uniform() -> None:
    window = skewed_fleet(3000)
    rank = (stats.rankdata(window.lengths) - 1) / (len(window) - 1)
    policy = CurriculumPolicy(strength=4.0, half_life_steps=100.0)
    assert policy.beta(0) == 4.0 and policy.beta(100) == pytest.approx(2.0) and policy.beta(1000) < 0.004

    def mean_rank(planned_steps: int, passes: int = 40) -> float:
        sampler = PassSampler(300, 0.0, "seeded", 4, policy)
        return float(
            np.mean([rank[sampler.select(window, planned_steps=planned_steps).index].mean() for _ in range(passes)])
        )

    early, late = mean_rank(0), mean_rank(2000)
    assert early < 0.3, "strength 4 should favour the short items clearly"
    # at beta ~ 0 a 300-of-3000 replay has mean rank 0.5 with standard error ~0.017 / sqrt(40)
    assert abs(late - 0.5) < 0.02


@pytest.mark.parametrize("mode", MODES)
def test_curriculum_at_zero_strength_replays_uniformly(mode: str) -> None:
    window = skewed_fleet(200)
    sampler = PassSampler(20, 0.0, mode, 6, CurriculumPolicy(strength=0.0))  # type: ignore[arg-type]
    counts = np.zeros(200)
    passes = 1000
    for _ in range(passes):
        counts[sampler.select(window).index] += 1
    # every item with probability 1/10 per pass: chi-square over 200 cells
    statistic = float(((counts - passes / 10) ** 2 / (passes / 10)).sum())
    assert stats.chi2.sf(statistic / 0.9, 199) > 1e-6  # a fixed 20 per pass: each count varies by p(1 - p), not p


def test_make_policy_names_the_choices() -> None:
    assert make_policy("stratified").stratify_batches and not make_policy("uniform").stratify_batches
    with pytest.raises(ValueError, match="SAMPLING"):
        make_policy("random")
    with pytest.raises(ValueError, match="temperature"):
        SensorBalancedPolicy(0.0)
    with pytest.raises(ValueError, match="half_life"):
        CurriculumPolicy(1.0, 0.0)


def _candidates(lengths: list[int]) -> PassCandidates:
    n = len(lengths)
    return PassCandidates(
        lengths=np.asarray(lengths, np.int64),
        labels=np.full(n, -1, np.int64),
        sensor_codes=np.zeros(n, np.int64),
        sensors=1,
        pass_items=max(n - 1, 0),
        fresh_order=np.zeros(0, np.int64),
        fresh_cap=0,
        planned_steps=0,
    )


@pytest.mark.parametrize(
    "lengths, difficulty",
    [
        ([], []),
        ([7], [0.0]),
        ([2, 1], [1.0, 0.0]),
        ([5, 1, 3, 3], [1.0, 0.0, 0.5, 0.5]),  # tied lengths share their mid-rank
        ([4, 4, 4], [0.5, 0.5, 0.5]),
    ],
)
def test_length_difficulty_is_the_mid_rank_scaled_to_zero_one(lengths: list[int], difficulty: list[float]) -> None:
    assert length_difficulty(_candidates(lengths)).tolist() == difficulty


def test_group_codes_number_values_in_order_of_first_appearance() -> None:
    for values in (["b", "a", "b", "c"], np.array(["b", "a", "b", "c"], dtype=object)):
        codes, groups = group_codes(values)
        assert codes.tolist() == [0, 1, 0, 2] and groups == 3 and codes.dtype == np.int64


@settings(max_examples=60, deadline=None)
@given(
    table_size=st.integers(1, 12),
    draws=st.lists(st.integers(0, 11), max_size=40),
    piece=st.integers(1, 8),
)
def test_group_codes_of_sensor_codes_number_the_ids_as_the_ids_themselves_do(
    table_size: int, draws: list[int], piece: int
) -> None:
    """A window's snapshot gives its ids as codes into a table (unused entries included); the
    renumbering, done in pieces, must give what the ids would give, or passes would change."""
    strings = np.array([f"sensor-{i}" for i in range(table_size)], dtype=object)
    codes = np.array([d % table_size for d in draws], dtype=np.int32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policies_module, "CODE_PIECE_ITEMS", piece)
        coded, groups = group_codes(SensorCodes(codes, strings))
    expected, expected_groups = group_codes(strings[codes])
    assert coded.tolist() == expected.tolist() and groups == expected_groups and coded.dtype == np.int64


def test_a_window_pass_selects_from_its_codes_what_it_selects_from_the_ids() -> None:
    window = RecencyWindow(1000, 3600.0, rng=np.random.default_rng(0))
    rng = np.random.default_rng(1)
    for start in range(0, 3000, 250):  # sensors come and go, so codes and first appearances differ
        sensors = [f"pump-{s}" for s in rng.integers(start // 100, start // 100 + 40, 250)]
        events = [SensorEvent(s, float(start + i), np.ones((3, 1), np.float32)) for i, s in enumerate(sensors)]
        window.insert_batch(EventBatch.from_events(events, offsets=np.arange(start, start + 250)))
    snapshot = window.snapshot()
    assert isinstance(snapshot.sensor_ids, SensorCodes)  # not an object per item
    as_ids = dataclasses.replace(snapshot, sensor_ids=np.asarray(snapshot.sensor_ids, dtype=object))
    assert snapshot.sensor_ids.codes.tolist() != group_codes(as_ids.sensor_ids)[0].tolist()  # the test can tell
    picks = [PassSampler(512, 0.25, "seeded", 7, SensorBalancedPolicy(2.0)).select(snap) for snap in (snapshot, as_ids)]
    assert picks[0].index.tolist() == picks[1].index.tolist() and picks[0].facts == picks[1].facts


def test_policy_signatures_name_the_policy_and_every_knob() -> None:
    assert UniformPolicy().signature() == "uniform{}"
    assert SensorBalancedPolicy(1.5).signature() == "sensor_balanced{'temperature': '1.5'}"
    assert StratifiedPolicy().signature() == "stratified{}"
    assert CurriculumPolicy(3.0, 500.0).signature() == (
        "curriculum{'difficulty': 'length_difficulty', 'half_life_steps': '500.0', 'strength': '3.0'}"
    )

    class Named:
        """A callable without a __qualname__ of its own: its repr stands in."""

        __qualname__ = ""

        def __call__(self, candidates: PassCandidates) -> np.ndarray:
            return np.zeros(candidates.window_items)

        def __repr__(self) -> str:
            return "Named()"

    assert CurriculumPolicy(1.0, 2.0, Named()).signature() == (
        "curriculum{'difficulty': 'Named()', 'half_life_steps': '2.0', 'strength': '1.0'}"
    )


def test_policy_defaults_match_the_settings_defaults() -> None:
    assert SensorBalancedPolicy().temperature == 2.0
    curriculum = CurriculumPolicy()
    assert (curriculum.strength, curriculum.half_life_steps) == (3.0, 500.0)
    assert curriculum.facts(500) == {"curriculum_beta": 1.5}


@pytest.mark.parametrize("strength", [-1.0, math.inf, math.nan])
def test_curriculum_refuses_a_strength_that_is_negative_or_not_finite(strength: float) -> None:
    with pytest.raises(ValueError, match=rf"^curriculum strength must be a finite number >= 0, got {strength}$"):
        CurriculumPolicy(strength)


def test_gumbel_top_k_of_one_item_draws_one() -> None:
    chosen = gumbel_top_k(np.arange(5), np.zeros(5), 1, SeededRandomness(0))
    assert chosen.shape == (1,) and 0 <= int(chosen[0]) < 5


@pytest.mark.parametrize("k", [2, 3, 4])
def test_gumbel_top_k_takes_the_overwhelmingly_heavy_items_first(k: int) -> None:
    log_weights = np.full(10, -1e6)
    heavy = np.array([7, 2, 5, 0])[:k]
    log_weights[heavy] = 0.0
    for seed in range(20):
        assert set(gumbel_top_k(np.arange(10), log_weights, k, SeededRandomness(seed)).tolist()) == set(heavy.tolist())


def test_water_fill_does_not_depend_on_the_scale_of_huge_weights() -> None:
    caps = np.array([5.0, 1.0, 9.0])
    assert water_fill(np.array([1e200, 1e200, 3e200]), caps, 6.0).tolist() == [1.25, 1.0, 3.75]
    assert water_fill(np.array([1.0, 1.0, 3.0]), caps, 6.0).tolist() == [1.25, 1.0, 3.75]


def test_systematic_rounding_gives_whole_numbers_within_one_of_each_quota() -> None:
    for seed in range(50):
        out = systematic_round(np.array([0.9, 0.6, 2.0]), SeededRandomness(seed))
        assert out.dtype == np.int64 and out[2] == 2
        assert out[0] in (0, 1) and out[1] in (0, 1)
        rounded_total = systematic_round(np.array([0.7, 0.7]), SeededRandomness(seed))
        assert rounded_total.sum() == 1  # round(1.4)


def test_systematic_rounding_lays_the_fractions_out_in_a_random_order() -> None:
    """In a fixed order two neighbouring halves would never both round up; in a random order they do."""
    both = sum(bool((systematic_round(np.full(4, 0.5), SeededRandomness(seed))[:2] == 1).all()) for seed in range(200))
    assert both > 0


def test_make_policy_passes_each_knob_and_has_the_settings_defaults() -> None:
    assert make_policy("sensor_balanced").temperature == 2.0
    assert make_policy("sensor_balanced", sensor_temperature=4.0).temperature == 4.0
    default = make_policy("curriculum")
    assert (default.strength, default.half_life_steps) == (3.0, 500.0)
    tuned = make_policy("curriculum", curriculum_strength=1.0, curriculum_half_life_steps=10.0)
    assert (tuned.strength, tuned.half_life_steps) == (1.0, 10.0)
