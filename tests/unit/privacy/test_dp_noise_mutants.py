"""The discrete Gaussian sampler's exact paths, bit budget and refusals, driven by chosen words.

The distribution tests in test_dp_noise.py cannot see the rare paths (a float estimate off
by one, a coin inside the safety band: about one draw in 2^30); here the bit source hands
over the words that force them, and counts how many words each step takes.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from streamtrain.data.randomness import SeededRandomness
from streamtrain.privacy.noise import (
    LazyUniform,
    _pow_fixed,
    _random_bits,
    _thresholds,
    bernoulli_exp_neg,
    discrete_gaussian,
    discrete_laplace,
    exp_neg_bounds,
    geometric_exp,
    uniform_u32,
)


class Words:
    """Hands out ``first`` in order, then seeded words; counts the words taken."""

    def __init__(self, first: list[int] | None = None, seed: int = 0) -> None:
        self.queue = list(first or [])
        self.seeded = SeededRandomness(seed)
        self.taken = 0

    def raw_uint64(self, n: int) -> np.ndarray:
        head, self.queue = self.queue[:n], self.queue[n:]
        tail = self.seeded.raw_uint64(n - len(head)) if n > len(head) else np.zeros(0, np.uint64)
        self.taken += n
        return np.concatenate([np.asarray(head, dtype=np.uint64), tail])


@pytest.mark.parametrize(("base", "exponent", "prec"), [(3, 3, 2), (3, 5, 2), (1000, 7, 10), (123_457, 13, 17)])
def test_fixed_point_powers_round_down_and_up_around_the_exact_power(base: int, exponent: int, prec: int) -> None:
    exact = Fraction(base, 1 << prec) ** exponent * (1 << prec)
    down, up = _pow_fixed(base, exponent, prec, up=False), _pow_fixed(base, exponent, prec, up=True)
    assert down <= exact <= up


def test_uniform_words_take_one_64_bit_word_per_two_uniforms() -> None:
    source = Words()
    assert uniform_u32(4, source).shape == (4,) and source.taken == 2
    source = Words()
    assert uniform_u32(3, source).shape == (3,) and source.taken == 2


def test_fair_coins_take_one_word_per_64() -> None:
    source = Words()
    assert _random_bits(64, source).shape == (64,) and source.taken == 1
    source = Words()
    assert _random_bits(65, source).shape == (65,) and source.taken == 2


def test_a_lazy_uniform_draws_one_word_per_64_more_bits() -> None:
    gamma = Fraction(1, 3)
    word = math.floor(math.exp(-1 / 3) * 2**32)  # inside the band: 32 bits cannot decide
    source = Words()
    uniform = LazyUniform(word, 32, source)
    uniform.below_exp_neg(gamma)
    assert source.taken >= 1 and uniform.known == 32 + 64 * source.taken


def test_no_coins_for_no_gammas() -> None:
    coins = bernoulli_exp_neg(np.zeros(0), lambda i: Fraction(0), Words())
    assert coins.shape == (0,) and coins.dtype == bool


def test_a_word_at_the_upper_threshold_is_decided_without_more_bits() -> None:
    gamma = np.asarray([0.5])
    _, above, reachable = _thresholds(gamma, 32)
    assert bool(reachable[0])
    source = Words([int(above[0]) << 32])  # the first 32-bit uniform is the high half
    assert bernoulli_exp_neg(gamma, lambda i: Fraction(1, 2), source).tolist() == [False]
    assert source.taken == 1


def test_an_inconclusive_coin_asks_for_the_exact_gamma_of_its_own_element() -> None:
    gamma = Fraction(1, 3)
    word = math.floor(math.exp(-1 / 3) * 2**32)
    asked: list[int] = []

    def exact_of(i: int) -> Fraction:
        asked.append(i)
        return gamma

    # one word gives both coins: element 0 its high half (0: certainly below), element 1 the band word
    bernoulli_exp_neg(np.asarray([0.0, 1 / 3]), exact_of, Words([word]))
    assert asked == [1]


@pytest.mark.parametrize("t", [1, 2, 3])
def test_a_geometric_estimate_one_too_high_is_corrected_down(t: int) -> None:
    """U just above exp(-1/t): X is 0, but the float estimate floor(-t ln U) says 1."""
    _, hi = exp_neg_bounds(Fraction(1, t), 64)
    assert geometric_exp(t, 1, Words([hi])).tolist() == [0]


def test_a_geometric_estimate_one_too_low_is_corrected_up() -> None:
    """U just below exp(-2/5): X is 2, but the float estimate floor(-5 ln U) says 1."""
    lo, _ = exp_neg_bounds(Fraction(2, 5), 64)
    assert geometric_exp(5, 1, Words([lo - 1])).tolist() == [2]


def test_a_geometric_draw_from_the_all_zero_word_is_far_out_in_the_tail() -> None:
    """U < 2^-64: X >= floor(64 ln 2) = 44 at t = 1, settled by the exact path with more bits."""
    draw = geometric_exp(1, 1, Words([0]))
    assert 44 <= int(draw[0]) <= 44 + 64


def _gaussian_words(y: int, t: int, coin_word: int, extension: int) -> Words:
    """Words that make discrete_gaussian (scale ``t``) draw the Laplace value ``y`` > 0, then a
    coin whose 32-bit word is ``coin_word``, continued by the 64-bit word ``extension``."""
    u = (math.exp(-y / t) + math.exp(-(y + 1) / t)) / 2  # geometric: X = y for U in [e^-(y+1)/t, e^-y/t)
    return Words([int(u * 2**64), 0, coin_word << 32] + [extension] * 40, seed=1)  # sign word 0: positive


@pytest.mark.parametrize(("extension", "accepted"), [(0, True), ((1 << 64) - 1, False)])
def test_a_gaussian_coin_inside_the_band_is_settled_with_the_exact_gamma(extension: int, accepted: bool) -> None:
    """σ² = 7/2 (t = 2), y = 3: γ = (3·2·2 - 7)² / (2·7·2·2²) = 25/112. The coin's first 32 bits are
    floor(exp(-γ)·2^32), inside the safety band; the bits after them decide: all zeros put U
    below exp(-γ) (accepted: the draw is 3), all ones above it (rejected: the sampler starts over)."""
    gamma = Fraction(25, 112)
    lo, hi = exp_neg_bounds(gamma, 48)
    word = lo >> 16
    assert hi >> 16 == word, "the word is floor(exp(-γ)·2^32)"
    source = _gaussian_words(3, 2, word, extension)
    draw = discrete_gaussian(Fraction(7, 2), 1, source)
    if accepted:
        assert draw.tolist() == [3] and source.taken <= 3 + 2, "accepted after an extension word or two"
    else:
        assert source.taken > 3 + 2, "rejected: a fresh Laplace draw followed"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: discrete_laplace(0, 1, Words()), r"^discrete_laplace needs an integer scale t >= 1, got 0$"),
        (lambda: discrete_gaussian(0, 1, Words()), r"^discrete_gaussian needs sigma² > 0, got 0$"),
        (lambda: discrete_gaussian(-1.5, 1, Words()), r"^discrete_gaussian needs sigma² > 0, got -1.5$"),
        (
            lambda: discrete_gaussian(float(2**40) ** 2, 1, Words()),
            r"^discrete_gaussian: σ = 1099511627776.0 is beyond this sampler's integer range \(2\^40\)$",
        ),
    ],
)
def test_refusals_say_the_rule(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call()


def test_the_largest_sigma_in_range_is_sampled() -> None:
    """floor(σ) + 1 == 2^40 is the last scale the sampler takes."""
    sigma = 2**40 - 1
    draws = discrete_gaussian(sigma * sigma, 4, SeededRandomness(3))
    assert draws.dtype == np.int64 and draws.shape == (4,)
    assert bool((np.abs(draws) < 10 * sigma).all())


def test_the_series_bounds_refuse_a_fraction_outside_zero_one() -> None:
    from streamtrain.privacy.noise import _exp_neg_fraction_bounds

    with pytest.raises(ValueError, match=r"^_exp_neg_fraction_bounds needs 0 <= f <= 1, got 3/2$"):
        _exp_neg_fraction_bounds(Fraction(3, 2), 10)


@pytest.mark.parametrize("gamma", [0.5, 2.0, 7.0])
def test_the_fast_thresholds_keep_the_documented_band_around_exp_minus_gamma(gamma: float) -> None:
    """below/2^64 <= exp(-γ) - slack and above/2^64 >= exp(-γ) + slack, with slack = exp(-γ)(1 + γ)·2^-44
    (a float γ that far off cannot fool them), and the band is no wider than twice (1 + γ)·2^-40."""
    below, above, reachable = _thresholds(np.asarray([gamma]), 64)
    lo, hi = exp_neg_bounds(Fraction(gamma), 64)  # exact, to a unit of 2^-64
    p = math.exp(-gamma)
    slack = math.floor(p * (1 + gamma) * 2.0**-44 * 2.0**64)
    assert bool(reachable[0])
    assert int(below[0]) <= lo - slack and int(above[0]) >= hi + slack
    assert int(above[0]) - int(below[0]) <= 2 * p * (1 + gamma) * 2.0**-40 * 2.0**64 + 4096


@pytest.mark.parametrize("width", [32, 64])
def test_a_threshold_at_certainty_is_a_word_that_cannot_exist(width: int) -> None:
    below, _, reachable = _thresholds(np.asarray([0.0]), width)
    assert not bool(reachable[0]) and int(below[0]) < 2**width


def test_a_zero_word_against_a_vanishing_probability_still_takes_the_exact_path() -> None:
    """exp(-800) underflows to 0.0 in float64, but it is not 0: only more bits can refuse U = 0..."""
    source = Words([0])
    assert bernoulli_exp_neg(np.asarray([800.0]), lambda i: Fraction(800), source).tolist() == [False]
    assert source.taken > 1


def test_the_variance_of_a_tiny_sigma_is_tiny_and_finite() -> None:
    from streamtrain.privacy.noise import discrete_gaussian_variance

    variance = discrete_gaussian_variance(1e-4)
    assert 0.0 <= variance < 1e-100
    weights = {k: math.exp(-k * k / 2) for k in range(-60, 61)}  # σ² = 1, summed independently
    expected = sum(k * k * w for k, w in weights.items()) / sum(weights.values())
    assert discrete_gaussian_variance(1.0) == pytest.approx(expected, rel=1e-12)


def test_the_series_bounds_enclose_exp_minus_f_at_every_precision() -> None:
    """The fixed-point series bounds themselves, before exp_neg_bounds' guard bits hide a unit."""
    import decimal

    from streamtrain.privacy.noise import _exp_neg_fraction_bounds

    with decimal.localcontext() as context:
        context.prec = 120
        for prec in range(0, 40):
            for f in (Fraction(0), Fraction(1, 7), Fraction(1, 3), Fraction(1, 2), Fraction(5, 6), Fraction(1)):
                lo, hi = _exp_neg_fraction_bounds(f, prec)
                exact = (-(decimal.Decimal(f.numerator) / decimal.Decimal(f.denominator))).exp() * (
                    decimal.Decimal(2) ** prec
                )
                assert decimal.Decimal(lo) <= exact <= decimal.Decimal(hi), (f, prec)


def test_exp_neg_bounds_refuses_a_negative_gamma() -> None:
    with pytest.raises(ValueError, match=r"^exp_neg_bounds needs gamma >= 0, got -1/2$"):
        exp_neg_bounds(Fraction(-1, 2), 10)
