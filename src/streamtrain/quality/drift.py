"""Drift detection on the stream of per-event model errors.

River's detectors (ADWIN by default, Page-Hinkley as an option) watch the error per step
of each scored event, in arrival order. A detection is counted, logged with the error
level before it and the recent level, and can trigger a reaction in the trainer. The
levels are the detector's neighbours, not its internals, so every detector reports the
same "before" and "after". River's detectors keep no state a checkpoint could hold as
plain data: after a restart they start over.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

_RECENT_EVENTS = 64  # the "after" level of a drift: the mean error of the last events


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
    """

    def __init__(self, kind: str, adwin_delta: float, ph_threshold: float, half_life: float) -> None:
        """The settings' ``DRIFT_*`` and ``QUALITY_HALF_LIFE_EVENTS`` (their defaults live there, once)."""
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
