"""Sums of scored events, for one horizon: what the prequential averages and skill come from.

``prequential_mse`` and ``naive_mse`` are fading averages over scored steps with a
half-life of ``QUALITY_HALF_LIFE_EVENTS`` scored events (an event's weight halves every
that many later events); totals since start are the same sums with every weight 1.
``skill = 1 - prequential_mse / naive_mse``: above 0 the model beats the last value.
Sums, not means, are kept, so fading is one scale of every sum; a ratio with nothing under
it is None, never 0 or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamtrain.quality.scoring import EventScores


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
    """What one model version scored while it served (the rollback rule compares these)."""

    version: int
    events: int = 0
    totals: Averages = field(default_factory=Averages)
    rolled_back: bool = False
