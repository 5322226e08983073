"""Sampling policies: which window items a bounded pass trains on, and how batches mix labels.

A bounded pass takes ``m = min(PASS_MAX_ITEMS, window size)`` distinct items. Events new
since the previous pass (*fresh*) come first, newest first, up to the pass's fresh share;
the rest of the pass is *replayed* from the window. A policy decides both parts and
nothing else: every chosen item is trained exactly once in the pass, batches keep the
token budget, and every draw goes through a :class:`~streamtrain.data.randomness.Randomness`,
so the seeded and crypto modes both hold. (A pass over the whole window, ``m == n``,
takes every item whatever the policy; only ``stratified`` still acts, on the batches.)

* ``uniform``: the replay is a uniform sample without replacement of the other items.
* ``sensor_balanced``: each sensor gets a quota of the pass in proportion to
  ``n_s ** (1 / T)`` (``n_s``: its items in the window, ``T``: the temperature), capped
  at ``n_s``, the surplus of capped sensors shared by the others (water-filling).
  ``T = 1`` is proportional to the window, ``T = inf`` gives every sensor the same share,
  so one chatty sensor does not dominate training. Fresh items fill their sensor's quota
  first (newest first), a uniform draw inside each sensor fills the rest.
* ``stratified``: the same quotas over label classes with ``T = 1``, so the pass's label
  mix is the window's; the batch planner then keeps every batch's mix close to the pass's
  (:func:`streamtrain.data.bucketing.plan_batches` with ``stratify=True``).
* ``curriculum``: the replay is a Gumbel-top-k draw with weights ``exp(-beta * d)``,
  ``d`` the item's difficulty (by default its length rank in the window, scaled to
  [0, 1]); ``beta = strength * 2 ** (-step / half_life_steps)`` decays with the training
  steps planned so far. ``beta`` is the inverse temperature: the temperature ``1 / beta``
  rises, so training starts on easy (short) items and anneals to the uniform replay.

Quotas are fractional; they become whole items by systematic sampling (Madow), so a
sensor whose quota is 2.3 items gets 3 items in 30% of passes and 2 otherwise: its
expected share is exactly the target, which a largest-remainder rounding would not give.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, get_args

import numpy as np

from streamtrain.data.bucketing import label_codes, rank_within_groups
from streamtrain.data.randomness import Randomness
from streamtrain.window.storage import SensorCodes

SamplingName = Literal["uniform", "sensor_balanced", "stratified", "curriculum"]
SAMPLING_POLICIES: Final[tuple[str, ...]] = get_args(SamplingName)
CODE_PIECE_ITEMS: Final = 1 << 20  # codes renumbered per call in first_appearance_codes (~8 ms each)


@dataclass(frozen=True)
class PassCandidates:
    """What a policy chooses from: one window snapshot and the pass's shape.

    ``fresh_order`` holds the fresh items' indices newest first; ``fresh_cap`` is the most
    of them the pass takes as fresh. ``planned_steps`` counts the batches planned before
    this pass (the curriculum's clock).
    """

    lengths: np.ndarray
    labels: np.ndarray
    sensor_codes: np.ndarray  # int64 [n], 0..sensors-1
    sensors: int
    pass_items: int  # m, below the window size
    fresh_order: np.ndarray
    fresh_cap: int
    planned_steps: int

    @property
    def window_items(self) -> int:
        return int(self.lengths.shape[0])


class SamplingPolicy(ABC):
    """Chooses a bounded pass's items; a policy holds settings, never per-pass state."""

    name: ClassVar[str]
    stratify_batches: ClassVar[bool] = False

    @abstractmethod
    def choose(self, candidates: PassCandidates, rng: Randomness) -> tuple[np.ndarray, np.ndarray]:
        """(fresh items taken, replayed items): disjoint index arrays, ``pass_items`` together."""

    def facts(self, planned_steps: int) -> dict[str, float]:
        """Numbers the pass diagnostics report for this policy."""
        return {}

    def signature(self) -> str:
        """The policy and its knobs as text, stable across processes (part of a resume check)."""
        knobs = {
            key: getattr(value, "__qualname__", None) or repr(value) if callable(value) else repr(value)
            for key, value in sorted(vars(self).items())
        }
        return f"{self.name}{knobs}"


# ------------------------------------------------------------------------------ building blocks
def group_codes(values: Sequence[Any] | np.ndarray | SensorCodes) -> tuple[np.ndarray, int]:
    """Dense int64 codes of ``values`` in order of first appearance, and how many distinct.

    A window's snapshot holds its sensor ids as codes into a table of distinct ids
    (:class:`SensorCodes`): those are renumbered with numpy, with no Python per item (a dict
    lookup per item holds the interpreter for seconds at 10M items, ingest waiting beside
    it: docs/operations.md). Other values get a dict lookup per item, several times faster
    than ``np.unique`` on an object array (which sorts).
    """
    if isinstance(values, SensorCodes):
        return first_appearance_codes(values.codes, len(values.strings))
    index: dict[Any, int] = {}
    items = values.tolist() if isinstance(values, np.ndarray) else list(values)
    codes = np.fromiter((index.setdefault(v, len(index)) for v in items), dtype=np.int64, count=len(items))
    return codes, len(index)


def first_appearance_codes(codes: np.ndarray, table_size: int) -> tuple[np.ndarray, int]:
    """``codes`` (each in ``[0, table_size)``) renumbered densely in order of first appearance,
    and how many distinct: what :func:`group_codes` gives for the values they stand for."""
    n = int(codes.shape[0])
    first = np.full(table_size, n, dtype=np.int64)
    for start in range(0, n, CODE_PIECE_ITEMS):  # in pieces: other threads run in between
        stop = min(n, start + CODE_PIECE_ITEMS)
        np.minimum.at(first, codes[start:stop], np.arange(start, stop))
    present = np.flatnonzero(first < n)
    rank = np.zeros(table_size, dtype=np.int64)
    rank[present[np.argsort(first[present], kind="stable")]] = np.arange(present.size)
    return rank[codes], int(present.size)


def newest_fresh(fresh_order: np.ndarray, cap: int) -> np.ndarray:
    """The first ``cap`` of the fresh items (they are given newest first)."""
    return fresh_order[: max(0, cap)]


def the_rest(n: int, taken: np.ndarray) -> np.ndarray:
    """Indices ``0..n-1`` not in ``taken``, ascending."""
    keep = np.ones(n, dtype=bool)
    keep[taken] = False
    return np.flatnonzero(keep)


def uniform_sample(population: np.ndarray, k: int, rng: Randomness) -> np.ndarray:
    """``k`` distinct items of ``population``, every ``k``-subset equally likely."""
    return population[rng.sample(population.size, k)]


def gumbel_top_k(population: np.ndarray, log_weights: np.ndarray, k: int, rng: Randomness) -> np.ndarray:
    """``k`` distinct items drawn one after another with probability proportional to weight.

    Efraimidis-Spirakis / Gumbel-top-k: keep the ``k`` smallest ``log E_i - log w_i`` with
    ``E_i ~ Exp(1)``; the result has the law of successive draws without replacement
    (Plackett-Luce). ``E`` is ``-log1p(-U)`` of a 53-bit uniform ``U``.
    """
    if k >= population.size:
        return population.copy()
    if k <= 0:
        return population[:0]
    with np.errstate(divide="ignore"):  # U == 0 gives E == 0: key -inf, certainly chosen
        keys = np.log(-np.log1p(-rng.random(population.size))) - log_weights
    return population[np.argpartition(keys, k - 1)[:k]]


def water_fill(weights: np.ndarray, caps: np.ndarray, total: float) -> np.ndarray:
    """Shares ``q_i = min(cap_i, lam * w_i)`` with ``sum(q) == min(total, sum(caps))``.

    Capped groups give their surplus to the others in proportion to weight. Vectorized:
    sort by ``cap / w`` (the level at which a group caps), then for every number of capped
    groups the level that would spend ``total``; the first consistent one is the answer.
    Groups of weight 0 get nothing (so the sum falls short when only they have room left).
    """
    weights = np.asarray(weights, dtype=np.float64)
    caps = np.asarray(caps, dtype=np.float64)
    if total >= caps.sum():
        return caps.copy()
    positive = weights > 0
    out = np.zeros_like(caps)
    if not positive.any() or total <= 0:
        return out
    w, c = weights[positive], caps[positive]
    w = w / w.max()  # the answer does not depend on the weights' scale; this keeps the ratios finite
    with np.errstate(over="ignore", divide="ignore"):  # a weight far below the largest caps last (inf)
        ratio = c / w
    order = np.argsort(ratio, kind="stable")
    w_sorted, c_sorted, r_sorted = w[order], c[order], ratio[order]
    capped_sum = np.concatenate(([0.0], np.cumsum(c_sorted)[:-1]))  # caps of the j lowest-ratio groups
    free_weight = np.cumsum(w_sorted[::-1])[::-1]  # weight of the groups from j on: a sum, never a difference
    levels = (total - capped_sum) / free_weight  # lam if exactly the first j groups are capped
    consistent = np.flatnonzero(levels <= r_sorted)  # group j itself is not capped at that level
    level = levels[consistent[0]] if consistent.size else r_sorted[-1]
    out[positive] = np.minimum(c, level * w)
    return out


def systematic_round(quotas: np.ndarray, rng: Randomness) -> np.ndarray:
    """Whole numbers with ``E[out_i] == quotas_i`` and ``sum(out) == round(sum(quotas))``.

    Madow's systematic sampling over the fractional parts, laid out in a random order: one
    uniform offset ``u``; group ``i`` gets an extra unit when an integer lies in its
    stretch ``(C_{i-1} - u, C_i - u]`` of the cumulative fractions, which happens with
    probability equal to its fraction (fractions are below 1, so at most one extra).
    """
    quotas = np.asarray(quotas, dtype=np.float64)
    whole = np.floor(quotas + 1e-9)  # a quota that is an integer up to rounding stays it
    fraction = np.clip(quotas - whole, 0.0, None)
    fraction[fraction < 1e-9] = 0.0
    extra_units = int(round(fraction.sum()))
    out = whole.astype(np.int64)
    if extra_units == 0:
        return out
    order = rng.permutation(quotas.size)
    cumulative = np.cumsum(fraction[order])
    cumulative *= extra_units / cumulative[-1]  # exact total despite float sums
    offset = float(rng.random(1)[0])
    upper = np.floor(cumulative - offset + 1.0)
    lower = np.floor(np.concatenate(([0.0], cumulative[:-1])) - offset + 1.0)
    out[order] += np.minimum(upper - lower, 1.0).astype(np.int64)  # scaling cannot make a fraction count twice
    return out


def quota_choose(
    groups: np.ndarray, quota: np.ndarray, fresh_order: np.ndarray, fresh_cap: int, rng: Randomness
) -> tuple[np.ndarray, np.ndarray]:
    """Take ``quota[g]`` items of every group ``g``: fresh ones first, newest first, the rest uniformly.

    A fresh item counts against its group's quota, so a group cannot take more of the
    pass through its fresh events than its quota; at most ``fresh_cap`` fresh in all.
    """
    n = groups.size
    fresh_groups = groups[fresh_order]
    eligible = fresh_order[rank_within_groups(fresh_groups) < quota[fresh_groups]]  # still newest first
    fresh = eligible[: max(0, fresh_cap)]
    remaining = quota - np.bincount(groups[fresh], minlength=quota.size)
    rest = the_rest(n, fresh)
    shuffled = rest[rng.permutation(rest.size)]
    replay = shuffled[rank_within_groups(groups[shuffled]) < remaining[groups[shuffled]]]
    return fresh, replay


# ------------------------------------------------------------------------------ the policies
class UniformPolicy(SamplingPolicy):
    """Fresh newest first, the replay uniform: every other window item equally likely."""

    name = "uniform"

    def choose(self, candidates: PassCandidates, rng: Randomness) -> tuple[np.ndarray, np.ndarray]:
        fresh = newest_fresh(candidates.fresh_order, candidates.fresh_cap)
        rest = the_rest(candidates.window_items, fresh)
        return fresh, uniform_sample(rest, candidates.pass_items - fresh.size, rng)


class SensorBalancedPolicy(SamplingPolicy):
    """Per-sensor quotas in proportion to ``n_s ** (1 / temperature)``."""

    name = "sensor_balanced"

    def __init__(self, temperature: float = 2.0) -> None:
        if not temperature > 0:
            raise ValueError(f"sensor_balanced temperature must be > 0 (inf: equal shares), got {temperature}")
        self.temperature = float(temperature)

    def quotas(self, candidates: PassCandidates, rng: Randomness) -> np.ndarray:
        counts = np.bincount(candidates.sensor_codes, minlength=candidates.sensors).astype(np.float64)
        weights = counts ** (1.0 / self.temperature) if math.isfinite(self.temperature) else (counts > 0) * 1.0
        return systematic_round(water_fill(weights, counts, candidates.pass_items), rng)

    def choose(self, candidates: PassCandidates, rng: Randomness) -> tuple[np.ndarray, np.ndarray]:
        quota = self.quotas(candidates, rng)
        return quota_choose(candidates.sensor_codes, quota, candidates.fresh_order, candidates.fresh_cap, rng)


class StratifiedPolicy(SamplingPolicy):
    """Class quotas in proportion to the window's label mix; batches stratified by label."""

    name = "stratified"
    stratify_batches = True

    def choose(self, candidates: PassCandidates, rng: Randomness) -> tuple[np.ndarray, np.ndarray]:
        codes, classes = label_codes(candidates.labels)
        counts = np.bincount(codes, minlength=classes).astype(np.float64)
        quota = systematic_round(water_fill(counts, counts, candidates.pass_items), rng)
        return quota_choose(codes, quota, candidates.fresh_order, candidates.fresh_cap, rng)


class CurriculumPolicy(SamplingPolicy):
    """Replay by Gumbel-top-k on ``-beta * difficulty``, ``beta`` halving every ``half_life_steps``."""

    name = "curriculum"

    def __init__(
        self,
        strength: float = 3.0,
        half_life_steps: float = 500.0,
        difficulty: Callable[[PassCandidates], np.ndarray] | None = None,
    ) -> None:
        if not (math.isfinite(strength) and strength >= 0):
            raise ValueError(f"curriculum strength must be a finite number >= 0, got {strength}")
        if not half_life_steps > 0:
            raise ValueError(f"curriculum half_life_steps must be > 0 (inf: never anneal), got {half_life_steps}")
        self.strength = float(strength)
        self.half_life_steps = float(half_life_steps)
        self.difficulty = difficulty or length_difficulty

    def beta(self, planned_steps: int) -> float:
        """The inverse temperature after ``planned_steps`` steps."""
        return self.strength * 2.0 ** (-planned_steps / self.half_life_steps)

    def choose(self, candidates: PassCandidates, rng: Randomness) -> tuple[np.ndarray, np.ndarray]:
        fresh = newest_fresh(candidates.fresh_order, candidates.fresh_cap)
        rest = the_rest(candidates.window_items, fresh)
        difficulty = np.asarray(self.difficulty(candidates), dtype=np.float64)
        log_weights = -self.beta(candidates.planned_steps) * difficulty[rest]
        return fresh, gumbel_top_k(rest, log_weights, candidates.pass_items - fresh.size, rng)

    def facts(self, planned_steps: int) -> dict[str, float]:
        return {"curriculum_beta": self.beta(planned_steps)}


def length_difficulty(candidates: PassCandidates) -> np.ndarray:
    """Each item's length as a mid-rank among the window's lengths, scaled to [0, 1] (scale-free)."""
    lengths = candidates.lengths
    n = lengths.size
    if n < 2:
        return np.zeros(n)
    ordered = np.sort(lengths)
    mid_rank = (np.searchsorted(ordered, lengths, "left") + np.searchsorted(ordered, lengths, "right") - 1) / 2.0
    return mid_rank / (n - 1)


def make_policy(
    name: str,
    *,
    sensor_temperature: float = 2.0,
    curriculum_strength: float = 3.0,
    curriculum_half_life_steps: float = 500.0,
) -> SamplingPolicy:
    """The policy called ``name`` with its knobs (the others are ignored)."""
    if name == "uniform":
        return UniformPolicy()
    if name == "sensor_balanced":
        return SensorBalancedPolicy(sensor_temperature)
    if name == "stratified":
        return StratifiedPolicy()
    if name == "curriculum":
        return CurriculumPolicy(curriculum_strength, curriculum_half_life_steps)
    raise ValueError(f"sampling policy must be one of {SAMPLING_POLICIES}, got {name!r}; set STREAMTRAIN_SAMPLING")


# ------------------------------------------------------------------------------ diagnostics
def concentration(codes: np.ndarray, groups: int) -> tuple[float, float]:
    """(largest group's share, normalized HHI) of ``codes`` over ``groups`` possible groups.

    The normalized Herfindahl-Hirschman index ``(sum s**2 - 1/N) / (1 - 1/N)`` is 0 when
    all ``N`` groups have the same share and 1 when one group has everything; NaN when
    ``N < 2`` or nothing was counted.
    """
    if codes.size == 0:
        return float("nan"), float("nan")
    shares = np.bincount(codes, minlength=groups) / codes.size
    top = float(shares.max())
    if groups < 2:
        return top, float("nan")
    hhi = float(shares @ shares)
    return top, (hhi - 1.0 / groups) / (1.0 - 1.0 / groups)
