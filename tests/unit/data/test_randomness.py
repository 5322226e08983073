"""Randomness modes: seeded streams are reproducible and distinct, crypto draws are uniform and fresh."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from streamtrain.data.randomness import (
    STREAM_PURPOSES,
    CryptoRandomness,
    Randomness,
    SeededRandomness,
    derive_seed,
    derive_seed_sequence,
    make_randomness,
)

# A crypto test cannot fix its seed, so its chi-square threshold is set where a correct
# generator fails once in a million runs.
CRYPTO_ALPHA = 1e-6


class ScriptedRandomness(Randomness):
    """Replays given 64-bit words, to drive the exact-comparison paths deterministically."""

    mode = "seeded"
    reproducible = True

    def __init__(self, words: list[int]) -> None:
        self.words = list(words)

    def raw_uint64(self, n: int) -> np.ndarray:
        taken, self.words = self.words[:n], self.words[n:]
        assert len(taken) == n, "script ran out of words"
        return np.array(taken, dtype=np.uint64)


def test_seeded_streams_repeat_for_the_same_coordinates() -> None:
    a, b = SeededRandomness(7, 3, 1, 2), SeededRandomness(7, 3, 1, 2)
    assert np.array_equal(a.permutation(1000), b.permutation(1000))
    assert np.array_equal(a.random(100), b.random(100))
    assert np.array_equal(a.integers(13, 100), b.integers(13, 100))
    assert np.array_equal(a.bernoulli(np.full(100, 0.3)), b.bernoulli(np.full(100, 0.3)))


def test_seeded_streams_differ_across_pass_rank_worker_and_shared() -> None:
    coordinates = [(0, None, None), (0, 0, None), (0, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 0), (1, None, None)]
    heads = {tuple(SeededRandomness(5, *c).raw_uint64(4).tolist()) for c in coordinates}
    assert len(heads) == len(coordinates)
    assert not np.array_equal(SeededRandomness(5).raw_uint64(8), SeededRandomness(6).raw_uint64(8))


def test_each_purpose_has_its_own_stream_for_the_same_coordinates() -> None:
    heads = {
        purpose: tuple(SeededRandomness(5, 2, 0, None, purpose=purpose).raw_uint64(4).tolist())
        for purpose in STREAM_PURPOSES
    }
    assert len(set(heads.values())) == len(STREAM_PURPOSES)
    assert len({derive_seed(5, 2, purpose=purpose) for purpose in STREAM_PURPOSES}) == len(STREAM_PURPOSES)
    with pytest.raises(ValueError, match="purpose"):
        make_randomness("seeded", 5, purpose="shuffle")  # type: ignore[arg-type]


def test_a_stream_is_a_child_in_the_seed_sequence_spawn_tree() -> None:
    """(seed, purpose, pass, rank, worker) names the node spawn() would hand out on that path."""
    root = np.random.SeedSequence(9)
    purpose_child = root.spawn(3)[2]  # tag 2: "select"
    node = purpose_child.spawn(5)[4].spawn(2)[1].spawn(1)[0]  # pass 4, rank 0 (key 1), shared worker (key 0)
    derived = derive_seed_sequence(9, 4, 0, None, purpose="select")
    assert derived.spawn_key == node.spawn_key
    assert np.array_equal(derived.generate_state(4), node.generate_state(4))


def test_derived_seeds_are_distinct_per_rank_and_worker_and_stable() -> None:
    grid = list(itertools.product(range(4), [None, *range(4)], [None, *range(4)]))
    seeds = [derive_seed(11, p, r, w) for p, r, w in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(11, 2, 1, 3) == derive_seed(11, 2, 1, 3)


def test_coordinates_must_be_non_negative_integers() -> None:
    with pytest.raises(ValueError, match="rank"):
        SeededRandomness(0, 0, -1)
    with pytest.raises(ValueError, match="seed"):
        derive_seed(-3)


def test_make_randomness_picks_the_mode_and_names_the_choices() -> None:
    assert isinstance(make_randomness("seeded", 1, 2, 0, 0), SeededRandomness)
    crypto = make_randomness("crypto", 1, 2)
    assert isinstance(crypto, CryptoRandomness) and not crypto.reproducible
    with pytest.raises(ValueError, match="seeded.*crypto"):
        make_randomness("fast", 0)  # type: ignore[arg-type]


def test_crypto_draws_are_not_reproducible() -> None:
    # Two equal 1000-element permutations happen with probability 1/1000!.
    assert not np.array_equal(CryptoRandomness().permutation(1000), CryptoRandomness().permutation(1000))
    assert not np.array_equal(make_randomness("crypto", 0).random(8), make_randomness("crypto", 0).random(8))


@pytest.mark.parametrize("rng", [SeededRandomness(3), CryptoRandomness()], ids=["seeded", "crypto"])
def test_permutation_is_uniform_over_all_orderings(rng: Randomness) -> None:
    n, draws = 4, 24_000
    codes = {perm: k for k, perm in enumerate(itertools.permutations(range(n)))}
    counts = np.zeros(len(codes))
    for _ in range(draws):
        counts[codes[tuple(rng.permutation(n).tolist())]] += 1
    assert stats.chisquare(counts).pvalue > CRYPTO_ALPHA


@pytest.mark.parametrize("rng", [SeededRandomness(4), CryptoRandomness()], ids=["seeded", "crypto"])
@pytest.mark.parametrize("n, k", [(9, 2), (5, 2)], ids=["draws", "permutation"])
def test_sample_is_uniform_over_ordered_tuples_of_distinct_items(rng: Randomness, n: int, k: int) -> None:
    codes = {t: i for i, t in enumerate(itertools.permutations(range(n), k))}
    counts = np.zeros(len(codes))
    for _ in range(300 * len(codes)):
        counts[codes[tuple(rng.sample(n, k).tolist())]] += 1
    assert stats.chisquare(counts).pvalue > CRYPTO_ALPHA


class Counting(Randomness):
    """Counts the 64-bit words drawn from the randomness it is mixed into."""

    drawn = 0

    def raw_uint64(self, n: int) -> np.ndarray:
        self.drawn += n
        return super().raw_uint64(n)


class CountingRandomness(Counting, SeededRandomness):
    """A seeded stream, its words counted."""


def test_a_small_sample_of_many_items_draws_words_for_the_sample_not_the_items() -> None:
    rng = CountingRandomness(5)
    picked = rng.sample(1_000_000, 8192)
    assert np.unique(picked).size == 8192 and picked.min() >= 0 and picked.max() < 1_000_000
    assert rng.drawn < 9000  # a permutation would draw a million
    assert SeededRandomness(1).sample(7, 7).tolist() != list(range(7)) and SeededRandomness(1).sample(0, 0).size == 0


def test_sample_keeps_the_first_distinct_draws_in_order_and_draws_again_for_repeats() -> None:
    # k=2 of n=16: 18 words, all 5 (one distinct value), then 18 more: 5, 7, ... -> (5, 7).
    words = [5] * 18 + [5, 7] + [3] * 16
    assert ScriptedRandomness(words).sample(16, 2).tolist() == [5, 7]
    with pytest.raises(ValueError, match="cannot take 4 distinct items of 3"):
        SeededRandomness(0).sample(3, 4)


def test_crypto_permutation_redraws_keys_that_tie() -> None:
    # First draw ties (5, 5, 1): rejected as a whole. Second draw (9, 2, 4) sorts to [1, 2, 0].
    # CryptoRandomness uses this shared argsort-of-keys permutation.
    assert ScriptedRandomness([5, 5, 1, 9, 2, 4]).permutation(3).tolist() == [1, 2, 0]
    assert "permutation" not in vars(CryptoRandomness)


def test_random_floats_lie_in_unit_interval_on_the_53_bit_grid() -> None:
    rng = ScriptedRandomness([0, 2**64 - 1, 2**63])
    assert rng.random(3).tolist() == [0.0, 1.0 - 2.0**-53, 0.5]
    values = SeededRandomness(0).random(100_000)
    assert values.min() >= 0.0 and values.max() < 1.0
    assert abs(values.mean() - 0.5) < 5 * math.sqrt(1 / 12 / values.size)


def test_integers_reject_the_biased_tail() -> None:
    # 2**64 % 3 == 1, so the word 2**64 - 1 would favour residue 0 and is redrawn.
    assert ScriptedRandomness([2**64 - 1, 5]).integers(3, 1).tolist() == [2]
    counts = np.bincount(SeededRandomness(1).integers(7, 70_000), minlength=7)
    assert stats.chisquare(counts).pvalue > 1e-4
    with pytest.raises(ValueError, match="high"):
        SeededRandomness(0).integers(0, 3)


def test_bernoulli_compares_exactly_including_ties() -> None:
    quarter = 2**62  # p = 0.25 is the word threshold 2**62
    assert ScriptedRandomness([quarter - 1, quarter]).bernoulli([0.25, 0.25]).tolist() == [True, False]
    tiny = 2.0**-70  # below one word's resolution: a zero word ties and the next word decides
    assert ScriptedRandomness([0, 2**58 - 1]).bernoulli([tiny]).tolist() == [True]
    assert ScriptedRandomness([0, 2**58]).bernoulli([tiny]).tolist() == [False]
    assert ScriptedRandomness([1]).bernoulli([tiny]).tolist() == [False]
    assert ScriptedRandomness([]).bernoulli([0.0, 1.0]).tolist() == [False, True]


@pytest.mark.parametrize("rng", [SeededRandomness(9), CryptoRandomness()], ids=["seeded", "crypto"])
def test_bernoulli_rates_match_probabilities(rng: Randomness) -> None:
    probs = np.repeat([0.001, 0.05, 0.5, 0.97], 50_000).reshape(4, 50_000)
    hits = rng.bernoulli(probs)
    assert hits.shape == probs.shape and hits.dtype == bool
    for row, p in zip(hits, probs[:, 0], strict=True):
        # Two-sided binomial test per probability.
        assert stats.binomtest(int(row.sum()), row.size, p).pvalue > CRYPTO_ALPHA


def test_bernoulli_rejects_probabilities_outside_unit_interval() -> None:
    for bad in ([1.5], [-0.1], [math.nan]):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            SeededRandomness(0).bernoulli(bad)


class ScriptedCounting(Counting, ScriptedRandomness):
    """Scripted words, counting how many were drawn."""


@pytest.mark.parametrize(
    ("call", "refusal"),
    [
        (lambda: SeededRandomness(0).random(-1), "n must be an integer >= 0, got -1"),
        (lambda: SeededRandomness(0).integers(5, -1), "n must be an integer >= 0, got -1"),
        (lambda: SeededRandomness(0).integers(0, 1), "high must be an integer >= 1, got 0"),
        (lambda: ScriptedRandomness([]).permutation(-2), "n must be an integer >= 0, got -2"),
        (lambda: SeededRandomness(0).permutation(-2), "n must be an integer >= 0, got -2"),
        (lambda: SeededRandomness(0).sample(-1, 0), "n must be an integer >= 0, got -1"),
        (lambda: SeededRandomness(0).sample(4, -1), "k must be an integer >= 0, got -1"),
        (lambda: SeededRandomness(0).raw_uint64(-3), "n must be an integer >= 0, got -3"),
        (lambda: CryptoRandomness().raw_uint64(-3), "n must be an integer >= 0, got -3"),
        (lambda: derive_seed_sequence(-1), "seed must be an integer >= 0, got -1"),
        (lambda: derive_seed_sequence(1, -1), "pass_index must be an integer >= 0, got -1"),
        (lambda: derive_seed_sequence(1, 0, rank=-1), "rank must be an integer >= 0, got -1"),
        (lambda: derive_seed_sequence(1, 0, worker=-1), "worker must be an integer >= 0, got -1"),
        (lambda: SeededRandomness(0).integers(2**63, 1), f"high must be below 2**63 (an int64 result), got {2**63}"),
        (
            lambda: SeededRandomness(0).bernoulli([0.5, 2.0]),
            "bernoulli probabilities must be finite and within [0, 1]",
        ),
    ],
)
def test_each_refusal_names_its_argument_in_full(call: object, refusal: str) -> None:
    with pytest.raises(ValueError) as refused:
        call()  # type: ignore[operator]
    assert str(refused.value) == refusal


def test_every_draw_of_indices_is_int64() -> None:
    assert SeededRandomness(0).permutation(5).dtype == np.int64
    assert ScriptedRandomness([3, 1, 2]).permutation(3).dtype == np.int64
    assert SeededRandomness(0).sample(5, 0).dtype == np.int64
    assert SeededRandomness(0).integers(1, 4).tolist() == [0, 0, 0, 0]  # one value: always it
    assert SeededRandomness(0).integers(2**63 - 1, 3).dtype == np.int64


def test_rejection_redraws_only_the_biased_tail() -> None:
    rng = CountingRandomness(3)
    rng.integers(3, 1000)  # 2**64 % 3 == 1: one word in 2**64 is redrawn
    assert rng.drawn == 1000


def test_two_tied_keys_are_drawn_again() -> None:
    assert ScriptedRandomness([5, 5, 9, 1]).permutation(2).tolist() == [1, 0]


def test_a_tie_past_the_first_word_compares_what_is_left() -> None:
    p = (1 + 2.0**-3) * 2.0**-63  # 2.25 words: the word 2 ties, then a quarter of the next word decides
    assert ScriptedRandomness([2, 2**62 - 1]).bernoulli([p]).tolist() == [True]
    assert ScriptedRandomness([2, 2**62]).bernoulli([p]).tolist() == [False]


@pytest.mark.parametrize(
    ("n", "k", "words"),
    [
        (8, 2, 18),  # 4k == n: k + k*k//n + 16 draws, not a permutation of n
        (9, 2, 18),  # 4k < n < 5k
        (10, 3, 10),  # 4k > n: a permutation's n keys
        (16, 4, 21),  # k*k//n == 1 more draw
    ],
)
def test_a_sample_draws_a_permutation_only_past_a_quarter_of_the_items(n: int, k: int, words: int) -> None:
    script = list(range(words))  # distinct words, distinct residues where the path draws integers
    rng = ScriptedCounting(script)
    assert len(set(rng.sample(n, k).tolist())) == k and rng.drawn == words


def test_a_sample_that_found_exactly_k_distinct_values_draws_no_more() -> None:
    rng = ScriptedCounting([0, 5, 10] + [15] * 14)  # n=5, k=1: 17 draws, one distinct value (0)
    assert rng.sample(5, 1).tolist() == [0] and rng.drawn == 17


def test_the_default_coordinates_are_pass_0_shared_and_the_plan() -> None:
    assert derive_seed_sequence(7).spawn_key == (1, 0, 0, 0)
    assert derive_seed_sequence(7, 2, rank=0, worker=0, purpose="select").spawn_key == (2, 2, 1, 1)
    assert derive_seed_sequence(7, 2, rank=3, worker=5, purpose="select").spawn_key == (2, 2, 4, 6)
    assert SeededRandomness(7).raw_uint64(4).tolist() == SeededRandomness(7, 0).raw_uint64(4).tolist()
    assert SeededRandomness(7, purpose="select").purpose == "select"
    seeded = make_randomness("seeded")
    assert seeded.raw_uint64(4).tolist() == SeededRandomness(0, 0).raw_uint64(4).tolist()
    coordinates = make_randomness("seeded", 1, 2, 3, 4, purpose="linear")
    assert coordinates.raw_uint64(4).tolist() == SeededRandomness(1, 2, 3, 4, purpose="linear").raw_uint64(4).tolist()
    assert derive_seed(7) == derive_seed(7, 0)


def test_a_derived_seed_is_the_stream_s_first_word_shifted_to_63_bits() -> None:
    word = np.random.SeedSequence(11, spawn_key=(3, 4, 2, 0)).generate_state(1, dtype=np.uint64)[0]
    assert derive_seed(11, 4, rank=1) == int(word) >> 1
    assert 2**62 <= max(derive_seed(11, p) for p in range(8)) < 2**63  # the top bit is used


def test_large_integers_and_half_precision_probabilities_stay_exact() -> None:
    assert ScriptedRandomness([2**62 + 1]).integers(2**63 - 1, 1).tolist() == [2**62 + 1]  # no float on the way
    half = np.array([0.25], dtype=np.float16)  # scaled by 2**64 it would overflow a float16
    assert ScriptedRandomness([2**62 - 1]).bernoulli(half).tolist() == [True]
    assert ScriptedRandomness([2**62]).bernoulli(half).tolist() == [False]
