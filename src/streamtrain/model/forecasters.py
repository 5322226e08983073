"""What serves a forecast: the network, the last value, or a ridge autoregression on lags.

A forecaster is only worth serving if it beats what a practitioner tries first: the last
value, and a least-squares autoregression. So the service keeps both beside the network
and serves whichever forecasts the held-out events best (:mod:`streamtrain.quality.selection`
chooses). All three speak the network's language — ``forward(x_norm, mask) ->
ModelOutput`` in the published model's normalized units — so predict, OIP v2, the
quality monitor and ``streamtrain export`` run the choice through one code path
(:class:`ServedModel`), and the class head, when there is one, is always the network's.

The linear forecaster is a per-channel ridge regression of the *change* ``x[t+1] - x[t]``
on an intercept and the last ``p`` readings ``x[t], ..., x[t-p+1]`` (positions before an
instance's first reading repeat it, as the network's own features do). Regressing the
change shrinks towards the last-value forecast: a large ridge penalty gives exactly the
last value, so the penalty chosen on held-out data can only move away from it when the
data says so. The fit is closed-form from sums of outer products (:class:`LagSums`),
which add over chunks, windows and ranks, so every rank of a scaled-out group solves the
same system from the all-reduced sums and one holdout's sums score every (order, penalty)
pair at once.
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

#: Orders tried for the linear forecaster (capped by LINEAR_MAX_ORDER).
ORDERS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Ridge penalties tried, relative to the mean diagonal of the lag block of X'X.
RELATIVE_PENALTIES = (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
_CHUNK_ROWS = 65_536  # positions per chunk when summing outer products


# --------------------------------------------------------------------------------------------
# Sums that fit and score the ridge autoregression
# --------------------------------------------------------------------------------------------


@dataclass
class LagSums:
    """Per channel: X'X over ``[1, x[t], ..., x[t-P+1]]``, X'y and y'y with ``y = x[t+1] - x[t]``.

    Orders below ``P`` use the leading blocks (their features are a prefix), so one set of
    sums fits and scores every order up to ``P``.
    """

    xtx: np.ndarray  # float64 [C, P+1, P+1]
    xty: np.ndarray  # float64 [C, P+1]
    yty: np.ndarray  # float64 [C]
    rows: float  # one-step targets summed over

    @classmethod
    def zeros(cls, channels: int, max_order: int) -> LagSums:
        size = max_order + 1
        return cls(np.zeros((channels, size, size)), np.zeros((channels, size)), np.zeros(channels), 0.0)

    @property
    def max_order(self) -> int:
        return int(self.xty.shape[1]) - 1

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
        lags = np.arange(max_order, dtype=np.int64)
        for begin in range(0, targets.size, _CHUNK_ROWS):
            rows = targets[begin : begin + _CHUNK_ROWS]
            index = np.maximum(item_start[rows, None], rows[:, None] - lags[None, :])  # [N, P]
            change = flat[rows + 1] - flat[rows]  # [N, C]
            for c in range(channels):  # one BLAS product per channel
                features = np.empty((rows.size, max_order + 1))
                features[:, 0] = 1.0
                features[:, 1:] = flat[index, c]
                sums.xtx[c] += features.T @ features
                sums.xty[c] += features.T @ change[:, c]
                sums.yty[c] += change[:, c] @ change[:, c]
        sums.rows += float(targets.size)
        return sums

    def as_array(self) -> np.ndarray:
        return np.concatenate([self.xtx.ravel(), self.xty.ravel(), self.yty, [self.rows]])

    @classmethod
    def from_array(cls, flat: np.ndarray, channels: int, max_order: int) -> LagSums:
        size = max_order + 1
        flat = np.asarray(flat, dtype=np.float64)
        a, b = channels * size * size, channels * size
        return cls(
            flat[:a].reshape(channels, size, size).copy(),
            flat[a : a + b].reshape(channels, size).copy(),
            flat[a + b : a + b + channels].copy(),
            float(flat[a + b + channels]),
        )


def ridge_solve(sums: LagSums, channel: int, order: int, penalty: float) -> np.ndarray:
    """Coefficients ``[intercept, w_1..w_order]`` of one channel (the intercept is not penalized)."""
    size = order + 1
    a = sums.xtx[channel, :size, :size].copy()
    a[np.arange(1, size), np.arange(1, size)] += penalty
    b = sums.xty[channel, :size]
    try:
        return np.linalg.solve(a, b)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(a, b, rcond=None)[0]


def held_out_sse(holdout: LagSums, channel: int, coefficients: np.ndarray) -> float:
    """The summed squared error on ``holdout`` of one channel's coefficients (closed form)."""
    size = coefficients.size
    xtx = holdout.xtx[channel, :size, :size]
    xty = holdout.xty[channel, :size]
    return float(holdout.yty[channel] - 2.0 * coefficients @ xty + coefficients @ xtx @ coefficients)


@dataclass(frozen=True)
class LinearChoice:
    """The fitted forecaster and how it was chosen, per channel."""

    coefficients: np.ndarray  # float64 [C, 1 + order]: intercept, then lags (zero beyond a channel's order)
    orders: tuple[int, ...]
    penalties: tuple[float, ...]  # relative to the lag block's mean diagonal (inf: the last value kept)
    held_out_sse: tuple[float, ...]  # the estimate the choice minimized, per channel
    criterion: str = "holdout"  # "holdout", or "gcv" (generalized cross-validation) without one

    @property
    def is_last_value(self) -> bool:
        return not np.any(self.coefficients)

    @property
    def order(self) -> int:
        return int(self.coefficients.shape[1]) - 1

    def report(self) -> dict[str, Any]:
        penalties = [None if math.isinf(p) else p for p in self.penalties]
        return {"orders": list(self.orders), "relative_penalties": penalties, "chosen_by": self.criterion}


def gcv_sse(train: LagSums, channel: int, coefficients: np.ndarray, penalty: float, redundancy: float = 1.0) -> float:
    """Generalized cross-validation's estimate of the out-of-sample SSE over the training rows
    (Golub, Heath and Wahba 1979): RSS / (1 - df / n)^2, df the trace of the ridge hat matrix.

    ``redundancy`` is how many rows each reading stands in on average (sliding windows of
    length L and stride 1: L): n is the rows divided by it, the independent evidence."""
    size = coefficients.size
    xtx = train.xtx[channel, :size, :size]
    rss = float(train.yty[channel] - 2.0 * coefficients @ train.xty[channel, :size] + coefficients @ xtx @ coefficients)
    a = xtx.copy()
    a[np.arange(1, size), np.arange(1, size)] += penalty
    try:
        df = float(np.trace(np.linalg.solve(a, xtx)))
    except np.linalg.LinAlgError:
        return math.inf
    n = train.rows / max(redundancy, 1.0)
    return math.inf if df >= n else max(rss, 0.0) / (1.0 - df / n) ** 2


def choose_linear(
    train: LagSums, holdout: LagSums | None, max_order: int, redundancy: float = 1.0
) -> LinearChoice | None:
    """Per channel, the (order, penalty) with the least estimated out-of-sample error; None
    without training data.

    The estimate is the held-out error when there are held-out targets, else generalized
    cross-validation on the training sums. The last value (every coefficient zero) competes
    as well, so a channel nothing forecasts better keeps it.
    """
    if train.rows <= 0:
        return None
    channels = train.xty.shape[0]
    orders = [p for p in ORDERS if p <= min(max_order, train.max_order)] or [1]
    held_out = holdout if holdout is not None and holdout.rows > 0 else None

    def estimate(c: int, coefficients: np.ndarray, penalty: float) -> float:
        if held_out is not None:
            return held_out_sse(held_out, c, coefficients)
        return gcv_sse(train, c, coefficients, penalty, redundancy)

    picks: list[tuple[int, float, np.ndarray, float]] = []
    for c in range(channels):
        zero = np.zeros(2)
        last_value_sse = held_out_sse(held_out, c, zero) if held_out is not None else float(train.yty[c])
        best = (1, math.inf, zero, last_value_sse)
        for order in orders:
            diagonal = np.diagonal(train.xtx[c])[1 : order + 1]
            scale = float(diagonal.mean()) if diagonal.size and diagonal.mean() > 0 else 1.0
            for relative in RELATIVE_PENALTIES:
                coefficients = ridge_solve(train, c, order, relative * scale)
                if not np.isfinite(coefficients).all():
                    continue
                error = estimate(c, coefficients, relative * scale)
                if error < best[3]:
                    best = (order, relative, coefficients, error)
        picks.append(best)
    width = max(order for order, *_ in picks)
    coefficients = np.zeros((channels, width + 1))
    for c, (_, _, coef, _) in enumerate(picks):
        coefficients[c, : coef.size] = coef
    return LinearChoice(
        coefficients=coefficients,
        orders=tuple(p[0] for p in picks),
        penalties=tuple(p[1] for p in picks),
        held_out_sse=tuple(p[3] for p in picks),
        criterion="holdout" if held_out is not None else "gcv",
    )


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
    """``x[t] + intercept + sum_k w_k x[t-k]`` per channel, on ``x [B, L, C]`` (pads zero, real first)."""

    intercept: torch.Tensor  # [C]
    weight: torch.Tensor  # [C, order]: lag 0 first

    def __init__(self, coefficients: torch.Tensor | np.ndarray) -> None:
        super().__init__()
        coefficients = torch.as_tensor(np.asarray(coefficients), dtype=torch.float32)
        if coefficients.dim() != 2 or coefficients.shape[1] < 2:
            raise ValueError(
                f"LinearForecast: coefficients must be [C, 1 + order >= 2], got {tuple(coefficients.shape)}"
            )
        self.order = int(coefficients.shape[1]) - 1
        self.register_buffer("intercept", coefficients[:, 0].clone())
        self.register_buffer("weight", coefficients[:, 1:].clone())  # [C, order]: lag 0 first

    @property
    def coefficients(self) -> torch.Tensor:
        return torch.cat([self.intercept[:, None], self.weight], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = self.order
        padded = torch.cat([x[:, :1].expand(-1, order - 1, -1), x], dim=1)  # [B, order - 1 + L, C]
        lags = padded.unfold(1, order, 1)  # [B, L, C, order]: x[t - order + 1], ..., x[t]
        change = (lags * self.weight.flip(1).to(x.dtype)).sum(-1) + self.intercept.to(x.dtype)
        return x + change


@dataclass(frozen=True)
class Forecaster:
    """Which forecast serves: the network, the last value, the linear forecaster (its
    coefficients), or a blend ``network_weight * network + (1 - network_weight) * linear``."""

    kind: ForecasterKind = "network"
    coefficients: np.ndarray | None = None  # [C, 1 + order] for kinds "linear" and "blend"
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
            out["order"] = int(self.coefficients.shape[1]) - 1
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
        self.max_len = network.max_len
        self.config = network.config

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
