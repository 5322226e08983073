"""Exact discrete Gaussian noise (Canonne, Kamath & Steinke 2020) from an injectable bit source.

Floating-point Gaussian samplers leave gaps and biases that leak the value they are added
to (Mironov 2012; Holohan & Braghin 2021); hardening them is a mitigation, not a proof.
Here the noise is an integer vector drawn *exactly* from the discrete Gaussian
``N_Z(0, s²)`` — ``P(k) ∝ exp(-k² / 2s²)`` on the integers — and added to an integer
gradient sum (``per_sample.py`` puts the clipped per-example gradients on a grid first),
so the noisy sum is computed in exact integer arithmetic; what happens to it afterwards is
post-processing.

The sampler is CKS Algorithm 3 (rejection from a discrete Laplace), vectorized over numpy
arrays, with every random bit taken from ``bits.raw_uint64`` — the OS CSPRNG in the service,
a seeded generator in tests (the CSPRNG cannot be seeded, by design). The discrete Laplace is
a fair sign and a geometric magnitude X with P(X >= x) = exp(-x/t), drawn as the number of
thresholds exp(-1/t), exp(-2/t), ... above one uniform (the law of CKS Algorithm 2).

Every comparison of a uniform U with exp(-γ) is decided *lazily but exactly*: U's first 32
or 64 bits are compared with the float64 value of exp(-γ) widened by a safety band of
(1 + γ)·2^-40 relative — far above the error of float64 ``exp`` and of the few float
operations that form γ — and only when they fall inside the band (about one draw in 2^31)
are more bits drawn and compared with exact rational bounds of exp(-γ) computed with Python
integers (:func:`exp_neg_bounds`). So every decision has probability exactly exp(-γ) for the
exact rational γ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Protocol

import numpy as np

#: One clip norm C is this many grid units: per-example gradients become integer vectors
#: of L2 norm at most 2**GRID_BITS (see per_sample.py).
GRID_BITS = 16
GRID = 1 << GRID_BITS

_BAND = 2.0**-40  # safety band around float exp(-γ), relative, times (1 + γ)
_FLOOR = 2.0**-1060  # absolute band (covers exp(-γ) underflowing to 0)


class BitSource(Protocol):
    """Anything that gives independent uniform 64-bit words (every :class:`Randomness` does)."""

    def raw_uint64(self, n: int) -> np.ndarray: ...


# --------------------------------------------------------------------------------------------
# exact rational bounds of exp(-γ)
# --------------------------------------------------------------------------------------------


def _exp_neg_fraction_bounds(f: Fraction, prec: int) -> tuple[int, int]:
    """(lo, hi) with lo/2^prec <= exp(-f) <= hi/2^prec, for 0 <= f <= 1.

    For f <= 1 the terms of 1 - f + f²/2! - ... shrink in magnitude and alternate in sign,
    so the value lies between any partial sum and the next; both are rounded outward.
    """
    if not 0 <= f <= 1:
        raise ValueError(f"_exp_neg_fraction_bounds needs 0 <= f <= 1, got {f}")
    scale = 1 << prec
    total, term, k = Fraction(0), Fraction(1), 0
    while True:
        total += term
        k += 1
        term = -term * f / k
        if term == 0 or abs(term) * scale < 1:
            low, high = sorted((total, total + term))
            return max(math.floor(low * scale), 0), math.ceil(high * scale)


def exp_neg_bounds(gamma: Fraction, prec: int) -> tuple[int, int]:
    """Integers (lo, hi) with ``lo / 2^prec <= exp(-gamma) <= hi / 2^prec``, exactly, gamma >= 0.

    ``hi - lo`` is a few units for moderate gamma; for large gamma ``lo`` is 0 and ``hi``
    tiny. Pure Python integers: used only when a fast float comparison is inconclusive.
    """
    gamma = Fraction(gamma)
    if gamma < 0:
        raise ValueError(f"exp_neg_bounds needs gamma >= 0, got {gamma}")
    whole = math.floor(gamma)
    work = prec + 16 + whole.bit_length() * 2
    lo, hi = _exp_neg_fraction_bounds(gamma - whole, work)
    if whole:
        e_lo, e_hi = _exp_neg_fraction_bounds(Fraction(1), work)
        p_lo, p_hi = _pow_fixed(e_lo, whole, work, up=False), _pow_fixed(e_hi, whole, work, up=True)
        lo, hi = (lo * p_lo) >> work, -((-(hi * p_hi)) >> work)  # floor / ceil
    shift = work - prec
    return lo >> shift, -((-hi) >> shift)


def _pow_fixed(base: int, exponent: int, prec: int, up: bool) -> int:
    """(base / 2^prec)^exponent in fixed point, rounded down (or up when ``up``)."""
    result = 1 << prec
    while exponent:
        if exponent & 1:
            product = result * base
            result = -((-product) >> prec) if up else product >> prec
        exponent >>= 1
        if exponent:
            square = base * base
            base = -((-square) >> prec) if up else square >> prec
    return result


class LazyUniform:
    """A uniform U in [0, 1) known to ``known`` bits so far, extended 64 bits at a time on demand."""

    def __init__(self, prefix: int, known: int, bits: BitSource) -> None:
        self.prefix, self.known, self.bits = int(prefix), int(known), bits

    def below_exp_neg(self, gamma: Fraction) -> bool:
        """Exactly ``U < exp(-gamma)``: draws more bits until exact bounds settle it."""
        while True:
            lo, hi = exp_neg_bounds(gamma, self.known + 8)
            # U in [prefix, prefix + 1) / 2^known; the bounds are on the grid 2^-(known + 8).
            if (self.prefix + 1) << 8 <= lo:
                return True
            if self.prefix << 8 >= hi:
                return False
            self.prefix = (self.prefix << 64) | int(self.bits.raw_uint64(1)[0])
            self.known += 64


def uniform_u32(n: int, bits: BitSource) -> np.ndarray:
    """n independent uniform 32-bit words (as uint64): each 64-bit word gives two."""
    words = bits.raw_uint64((n + 1) // 2)
    return np.concatenate([words >> np.uint64(32), words & np.uint64(0xFFFFFFFF)])[:n]


def _thresholds(gamma: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer thresholds for a ``width``-bit word w against exp(-γ), γ given in float64.

    For the uniform U in [w, w + 1) / 2^width: ``w < below`` proves U < exp(-γ), and
    ``reachable & (w >= above)`` proves U >= exp(-γ); in between, the exact path decides.
    """
    scale = float(2**width)
    p = np.exp(-gamma)
    band = p * (1.0 + gamma) * _BAND + _FLOOR  # covers a float γ off by (1 + γ)·2^-44, exp off by 2^-50
    lo = np.maximum(p - band, 0.0)
    hi = np.minimum(p + band, 1.0)
    largest = scale - 2.0 ** (width - 53)  # the largest float below 2^width
    below = np.minimum(np.floor(lo * scale), largest).astype(np.uint64)  # lower only: still proves U < p
    above_float = np.ceil(hi * scale)
    reachable = above_float <= largest  # a word at or past 2^width cannot exist
    above = np.where(reachable, above_float, 0.0).astype(np.uint64)
    return below, above, reachable


def bernoulli_exp_neg(gamma: np.ndarray, exact_of: Callable[[int], Fraction], bits: BitSource) -> np.ndarray:
    """One Bernoulli(exp(-γ_i)) per element: bool array, exact for the rational γ_i.

    ``gamma`` holds float64 values within (1 + γ_i)·2^-44 of the exact γ_i; a 32-bit uniform
    decides unless it falls in the safety band around exp(-γ_i) (chance about 2^-31), and
    then ``exact_of(i)`` (the Fraction γ_i) and more bits settle it exactly.
    """
    gamma = np.asarray(gamma, dtype=np.float64)
    if gamma.size == 0:
        return np.zeros(0, dtype=bool)
    words = uniform_u32(gamma.size, bits)
    below, above, reachable = _thresholds(gamma, 32)
    accept = words < below
    undecided = ~accept & ~(reachable & (words >= above))
    for i in np.flatnonzero(undecided):
        accept[i] = LazyUniform(words[i], 32, bits).below_exp_neg(exact_of(int(i)))
    return accept


# --------------------------------------------------------------------------------------------
# geometric, discrete Laplace, discrete Gaussian
# --------------------------------------------------------------------------------------------


def _random_bits(n: int, bits: BitSource) -> np.ndarray:
    """n fair coins, 64 from each word."""
    words = bits.raw_uint64((n + 63) // 64)
    return np.unpackbits(words.view(np.uint8))[:n].astype(bool)


def geometric_exp(t: int, n: int, bits: BitSource) -> np.ndarray:
    """n exact draws of X >= 0 with P(X >= x) = exp(-x / t) (int64).

    X is the number of thresholds exp(-1/t), exp(-2/t), ... that lie above one uniform U,
    i.e. the integer with exp(-(X+1)/t) <= U < exp(-X/t). A float estimate floor(-t ln U)
    is checked against both thresholds with the safety band; only an inconclusive check
    (chance about 2^-29) goes to exact comparisons.
    """
    words = bits.raw_uint64(n)
    u = (words.astype(np.float64) + 0.5) * 2.0**-64
    x = np.maximum(np.floor(-float(t) * np.log(u)), 0.0)
    below_x, _, _ = _thresholds(x / t, 64)  # U < exp(-x/t) proven when w < below_x
    _, above_next, reachable = _thresholds((x + 1.0) / t, 64)  # U >= exp(-(x+1)/t) proven when w >= above_next
    out = x.astype(np.int64)
    for i in np.flatnonzero(~((words < below_x) & reachable & (words >= above_next))):
        uniform = LazyUniform(words[i], 64, bits)
        k = int(out[i])
        while k > 0 and not uniform.below_exp_neg(Fraction(k, t)):
            k -= 1
        while uniform.below_exp_neg(Fraction(k + 1, t)):
            k += 1
        out[i] = k
    return out


def discrete_laplace(t: int, n: int, bits: BitSource) -> np.ndarray:
    """n exact draws of the discrete Laplace with scale t: P(k) ∝ exp(-|k| / t).

    A geometric magnitude and a fair sign, with -0 rejected so 0 is not counted twice (the
    construction of CKS Algorithm 2, the magnitude drawn from one uniform).
    """
    if t < 1:
        raise ValueError(f"discrete_laplace needs an integer scale t >= 1, got {t}")
    out = np.zeros(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        x = geometric_exp(t, pending.size, bits)
        negative = _random_bits(pending.size, bits)
        valid = ~(negative & (x == 0))
        out[pending[valid]] = np.where(negative[valid], -x[valid], x[valid])
        pending = pending[~valid]
    return out


def discrete_gaussian(sigma_squared: Fraction | float, n: int, bits: BitSource) -> np.ndarray:
    """n exact i.i.d. draws of N_Z(0, σ²): P(k) ∝ exp(-k² / 2σ²) on the integers (CKS Algorithm 3).

    ``sigma_squared`` is the exact rational σ² (a float is taken at its exact binary value).
    """
    s2 = Fraction(sigma_squared)
    if s2 <= 0:
        raise ValueError(f"discrete_gaussian needs sigma² > 0, got {sigma_squared}")
    t = math.isqrt(s2.numerator // s2.denominator) + 1  # floor(σ) + 1
    if t > 2**40:
        raise ValueError(f"discrete_gaussian: σ = {math.sqrt(s2)} is beyond this sampler's integer range (2^40)")
    s2_float = float(s2)
    a, b = s2.numerator, s2.denominator
    out = np.zeros(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        y = discrete_laplace(t, pending.size, bits)
        magnitude = np.abs(y)
        # γ = (|y| - σ²/t)² / (2σ²) = (|y|·t·b - a)² / (2·a·b·t²), computed in float for the fast path
        diff = magnitude.astype(np.float64) - s2_float / t
        gamma = diff * diff / (2.0 * s2_float)

        def exact_gamma(i: int, magnitude: np.ndarray = magnitude) -> Fraction:
            return Fraction((int(magnitude[i]) * t * b - a) ** 2, 2 * a * b * t * t)

        keep = bernoulli_exp_neg(gamma, exact_gamma, bits)
        out[pending[keep]] = y[keep]
        pending = pending[~keep]
    return out


def discrete_gaussian_variance(sigma_squared: float, tail_sigmas: float = 40.0) -> float:
    """The exact variance of N_Z(0, σ²) by summing its pmf (for tests and docs; σ up to ~1e5)."""
    sigma = math.sqrt(float(sigma_squared))
    k = np.arange(0, int(math.ceil(tail_sigmas * sigma)) + 2, dtype=np.float64)
    weights = np.exp(-(k * k) / (2.0 * float(sigma_squared)))
    weights[1:] *= 2.0  # ±k
    return float((weights * k * k).sum() / weights.sum())


class DiscreteGaussianNoise:
    """Integer noise N_Z(0, s²) for the integer gradient sum; every bit from ``bits``.

    Without a bit source it reads the OS CSPRNG (``CryptoRandomness``); tests inject a
    seeded one. There is deliberately no faster non-cryptographic option.
    """

    def __init__(self, bits: BitSource | None = None) -> None:
        if bits is None:
            from streamtrain.data.randomness import CryptoRandomness

            bits = CryptoRandomness()
        self.bits = bits

    def sample(self, sigma_squared: Fraction | float, n: int) -> np.ndarray:
        """``n`` draws (int64) of N_Z(0, sigma_squared)."""
        return discrete_gaussian(sigma_squared, n, self.bits)
