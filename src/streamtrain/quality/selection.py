"""The publish gate and the forecaster that serves, both judged on the holdout.

A candidate network is published only if its MSE on the holdout is at most
``(1 + PUBLISH_GATE_TOLERANCE)`` times the reference network's (the best that passed), and
it serves with whichever of the last value, the linear forecaster, the network and their
blend forecasts the holdout best. Every model is scored in the candidate's normalized
units, so the errors compare on one scale. Scaled out, every sum goes through one
``combined`` function, in the same order on every rank, so all ranks choose alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from streamtrain.data.collate import collate
from streamtrain.model.forecasters import (
    LAST_VALUE,
    NETWORK,
    Forecaster,
    LagSums,
    LinearChoice,
    best_blend,
    choose_linear,
    served_module,
)
from streamtrain.model.inference import evaluating, plan_predict_batches
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.config import QualityConfig
from streamtrain.quality.holdout import repeated_readings
from streamtrain.quality.scoring import Scorable, forward_in_data_units

#: What the linear forecaster is fitted on: a sample of the window's readings, and the share
#: of the window's events the sample holds (sliding windows repeat readings less in a sample).
TrainingSample = tuple[Sequence[np.ndarray], float]

_BLEND_MARGIN = 0.01  # a blend (its weight fitted on the holdout) serves only when 1% better than both parts
#: One-sided 5%: another forecaster replaces what the window's evidence chose only when its
#: holdout error is lower by this many standard errors.
EVIDENCE_Z = 1.645
#: The standard error is a Newey-West one over the held-out events (each sensor's in arrival
#: order), with a lag window of n^(1/3) + 1; it is trusted only when the holdout holds this
#: many such windows (fewer: no evidence).
MIN_LAG_WINDOWS = 5
#: ... and only when its held-out events come from this many separate stretches of a stream
#: (runs of overlapping events: a held-out block of sliding windows is one), so that one
#: stretch of time cannot decide alone (measured: one block of 46 windows served a network
#: on ``water_flow`` that forecast its later 30% 1.3x worse than the linear forecaster).
MIN_STRETCHES = 3
MAX_LAG = 64


def lag_window(events: int) -> int:
    """The Newey-West bandwidth: consecutive forecasts of one sensor are correlated (each target
    is scored once, :func:`fresh_targets_from`, so overlapping events share no target)."""
    return int(min(MAX_LAG, 1 + math.ceil(max(events, 1) ** (1 / 3))))


def fresh_targets_from(values: Sequence[np.ndarray], sensors: Sequence[str]) -> np.ndarray:
    """Per held-out event (in arrival order), the first position whose reading no earlier held-out
    event of its sensor held: only targets from there on are scored. Sliding windows repeat all
    but their newest readings, so each target is scored once, from the longest context the
    holdout gives it, as ``/v1/predict`` forecasts; events that do not overlap score every target."""
    previous: dict[str, np.ndarray] = {}
    first = np.zeros(len(values), dtype=np.int64)
    for i, (x, sensor) in enumerate(zip(values, sensors, strict=True)):
        first[i] = repeated_readings(previous.get(sensor), x)
        previous[sensor] = x
    return first


@dataclass(frozen=True)
class HoldoutErrors:
    """Sums over the holdout's one-step targets of every model's errors (in the candidate's units).

    ``gram[i, j]``: the sum of each target's channel mean of ``e_i e_j``, so ``gram[i, i]`` is
    model i's summed squared error and any blend's follows. ``lagged[j]``: over the held-out
    events in order (each sensor's consecutive), ``sum_e q_e q_{e+j}'`` with ``q_e`` the
    event's summed products (``k * k``) and its target count: the autocovariances a
    Newey-West standard error of any two blends' loss difference needs (:meth:`evidence`).
    """

    steps: float
    gram: np.ndarray  # [k, k]
    lagged: np.ndarray  # [J + 1, k * k + 1, k * k + 1]
    events: float
    stretches: float = math.inf  # runs of overlapping held-out events (each event its own when none overlap)

    def evidence(self, better: np.ndarray, than: np.ndarray) -> float:
        """The paired (Diebold-Mariano) statistic that ``better`` forecasts with less error than
        ``than``: the mean loss difference over its Newey-West standard error (Bartlett weights),
        events as the units; 0 when the holdout holds fewer than :data:`MIN_LAG_WINDOWS` lag
        windows, or fewer than :data:`MIN_STRETCHES` stretches, or the difference has no spread.
        Only the products of the two forecasts' models are read: a model the contrast does not
        weigh (a non-finite candidate beside the reference) leaves the statistic as it is."""
        lags = self.lagged.shape[0] - 1
        if self.events < MIN_LAG_WINDOWS * (lags + 1) or self.stretches < MIN_STRETCHES or self.steps <= 0:
            return 0.0
        contrast = _contrast(than, better)
        used = np.flatnonzero(contrast)
        mean = float(contrast[used] @ self.gram.ravel()[used]) / self.steps
        residual = np.append(contrast[used], -mean)  # per event: its summed difference minus mean x its targets
        rows = np.append(used, contrast.size)  # ... and its target count, the last row
        gammas = np.einsum("a,jab,b->j", residual, self.lagged[:, rows][:, :, rows], residual)
        bartlett = 1.0 - np.arange(lags + 1) / (lags + 1)
        variance = float(gammas[0] + 2.0 * (bartlett[1:] * gammas[1:]).sum())
        if not variance > 0:
            return 0.0
        return mean * self.steps / math.sqrt(variance)


def _contrast(weights_a: np.ndarray, weights_b: np.ndarray) -> np.ndarray:
    """The weights over the ``k * k`` error products of ``loss(a) - loss(b)``."""
    return (np.outer(weights_a, weights_a) - np.outer(weights_b, weights_b)).ravel()


@dataclass(frozen=True)
class GateDecision:
    publish: bool
    reason: str
    holdout_events: int
    candidate_mse: float | None = None
    serving_mse: float | None = None


@dataclass(frozen=True)
class Selection:
    """What a publication serves: the network gate's verdict and the forecaster chosen.

    ``network`` is the candidate when it passed the gate, else None: then, with
    ``refreshed``, the reference network serves on with ``forecaster`` (chosen with it as the
    network, in its units), so a held-back network never keeps a stale linear forecaster or
    choice serving; without, nothing new serves. ``mse`` holds each model's held-out error per
    step in the candidate's units.
    """

    decision: GateDecision
    forecaster: Forecaster
    network: Scorable | None
    reason: str
    holdout_events: int = 0
    mse: dict[str, float | None] = field(default_factory=dict)
    new_reference: bool = False
    linear: dict[str, Any] | None = None
    refreshed: bool = False

    def report(self) -> dict[str, Any]:
        return {
            "kind": self.forecaster.kind,
            "reason": self.reason,
            "holdout_events": self.holdout_events,
            "holdout_mse": dict(self.mse),
            "linear": self.linear,
        }


@dataclass(frozen=True)
class _Served:
    """A candidate's network and norm with another forecaster: a Scorable for the baselines."""

    published: Scorable
    forecaster: Forecaster

    @property
    def model(self) -> SensorModel:
        return self.published.model

    @property
    def norm(self) -> RunningNorm:
        return self.published.norm

    @property
    def version(self) -> int:
        return self.published.version

    @property
    def served(self) -> torch.nn.Module:
        return served_module(self.published.model, self.forecaster)


class ForecasterSelector:
    """Judges a candidate on the holdout: the network gate, then the forecaster that serves.

    ``combined`` adds a float64 vector over the ranks (the identity in one process);
    ``redundancy_sums`` gives the splitter's [sum over sensors of the events each reading
    is in, sensors]: overlapping events repeat readings, and the linear fit on them has
    less evidence than its rows suggest.
    """

    def __init__(
        self,
        config: QualityConfig,
        combined: Callable[[np.ndarray], np.ndarray],
        redundancy_sums: Callable[[], np.ndarray],
    ) -> None:
        self.config = config
        self._combined = combined
        self._redundancy_sums = redundancy_sums

    def select(
        self,
        candidate: Scorable,
        reference: Scorable | None,
        training_values: Callable[[], TrainingSample],
        values: list[np.ndarray],
        sensors: Sequence[str],
        guards: Sequence[np.ndarray] = (),
    ) -> Selection:
        """The network gate, then the forecaster that serves (:meth:`_choose`).

        ``values`` are this rank's held-out events (``sensors``: whose each is, in arrival
        order), ``guards`` the events kept out beside them (overlapping a held-out block). While
        the holdout is too small to judge anything, the linear forecaster is fitted on those
        too: on a short stream of sliding windows they are half of it (26 of the 50 events of a
        yearly series), and nothing is left for them to keep honest. ``reference`` is the
        network the candidate must not fall behind: the best one that passed the gate so far
        (or the serving one), re-scored on today's holdout, so a run of candidates each a
        little worse than the last cannot ratchet the quality down.
        A held-back candidate leaves the reference serving with a choice made afresh.
        ``training_values`` gives the readings the linear forecaster is fitted on (a sample of
        the window).
        """
        cfg = self.config
        units = candidate.norm  # every model is scored in the same units
        n = int(round(self._combined(np.array([float(len(values))]))[0]))
        redundancy = self._redundancy()
        if n < cfg.holdout_min_events:
            # The network cannot be judged yet; the linear forecaster can, by generalized
            # cross-validation on the window, against the last value (its all-zero choice).
            linear = self._fit_linear(candidate, training_values, redundancy, [*values, *guards])
            forecaster, kind = LAST_VALUE, "the last value"
            if linear is not None and not linear.is_last_value:
                forecaster, kind = Forecaster("linear", linear.coefficients), "the linear forecaster (chosen by GCV)"
            reason = f"holdout has {n} of the {cfg.holdout_min_events} events the gate needs: {kind} serves"
            return Selection(
                GateDecision(True, reason, n), forecaster, candidate, reason, n, new_reference=reference is None,
                linear=None if linear is None else linear.report(),
            )  # fmt: skip
        linear = self._fit_linear(candidate, training_values, redundancy)
        linear_forecaster = None if linear is None else Forecaster("linear", linear.coefficients)
        # One scoring pass: the networks against each other, the baselines beside them.
        models: list[Scorable | None] = [
            candidate,
            None if reference is None else _Served(reference, NETWORK),
            _Served(candidate, LAST_VALUE),
            None if linear_forecaster is None else _Served(candidate, linear_forecaster),
        ]
        errors = self._error_gram(values, sensors, models, units, lag_window(n))
        steps, gram = errors.steps, errors.gram
        if steps == 0:
            reason = "holdout events have no steps to forecast"
            return Selection(
                GateDecision(True, reason, n), NETWORK, candidate, reason, n, new_reference=reference is None
            )
        sse = np.diagonal(gram)
        mse: dict[str, float | None] = {"candidate": sse[0] / steps, "last_value": sse[2] / steps}
        mse["reference"] = None if reference is None else sse[1] / steps
        if linear is not None:
            mse["linear"] = sse[3] / steps
        candidate_mse, reference_mse = mse["candidate"], mse["reference"]
        tolerance = cfg.publish_gate_tolerance
        assert candidate_mse is not None
        if not math.isfinite(candidate_mse):
            decision = GateDecision(False, "candidate forecasts are not finite", n, candidate_mse, reference_mse)
        elif reference_mse is not None and not math.isfinite(reference_mse):
            # a reference that fails on today's holdout bars nothing: the finite candidate replaces it
            reason = "the reference network's forecasts are not finite"
            decision = GateDecision(True, reason, n, candidate_mse, reference_mse)
        elif reference_mse is None or candidate_mse <= reference_mse * (1.0 + tolerance):
            decision = GateDecision(True, "not worse than the reference network", n, candidate_mse, reference_mse)
        else:
            reason = f"holdout MSE {candidate_mse:.4g} > {1.0 + tolerance:g} x reference {reference_mse:.4g}"
            decision = GateDecision(False, reason, n, candidate_mse, reference_mse)
        if not decision.publish:
            if reference is None:
                return Selection(decision, NETWORK, None, decision.reason, n, mse)
            # the reference network serves on, with a choice made afresh beside it
            _, forecaster, reason = self._choose(errors, mse, linear, network=1)
            units, to = candidate.norm, reference.norm
            forecaster = forecaster.in_units(units.mean.numpy(), units.std.numpy(), to.mean.numpy(), to.std.numpy())
            return Selection(
                decision, forecaster, None, f"{decision.reason}; the reference network serves on: {reason}", n, mse,
                linear=None if linear is None else linear.report(), refreshed=True,
            )  # fmt: skip
        new_reference = reference_mse is None or not candidate_mse > reference_mse  # a NaN reference is replaced
        _, forecaster, reason = self._choose(errors, mse, linear)
        return Selection(
            decision, forecaster, candidate, reason, n, mse,
            new_reference=new_reference, linear=None if linear is None else linear.report(),
        )  # fmt: skip

    def _choose(
        self,
        errors: HoldoutErrors,
        mse: dict[str, float | None],
        linear: LinearChoice | None,
        network: int = 0,
    ) -> tuple[str, Forecaster, str]:
        """(kind, forecaster, reason). What the window's evidence chose serves (the linear
        forecaster, or the last value where generalized cross-validation found nothing better)
        unless the holdout shows another forecasts better *with evidence* (:data:`EVIDENCE_Z`
        standard errors, the targets counted once); among those that do, the least held-out
        error serves. A holdout holds a few dozen events: on it a network that fitted noise can
        beat the linear forecaster by chance, and a linear forecaster fitted on thousands of
        targets can lose to the last value by chance. ``network``: which scored network
        competes (0: the candidate, 1: the reference)."""
        steps, gram = errors.steps, errors.gram
        n = network
        weights = {kind: np.eye(4)[i] for kind, i in (("network", n), ("last_value", 2), ("linear", 3))}
        options: dict[str, tuple[float, Forecaster]] = {"last_value": (gram[2, 2] / steps, LAST_VALUE)}
        incumbent = "last_value"
        if linear is not None:
            options["linear"] = (gram[3, 3] / steps, Forecaster("linear", linear.coefficients))
            incumbent = "last_value" if linear.is_last_value else "linear"
        options["network"] = (gram[n, n] / steps, NETWORK)
        if linear is not None:
            weight, blend_sse = best_blend(gram[n, n], gram[3, 3], gram[n, 3])
            mse["blend"] = blend_sse / steps
            if 0.0 < weight < 1.0 and blend_sse < (1.0 - _BLEND_MARGIN) * min(gram[n, n], gram[3, 3]):
                options["blend"] = (blend_sse / steps, Forecaster("blend", linear.coefficients, weight))
                weights["blend"] = weight * weights["network"] + (1.0 - weight) * weights["linear"]
        shown = ", ".join(f"{kind} {error:.4g}" for kind, (error, _) in options.items())
        evidence = {
            kind: errors.evidence(weights[kind], weights[incumbent])
            for kind, (error, _) in options.items()
            if kind != incumbent and math.isfinite(error) and error < options[incumbent][0]
        }
        won = [kind for kind, z in evidence.items() if z >= EVIDENCE_Z]
        if won:
            kind = min(won, key=lambda k: options[k][0])
            reason = f"{kind} forecasts the holdout better than {incumbent} by z = {evidence[kind]:.2f} ({shown})"
            return kind, options[kind][1], reason
        doubts = ", ".join(f"{kind} z = {z:.2f}" for kind, z in evidence.items())
        reason = f"{incumbent} serves: nothing forecasts the holdout better with evidence (z >= {EVIDENCE_Z:g}"
        reason += f"; {doubts}) ({shown})" if doubts else f") ({shown})"
        return incumbent, options[incumbent][1], reason

    def _redundancy(self) -> float:
        """How many events each reading is in, on average over sensors (sliding windows: their length)."""
        readings, sensors = self._combined(self._redundancy_sums())
        return readings / sensors if sensors else 1.0

    def _fit_linear(
        self,
        candidate: Scorable,
        training_values: Callable[[], TrainingSample],
        redundancy: float,
        unjudged: Sequence[np.ndarray] = (),
    ) -> LinearChoice | None:
        """The linear forecaster in the candidate's units, fitted on a sample of the window and on
        ``unjudged`` (held-out and guard events, only where the holdout judges nothing: on a
        holdout that judges it, never)."""
        max_order = max(1, min(self.config.linear_max_order, candidate.model.max_len))
        channels, units = candidate.model.channels, candidate.norm
        values, sampled_share = training_values()
        values = [*values, *unjudged]
        local = LagSums.of(values, max_order, channels, units.mean.numpy(), units.std.numpy())
        sums = LagSums.from_array(self._combined(local.as_array()), channels, max_order)
        # each reading is in ``redundancy`` events of the stream; a sample keeps a share of them
        return choose_linear(sums, max_order, redundancy=max(1.0, sampled_share * redundancy))

    def _error_gram(
        self,
        values: list[np.ndarray],
        sensors: Sequence[str],
        models: list[Scorable | None],
        units: RunningNorm,
        lags: int,
    ) -> HoldoutErrors:
        """The holdout errors of every rank, as sums (see :class:`HoldoutErrors`), the lagged
        ones over each sensor's events in arrival order (``values`` and ``sensors`` are in
        arrival order). A model that is None is absent on every rank."""
        k, width = len(models), len(models) ** 2 + 1
        local = np.zeros(1 + k * k + (lags + 1) * width * width + 2)
        budget = self.config.token_budget
        present = [i for i, model in enumerate(models) if model is not None]
        if values and present:
            unit_std = units.std.float()
            lengths = np.array([len(v) for v in values], dtype=np.int64)
            fresh_from = fresh_targets_from(values, sensors)
            first_fresh = torch.from_numpy(fresh_from)
            per_event = np.zeros((len(values), width))  # each event's summed products, then its targets
            with torch.inference_mode():
                for group in plan_predict_batches(lengths, budget):
                    batch = collate([values[i] for i in group])
                    mask, data = batch.mask, batch.values
                    targets = torch.arange(1, data.shape[1])[None, :]  # the position each forecast is of
                    fresh = targets >= first_fresh[torch.as_tensor(group, dtype=torch.long)][:, None]
                    valid = (mask[:, :-1] & mask[:, 1:] & fresh).double()
                    errors = torch.zeros(k, *data[:, 1:].shape, dtype=torch.float64)
                    for i in present:
                        model = models[i]
                        assert model is not None
                        with evaluating(model.served) as module:
                            _, forecast = forward_in_data_units(module, model.norm, data, mask)
                        errors[i] = ((forecast.float()[:, :-1] - data[:, 1:]) / unit_std).double()
                    # each target's channel mean of e_i e_j, summed over the event's targets
                    products = torch.einsum("ibtc,jbtc,bt->ijb", errors, errors, valid) / data.shape[-1]
                    rows = np.asarray(group, dtype=np.int64)
                    per_event[rows, :-1] = products.reshape(k * k, -1).T.numpy()
                    per_event[rows, -1] = valid.sum(dim=1).numpy()
            order = sorted(range(len(values)), key=lambda i: sensors[i])  # stable: arrival order within a sensor
            q = per_event[np.asarray(order, dtype=np.int64)]
            lagged = np.stack([q[: len(q) - j].T @ q[j:] for j in range(lags + 1)])
            local[0] = per_event[:, -1].sum()
            local[1 : 1 + k * k] = per_event[:, :-1].sum(axis=0)
            local[1 + k * k : -2] = lagged.ravel()
            local[-2] = len(values)
            local[-1] = np.count_nonzero(fresh_from == 0)  # an event that repeats no reading starts a stretch
        total = self._combined(local)
        gram, lagged = total[1 : 1 + k * k].reshape(k, k), total[1 + k * k : -2].reshape(lags + 1, width, width)
        return HoldoutErrors(float(total[0]), gram, lagged, float(total[-2]), float(total[-1]))
