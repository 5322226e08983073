"""The exact discrete Gaussian sampler: its distribution at fixed seeds, and the exactness of each coin."""

from __future__ import annotations

import decimal
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from streamtrain.data.randomness import CryptoRandomness, SeededRandomness
from streamtrain.privacy.noise import (
    GRID,
    DiscreteGaussianNoise,
    LazyUniform,
    bernoulli_exp_neg,
    discrete_gaussian,
    discrete_gaussian_variance,
    discrete_laplace,
    exp_neg_bounds,
    geometric_exp,
)

ALPHA = 1e-6  # fixed seeds: these tests are deterministic; the level only sizes the tolerances


def pmf_discrete_gaussian(sigma2: float, support: np.ndarray) -> np.ndarray:
    k = np.arange(-int(40 * math.sqrt(sigma2)) - 2, int(40 * math.sqrt(sigma2)) + 3)
    norm = np.exp(-(k * k) / (2 * sigma2)).sum()
    return np.exp(-(support.astype(float) ** 2) / (2 * sigma2)) / norm


def chi_square_pvalue(draws: np.ndarray, pmf, min_expected: float = 20.0) -> float:
    """Chi-square goodness of fit, cells with small expectation merged into the two tails."""
    values, counts = np.unique(draws, return_counts=True)
    low, high = int(values.min()), int(values.max())
    support = np.arange(low - 50, high + 51)
    expected = pmf(support) * draws.size
    observed = np.zeros(support.size)
    observed[values - support[0]] = counts
    # merge from both ends until every cell expects enough
    keep = expected >= min_expected
    first, last = np.flatnonzero(keep)[[0, -1]]
    # the mass outside the support, split evenly between the two tail cells
    outside = (1 - pmf(support).sum()) * draws.size / 2
    cells_e = np.concatenate(
        [[expected[:first].sum() + outside], expected[first : last + 1], [expected[last + 1 :].sum() + outside]]
    )
    cells_o = np.concatenate([[observed[:first].sum()], observed[first : last + 1], [observed[last + 1 :].sum()]])
    return float(stats.chisquare(cells_o, cells_e * cells_o.sum() / cells_e.sum()).pvalue)


@pytest.mark.parametrize(("sigma2", "seed"), [(0.5, 1), (2.0, 2), (Fraction(21, 2), 3), (1000.0, 4)])
def test_discrete_gaussian_fits_its_pmf(sigma2: Fraction | float, seed: int) -> None:
    n = 200_000
    draws = discrete_gaussian(sigma2, n, SeededRandomness(seed))
    assert draws.dtype == np.int64
    assert chi_square_pvalue(draws, lambda k: pmf_discrete_gaussian(float(sigma2), k)) > ALPHA
    variance = discrete_gaussian_variance(float(sigma2))
    assert abs(draws.mean()) <= 5 * math.sqrt(variance / n)
    # sample variance of n draws: standard error about variance * sqrt(2 / n) (light tails)
    assert abs(draws.var() - variance) <= 6 * variance * math.sqrt(2 / n)
    assert stats.skew(draws) == pytest.approx(0, abs=6 * math.sqrt(6 / n))


def test_discrete_gaussian_at_the_service_scale_has_the_continuous_moments() -> None:
    """σ = 2^16 grid units (σ = 1 at the default grid): variance σ², normal quantiles."""
    s2 = float(GRID) ** 2
    n = 100_000
    draws = discrete_gaussian(s2, n, SeededRandomness(11)).astype(np.float64)
    assert abs(draws.var() / s2 - 1) <= 6 * math.sqrt(2 / n)
    assert stats.kstest(draws / GRID, "norm").pvalue > ALPHA  # lattice steps of 2^-16 are invisible to KS
    assert stats.kurtosis(draws) == pytest.approx(0, abs=6 * math.sqrt(24 / n))


def test_discrete_laplace_and_geometric_fit_their_laws() -> None:
    t = 3
    draws = discrete_laplace(t, 200_000, SeededRandomness(5))
    pmf = lambda k: np.exp(-np.abs(k) / t) * (1 - math.exp(-1 / t)) / (1 + math.exp(-1 / t))  # noqa: E731
    assert chi_square_pvalue(draws, pmf) > ALPHA
    geometric = geometric_exp(t, 200_000, SeededRandomness(6))
    assert geometric.min() >= 0
    assert (
        chi_square_pvalue(geometric, lambda k: np.where(k >= 0, np.exp(-k / t) * (1 - math.exp(-1 / t)), 0.0)) > ALPHA
    )


def test_same_seed_same_noise_and_the_default_source_is_the_csprng() -> None:
    a = DiscreteGaussianNoise(SeededRandomness(9)).sample(100.0, 1000)
    b = DiscreteGaussianNoise(SeededRandomness(9)).sample(100.0, 1000)
    assert np.array_equal(a, b)
    noise = DiscreteGaussianNoise()
    assert isinstance(noise.bits, CryptoRandomness)
    assert not np.array_equal(noise.sample(100.0, 64), noise.sample(100.0, 64))


@settings(max_examples=60, deadline=None)
@given(num=st.integers(0, 10**6), den=st.integers(1, 10**4), prec=st.integers(8, 200))
def test_exp_neg_bounds_enclose_the_value(num: int, den: int, prec: int) -> None:
    gamma = Fraction(num, den)
    lo, hi = exp_neg_bounds(gamma, prec)
    with decimal.localcontext() as context:  # an independent computation: correctly rounded exp at 200 digits
        context.prec = 200
        exact = (-(decimal.Decimal(num) / decimal.Decimal(den))).exp() * (decimal.Decimal(2) ** prec)
        assert decimal.Decimal(lo) <= exact <= decimal.Decimal(hi)
    assert hi - lo <= 2 + (1 if gamma < 1 else 0) or lo == 0


def test_an_inconclusive_coin_is_settled_with_the_exact_conditional_probability() -> None:
    """A 32-bit word inside the band around exp(-γ): the exact path must accept with
    probability (exp(-γ)·2^32 - w), the chance that the rest of U lies below exp(-γ)."""
    gamma = Fraction(1, 3)
    boundary = math.exp(-1 / 3) * 2**32
    word = math.floor(boundary)
    expected = boundary - word
    trials = 4000
    accepted = sum(LazyUniform(word, 32, SeededRandomness(seed)).below_exp_neg(gamma) for seed in range(trials))
    assert stats.binomtest(accepted, trials, expected).pvalue > ALPHA

    # and bernoulli_exp_neg routes such a word through that path
    class Words:
        def __init__(self) -> None:
            self.calls = 0
            self.seeded = SeededRandomness(1)

        def raw_uint64(self, n: int) -> np.ndarray:
            self.calls += 1
            if self.calls == 1:  # one 64-bit word = two 32-bit uniforms, the first is ours
                return np.asarray([(word << 32) | 0], dtype=np.uint64)
            return self.seeded.raw_uint64(n)

    source = Words()
    bernoulli_exp_neg(np.asarray([1 / 3]), lambda i: gamma, source)
    assert source.calls >= 2, "the word in the band must draw more bits"


def test_bernoulli_exp_neg_has_the_right_rate_far_and_near_zero() -> None:
    gammas = np.asarray([0.0, 1e-12, 0.5, 1.0, 4.0, 30.0, 800.0])
    n = 100_000
    for gamma in gammas:
        coins = bernoulli_exp_neg(
            np.full(n, gamma), lambda i, g=gamma: Fraction(g), SeededRandomness(int(gamma * 7) + 1)
        )
        assert stats.binomtest(int(coins.sum()), n, math.exp(-gamma)).pvalue > ALPHA, gamma


class AllOnes:
    """Every word has every bit set: U as close to 1 as the bits allow."""

    def raw_uint64(self, n: int) -> np.ndarray:
        return np.full(n, np.iinfo(np.uint64).max, dtype=np.uint64)


def test_coins_near_certainty_are_never_decided_wrongly() -> None:
    """exp(-0) = 1: even the largest uniform is below it, so the coin must come up True;
    the geometric's first threshold exp(0) is never crossed the wrong way either."""
    assert bool(bernoulli_exp_neg(np.zeros(3), lambda i: Fraction(0), AllOnes()).all())
    assert geometric_exp(5, 4, AllOnes()).tolist() == [0, 0, 0, 0]  # U just below 1 lies above exp(-1/5)
