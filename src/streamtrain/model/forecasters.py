"""What serves a forecast: the network, the last value, or a ridge autoregression on lags.

A forecaster is only worth serving if it beats what a practitioner tries first: the last
value, and a least-squares autoregression. So the service keeps both beside the network
and serves whichever forecasts the held-out events best (:mod:`streamtrain.quality.selection`
chooses). All three speak the network's language — ``forward(x_norm, mask) ->
ModelOutput`` in the published model's normalized units — so predict, OIP v2, the
quality monitor and ``streamtrain export`` run the choice through one code path
(:class:`ServedModel`), and the class head, when there is one, is always the network's.

The linear forecaster forecasts the change ``x[t+1] - x[t]`` of each channel with a ridge
regression, as a practitioner's autoregression would, but chosen so that it does not lose
to one on series it has never seen. Per channel it tests for a unit root (an augmented
Dickey-Fuller regression, the test ``auto.arima`` and ``ndiffs`` use to decide on a
difference): where the test cannot reject one, the channel wanders (prices, levels that
leave their range) and only models of its *changes* are fitted, which follow it wherever
it goes; where it rejects one, the best model of its *levels* (which may revert to a mean)
and the best model of its changes are both fitted and their forecasts averaged, a
combination that is seldom much worse than the better of the two and often better than
both. The models of changes include simple exponential smoothing of the event's readings
(the local-level model, ARIMA(0,1,1)): one coefficient, which a few dozen events fit where an
autoregression on two dozen changes cannot. Each model's order and ridge penalty are chosen by
generalized cross-validation, every model is fitted only on forecast origins whose lags are all
real readings (no padding enters a fit) and serves only at such origins (an origin with fewer readings before it serves
the members that need no more), and the evidence is counted in distinct targets (sliding windows repeat
each reading in many events). A large penalty gives the last value (all coefficients
zero), which competes too, and each family's forecast change is shrunk toward it by
Copas' factor, so an edge shown by little evidence is trusted a little. Everything comes
from sums of outer products (:class:`LagSums`, per forecast position) that add over chunks,
windows and ranks, so every rank of a scaled-out group solves the same systems from the
all-reduced sums. A model of changes is a model of levels with one more lag whose
coefficients sum to zero, so whatever is chosen serves as one set of lag coefficients per
origin position (:class:`LinearForecast`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from streamtrain.model.network import ModelOutput, SensorModel

ForecasterKind = Literal["last_value", "linear", "network", "blend"]
FORECASTER_KINDS: tuple[ForecasterKind, ...] = ("last_value", "linear", "network", "blend")

#: Orders tried for the linear forecaster (capped by LINEAR_MAX_ORDER and by the events' lengths):
#: every order to 24, since a season of s readings needs order s + 1 (a grid of 12 and 16 missed
#: the 13 of a monthly series), then coarser.
ORDERS = (*range(1, 25), 32, 48, 64)
#: The smoothed family (simple exponential smoothing of the context, the local-level model): its
#: smoothing weights, and the orders (readings - 1) it is tried at besides the widest the window
#: allows; the short ones serve the first positions of an event.
SMOOTHING_WEIGHTS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
SMOOTHED_ORDERS = (1, 2, 4, 8, 12, 16)
#: Ridge penalties tried, relative to the mean diagonal of the lag block of X'X.
RELATIVE_PENALTIES = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
#: The unit-root test: lagged changes in the augmented Dickey-Fuller regression, and its 5%
#: critical value with a constant (MacKinnon's asymptotic value; a t-statistic above it keeps the root).
ADF_LAGS = 4
ADF_CRITICAL_T = -2.86
#: A family serves only where its best model's estimated error is at least this share below the
#: last value's on the window: a smaller edge is within what a change of regime after the window
#: takes away (a random walk's fit "gains" 1-2% in sample and loses as much later: docs/quality.md),
#: and serving the last value there costs at most that share.
LINEAR_MIN_GAIN = 0.02
#: A family's forecast change is shrunk toward the last value by ``1 - df / (n * edge)`` (n distinct
#: targets, edge its best model's gain over the last value): Copas' shrinkage factor ``1 - df / chi2``,
#: so an edge that little evidence shows is trusted a little. ``df`` is the best model's fitted
#: parameters (its ridge hat's trace, as edge and n are its own) capped at this many: the full fitted
#: df cost seasonal series, whose many lags count as many parameters (docs/quality.md); a
#: one-parameter model (the smoothed family) counts one, not two.
LINEAR_SHRINK_DF = 2.0
_CHUNK_ROWS = 65_536  # positions per chunk when summing outer products

Family = Literal["levels", "changes", "changes_no_drift", "smoothed"]


# --------------------------------------------------------------------------------------------
# Sums that fit and score the ridge autoregressions
# --------------------------------------------------------------------------------------------


@dataclass
class LagSums:
    """Per channel and forecast position: X'X over ``[1, x[t], ..., x[t-P+1]]``, X'y and y'y
    with ``y = x[t+1] - x[t]``.

    Bucket ``k`` holds the targets whose forecast origin ``t`` is at position ``k`` of its
    instance (the last bucket: ``P - 1`` or later), so a model that needs ``r`` real readings
    is fitted on the buckets from ``r - 1`` on, where none of its lags repeats a padded
    reading. Orders below ``P`` use the leading blocks (their features are a prefix), so
    bucket ``k`` sums only its leading ``k + 2`` features (the intercept and the ``k + 1``
    readings it has); the rest of its block stays zero, never read.
    """

    xtx: np.ndarray  # float64 [C, P, P+1, P+1]
    xty: np.ndarray  # float64 [C, P, P+1]
    yty: np.ndarray  # float64 [C, P]
    rows: np.ndarray  # float64 [P]: one-step targets per bucket
    instances: float  # instances with at least one target

    @classmethod
    def zeros(cls, channels: int, max_order: int) -> LagSums:
        size = max_order + 1
        return cls(
            np.zeros((channels, max_order, size, size)), np.zeros((channels, max_order, size)),
            np.zeros((channels, max_order)), np.zeros(max_order), 0.0,
        )  # fmt: skip

    @property
    def max_order(self) -> int:
        return int(self.xty.shape[2]) - 1

    @property
    def channels(self) -> int:
        return int(self.xty.shape[0])

    @property
    def total_rows(self) -> float:
        return float(self.rows.sum())

    @property
    def mean_length(self) -> float:
        """Readings per instance, on average (an instance of n readings has n - 1 targets)."""
        return self.total_rows / self.instances + 1.0 if self.instances else 0.0

    @classmethod
    def of(
        cls,
        values: Sequence[np.ndarray],
        max_order: int,
        channels: int,
        mean: np.ndarray | None = None,
        std: np.ndarray | None = None,
    ) -> LagSums:
        """The sums over every one-step target of every instance in ``values`` (each ``[L, C]``),
        in units ``(x - mean) / std`` when those are given."""
        if (mean is None) != (std is None):
            raise ValueError("LagSums.of: give the mean and the std together, or neither")
        sums = cls.zeros(channels, max_order)
        arrays = [v for v in values if len(v) >= 2]
        if not arrays:
            return sums
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        flat = np.concatenate(arrays).astype(np.float64).reshape(-1, channels)
        if mean is not None and std is not None:
            flat = (flat - mean) / std
        starts = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        item_start = np.repeat(starts, lengths)
        position = np.arange(flat.shape[0], dtype=np.int64)
        has_target = position + 1 < np.repeat(starts + lengths, lengths)
        targets = np.flatnonzero(has_target)
        bucket_of = np.minimum(targets - item_start[targets], max_order - 1)
        lags = np.arange(max_order, dtype=np.int64)
        for begin in range(0, targets.size, _CHUNK_ROWS):
            buckets = bucket_of[begin : begin + _CHUNK_ROWS]
            order = np.argsort(buckets, kind="stable")  # each bucket's rows contiguous
            rows = targets[begin : begin + _CHUNK_ROWS][order]
            counts = np.bincount(buckets, minlength=max_order)
            bounds = np.concatenate([[0], np.cumsum(counts)])
            change = flat[rows + 1] - flat[rows]  # [N, C]
            for k in np.flatnonzero(counts).tolist():  # one BLAS product per position bucket and channel
                origins = rows[bounds[k] : bounds[k + 1]]
                # the k + 1 readings up to an origin at position k (or later) are all real
                lagged = flat[origins[:, None] - lags[None, : k + 1]]  # [n, k + 1, C]
                x = np.empty((origins.size, k + 2))
                x[:, 0] = 1.0
                for c in range(channels):
                    x[:, 1:] = lagged[:, :, c]
                    y = change[bounds[k] : bounds[k + 1], c]
                    sums.xtx[c, k, : k + 2, : k + 2] += x.T @ x
                    sums.xty[c, k, : k + 2] += x.T @ y
                    sums.yty[c, k] += y @ y
            sums.rows += counts
        sums.instances += float(lengths.size)
        return sums

    def tail(self, channel: int, first_position: int) -> tuple[np.ndarray, np.ndarray, float, float]:
        """(X'X, X'y, y'y, rows) of one channel over the targets whose origin is at
        ``first_position`` or later."""
        k = min(max(first_position, 0), self.max_order - 1)
        return (
            self.xtx[channel, k:].sum(axis=0), self.xty[channel, k:].sum(axis=0),
            float(self.yty[channel, k:].sum()), float(self.rows[k:].sum()),
        )  # fmt: skip

    def as_array(self) -> np.ndarray:
        return np.concatenate([self.xtx.ravel(), self.xty.ravel(), self.yty.ravel(), self.rows, [self.instances]])

    @classmethod
    def from_array(cls, flat: np.ndarray, channels: int, max_order: int) -> LagSums:
        size = max_order + 1
        flat = np.asarray(flat, dtype=np.float64)
        sums = cls.zeros(channels, max_order)
        at = 0
        for part in (sums.xtx, sums.xty, sums.yty, sums.rows):
            part[...] = flat[at : at + part.size].reshape(part.shape)
            at += part.size
        sums.instances = float(flat[at])
        assert at + 1 == flat.size == channels * max_order * (size * size + size + 1) + max_order + 1
        return sums


def family_basis(family: Family, order: int, smoothing: float = 0.0) -> tuple[np.ndarray, int]:
    """(B, r): a model of ``order`` in ``family`` has features ``[1, x[t], ..., x[t-r+1]] @ B``
    (r readings: its lag block of the level sums). ``levels``: the readings themselves;
    ``changes``: an intercept and ``x[t-j] - x[t-j-1]`` for ``j < order``; ``changes_no_drift``:
    the changes alone (the intercept is a drift a random walk may not have); ``smoothed``: one
    feature, the exponentially weighted mean of the ``order + 1`` readings (weights
    ``smoothing * (1 - smoothing)^j``, normalized) less ``x[t]``, so a coefficient of one is
    simple exponential smoothing (ARIMA(0,1,1), the local-level model) and zero the last value."""
    if family == "levels":
        return np.eye(order + 1), order
    if family == "smoothed":
        weights = smoothing * (1.0 - smoothing) ** np.arange(order + 1)
        basis = np.zeros((order + 2, 1))
        basis[1:, 0] = weights / weights.sum()
        basis[1, 0] -= 1.0
        return basis, order + 1
    if family not in ("changes", "changes_no_drift"):
        raise ValueError(f"unknown family {family!r}: levels, changes, changes_no_drift or smoothed")
    readings = order + 1
    basis = np.zeros((readings + 1, order + 1))
    basis[0, 0] = 1.0
    for j in range(order):
        basis[1 + j, 1 + j], basis[2 + j, 1 + j] = 1.0, -1.0
    return (basis[:, 1:], readings) if family == "changes_no_drift" else (basis, readings)


@dataclass(frozen=True)
class LinearModel:
    """One fitted member of a family, its coefficients in level space (what serves)."""

    family: Family
    order: int
    relative_penalty: float
    coefficients: np.ndarray  # [1 + readings]: intercept, then lags x[t], x[t-1], ...
    gcv_mse: float  # generalized cross-validation's estimate of the error per target
    distinct_targets: float  # the evidence it was fitted on, each target counted once
    smoothing: float = 0.0  # the smoothed family's weight (0 for the others)
    df: float = 0.0  # its effective parameters: the trace of the ridge fit's hat matrix

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"family": self.family, "order": self.order, "relative_penalty": self.relative_penalty}
        if self.family == "smoothed":
            report["smoothing"] = self.smoothing
        return report


def _repeats(sums: LagSums, readings: int, redundancy: float) -> float:
    """How many rows each distinct target stands in, for models that need ``readings`` real
    readings: every instance that holds it with the origin where those lags are real (sliding
    windows of length L and stride 1: L - readings of the L instances each reading is in)."""
    length = sums.mean_length
    return max(1.0, redundancy * (length - readings) / length) if length > 0 else 1.0


def fit_model(
    sums: LagSums,
    channel: int,
    family: Family,
    order: int,
    relative_penalty: float,
    redundancy: float = 1.0,
    smoothing: float = 0.0,
) -> LinearModel | None:
    """The ridge fit of one (family, order, penalty) on the targets whose lags are all real,
    with its GCV estimate (Golub, Heath and Wahba 1979: RSS / (1 - df / n)^2 with n the
    distinct targets); None without data or with as many parameters as targets. The
    penalty is relative to the mean diagonal of the penalized block; the intercept is not
    penalized."""
    basis, readings = family_basis(family, order, smoothing)
    if readings > sums.max_order:
        return None
    xtx, xty, yty, rows = sums.tail(channel, readings - 1)
    if rows <= 0:
        return None
    width = readings + 1
    a = basis.T @ xtx[:width, :width] @ basis
    b = basis.T @ xty[:width]
    penalized = np.arange(0 if family in ("changes_no_drift", "smoothed") else 1, a.shape[0])
    scale = float(np.diagonal(a)[penalized].mean()) if penalized.size else 0.0
    ridge = a.copy()
    ridge[penalized, penalized] += relative_penalty * (scale if scale > 0 else 1.0)
    try:
        solved = np.linalg.solve(ridge, np.concatenate([b[:, None], a], axis=1))  # coefficients, and the hat's trace
    except np.linalg.LinAlgError:
        return None
    phi, df = solved[:, 0], float(np.trace(solved[:, 1:]))
    n = rows / _repeats(sums, readings, redundancy)
    if not np.isfinite(phi).all() or df >= n:
        return None
    rss = max(yty - 2.0 * phi @ b + phi @ a @ phi, 0.0)
    return LinearModel(family, order, relative_penalty, basis @ phi, rss / rows / (1.0 - df / n) ** 2, n, smoothing, df)


def unit_root_t(sums: LagSums, channel: int, redundancy: float, lags: int = ADF_LAGS) -> float | None:
    """The augmented Dickey-Fuller t-statistic of ``rho`` in
    ``x[t+1] - x[t] = a + rho x[t] + sum_j phi_j (x[t-j] - x[t-j-1])``: well below
    :data:`ADF_CRITICAL_T` rejects a unit root. Rows that repeat a target (overlapping
    events) count once. None without enough data."""
    lags = min(lags, sums.max_order - 1)
    changes, readings = family_basis("changes", lags)
    basis = np.concatenate([changes[:, :1], np.eye(readings + 1)[:, 1:2], changes[:, 1:]], axis=1)
    xtx, xty, yty, rows = sums.tail(channel, readings - 1)
    width = readings + 1
    a, b = basis.T @ xtx[:width, :width] @ basis, basis.T @ xty[:width]
    dof = rows / _repeats(sums, readings, redundancy) - a.shape[0]
    if rows <= 0 or dof <= 0:
        return None
    try:
        inverse = np.linalg.inv(a)
    except np.linalg.LinAlgError:
        return None
    phi = inverse @ b
    rss = max(yty - 2.0 * phi @ b + phi @ a @ phi, 0.0)
    variance = float(inverse[1, 1]) * rss / dof  # the repeats scale X'X and the RSS alike
    if not variance > 0:
        return None
    return float(phi[1] / math.sqrt(variance))


@dataclass(frozen=True)
class FamilyFit:
    """A family's forecast: its models averaged with Akaike weights (Burnham and Anderson),
    ``w ∝ exp(-n/2 log(GCV_m / GCV_best))`` with n the distinct targets (n log GCV is AIC to
    first order), so models that GCV cannot tell apart share the forecast instead of one of
    them winning by noise; a model of weight below 0.1% is left out. The average's forecast
    change is then shrunk toward the last value by ``shrink`` (:func:`shrink_factor`, with the best
    model's capped fitted df: :data:`LINEAR_SHRINK_DF`)."""

    models: tuple[LinearModel, ...]  # the least GCV error first
    weights: tuple[float, ...]
    coefficients: np.ndarray  # [1 + readings of the widest model]: the average times ``shrink``
    shrink: float

    @property
    def best(self) -> LinearModel:
        return self.models[0]

    def report(self) -> dict[str, Any]:
        return {
            **self.best.report(), "weight": round(self.weights[0], 4), "models_averaged": len(self.models),
            "shrink": round(self.shrink, 4),
        }  # fmt: skip


def shrink_factor(edge: float, distinct_targets: float, df: float) -> float:
    """``max(0, 1 - df / (n * edge))``: Copas' (1983) factor ``1 - df / chi2`` for the forecasts of a
    regression, with ``chi2 ≈ n * edge`` (n log of the last value's error over the model's, to first
    order). Where a window's evidence for an edge is thin its forecast change is trusted in
    proportion; an edge seen on thousands of targets keeps its forecast (the factor near 1)."""
    if not edge > 0 or not distinct_targets > 0:
        return 0.0
    return max(0.0, 1.0 - df / float(distinct_targets * edge))


def family_members(
    sums: LagSums, channel: int, families: Sequence[Family], max_order: int, redundancy: float
) -> list[LinearModel]:
    """Every order up to ``max_order`` and every penalty of ``families`` that could be fitted (the
    smoothed family: every smoothing weight at its orders, one parameter needs no penalty)."""
    members = [
        model
        for family in families if family != "smoothed"
        for order in ORDERS if order <= max_order for relative in RELATIVE_PENALTIES
        if (model := fit_model(sums, channel, family, order, relative, redundancy)) is not None
    ]  # fmt: skip
    if "smoothed" in families:
        widest = min(max_order, sums.max_order) - 1
        orders = sorted({o for o in SMOOTHED_ORDERS if o < widest} | ({widest} if widest >= 1 else set()))
        members += [
            model
            for weight in SMOOTHING_WEIGHTS for order in orders
            if (model := fit_model(sums, channel, "smoothed", order, 0.0, redundancy, weight)) is not None
        ]  # fmt: skip
    return members


def averaged(members: Sequence[LinearModel], sums: LagSums, channel: int) -> FamilyFit | None:
    """``members`` averaged (see :class:`FamilyFit`); None when not even the best beats the
    last value's error (every coefficient zero) on the targets it was fitted on by
    :data:`LINEAR_MIN_GAIN`, or when its evidence shrinks it to the last value."""
    if not members:
        return None
    members = sorted(members, key=lambda m: m.gcv_mse)
    best = members[0]
    _, _, yty, rows = sums.tail(channel, best.coefficients.size - 2)
    edge = 1.0 - best.gcv_mse / (yty / rows)  # against the last value's error on the same targets
    shrink = shrink_factor(edge, best.distinct_targets, min(LINEAR_SHRINK_DF, best.df))
    if not edge > LINEAR_MIN_GAIN or shrink == 0.0:  # dropped alike: the family is the last value
        return None
    logs = np.log(np.maximum([m.gcv_mse for m in members], 1e-300))
    weights = np.exp(-0.5 * best.distinct_targets * (logs - logs[0]))
    kept = weights / weights.sum() >= 1e-3
    weights = weights[kept] / weights[kept].sum()
    models = tuple(m for m, keep in zip(members, kept, strict=True) if keep)
    coefficients = np.zeros(max(m.coefficients.size for m in models))
    for weight, model in zip(weights, models, strict=True):
        coefficients[: model.coefficients.size] += weight * model.coefficients
    return FamilyFit(models, tuple(float(w) for w in weights), coefficients * shrink, shrink)


def family_fit(
    sums: LagSums, channel: int, families: Sequence[Family], max_order: int, redundancy: float
) -> FamilyFit | None:
    """Every order up to ``max_order`` and every penalty of ``families``, averaged (see
    :func:`averaged`)."""
    return averaged(family_members(sums, channel, families, max_order, redundancy), sums, channel)


@dataclass(frozen=True)
class ChannelChoice:
    """What one channel serves: the families' fits averaged (none: the last value) and why.
    ``fits`` serve where every lag is real; an origin with fewer real readings before it
    serves the same families refitted from their members that need no more."""

    unit_root_t: float | None
    fits: tuple[FamilyFit, ...]

    def report(self) -> dict[str, Any]:
        t = None if self.unit_root_t is None else round(self.unit_root_t, 3)
        return {"unit_root_t": t, "families": [f.report() for f in self.fits]}


@dataclass(frozen=True)
class LinearChoice:
    """The fitted forecaster and how it was chosen, per channel."""

    #: float64 [C, K, 1 + readings]: row k (intercept, then lags, zero beyond a channel's)
    #: serves forecast origins at position k of an event, the last row every later one.
    coefficients: np.ndarray
    channels: tuple[ChannelChoice, ...]

    @property
    def is_last_value(self) -> bool:
        return not np.any(self.coefficients)

    @property
    def order(self) -> int:
        return int(self.coefficients.shape[-1]) - 1

    def report(self) -> dict[str, Any]:
        return {"chosen_by": "gcv", "channels": [c.report() for c in self.channels]}


def _readings(model: LinearModel) -> int:
    return int(model.coefficients.size) - 1


def choose_linear(train: LagSums, max_order: int, redundancy: float = 1.0) -> LinearChoice | None:
    """Per channel: the changes family alone where a unit root stands, else the average of the
    levels family and the changes family (see the module's docstring); None without training
    data. ``redundancy``: how many instances each reading is in, on average.

    Each forecast origin serves only models whose lags are real readings there: at position
    ``k`` of an event (``k + 1`` readings so far) the families are averaged over their members
    of at most ``k + 1`` readings. A model of order 16 served at the third reading would
    forecast from 14 copies of the first (its fit never saw such lags)."""
    if train.total_rows <= 0:
        return None
    max_order = min(max_order, train.max_order)
    choices, members = [], []
    for c in range(train.channels):
        t = unit_root_t(train, c, redundancy)
        wanders = t is None or t >= ADF_CRITICAL_T
        groups: list[tuple[Family, ...]] = [("changes", "changes_no_drift", "smoothed")]
        if not wanders:
            groups.insert(0, ("levels",))
        members.append([family_members(train, c, g, max_order, redundancy) for g in groups])
        fits = [f for m in members[-1] if (f := averaged(m, train, c)) is not None]
        choices.append(ChannelChoice(t, tuple(fits)))
    positions = max((f.coefficients.size - 1 for ch in choices for f in ch.fits), default=1)
    coefficients = np.zeros((train.channels, positions, positions + 1))
    for c, choice in enumerate(choices):
        for k in range(positions):
            fits = list(choice.fits) if k == positions - 1 else [
                f for group in members[c]
                if (f := averaged([m for m in group if _readings(m) <= k + 1], train, c)) is not None
            ]  # fmt: skip
            for fit in fits:
                coefficients[c, k, : fit.coefficients.size] += fit.coefficients / len(fits)
    return LinearChoice(coefficients=coefficients, channels=tuple(choices))


def best_blend(network_sse: float, linear_sse: float, cross: float) -> tuple[float, float]:
    """(w, SSE) of the least-squares blend ``w * network + (1 - w) * linear``, ``w`` in [0, 1].

    From the two models' summed squared errors and the sum of their errors' products:
    the blend's error is ``w e_n + (1 - w) e_l``, a quadratic in ``w``.
    """
    curvature = network_sse - 2.0 * cross + linear_sse
    weight = (linear_sse - cross) / curvature if curvature > 0 else 0.0
    weight = min(1.0, max(0.0, weight))
    sse = weight**2 * network_sse + 2.0 * weight * (1.0 - weight) * cross + (1.0 - weight) ** 2 * linear_sse
    return float(weight), float(sse)


# --------------------------------------------------------------------------------------------
# The modules that serve
# --------------------------------------------------------------------------------------------


class LinearForecast(nn.Module):
    """``x[t] + intercept + sum_k w_k x[t-k]`` per channel, on ``x [B, L, C]`` (pads zero, real
    first), with the coefficients of the origin's position ``t`` (``[C, K, 1 + order]``: row
    ``min(t, K - 1)``; ``[C, 1 + order]``: one row for every position)."""

    intercept: torch.Tensor  # [C, K]
    weight: torch.Tensor  # [C, K, order]: lag 0 first

    def __init__(self, coefficients: torch.Tensor | np.ndarray) -> None:
        super().__init__()
        coefficients = torch.as_tensor(np.asarray(coefficients), dtype=torch.float32)
        given = tuple(coefficients.shape)
        if coefficients.dim() == 2:
            coefficients = coefficients[:, None]
        if coefficients.dim() != 3 or coefficients.shape[1] < 1 or coefficients.shape[2] < 2:
            raise ValueError(
                "LinearForecast: coefficients must be [C, 1 + order >= 2] or [C, positions >= 1, 1 + order >= 2],"
                f" got {given}"
            )
        self.order = int(coefficients.shape[2]) - 1
        self.register_buffer("intercept", coefficients[..., 0].clone())
        self.register_buffer("weight", coefficients[..., 1:].clone())  # [C, K, order]: lag 0 first

    @property
    def coefficients(self) -> torch.Tensor:
        return torch.cat([self.intercept[..., None], self.weight], dim=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = self.order
        padded = torch.cat([x[:, :1].expand(-1, order - 1, -1), x], dim=1)  # [B, order - 1 + L, C]
        lags = padded.unfold(1, order, 1)  # [B, L, C, order]: x[t - order + 1], ..., x[t]
        row = torch.arange(x.shape[1], device=x.device).clamp(max=self.weight.shape[1] - 1)
        weight = self.weight[:, row].transpose(0, 1).flip(2).to(x.dtype)  # [L, C, order]
        change = (lags * weight).sum(-1) + self.intercept[:, row].t().to(x.dtype)
        return x + change


@dataclass(frozen=True)
class Forecaster:
    """Which forecast serves: the network, the last value, the linear forecaster (its
    coefficients), or a blend ``network_weight * network + (1 - network_weight) * linear``."""

    kind: ForecasterKind = "network"
    coefficients: np.ndarray | None = None  # [C, (K,) 1 + order] for kinds "linear" and "blend"
    network_weight: float | None = None  # for kind "blend", in (0, 1)

    def __post_init__(self) -> None:
        if self.kind not in FORECASTER_KINDS:
            raise ValueError(f"forecaster kind must be one of {FORECASTER_KINDS}, got {self.kind!r}")
        if (self.kind in ("linear", "blend")) != (self.coefficients is not None):
            raise ValueError("a linear or blended forecaster needs its coefficients, and only they have them")
        if (self.kind == "blend") != (self.network_weight is not None):
            raise ValueError("a blend needs its network weight, and only a blend has one")
        if self.network_weight is not None and not 0.0 <= self.network_weight <= 1.0:
            raise ValueError(f"a blend's network weight must be within [0, 1], got {self.network_weight}")

    def in_units(self, mean: np.ndarray, std: np.ndarray, to_mean: np.ndarray, to_std: np.ndarray) -> Forecaster:
        """The same forecasts for a network normalized by ``(to_mean, to_std)`` instead of
        ``(mean, std)``: the lag weights act on readings either way, only the intercept moves
        (``a' = (std a + (to_mean - mean) sum_k w_k) / to_std``)."""
        if self.coefficients is None:
            return self
        coefficients = np.array(self.coefficients, dtype=np.float64)
        per_row = (-1,) + (1,) * (coefficients.ndim - 2)  # each channel's over its position rows
        mean, std = np.asarray(mean, np.float64).reshape(per_row), np.asarray(std, np.float64).reshape(per_row)
        to_mean = np.asarray(to_mean, np.float64).reshape(per_row)
        to_std = np.asarray(to_std, np.float64).reshape(per_row)
        intercept, lags = coefficients[..., 0], coefficients[..., 1:].sum(axis=-1)
        coefficients[..., 0] = (std * intercept + (to_mean - mean) * lags) / to_std
        return Forecaster(self.kind, coefficients, self.network_weight)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kind": self.kind}
        if self.coefficients is not None:
            state["coefficients"] = torch.as_tensor(np.asarray(self.coefficients, dtype=np.float64))
        if self.network_weight is not None:
            state["network_weight"] = float(self.network_weight)
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any] | None) -> Forecaster:
        """A saved forecaster; None (a checkpoint or bundle from before the choice) is the network."""
        if not state:
            return NETWORK
        coefficients = state.get("coefficients")
        array = None if coefficients is None else np.asarray(torch.as_tensor(coefficients), dtype=np.float64)
        weight = state.get("network_weight")
        return cls(kind=state["kind"], coefficients=array, network_weight=None if weight is None else float(weight))

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.coefficients is not None:
            out["order"] = int(self.coefficients.shape[-1]) - 1
        if self.network_weight is not None:
            out["network_weight"] = self.network_weight
        return out


NETWORK = Forecaster("network")
LAST_VALUE = Forecaster("last_value")


class ServedModel(nn.Module):
    """The network's interface with the chosen forecast: what predict, OIP, scoring and export run.

    The class head (``logits``) is always the network's; the forecast is the network's,
    the last value, or the linear forecaster's. No op mixes instances, so the answers
    keep request order and do not depend on an instance's company.
    """

    def __init__(self, network: SensorModel, forecaster: Forecaster = NETWORK) -> None:
        super().__init__()
        self.network = network
        self.kind: ForecasterKind = forecaster.kind
        self.network_weight = 1.0 if forecaster.network_weight is None else float(forecaster.network_weight)
        self.linear: LinearForecast | None = None
        if forecaster.coefficients is not None:
            device = next(network.parameters()).device
            self.linear = LinearForecast(forecaster.coefficients).to(device)
        self.channels = network.channels
        self.n_classes = network.n_classes

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        if self.kind == "network":
            return self.network(x_norm, mask)
        output = self.network(x_norm, mask) if self.kind == "blend" or self.n_classes > 0 else None
        real = mask.bool()[..., None]
        x = torch.where(real, x_norm, torch.zeros((), dtype=x_norm.dtype, device=x_norm.device))
        forecast = x if self.linear is None else self.linear(x) * real
        if self.kind == "blend":
            assert output is not None
            forecast = self.network_weight * output.forecast + (1.0 - self.network_weight) * forecast
        return ModelOutput(forecast=forecast, logits=None if output is None else output.logits)


def served_module(network: SensorModel, forecaster: Forecaster) -> nn.Module:
    """What answers for ``network`` with ``forecaster``: the network itself, or a :class:`ServedModel`
    around it, in eval mode like the published network it holds (a module built in training
    mode would put that network, which other threads serve from, into training mode the first
    time anyone restores its mode)."""
    return network if forecaster.kind == "network" else ServedModel(network, forecaster).eval()
