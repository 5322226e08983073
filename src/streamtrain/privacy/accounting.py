"""Per-event privacy accounting over the K heterogeneous steps of the DP window.

An event is eligible for exactly K steps, at ages j = 0..K-1, sampled with probability
q_j each time; no other step touches it (docs/privacy.md). Its ε is therefore the
composition of K Poisson-subsampled Gaussian mechanisms with rates q_0..q_{K-1} — fixed
in advance, so it is computed once at start-up and cached.

Method: privacy loss distributions from Google's ``dp_accounting`` (PLD, pessimistic
estimates, so every number is an upper bound) under REPLACE_ONE: at the window level two
neighbouring streams differ by one event in one slot (x displaced y at admission, same
slot, same coin). REPLACE_ONE also covers add/remove: a window without y behaves exactly
like one where y is replaced by a record whose clipped gradient is 0 (a length-1,
unlabelled event has loss 0), because the noisy sum is divided by a public constant,
never by the batch size (docs/privacy.md; the tests check ε_replace >= ε_add/remove).

The noise is the *discrete* Gaussian N_Z(0, s²) on every coordinate of an integer vector of
dimension d (s = σ·2^16 grid units), not the continuous one the PLDs describe. It is
accounted by a coupling (:class:`DiscreteSlack`, docs/privacy.md "Accounting of the
discretization"): a continuous Gaussian of std s' = sqrt(s² − r²) followed by a discrete
Gaussian N_Z(·, r²) centred at its output (post-processing) has, on each coordinate, a pmf
within a factor e^{±η} of N_Z(0, s²), η = ln((1+ε_r)/(1−ε_r)), ε_r = 2·Σ_{n≥1} e^{−2π²r²n²}
(Poisson summation; CKS 2020). So the PLD is composed at σ' = s'/2^16 and, over the T steps
a unit takes part in, the released transcripts are within e^{±T·d·η} of that post-processed
continuous mechanism's: ε grows by 2·T·d·η and δ is met with δ·e^{−T·d·η} in the PLD.
With r = s/1024 (the service's σ ≥ 0.3), σ' = σ·sqrt(1 − 2^-20) and T·d·η is below
10^-3100 at d = 10^5, K = 100 (``log10_slack``). The figure reported is that bound, floored at
the continuous PLD's own figure at σ (no bound for the discrete noise by itself, but the
maximum with a bound is one; it keeps the report from dipping below the continuous figure by
the PLD estimates' jitter, ~1e-3, between σ and σ'). This costs a second PLD composition.

Speed: composing K distinct rates one by one costs seconds per step, so the rates are
rounded *up* onto a few geometric levels (a larger q never lowers ε, so this is
conservative) and each run of equal rates is self-composed at once. ε after n < K steps
is kept at ~24 grid points and read at the next grid point at or above n (ε grows with n,
so again an upper bound).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from streamtrain.privacy.noise import GRID

RELATION = NeighboringRelation.REPLACE_ONE
DEFAULT_DISCRETIZATION = 2e-3
DEFAULT_RATE_LEVELS = 32
DEFAULT_GRID_POINTS = 16
#: r, the std of the coupling's discrete Gaussian smoothing step: s / 2^10 grid units, at least 8
#: (never above s/2). At the service's s = σ·2^16 ≥ 19,660 this is s/1024, so σ' = σ·sqrt(1 − 2^-20).
SMOOTHING_FRACTION = 1.0 / 1024.0
SMOOTHING_RADIUS = 8.0
#: The dimension assumed when the model is not known (an upper bound on any model here; ε grows with d).
MAX_DIMENSION = 1 << 40
#: Sensor unit: the most groups (K-step participations) any sensor may have, ever.
MAX_LIFETIME_GROUPS = 1_000_000


def _log_theta_tail(radius: float) -> float:
    """ln of an upper bound on ε_r = 2·Σ_{n≥1} e^{−2π²r²n²} (n² ≥ 3n − 2, so Σ ≤ e^{−a}/(1 − e^{−3a}))."""
    a = 2.0 * math.pi**2 * radius**2
    log_bound = math.log(2.0) - a - math.log1p(-math.exp(-3.0 * a))
    return log_bound + 1e-12 * max(1.0, abs(log_bound))  # rounded up past the float error of exp/log


@dataclasses.dataclass(frozen=True)
class DiscreteSlack:
    """What accounting the d-dimensional discrete Gaussian N_Z(0, s²)^d with continuous PLDs costs.

    Lemma (docs/privacy.md, "Accounting of the discretization"): let X ~ N(0, s'²) with
    s'² = s² − r², and K | X ~ N_Z(X, r²). By Poisson summation, θ_r(x) = Σ_m e^{−(m−x)²/2r²}
    lies in √(2π)·r·[1 − ε_r, 1 + ε_r] for every real x, ε_r = 2·Σ_{n≥1} e^{−2π²r²n²}, and
    Σ_m e^{−m²/2s²} = √(2π)·s·(1 + ε_s) with 0 ≤ ε_s ≤ ε_r; the Gaussian convolution gives
    P(K = k) / N_Z(0, s²)(k) ∈ [1/(1+ε_r), (1+ε_r)/(1−ε_r)] for every integer k. K shifted by
    an integer vector is the same kernel applied to the continuous Gaussian mechanism's
    output, i.e. post-processing; per step and coordinate the two laws are within e^{±η},
    η = ln((1+ε_r)/(1−ε_r)) = 2·atanh(ε_r) ≤ 2ε_r/(1−ε_r²); over d coordinates and the T steps
    a unit takes part in (the other steps have the same law under both neighbours), the
    transcripts are within e^{±T·d·η} pointwise. Hence (ε, δ·e^{−x}) for the continuous
    mechanism at σ' gives (ε + 2x, δ) for the service, x = T·d·η.
    """

    noise_multiplier: float  # σ
    dimension: int  # d: coordinates that get noise (the model's trainable parameters)
    radius: float  # r in grid units
    accounted_multiplier: float  # σ' = sqrt(s² − r²) / 2^16, rounded down
    log_eta: float  # ln η, per coordinate and step (natural log), rounded up

    @classmethod
    def compute(cls, noise_multiplier: float, dimension: int) -> DiscreteSlack:
        if not (noise_multiplier > 0 and 1 <= int(dimension) <= MAX_DIMENSION):
            raise ValueError(f"DiscreteSlack: need σ > 0 and 1 <= d <= 2^40, got σ={noise_multiplier}, d={dimension}")
        s = float(noise_multiplier) * GRID  # exact: GRID is a power of two
        r = max(s * SMOOTHING_FRACTION, min(SMOOTHING_RADIUS, s / 2.0))
        log_eps = _log_theta_tail(r)
        eps = math.exp(log_eps)
        if eps >= 0.5:
            raise ValueError(f"DiscreteSlack: s = {s:g} grid units is too small for the coupling (r = {r:g})")
        log_eta = math.log(2.0) + log_eps - math.log1p(-(eps**2))
        log_eta += 1e-9 * max(1.0, abs(log_eta))  # covers the rounding of the float logs above
        accounted = float(noise_multiplier) * math.sqrt(1.0 - (r / s) ** 2) * (1.0 - 1e-12)
        return cls(float(noise_multiplier), int(dimension), r, accounted, log_eta)

    def log_slack(self, steps: int) -> float:
        """ln x, x = T·d·η: the log of the multiplicative gap after ``steps`` steps."""
        return math.log(max(int(steps), 1)) + math.log(self.dimension) + self.log_eta

    def log10_slack(self, steps: int) -> float:
        return self.log_slack(steps) / math.log(10.0)

    def epsilon(self, continuous_epsilon: float, steps: int) -> float:
        """ε + 2x, rounded up (x underflows to 0 in float at the service's σ; the last ulp covers it)."""
        extra = math.exp(math.log(2.0) + self.log_slack(steps))
        return float(np.nextafter(continuous_epsilon + extra * (1.0 + 1e-12), np.inf))

    def pld_delta(self, delta: float, steps: int) -> float:
        """δ·e^{−x}, rounded down: the δ the continuous PLD must meet."""
        x = math.exp(self.log_slack(steps))
        return float(np.nextafter(delta * math.exp(-max(x, 1e-15)), 0.0))

    def describe(self, steps: int) -> str:
        return (
            f"discrete Gaussian coupling: d={self.dimension}, r={self.radius:g}, σ'={self.accounted_multiplier:.12g}, "
            f"log10(T·d·η)={self.log10_slack(steps):.1f} at T={steps}"
        )


def rate_groups(schedule: np.ndarray, max_levels: int = DEFAULT_RATE_LEVELS) -> np.ndarray:
    """A group id per age: ages whose q lies in one geometric band share a group.

    Bands are at most 1/16 octave wide, or wider when that would need more than
    ``max_levels`` bands. Group ids are non-decreasing in age (q_j is non-increasing).
    """
    octaves = np.log2(schedule[0] / schedule)  # >= 0, non-decreasing
    span = float(octaves[-1])
    if span == 0.0:
        return np.zeros(len(schedule), dtype=np.int64)
    width = max(1.0 / 16.0, span / max_levels)
    return np.floor(octaves / width).astype(np.int64)


def grid_points(steps: int, points: int = DEFAULT_GRID_POINTS) -> np.ndarray:
    """Step counts at which ε is tabulated: geometric over 1..steps, always including both ends."""
    grid = np.unique(np.round(np.geomspace(1, steps, num=min(points, steps))).astype(np.int64))
    return np.union1d(grid, [steps])


def _subsampled_gaussian_pld(
    noise_multiplier: float, rate: float, relation: NeighboringRelation, discretization: float
) -> Any:
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        sensitivity=1.0,
        sampling_prob=rate,
        value_discretization_interval=discretization,
        neighboring_relation=relation,
        pessimistic_estimate=True,
    )


# Each cache wraps a plain function rather than decorating it: mutmut mutates no decorated function
# (docs/testing.md), and these hold the composition itself.
_subsampled_gaussian = functools.lru_cache(maxsize=256)(_subsampled_gaussian_pld)


def _segments(groups: np.ndarray, grid: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of ages that share a group and do not cross a grid point."""
    cuts = set((np.flatnonzero(np.diff(groups)) + 1).tolist()) | set(grid.tolist()) | {0}
    edges = sorted(c for c in cuts if c <= len(groups))
    return list(zip(edges[:-1], edges[1:], strict=True))


def _compose_schedule(
    noise_multiplier: float,
    schedule: tuple[float, ...],
    discretization: float,
    max_levels: int,
    points: int,
    relation: NeighboringRelation,
) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """The PLD of one record after each tabulated step count (grid points), and the grid."""
    q = np.asarray(schedule, dtype=np.float64)
    groups = rate_groups(q, max_levels)
    grid = grid_points(len(q), points)
    group_rate = {int(g): float(q[groups == g].max()) for g in np.unique(groups)}  # the band's largest q
    plds: list[Any] = [None] * len(grid)
    composed = None
    for start, end in _segments(groups, grid):
        rate = group_rate[int(groups[start])]
        piece = _subsampled_gaussian(noise_multiplier, rate, relation, discretization).self_compose(end - start)
        composed = piece if composed is None else composed.compose(piece)
        if end in grid:
            plds[int(np.searchsorted(grid, end))] = composed
    return tuple(int(n) for n in grid), tuple(plds)


_composed = functools.lru_cache(maxsize=32)(_compose_schedule)


def _epsilon(pld: Any, delta: float, slack: DiscreteSlack | None = None, steps: int = 1) -> float:
    """ε of a PLD at δ; with ``slack``, the bound for the discrete Gaussian over ``steps`` steps
    (the PLD must then be that of σ' = ``slack.accounted_multiplier``)."""
    if slack is None:
        return float(pld.get_epsilon_for_delta(delta))
    return slack.epsilon(float(pld.get_epsilon_for_delta(slack.pld_delta(delta, steps))), steps)


def _tabulate_epsilons(
    noise_multiplier: float,
    schedule: tuple[float, ...],
    delta: float,
    discretization: float,
    max_levels: int,
    points: int,
    relation: NeighboringRelation = RELATION,
    slack: DiscreteSlack | None = None,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """ε after each grid point's step count. ``slack``: the discrete Gaussian's bound (PLDs composed at
    its σ' plus the slack; ``noise_multiplier`` must be its σ); None: the continuous Gaussian at σ."""
    grid, plds = _composed(noise_multiplier, schedule, discretization, max_levels, points, relation)
    epsilons = np.asarray([_epsilon(pld, delta) for pld in plds])
    if slack is not None:
        # The bound is the coupled one (PLD at σ', plus the slack). The continuous figure at σ is
        # kept as a floor: it is no bound for the discrete noise, but the maximum with one is a bound,
        # and it keeps the report from dropping below it by the PLD estimates' own jitter (~1e-3).
        _, coupled = _composed(slack.accounted_multiplier, schedule, discretization, max_levels, points, relation)
        bound = [_epsilon(pld, delta, slack, int(n)) for n, pld in zip(grid, coupled, strict=True)]
        epsilons = np.maximum(epsilons, np.asarray(bound))
    return grid, tuple(float(e) for e in np.maximum.accumulate(epsilons))


_epsilon_table = functools.lru_cache(maxsize=32)(_tabulate_epsilons)


class PerEventAccountant:
    """ε of one event after it has been eligible for n steps (0 <= n, capped at K).

    ``epsilon_after(n)`` is an upper bound on the privacy loss of any single event that
    has been eligible for n steps; ``epsilon_cap`` = ``epsilon_after(K)`` holds for every
    event forever, however long the service runs. ``dimension``: the number of coordinates
    that get discrete Gaussian noise (the model's trainable parameters); None assumes
    :data:`MAX_DIMENSION`, an upper bound (the slack grows with d).
    """

    def __init__(
        self,
        noise_multiplier: float,
        sampling_schedule: np.ndarray | list[float],
        delta: float,
        discretization: float = DEFAULT_DISCRETIZATION,
        max_rate_levels: int = DEFAULT_RATE_LEVELS,
        grid_points: int = DEFAULT_GRID_POINTS,
        dimension: int | None = None,
    ) -> None:
        schedule = np.asarray(sampling_schedule, dtype=np.float64).reshape(-1)
        if schedule.size == 0 or not np.all((schedule > 0) & (schedule <= 1)):
            raise ValueError("PerEventAccountant: sampling schedule needs K >= 1 rates in (0, 1]")
        if np.any(np.diff(schedule) > 0):
            raise ValueError("PerEventAccountant: sampling rates must not increase with age")
        if not (noise_multiplier > 0 and 0 < delta < 1):
            raise ValueError(f"PerEventAccountant: need σ > 0 and 0 < δ < 1, got {noise_multiplier}, {delta}")
        self.noise_multiplier = float(noise_multiplier)
        self.schedule = schedule
        self.delta = float(delta)
        self.discretization = float(discretization)
        self.dimension = MAX_DIMENSION if dimension is None else int(dimension)
        self.slack = DiscreteSlack.compute(self.noise_multiplier, self.dimension)
        grid, epsilons = _epsilon_table(
            self.noise_multiplier,
            tuple(schedule.tolist()),
            self.delta,
            self.discretization,
            max_rate_levels,
            grid_points,
            RELATION,
            self.slack,
        )
        self.grid = np.asarray(grid, dtype=np.int64)
        self.epsilons = np.asarray(epsilons, dtype=np.float64)

    @classmethod
    def for_config(cls, config: Any, dimension: int | None = None) -> PerEventAccountant:
        """The accountant of a :class:`DPConfig` for a model with ``dimension`` noised coordinates."""
        return cls(config.noise_multiplier, config.sampling_schedule(), config.delta, dimension=dimension)

    @property
    def eligible_steps(self) -> int:
        return int(self.schedule.size)

    @property
    def epsilon_cap(self) -> float:
        """ε after all K eligible steps: the bound every event keeps forever."""
        return float(self.epsilons[-1])

    def epsilon_after(self, steps: int) -> float:
        """ε of an event eligible for ``steps`` steps so far (read at the next grid point up)."""
        if steps <= 0:
            return 0.0
        index = int(np.searchsorted(self.grid, min(int(steps), self.eligible_steps)))
        return float(self.epsilons[index])

    def describe(self) -> str:
        return (
            f"PLD (dp_accounting), replace-one, Poisson-subsampled Gaussian "
            f"σ={self.noise_multiplier:g}, K={self.eligible_steps}, q_0={self.schedule[0]:g}, "
            f"q_K-1={self.schedule[-1]:.3g}, δ={self.delta:g}: ε ≤ {self.epsilon_cap:.4f}; "
            f"{self.slack.describe(self.eligible_steps)}"
        )

    @property
    def log10_slack(self) -> float:
        """log10 of T·d·η at T = K: the discrete Gaussian's slack (ε gains twice it)."""
        return self.slack.log10_slack(self.eligible_steps)

    def state_dict(self) -> dict[str, Any]:
        """The table and what it was computed for: a restart reuses it after a match check."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "schedule": self.schedule.copy(),
            "delta": self.delta,
            "dimension": self.dimension,
            "grid": self.grid.copy(),
            "epsilons": self.epsilons.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        same = (
            float(state["noise_multiplier"]) == self.noise_multiplier
            and np.array_equal(np.asarray(state["schedule"], dtype=np.float64), self.schedule)
            and float(state["delta"]) == self.delta
        )
        if not same:
            raise ValueError(
                "PerEventAccountant.load_state_dict: the checkpoint's DP schedule (σ, q_j, K, δ) differs from "
                "this run's; restore the checkpoint's DP settings or start from an empty checkpoint directory"
            )
        # The table is recomputed from the (identical) schedule; keep whichever bound is larger.
        self.epsilons = np.maximum(self.epsilons, np.asarray(state["epsilons"], dtype=np.float64))


def _tabulate_lifetime(
    noise_multiplier: float,
    schedule: tuple[float, ...],
    delta: float,
    target_epsilon: float,
    max_groups: int | None,
    discretization: float,
    slack: DiscreteSlack,
) -> tuple[int, tuple[int, ...], tuple[float, ...]]:
    """(G, grid of group counts, ε after each): G is the most K-step groups within the target.

    As in :func:`_tabulate_epsilons`, g groups (g·K steps of the discrete Gaussian) are bounded by
    the coupled PLD at σ' plus the slack, floored at the continuous figure at σ."""
    levels, points = DEFAULT_RATE_LEVELS, DEFAULT_GRID_POINTS
    one = _composed(noise_multiplier, schedule, discretization, levels, points, RELATION)[1][-1]
    coupled = _composed(slack.accounted_multiplier, schedule, discretization, levels, points, RELATION)[1][-1]

    def epsilon_of(groups: int) -> float:
        floor = _epsilon(one.self_compose(groups) if groups > 1 else one, delta)
        bound = _epsilon(coupled.self_compose(groups) if groups > 1 else coupled, delta, slack, groups * len(schedule))
        return max(floor, bound)

    ceiling = MAX_LIFETIME_GROUPS if max_groups is None else int(max_groups)
    if epsilon_of(1) > target_epsilon:
        return 0, (1,), (epsilon_of(1),)
    low, high = 1, 2  # epsilon_of(low) <= target; find high with epsilon_of(high) > target (or the ceiling)
    while high <= ceiling and epsilon_of(high) <= target_epsilon:
        low, high = high, high * 2
    high = min(high, ceiling + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if epsilon_of(middle) <= target_epsilon else (low, middle)
    grid = grid_points(low)
    epsilons = np.maximum.accumulate([epsilon_of(int(g)) for g in grid])
    return low, tuple(int(g) for g in grid), tuple(float(e) for e in epsilons)


_lifetime_table = functools.lru_cache(maxsize=16)(_tabulate_lifetime)


class SensorLifetimeAccountant:
    """ε of one sensor after g groups: g compositions of the K-step record schedule.

    A sensor contributes at most one group (≤ b events, clipped together) per K steps and
    at most :attr:`max_groups` groups in its life; ``max_groups`` is the largest count whose
    composition stays within the target ε, so every sensor's lifetime ε is at most
    :attr:`epsilon_cap`, however long the service runs.
    """

    def __init__(self, record: PerEventAccountant, target_epsilon: float, max_groups: int | None = None) -> None:
        self.record = record
        self.delta = record.delta
        groups, grid, epsilons = _lifetime_table(
            record.noise_multiplier,
            tuple(record.schedule.tolist()),
            record.delta,
            float(target_epsilon),
            max_groups,
            record.discretization,
            record.slack,
        )
        self.max_groups = int(groups)
        self.grid = np.asarray(grid, dtype=np.int64)
        self.epsilons = np.asarray(epsilons, dtype=np.float64)

    @property
    def epsilon_cap(self) -> float:
        return float(self.epsilons[-1]) if self.max_groups else float("inf")

    def epsilon_after(self, groups: int) -> float:
        """ε of a sensor that has had ``groups`` groups (each counted in full from its first step)."""
        if groups <= 0:
            return 0.0
        index = int(np.searchsorted(self.grid, min(int(groups), int(self.grid[-1]))))
        return float(self.epsilons[index])


def expected_exposures(delta: float, expected_units: float) -> float:
    """δ times the privacy units a deployment will see: the expected number whose bound may fail."""
    return float(delta) * float(expected_units)
