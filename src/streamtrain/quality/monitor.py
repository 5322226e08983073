"""The quality monitor: the coordinator of scoring, drift, the holdout and the rollback rule.

:class:`QualityMonitor` runs on the ingest thread for every poll batch of valid events,
before they reach the window: it scores a sample with the serving model (scoring costs a
forward pass, so at most ``QUALITY_MAX_EVENTS_PER_S`` events a second, drawn at random
from each poll batch; the share scored is reported; a sampled event waits up to
``QUALITY_SCORE_DELAY_S`` to be scored in one call with later ones, by the model that
served on its arrival), folds the scores into the averages
and the drift detector, and splits off the holdout. The trainer asks it to
:meth:`QualityMonitor.select` what a publication serves. Its lock guards the averages,
the holdout buffer and the version records, which the trainer and the HTTP thread read;
the callbacks into the trainer run outside it.

Rollback: the serving version is rolled back to its predecessor automatically when, over
at least ``ROLLBACK_MIN_EVENTS`` scored events each, its skill is below the predecessor's
by more than ``ROLLBACK_MARGIN``; each version is rolled back at most once.

:meth:`QualityMonitor.state_dict` is checkpointed: its keys are part of the checkpoint
format.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from streamtrain.data.randomness import make_randomness
from streamtrain.events import EventBatch
from streamtrain.metrics import Metrics
from streamtrain.model.forecasters import NETWORK
from streamtrain.quality.averages import Averages, VersionRecord
from streamtrain.quality.config import SCORING_STREAM, QualityConfig
from streamtrain.quality.drift import Drift, DriftMonitor
from streamtrain.quality.holdout import HoldoutBuffer, HoldoutSplitter
from streamtrain.quality.scoring import EventScores, Scorable, score_events
from streamtrain.quality.selection import ForecasterSelector, GateDecision, Selection, TrainingSample

log = logging.getLogger(__name__)

#: Waiting sampled events that are scored at once, without waiting out ``QUALITY_SCORE_DELAY_S``:
#: from about this many in a call, its cost per event stops falling.
SCORE_BATCH_EVENTS = 64
_DRIFTS_SHOWN = 10  # detections and rollbacks listed in the report
_VERSIONS_TRACKED = 32


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
        # the guards of held-out blocks (never trained on): while the holdout is too small to
        # judge anything, the linear forecaster is fitted on them and on the held-out events too
        self.guards = HoldoutBuffer(config.holdout_capacity)
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
        # sampled events waiting to be scored together: (the model that served on arrival, values, labels)
        self._unscored: list[tuple[Scorable, list[np.ndarray], np.ndarray]] = []
        self._unscored_events = 0
        self._scored_at = -math.inf
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
            self._queue(batch, take)
        self.score_if_due()
        self.offered += n
        if not self.gate_enabled:
            return batch
        held, guard = self.splitter.split(batch)
        if held.size == 0 and guard.size == 0:
            return batch
        with self._lock:
            self.holdout.add(batch, held)
            self.guards.add(batch, guard)
            self.held_out_total += int(held.size)
            self.guarded_total += int(guard.size)
        trained = np.ones(n, dtype=bool)
        trained[held] = False
        trained[guard] = False
        return batch.take(np.flatnonzero(trained))

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
        rng = make_randomness(self.config.shuffle, self.config.seed, self._draws, worker=SCORING_STREAM)
        return np.sort(rng.permutation(n)[:k])

    def _queue(self, batch: EventBatch, rows: np.ndarray) -> None:
        """Keep ``rows`` of ``batch`` for scoring by the model that serves now (test, then train:
        it is frozen, so scoring them later gives the scores they would get now)."""
        serving = self._serving()
        if serving is None:
            return
        starts = batch.starts
        values = [batch.values[int(starts[i]) : int(starts[i]) + int(batch.lengths[i])] for i in rows.tolist()]
        self._unscored.append((serving, values, batch.labels[rows]))
        self._unscored_events += len(values)

    def score_if_due(self) -> None:
        """Score what waits once it fills a call or ``QUALITY_SCORE_DELAY_S`` has passed since the
        last scoring: below a few dozen events a call's cost is mostly its own (docs/quality.md,
        "Cost"). Ingest calls it with each poll batch and after each empty poll."""
        if not self._unscored:
            return
        full = self._unscored_events >= SCORE_BATCH_EVENTS
        if full or self._clock() - self._scored_at >= self.config.score_delay_s:
            self.score_waiting()

    def score_waiting(self) -> None:
        """Score every waiting event now (in arrival order, each by the model that served on its arrival)."""
        waiting, self._unscored, self._unscored_events = self._unscored, [], 0
        self._scored_at = self._clock()
        while waiting:
            serving = waiting[0][0]
            count = next((i for i, (s, _, _) in enumerate(waiting) if s is not serving), len(waiting))
            group, waiting = waiting[:count], waiting[count:]
            values = [v for _, vs, _ in group for v in vs]
            labels = np.concatenate([labels for _, _, labels in group])
            started = time.perf_counter()
            scores = score_events(serving.served, serving.norm, values, labels, self.config.token_budget)
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
                "drift detected by %s after %d scored events (serving version %s): "
                "error per step %.4g before, %.4g recently",
                drift.detector, drift.at_event, drift.version,
                drift.error_before or math.nan, drift.error_recent or math.nan,
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
            f"{previous.version} by more than {cfg.rollback_margin:g} "
            f"over {current.events} and {previous.events} events"
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
        training_values: Callable[[], TrainingSample],
    ) -> Selection:
        """The network gate, then the forecaster that serves (:meth:`ForecasterSelector.select`).

        Scaled out, the holdout judged is the union of the ranks' holdouts: every sum goes
        through :attr:`combine`, in the same order on every rank, so all ranks choose alike.
        """
        if not self.gate_enabled:
            reason = "gate off (HOLDOUT_SHARE=0)"
            return Selection(GateDecision(True, reason, 0), NETWORK, candidate, reason)
        with self._lock:
            values, sensors = list(self.holdout.values), list(self.holdout.sensors)
            guards = list(self.guards.values)
        selector = ForecasterSelector(self.config, self._combined, self.splitter.redundancy_sums)
        return selector.select(candidate, reference, training_values, values, sensors, guards)

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
                "guards": self.guards.state_dict(),
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
            if "guards" in state:  # saved before the guards were kept: none
                self.guards.load_state_dict(state["guards"], channels)
            if "splitter" in state:
                self.splitter.load_state_dict(state["splitter"], channels)
            self.guarded_total = int(state.get("guarded_total", 0))
            self.versions = OrderedDict(
                (
                    int(r["version"]),
                    VersionRecord(int(r["version"]), int(r["events"]), Averages(**r["totals"]), bool(r["rolled_back"])),
                )
                for r in state["versions"]
            )
            self.serving_order = [int(v) for v in state["serving_order"]]
