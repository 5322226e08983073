"""The public clock of DP mode: when each step is due and which step an arrival belongs to.

Invariant: step numbers and due times are functions of wall-clock time and the count of
steps already run, never of the data, so the clock itself releases nothing private.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class DPClock:
    """The public clock: step s (1-based) is due at ``origin + s / step_rate_hz``.

    Steps are numbered by time alone, so when a step runs and which arrivals belong to it
    never depends on the data. The origin is the first time the clock is read; after a
    restart it is re-anchored so that the step count continues (from the last step the
    admission record shows, never from an earlier one) without a burst of catch-up steps
    for the time the service was down.
    """

    def __init__(self, step_rate_hz: float) -> None:
        if not (math.isfinite(step_rate_hz) and step_rate_hz > 0):
            raise ValueError(f"DPClock: step_rate_hz must be finite and > 0, got {step_rate_hz}")
        self.step_rate_hz = float(step_rate_hz)
        self.origin: float | None = None
        self.steps_done = 0

    def _anchor(self, now: float) -> float:
        if self.origin is None:
            self.origin = now - self.steps_done / self.step_rate_hz
        return self.origin

    def clock_step(self, now: float) -> int:
        """The number of steps whose due time is at or before ``now``.

        A nanosecond of slack keeps ``origin + s / rate`` from landing just below step s
        through float rounding.
        """
        return int(math.floor((now - self._anchor(now)) * self.step_rate_hz + 1e-9))

    def due_steps(self, now: float) -> int:
        """Steps due but not yet run (> 1 when the trainer is behind the clock)."""
        return max(0, self.clock_step(now) - self.steps_done)

    def next_due_at(self, now: float) -> float:
        return self._anchor(now) + (self.steps_done + 1) / self.step_rate_hz

    def due_at(self, step: int, now: float) -> float:
        """When ``step`` is (or was) due: a public time."""
        return self._anchor(now) + step / self.step_rate_hz

    def arrival_step(self, now: float) -> int:
        """The step an arrival at ``now`` belongs to: the first step due after it."""
        return max(self.steps_done + 1, self.clock_step(now) + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"step_rate_hz": self.step_rate_hz, "steps_done": self.steps_done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])
        self.origin = None  # re-anchored at the next reading
