"""Learning quality: test-then-train scoring, drift detection, the publish gate, rollback rules.

Prequential (test-then-train) evaluation: before an accepted event reaches the window,
the model that serves scores it, so every scored event is one the scoring model has not
trained on. The score of an event is its one-step-ahead forecast MSE over its real steps
(mean over channels, in the serving model's normalized units, as the training loss), next
to the last-value forecast's MSE on the same steps; a labelled event adds its log-loss and
whether the top class was right. Scoring costs a forward pass, so at most
``QUALITY_MAX_EVENTS_PER_S`` events a second are scored, drawn at random from each poll
batch; the share scored is reported.

Averages: ``prequential_mse`` and ``naive_mse`` are fading averages over scored steps
with a half-life of ``QUALITY_HALF_LIFE_EVENTS`` scored events (an event's weight halves
every that many later events); totals since start are reported beside them.
``skill = 1 - prequential_mse / naive_mse``: above 0 the model beats the last value.

Drift: River's detectors (ADWIN by default, Page-Hinkley as an option) watch the stream of
per-event model errors. A detection is counted, logged with the error level before it and
the recent level, and can trigger a reaction in the trainer.

Publishing: with ``HOLDOUT_SHARE > 0`` a share of fresh events (one in ``1 / share`` of
each sensor's blocks of events, from a phase drawn by the configured randomness mode) is
kept out of the window in a bounded holdout buffer and is never trained on; a candidate
network is published only if its MSE on that holdout is at most
``(1 + PUBLISH_GATE_TOLERANCE)`` times the reference network's (the best that passed), and
it serves with whichever of the last value, the linear forecaster, the network and their
blend forecasts the holdout best (:meth:`QualityMonitor.select`). The serving version is
rolled back to its predecessor automatically when, over at least ``ROLLBACK_MIN_EVENTS``
scored events each, its skill is below the predecessor's by more than ``ROLLBACK_MARGIN``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from streamtrain.data.collate import collate
from streamtrain.data.randomness import make_randomness
from streamtrain.events import NO_LABEL, EventBatch
from streamtrain.metrics import Metrics
from streamtrain.model.forecasters import (
    LAST_VALUE,
    NETWORK,
    Forecaster,
    LagSums,
    LinearChoice,
    ServedModel,
    best_blend,
    choose_linear,
)
from streamtrain.model.network import RunningNorm, SensorModel, forward_on_model_device, plan_predict_batches
from streamtrain.window import token_positions

log = logging.getLogger(__name__)

# Randomness streams of their own: the coordinates never used by a data-loader worker.
_HOLDOUT_STREAM = 1_000_001
_SCORING_STREAM = 1_000_002
_RECENT_EVENTS = 64  # the "after" level of a drift: the mean error of the last events
_DRIFTS_SHOWN = 10
_VERSIONS_TRACKED = 32
_BLEND_MARGIN = 0.01  # a blend (its weight fitted on the holdout) serves only when 1% better than both parts


class Scorable(Protocol):
    """A published model: what scoring needs (train.PublishedModel has it).

    ``model`` is the network; ``served`` the module whose forecasts serve (the network,
    or the forecaster chosen beside it: :class:`streamtrain.model.forecasters.ServedModel`).
    """

    @property
    def model(self) -> SensorModel: ...

    @property
    def norm(self) -> RunningNorm: ...

    @property
    def version(self) -> int: ...

    @property
    def served(self) -> torch.nn.Module: ...


# --------------------------------------------------------------------------------------------
# Scoring a batch of events with a frozen model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EventScores:
    """Per-event scores; events with one reading have ``steps == 0`` and score nothing."""

    steps: np.ndarray  # int64 [n]: one-step targets (length - 1)
    sse: np.ndarray  # float64 [n]: model's summed squared error over the steps (mean over channels)
    naive_sse: np.ndarray  # float64 [n]: the last-value forecast's, same steps
    log_loss: np.ndarray  # float64 [n]: cross-entropy of the label; NaN when unlabelled or no head
    correct: np.ndarray  # float64 [n]: 1.0 / 0.0 top-class hit; NaN when unlabelled or no head


def score_events(
    model: torch.nn.Module,
    norm: RunningNorm,
    values: Sequence[np.ndarray],
    labels: Sequence[int] | np.ndarray | None = None,
    token_budget: int = 8192,
    units: RunningNorm | None = None,
) -> EventScores:
    """Score ``values`` (each ``[L, C]``) with ``model`` in inference mode, no update.

    Squared errors are in the normalized units of ``units`` (default: ``norm``, the
    model's own), so two models scored with the same ``units`` are compared on one scale.
    """
    n = len(values)
    labels_arr = np.full(n, NO_LABEL, dtype=np.int64) if labels is None else np.asarray(labels, dtype=np.int64)
    out = EventScores(
        steps=np.zeros(n, dtype=np.int64),
        sse=np.zeros(n),
        naive_sse=np.zeros(n),
        log_loss=np.full(n, math.nan),
        correct=np.full(n, math.nan),
    )
    if n == 0:
        return out
    units = norm if units is None else units
    unit_std = units.std.float()
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for group in plan_predict_batches(lengths, token_budget):
                batch = collate([values[i] for i in group])
                mask = batch.mask
                x_norm = norm.normalize(batch.values).float() * mask[..., None]
                output = forward_on_model_device(model, x_norm, mask)  # the serving copy may live on a GPU
                # Back to data units, then into the common units: (forecast - target) / unit std.
                forecast = norm.denormalize(output.forecast.double()).float()
                data = batch.values
                valid = (mask[:, :-1] & mask[:, 1:]).double()
                err = ((forecast[:, :-1] - data[:, 1:]) / unit_std).double().square().mean(-1) * valid
                naive = ((data[:, :-1] - data[:, 1:]) / unit_std).double().square().mean(-1) * valid
                out.steps[group] = valid.sum(1).long().numpy()
                out.sse[group] = err.sum(1).numpy()
                out.naive_sse[group] = naive.sum(1).numpy()
                if output.logits is not None:
                    group_labels = torch.from_numpy(labels_arr[group])
                    labelled = group_labels != NO_LABEL
                    if bool(labelled.any()):
                        logits = output.logits.double()
                        ce = F.cross_entropy(logits, group_labels.clamp_min(0), reduction="none")
                        hit = (logits.argmax(-1) == group_labels).double()
                        rows = group[labelled.numpy()]
                        out.log_loss[rows] = ce[labelled].numpy()
                        out.correct[rows] = hit[labelled].numpy()
    finally:
        model.train(was_training)
    return out


# --------------------------------------------------------------------------------------------
# Running averages
# --------------------------------------------------------------------------------------------


@dataclass
class Averages:
    """Sums for one horizon: squared errors and steps (model and naive), labels."""

    steps: float = 0.0
    sse: float = 0.0
    naive_sse: float = 0.0
    labelled: float = 0.0
    log_loss: float = 0.0
    correct: float = 0.0

    def add(self, scores: EventScores, decay: np.ndarray | float = 1.0) -> None:
        """Add events (weights ``decay``; 1 for totals)."""
        self.steps += float(np.sum(scores.steps * decay))
        self.sse += float(np.sum(scores.sse * decay))
        self.naive_sse += float(np.sum(scores.naive_sse * decay))
        labelled = ~np.isnan(scores.log_loss)
        weights = np.broadcast_to(decay, scores.log_loss.shape)[labelled]
        self.labelled += float(weights.sum())
        self.log_loss += float(np.sum(scores.log_loss[labelled] * weights))
        self.correct += float(np.sum(scores.correct[labelled] * weights))

    def scale(self, factor: float) -> None:
        for name in ("steps", "sse", "naive_sse", "labelled", "log_loss", "correct"):
            setattr(self, name, getattr(self, name) * factor)

    @property
    def mse(self) -> float | None:
        return self.sse / self.steps if self.steps > 0 else None

    @property
    def naive_mse(self) -> float | None:
        return self.naive_sse / self.steps if self.steps > 0 else None

    @property
    def skill(self) -> float | None:
        if self.steps <= 0 or self.naive_sse <= 0:
            return None
        return 1.0 - self.sse / self.naive_sse

    def report(self) -> dict[str, Any]:
        return {
            "prequential_mse": self.mse,
            "naive_mse": self.naive_mse,
            "skill": self.skill,
            "log_loss": self.log_loss / self.labelled if self.labelled > 0 else None,
            "accuracy": self.correct / self.labelled if self.labelled > 0 else None,
        }


@dataclass
class VersionRecord:
    """What one model version scored while it served."""

    version: int
    events: int = 0
    totals: Averages = field(default_factory=Averages)
    rolled_back: bool = False


# --------------------------------------------------------------------------------------------
# Drift detection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drift:
    at_event: int  # scored events before the detection
    at: float  # wall time
    detector: str
    version: int | None  # the serving version
    error_before: float | None  # mean model error per step before the change
    error_recent: float | None  # mean over the last scored events


class DriftMonitor:
    """A River detector on the per-event model error, with the levels around each detection.

    ``error_before`` is a fading mean of errors older than the last ``_RECENT_EVENTS``
    events (half-life ``half_life`` events), ``error_recent`` the mean of those last
    events: both are the detector-independent "levels before and after" of a log line.
    River's detectors keep no state a checkpoint could hold as plain data; after a restart
    they start over.
    """

    def __init__(
        self, kind: str, adwin_delta: float = 0.002, ph_threshold: float = 100.0, half_life: float = 2000.0
    ) -> None:
        self.kind = kind
        self.adwin_delta = adwin_delta
        self.ph_threshold = ph_threshold
        self.detector = self._make()
        self._recent: deque[float] = deque(maxlen=_RECENT_EVENTS)
        self._decay = 0.5 ** (1.0 / half_life)
        self._old_sum = 0.0
        self._old_weight = 0.0

    def _make(self) -> Any:
        from river import drift  # imported here: start-up does not pay for River unless asked

        if self.kind == "adwin":
            return drift.ADWIN(delta=self.adwin_delta)
        if self.kind == "page_hinkley":
            # Its input is the error relative to the earlier level (see update): delta = 0.1
            # lets the level wander by 10% without alarm; an error that doubles crosses the
            # default threshold of 100 after ~110 events; noise of unit spread rarely does.
            return drift.PageHinkley(threshold=self.ph_threshold, delta=0.1, mode="both")
        raise ValueError(f"drift detector must be 'adwin' or 'page_hinkley', got {self.kind!r}")

    def update(self, error: float) -> bool:
        if len(self._recent) == self._recent.maxlen:
            self._old_sum = self._decay * self._old_sum + self._recent[0]
            self._old_weight = self._decay * self._old_weight + 1.0
        self._recent.append(error)
        if self.kind == "page_hinkley":
            # Page-Hinkley's threshold is in the units of its input: feed it the error relative
            # to the level before, so one threshold fits every stream (50 = fifty events at 2x).
            before = self.error_before
            error = error / before if before is not None and before > 0 else 1.0
        self.detector.update(error)
        return bool(self.detector.drift_detected)

    @property
    def error_before(self) -> float | None:
        return self._old_sum / self._old_weight if self._old_weight > 0 else None

    @property
    def error_recent(self) -> float | None:
        return float(np.mean(self._recent)) if self._recent else None

    def restart_levels(self) -> None:
        """After a detection the old level is history: "before" starts from the recent events."""
        self._old_sum = 0.0
        self._old_weight = 0.0


# --------------------------------------------------------------------------------------------
# Holdout and the publish gate
# --------------------------------------------------------------------------------------------


@dataclass
class _SensorBlocks:
    count: int  # this sensor's events counted into blocks of ``block``
    phase: int  # its blocks with (index + phase) % period == 0 are held out
    block: int  # events per block: HOLDOUT_BLOCK_EVENTS, or twice the overlap once its events overlap
    guard: int = 0  # neighbours of a held-out block kept out too (overlapping events)
    last: np.ndarray | None = None  # its previous event's readings (to see overlap)


class HoldoutSplitter:
    """Which fresh events are held out: whole blocks of a sensor's consecutive events.

    A held-out event must not share readings with a trained one, or the holdout cannot
    tell a memorizing network from one that forecasts: a producer that sends sliding
    windows (each event the previous one shifted by a reading) would put almost every
    held-out reading into some trained event too. So each sensor's events are cut into
    blocks in arrival order, one block in ``round(1 / share)`` is held out (from a random
    phase per sensor, drawn by the configured randomness), and when a sensor's consecutive
    events overlap, the ``guard`` events on either side of a held-out block that share
    readings with it are kept out of training as well (counted as held out, not scored).
    A block is ``block_events`` long (default one: the holdout spread evenly over time, as
    a random share would be), and at least twice the overlap for a sensor whose events
    overlap, so the guards cost no more than the block itself. Events that do not overlap
    cost no guard. Per-sensor state is bounded (least recently seen sensors are forgotten
    first).
    """

    MAX_SENSORS = 100_000

    def __init__(self, share: float, block_events: int, mode: str, seed: int) -> None:
        self.share = share
        self.block_events = max(1, int(block_events))
        self.period = max(2, round(1.0 / share)) if share > 0 else 0
        self.mode, self.seed = mode, seed
        self._sensors: OrderedDict[str, _SensorBlocks] = OrderedDict()

    def _held(self, sensor: _SensorBlocks, block: int) -> bool:
        return block >= 0 and (block + sensor.phase) % self.period == 0

    def _phase(self, sensor_id: str) -> int:
        key = int.from_bytes(hashlib.blake2b(sensor_id.encode(), digest_size=8).digest(), "little") >> 1
        rng = make_randomness(self.mode, self.seed, key, worker=_HOLDOUT_STREAM)  # type: ignore[arg-type]
        return int(rng.integers(self.period, 1)[0])

    def split(self, batch: EventBatch) -> tuple[np.ndarray, np.ndarray]:
        """(held-out rows, guard rows) of ``batch``, ascending; the rest trains."""
        held: list[int] = []
        guard: list[int] = []
        if self.period == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        starts, lengths = batch.starts, batch.lengths
        for i, sensor_id in enumerate(batch.sensor_ids.tolist()):
            values = batch.values[int(starts[i]) : int(starts[i]) + int(lengths[i])]
            state = self._sensors.get(sensor_id)
            if state is None:
                state = _SensorBlocks(0, self._phase(sensor_id), self.block_events)
                self._sensors[sensor_id] = state
                if len(self._sensors) > self.MAX_SENSORS:
                    self._sensors.popitem(last=False)
            else:
                self._sensors.move_to_end(sensor_id)
                state.guard = _overlapping_neighbours(state.last, values)
                if 2 * state.guard > state.block:  # blocks grow once, when the overlap is first seen
                    state.block, state.count = 2 * state.guard, 0
            block, at = divmod(state.count, state.block)
            if self._held(state, block):
                held.append(i)
            elif (self._held(state, block + 1) and at >= state.block - state.guard) or (
                self._held(state, block - 1) and at < state.guard
            ):
                guard.append(i)
            state.count += 1
            state.last = np.array(values)
        return np.array(held, dtype=np.int64), np.array(guard, dtype=np.int64)

    def redundancy_sums(self) -> np.ndarray:
        """[sum over sensors of the events each reading is in, sensors]: overlapping events
        repeat readings, and a fit on them has less evidence than its rows suggest."""
        return np.array([float(sum(v.guard + 1 for v in self._sensors.values())), float(len(self._sensors))])

    def state_dict(self) -> dict[str, Any]:
        return {
            "sensors": [str(k) for k in self._sensors],
            "counts": np.array([v.count for v in self._sensors.values()], dtype=np.int64),
            "phases": np.array([v.phase for v in self._sensors.values()], dtype=np.int64),
            "guards": np.array([v.guard for v in self._sensors.values()], dtype=np.int64),
            "blocks": np.array([v.block for v in self._sensors.values()], dtype=np.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sensors.clear()
        for name, count, phase, guard, block in zip(
            state["sensors"], np.asarray(state["counts"]).tolist(), np.asarray(state["phases"]).tolist(),
            np.asarray(state["guards"]).tolist(), np.asarray(state["blocks"]).tolist(), strict=True,
        ):  # fmt: skip
            self._sensors[str(name)] = _SensorBlocks(
                int(count), int(phase) % max(self.period, 1), int(block), int(guard)
            )


def _overlapping_neighbours(previous: np.ndarray | None, current: np.ndarray) -> int:
    """How many later events share readings with one, if each starts where ``current`` starts
    within ``previous`` (a sliding window of stride s shares readings with ceil(L / s) - 1 others)."""
    if previous is None or len(previous) == 0 or len(current) == 0:
        return 0
    candidates = np.flatnonzero((previous == current[0]).all(axis=-1))
    for start in candidates.tolist():
        shared = min(len(previous) - start, len(current))
        if start > 0 and np.array_equal(previous[start : start + shared], current[:shared]):
            return -(-len(current) // start) - 1
    return 0


class HoldoutBuffer:
    """The most recent held-out events (readings and labels), never trained on."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.values: deque[np.ndarray] = deque(maxlen=capacity)
        self.labels: deque[int] = deque(maxlen=capacity)
        self.version = 0  # bumps when the content changes

    def __len__(self) -> int:
        return len(self.values)

    def add(self, batch: EventBatch, rows: np.ndarray) -> None:
        starts = batch.starts
        for i in rows.tolist():
            start = int(starts[i])
            self.values.append(np.array(batch.values[start : start + int(batch.lengths[i])], dtype=np.float32))
            self.labels.append(int(batch.labels[i]))
        if rows.size:
            self.version += 1

    def state_dict(self) -> dict[str, Any]:
        lengths = np.array([len(v) for v in self.values], dtype=np.int64)
        channels = self.values[0].shape[1] if self.values else 0
        flat = np.concatenate(list(self.values)) if self.values else np.zeros((0, channels), np.float32)
        return {"lengths": lengths, "values": flat, "labels": np.array(list(self.labels), dtype=np.int64)}

    def load_state_dict(self, state: dict[str, Any], channels: int) -> None:
        lengths = np.asarray(state["lengths"], dtype=np.int64)
        flat = np.asarray(state["values"], dtype=np.float32).reshape(-1, channels)
        if int(lengths.sum()) != flat.shape[0]:
            raise ValueError("holdout state is inconsistent: lengths do not sum to the stored values")
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        self.values.clear()
        self.labels.clear()
        for i, label in enumerate(np.asarray(state["labels"], dtype=np.int64).tolist()):
            self.values.append(flat[bounds[i] : bounds[i + 1]].copy())
            self.labels.append(int(label))
        self.version += 1


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

    ``network`` is the candidate when it passed the gate, else None (nothing new serves).
    ``mse`` holds each model's held-out error per step in the candidate's units.
    """

    decision: GateDecision
    forecaster: Forecaster
    network: Scorable | None
    reason: str
    holdout_events: int = 0
    mse: dict[str, float | None] = field(default_factory=dict)
    new_reference: bool = False
    linear: dict[str, Any] | None = None

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
        return ServedModel(self.published.model, self.forecaster)


# --------------------------------------------------------------------------------------------
# The monitor the service runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QualityConfig:
    """The quality settings (a view of config.Settings, so tests can build one directly)."""

    max_events_per_s: float = 100.0
    half_life_events: float = 2000.0
    drift_detector: str = "adwin"
    drift_adwin_delta: float = 0.002
    drift_ph_threshold: float = 100.0
    holdout_share: float = 0.0
    holdout_capacity: int = 256
    holdout_min_events: int = 32
    holdout_block_events: int = 1
    publish_gate_tolerance: float = 0.05
    linear_max_order: int = 24
    auto_rollback: bool = True
    rollback_min_events: int = 100
    rollback_margin: float = 0.1
    token_budget: int = 8192
    shuffle: str = "seeded"
    seed: int = 0

    @classmethod
    def from_settings(cls, settings: Any) -> QualityConfig:
        return cls(
            max_events_per_s=settings.quality_max_events_per_s,
            half_life_events=settings.quality_half_life_events,
            drift_detector=settings.drift_detector,
            drift_adwin_delta=settings.drift_adwin_delta,
            drift_ph_threshold=settings.drift_ph_threshold,
            holdout_share=settings.holdout_share,
            holdout_capacity=settings.holdout_capacity,
            holdout_min_events=settings.holdout_min_events,
            holdout_block_events=settings.holdout_block_events,
            publish_gate_tolerance=settings.publish_gate_tolerance,
            linear_max_order=settings.linear_max_order,
            auto_rollback=settings.auto_rollback,
            rollback_min_events=settings.rollback_min_events,
            rollback_margin=settings.rollback_margin,
            token_budget=settings.token_budget,
            shuffle=settings.shuffle,
            seed=settings.seed,
        )


class QualityMonitor:
    """Scores fresh events with the serving model, watches for drift, keeps the holdout.

    :meth:`observe` runs on the ingest thread for every poll batch of valid events before
    they reach the window and returns the events the window should get (all but the
    held-out ones). ``serving`` returns the model that serves now; ``on_drift`` and
    ``on_rollback(version, reason)`` are the trainer's reactions.
    """

    def __init__(
        self,
        config: QualityConfig,
        metrics: Metrics,
        serving: Callable[[], Scorable | None],
        *,
        on_drift: Callable[[Drift], None] | None = None,
        on_rollback: Callable[[int, str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._serving = serving
        self._on_drift = on_drift
        self._on_rollback = on_rollback
        self._clock = clock
        self._lock = threading.Lock()
        self._decay_per_event = 0.5 ** (1.0 / config.half_life_events)
        self.recent = Averages()
        self.totals = Averages()
        self.scored = 0  # events scored (with at least one step)
        self.offered = 0  # valid events seen
        self.drifts = 0
        self.drift_log: deque[Drift] = deque(maxlen=_DRIFTS_SHOWN)
        self.detector = (
            None
            if config.drift_detector == "off"
            else DriftMonitor(
                config.drift_detector, config.drift_adwin_delta, config.drift_ph_threshold, config.half_life_events
            )
        )
        self.holdout = HoldoutBuffer(config.holdout_capacity)
        self.splitter = HoldoutSplitter(config.holdout_share, config.holdout_block_events, config.shuffle, config.seed)
        self.held_out_total = 0
        self.guarded_total = 0  # kept out as neighbours of held-out blocks (overlapping events)
        self.versions: OrderedDict[int, VersionRecord] = OrderedDict()
        self.serving_order: list[int] = []  # versions in the order they served (bounded)
        self.rollbacks: list[dict[str, Any]] = []
        self._draws = 0  # poll batches drawn from (seeded mode: the stream coordinate)
        self._budget = config.max_events_per_s  # token bucket, one second of burst
        self._budget_at: float | None = None
        self.score_seconds = 0.0
        # Scaled out: adds a float64 vector over the ranks, the same result on every rank
        # (the service sets it). The gate then judges the union of the ranks' holdouts.
        self.combine: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def gate_enabled(self) -> bool:
        return self.config.holdout_share > 0

    # ------------------------------------------------------------------ the ingest hook
    def observe(self, batch: EventBatch) -> EventBatch:
        """Score a sample of ``batch`` with the serving model; split off the holdout share."""
        n = len(batch)
        if n == 0:
            return batch
        self._draws += 1
        take = self._take(n)
        if take.size:
            self._score(batch, take)
        self.offered += n
        if not self.gate_enabled:
            return batch
        held, guard = self.splitter.split(batch)
        if held.size == 0 and guard.size == 0:
            return batch
        with self._lock:
            self.holdout.add(batch, held)
            self.held_out_total += int(held.size)
            self.guarded_total += int(guard.size)
        trained = np.ones(n, dtype=bool)
        trained[held] = False
        trained[guard] = False
        return _rows(batch, np.flatnonzero(trained))

    def _take(self, n: int) -> np.ndarray:
        """Which rows to score: all while the per-second budget lasts, else a random sample."""
        rate = self.config.max_events_per_s
        if rate <= 0 or self._serving() is None:
            return np.zeros(0, dtype=np.int64)
        now = self._clock()
        if self._budget_at is not None:
            self._budget = min(rate, self._budget + rate * (now - self._budget_at))
        self._budget_at = now
        k = min(n, int(self._budget))
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        self._budget -= k
        if k == n:
            return np.arange(n)
        rng = make_randomness(self.config.shuffle, self.config.seed, self._draws, worker=_SCORING_STREAM)  # type: ignore[arg-type]
        return np.sort(rng.permutation(n)[:k])

    def _score(self, batch: EventBatch, rows: np.ndarray) -> None:
        serving = self._serving()
        if serving is None:
            return
        started = time.perf_counter()
        starts = batch.starts
        values = [batch.values[int(starts[i]) : int(starts[i]) + int(batch.lengths[i])] for i in rows.tolist()]
        scores = score_events(serving.served, serving.norm, values, batch.labels[rows], self.config.token_budget)
        self.score_seconds += time.perf_counter() - started
        self.record(scores, serving.version)

    def record(self, scores: EventScores, version: int) -> None:
        """Fold scored events (in arrival order) into the averages, detectors and rollback rule."""
        keep = scores.steps > 0
        if not keep.any():
            return
        scores = EventScores(*(getattr(scores, f)[keep] for f in EventScores.__dataclass_fields__))
        k = int(scores.steps.size)
        # Event i of k is followed by k - 1 - i newer ones: its fading weight is decay ** that.
        weights = self._decay_per_event ** np.arange(k - 1, -1, -1, dtype=np.float64)
        drifts: list[Drift] = []
        with self._lock:
            self.recent.scale(self._decay_per_event**k)
            self.recent.add(scores, weights)
            self.totals.add(scores)
            record = self._version_record(version)
            record.events += k
            record.totals.add(scores)
            if self.detector is not None:
                for error in (scores.sse / scores.steps).tolist():
                    self.scored += 1
                    if self.detector.update(error):
                        drifts.append(self._drift_locked(version))
            else:
                self.scored += k
            rollback = self._rollback_due_locked(version)
        m = self.metrics
        m.prequential_events.inc(k)
        if self.recent.mse is not None:
            m.prequential_mse.set(self.recent.mse)
            m.prequential_naive_mse.set(self.recent.naive_mse or 0.0)
        for drift in drifts:
            m.drift_detected.inc()
            log.warning(
                "drift detected by %s after %d scored events (serving version %s): error per step %.4g before, %.4g recently",
                drift.detector, drift.at_event, drift.version, drift.error_before or math.nan, drift.error_recent or math.nan,
            )  # fmt: skip
            if self._on_drift is not None:
                self._on_drift(drift)
        if rollback is not None and self._on_rollback is not None:
            target, reason = rollback
            if self._on_rollback(target, reason):
                with self._lock:
                    self.versions[version].rolled_back = True

    def _version_record(self, version: int) -> VersionRecord:
        record = self.versions.get(version)
        if record is None:
            record = self.versions[version] = VersionRecord(version)
            while len(self.versions) > _VERSIONS_TRACKED:
                self.versions.popitem(last=False)
        if not self.serving_order or self.serving_order[-1] != version:
            self.serving_order.append(version)
            del self.serving_order[:-_VERSIONS_TRACKED]
        return record

    def _drift_locked(self, version: int) -> Drift:
        assert self.detector is not None
        drift = Drift(
            at_event=self.scored,
            at=time.time(),
            detector=self.detector.kind,
            version=version,
            error_before=self.detector.error_before,
            error_recent=self.detector.error_recent,
        )
        self.detector.restart_levels()
        self.drifts += 1
        self.drift_log.append(drift)
        return drift

    def _rollback_due_locked(self, version: int) -> tuple[int, str] | None:
        """(predecessor, reason) when the serving version's skill fell below its predecessor's."""
        cfg = self.config
        if not cfg.auto_rollback or len(self.serving_order) < 2:
            return None
        current = self.versions.get(version)
        previous = self.versions.get(self.serving_order[-2])
        if current is None or previous is None or current.rolled_back:
            return None
        if current.events < cfg.rollback_min_events or previous.events < cfg.rollback_min_events:
            return None
        now_skill, before_skill = current.totals.skill, previous.totals.skill
        if now_skill is None or before_skill is None or not now_skill < before_skill - cfg.rollback_margin:
            return None
        return previous.version, (
            f"skill {now_skill:.3f} of version {version} is below {before_skill:.3f} of version "
            f"{previous.version} by more than {cfg.rollback_margin:g} over {current.events} and {previous.events} events"
        )

    def note_rollback(self, version: int, trigger: str, reason: str, from_version: int | None) -> None:
        with self._lock:
            self.rollbacks.append(
                {
                    "to_version": version,
                    "from_version": from_version,
                    "trigger": trigger,
                    "reason": reason,
                    "at": time.time(),
                }
            )
            del self.rollbacks[:-_DRIFTS_SHOWN]

    # ------------------------------------------------------------------ the gate and the forecaster
    def select(
        self,
        candidate: Scorable,
        reference: Scorable | None,
        training_values: Callable[[], Sequence[np.ndarray]],
    ) -> Selection:
        """The network gate, then the forecaster that serves: the least held-out error of the
        last value, the linear forecaster, the network and the best blend of the last two.

        ``reference`` is the network the candidate must not fall behind: the best one that
        passed the gate so far (or the serving one), re-scored on today's holdout, so a run of
        candidates each a little worse than the last cannot ratchet the quality down. With a
        held-back candidate nothing new serves. ``training_values`` gives the readings the
        linear forecaster is fitted on (a sample of the window). Scaled out, every sum goes
        through :attr:`combine`, in the same order on every rank, so all ranks choose alike.
        """
        cfg = self.config
        if not self.gate_enabled:
            reason = "gate off (HOLDOUT_SHARE=0)"
            return Selection(GateDecision(True, reason, 0), NETWORK, candidate, reason)
        with self._lock:
            values = list(self.holdout.values)
        units = candidate.norm  # every model is scored in the same units
        n = int(round(self._combined(np.array([float(len(values))]))[0]))
        if n < cfg.holdout_min_events:
            # The network cannot be judged yet; the linear forecaster can, by generalized
            # cross-validation on the window, against the last value (its all-zero choice).
            linear = self._fit_linear(candidate, [], training_values)
            forecaster, kind = LAST_VALUE, "the last value"
            if linear is not None and not linear.is_last_value:
                forecaster, kind = Forecaster("linear", linear.coefficients), "the linear forecaster (chosen by GCV)"
            reason = f"holdout has {n} of the {cfg.holdout_min_events} events the gate needs: {kind} serves"
            return Selection(
                GateDecision(True, reason, n), forecaster, candidate, reason, n, new_reference=reference is None,
                linear=None if linear is None else linear.report(),
            )  # fmt: skip
        linear = self._fit_linear(candidate, values, training_values)
        linear_forecaster = None if linear is None else Forecaster("linear", linear.coefficients)
        # One scoring pass: the networks against each other, the baselines beside them.
        models: list[Scorable | None] = [
            candidate,
            None if reference is None else _Served(reference, NETWORK),
            _Served(candidate, LAST_VALUE),
            None if linear_forecaster is None else _Served(candidate, linear_forecaster),
        ]
        steps, gram = self._error_gram(values, models, units)
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
        elif reference_mse is None or candidate_mse <= reference_mse * (1.0 + tolerance):
            decision = GateDecision(True, "not worse than the reference network", n, candidate_mse, reference_mse)
        else:
            reason = f"holdout MSE {candidate_mse:.4g} > {1.0 + tolerance:g} x reference {reference_mse:.4g}"
            decision = GateDecision(False, reason, n, candidate_mse, reference_mse)
        if not decision.publish:
            return Selection(decision, NETWORK, None, decision.reason, n, mse)
        new_reference = reference_mse is None or candidate_mse <= reference_mse
        options: list[tuple[str, float, Forecaster]] = [("last_value", sse[2] / steps, LAST_VALUE)]
        if linear is not None and linear_forecaster is not None:
            options.append(("linear", sse[3] / steps, linear_forecaster))
        options.append(("network", candidate_mse, NETWORK))
        if linear is not None:
            weight, blend_sse = best_blend(gram[0, 0], gram[3, 3], gram[0, 3])
            mse["blend"] = blend_sse / steps
            if 0.0 < weight < 1.0 and blend_sse < (1.0 - _BLEND_MARGIN) * min(gram[0, 0], gram[3, 3]):
                options.append(("blend", blend_sse / steps, Forecaster("blend", linear.coefficients, weight)))
        finite = [option for option in options if math.isfinite(option[1])]
        kind, _, forecaster = min(finite, key=lambda option: option[1])  # ties: the simpler (listed first)
        shown = ", ".join(f"{k} {v:.4g}" for k, v, _ in options)
        return Selection(
            decision, forecaster, candidate, f"{kind} forecasts the holdout best ({shown})", n, mse,
            new_reference=new_reference, linear=None if linear is None else linear.report(),
        )  # fmt: skip

    def _fit_linear(
        self, candidate: Scorable, holdout: list[np.ndarray], training_values: Callable[[], Sequence[np.ndarray]]
    ) -> LinearChoice | None:
        """The linear forecaster in the candidate's units: fitted on the window, order and penalty by the holdout."""
        max_order = max(1, min(self.config.linear_max_order, candidate.model.max_len))
        channels, units = candidate.model.channels, candidate.norm
        sums = []
        mean, std = units.mean.numpy(), units.std.numpy()
        for values in (training_values(), holdout):
            local = LagSums.of(values, max_order, channels, mean, std)
            sums.append(LagSums.from_array(self._combined(local.as_array()), channels, max_order))
        readings, sensors = self._combined(self.splitter.redundancy_sums())
        return choose_linear(sums[0], sums[1], max_order, redundancy=readings / sensors if sensors else 1.0)

    def _error_gram(
        self, values: list[np.ndarray], models: list[Scorable | None], units: RunningNorm
    ) -> tuple[float, np.ndarray]:
        """(steps, G) over the holdout of every rank: ``G[i, j]`` sums, over one-step targets,
        the channel mean of model i's error times model j's (so ``G[i, i]`` is model i's summed
        squared error, and any blend's follows from G). A model that is None is absent on every rank."""
        k = len(models)
        local = np.zeros(1 + k * k)
        budget = self.config.token_budget
        present = [i for i, model in enumerate(models) if model is not None]
        if values and present:
            unit_std = units.std.float()
            lengths = np.array([len(v) for v in values], dtype=np.int64)
            gram = np.zeros((k, k))
            steps = 0.0
            with torch.inference_mode():
                for group in plan_predict_batches(lengths, budget):
                    batch = collate([values[i] for i in group])
                    mask, data = batch.mask, batch.values
                    valid = (mask[:, :-1] & mask[:, 1:]).double()[..., None]
                    errors = torch.zeros(k, *data[:, 1:].shape, dtype=torch.float64)
                    for i in present:
                        model = models[i]
                        assert model is not None
                        module = model.served
                        was_training = module.training
                        module.eval()
                        try:
                            x_norm = model.norm.normalize(data).float() * mask[..., None]
                            forecast = model.norm.denormalize(
                                forward_on_model_device(module, x_norm, mask).forecast.double()
                            )
                        finally:
                            module.train(was_training)
                        errors[i] = ((forecast.float()[:, :-1] - data[:, 1:]) / unit_std).double() * valid
                    flat = errors.reshape(k, -1)
                    gram += (flat @ flat.T).numpy() / data.shape[-1]
                    steps += float(valid.sum())
            local[0] = steps
            local[1:] = gram.ravel()
        total = self._combined(local)
        return float(total[0]), total[1:].reshape(k, k)

    def _combined(self, local: np.ndarray) -> np.ndarray:
        return local if self.combine is None else np.asarray(self.combine(local), dtype=np.float64)

    # ------------------------------------------------------------------ reporting and state
    def report(self, serving_version: int | None = None) -> dict[str, Any] | None:
        """``/v1/model`` ``quality``: None until the first event was scored."""
        with self._lock:
            if self.scored == 0:
                return None
            recent = self.recent.report()
            current = self.versions.get(serving_version) if serving_version is not None else None
            return {
                "n": self.scored,
                "prequential_mse": recent["prequential_mse"],
                "naive_mse": recent["naive_mse"],
                "skill": recent["skill"],
                "drifts": self.drifts,
                "log_loss": recent["log_loss"],
                "accuracy": recent["accuracy"],
                "horizon": {"kind": "fading", "half_life_events": self.config.half_life_events},
                "units": "squared error per step and channel, in the serving model's normalized units",
                "total": self.totals.report(),
                "scored_share": self.scored_share,
                "score_seconds": self.score_seconds,
                "drift_detector": self.config.drift_detector,
                "recent_drifts": [asdict(d) for d in self.drift_log],
                "serving_version": None
                if current is None
                else {"version": current.version, "n": current.events, **current.totals.report()},
                "holdout": {
                    "share": self.config.holdout_share,
                    "events": len(self.holdout),
                    "held_out_total": self.held_out_total,
                    "guarded_total": self.guarded_total,
                    "block_events": self.config.holdout_block_events,
                },
                "rollbacks": list(self.rollbacks),
            }

    @property
    def scored_share(self) -> float | None:
        return self.scored / self.offered if self.offered else None

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "recent": asdict(self.recent),
                "totals": asdict(self.totals),
                "scored": self.scored,
                "offered": self.offered,
                "drifts": self.drifts,
                "draws": self._draws,
                "held_out_total": self.held_out_total,
                "score_seconds": self.score_seconds,
                "holdout": self.holdout.state_dict(),
                "splitter": self.splitter.state_dict(),
                "guarded_total": self.guarded_total,
                "versions": [
                    {"version": r.version, "events": r.events, "rolled_back": r.rolled_back, "totals": asdict(r.totals)}
                    for r in self.versions.values()
                ],
                "serving_order": list(self.serving_order),
            }

    def load_state_dict(self, state: dict[str, Any], channels: int) -> None:
        with self._lock:
            self.recent = Averages(**state["recent"])
            self.totals = Averages(**state["totals"])
            self.scored = int(state["scored"])
            self.offered = int(state["offered"])
            self.drifts = int(state["drifts"])
            self._draws = int(state["draws"])
            self.held_out_total = int(state["held_out_total"])
            self.score_seconds = float(state.get("score_seconds", 0.0))
            self.holdout.load_state_dict(state["holdout"], channels)
            if "splitter" in state:
                self.splitter.load_state_dict(state["splitter"])
            self.guarded_total = int(state.get("guarded_total", 0))
            self.versions = OrderedDict(
                (
                    int(r["version"]),
                    VersionRecord(int(r["version"]), int(r["events"]), Averages(**r["totals"]), bool(r["rolled_back"])),
                )
                for r in state["versions"]
            )
            self.serving_order = [int(v) for v in state["serving_order"]]


def _rows(batch: EventBatch, rows: np.ndarray) -> EventBatch:
    """The events ``rows`` of ``batch`` as a batch of their own (readings copied once)."""
    lengths = batch.lengths[rows]
    index = token_positions(batch.starts[rows], lengths)
    return EventBatch(
        sensor_ids=batch.sensor_ids[rows],
        ts=batch.ts[rows],
        labels=batch.labels[rows],
        lengths=lengths,
        values=batch.values[index],
        partitions=batch.partitions[rows],
        offsets=batch.offsets[rows],
    )
