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

Speed: composing K distinct rates one by one costs seconds per step, so the rates are
rounded *up* onto a few geometric levels (a larger q never lowers ε, so this is
conservative) and each run of equal rates is self-composed at once. ε after n < K steps
is kept at ~24 grid points and read at the next grid point at or above n (ε grows with n,
so again an upper bound).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting.pld import privacy_loss_distribution as pld_lib

RELATION = NeighboringRelation.REPLACE_ONE
DEFAULT_DISCRETIZATION = 2e-3
DEFAULT_RATE_LEVELS = 32
DEFAULT_GRID_POINTS = 16
#: Added to every ε: covers accounting the discrete Gaussian on its grid (s = σ·2^16 grid
#: units) with the continuous Gaussian's PLD; in one dimension, where dp_accounting has the
#: discrete mechanism's own PLD, the two agree within 1e-7 from s = 4 up (tests).
DISCRETE_NOISE_MARGIN = 1e-4
#: Sensor unit: the most groups (K-step participations) any sensor may have, ever.
MAX_LIFETIME_GROUPS = 1_000_000


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


@functools.lru_cache(maxsize=256)
def _subsampled_gaussian(
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


def _segments(groups: np.ndarray, grid: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of ages that share a group and do not cross a grid point."""
    cuts = set((np.flatnonzero(np.diff(groups)) + 1).tolist()) | set(grid.tolist()) | {0}
    edges = sorted(c for c in cuts if c <= len(groups))
    return list(zip(edges[:-1], edges[1:], strict=True))


@functools.lru_cache(maxsize=32)
def _composed(
    noise_multiplier: float,
    schedule: tuple[float, ...],
    discretization: float,
    max_levels: int,
    points: int,
    relation: NeighboringRelation = RELATION,
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


def _epsilon(pld: Any, delta: float) -> float:
    """ε of a PLD at δ, plus the margin for the discrete Gaussian (docs/privacy.md, Noise)."""
    return float(pld.get_epsilon_for_delta(delta)) + DISCRETE_NOISE_MARGIN


@functools.lru_cache(maxsize=32)
def _epsilon_table(
    noise_multiplier: float,
    schedule: tuple[float, ...],
    delta: float,
    discretization: float,
    max_levels: int,
    points: int,
    relation: NeighboringRelation = RELATION,
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    grid, plds = _composed(noise_multiplier, schedule, discretization, max_levels, points, relation)
    epsilons = np.asarray([_epsilon(pld, delta) for pld in plds])
    return grid, tuple(float(e) for e in np.maximum.accumulate(epsilons))


class PerEventAccountant:
    """ε of one event after it has been eligible for n steps (0 <= n, capped at K).

    ``epsilon_after(n)`` is an upper bound on the privacy loss of any single event that
    has been eligible for n steps; ``epsilon_cap`` = ``epsilon_after(K)`` holds for every
    event forever, however long the service runs.
    """

    def __init__(
        self,
        noise_multiplier: float,
        sampling_schedule: np.ndarray | list[float],
        delta: float,
        discretization: float = DEFAULT_DISCRETIZATION,
        max_rate_levels: int = DEFAULT_RATE_LEVELS,
        grid_points: int = DEFAULT_GRID_POINTS,
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
        grid, epsilons = _epsilon_table(
            self.noise_multiplier,
            tuple(schedule.tolist()),
            self.delta,
            self.discretization,
            max_rate_levels,
            grid_points,
        )
        self.grid = np.asarray(grid, dtype=np.int64)
        self.epsilons = np.asarray(epsilons, dtype=np.float64)

    @classmethod
    def for_config(cls, config: Any) -> PerEventAccountant:
        """The accountant of a :class:`DPConfig` (tables are cached per schedule)."""
        return cls(config.noise_multiplier, config.sampling_schedule(), config.delta)

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
            f"q_K-1={self.schedule[-1]:.3g}, δ={self.delta:g}: ε ≤ {self.epsilon_cap:.4f}"
        )

    def state_dict(self) -> dict[str, Any]:
        """The table and what it was computed for: a restart reuses it after a match check."""
        return {
            "noise_multiplier": self.noise_multiplier,
            "schedule": self.schedule.copy(),
            "delta": self.delta,
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


@functools.lru_cache(maxsize=16)
def _lifetime_table(
    noise_multiplier: float,
    schedule: tuple[float, ...],
    delta: float,
    target_epsilon: float,
    max_groups: int | None,
    discretization: float = DEFAULT_DISCRETIZATION,
    points: int = DEFAULT_GRID_POINTS,
) -> tuple[int, tuple[int, ...], tuple[float, ...]]:
    """(G, grid of group counts, ε after each): G is the most K-step groups within the target."""
    _, plds = _composed(noise_multiplier, schedule, discretization, DEFAULT_RATE_LEVELS, DEFAULT_GRID_POINTS)
    one = plds[-1]

    def epsilon_of(groups: int) -> float:
        return _epsilon(one.self_compose(groups) if groups > 1 else one, delta)

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
    grid = grid_points(low, points)
    epsilons = np.maximum.accumulate([epsilon_of(int(g)) for g in grid])
    return low, tuple(int(g) for g in grid), tuple(float(e) for e in epsilons)


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
