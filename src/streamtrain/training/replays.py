"""How often the trainer may replay each event (``MAX_REPLAYS_PER_EVENT``)."""

from __future__ import annotations

from typing import Any


class ReplayBudget:
    """How many times, on average, the trainer may train each event: a trainer faster than
    its stream idles instead of memorizing its window.

    Every accepted event adds ``per_event_limit`` item-trainings to an allowance that each
    trained item spends; the allowance never exceeds ``per_event_limit`` passes over the
    window as it is now, so a fast phase leaves no credit for replaying a slow one. 0 turns
    the budget off.
    """

    def __init__(self, per_event_limit: float) -> None:
        self.limit = float(per_event_limit)
        self.allowance = 0.0
        self.accepted_seen = 0  # window.accepted_total already credited
        self.trained_items = 0
        self.accepted = 0

    def allows(self, items: int, accepted_total: int, window_size: int) -> bool:
        new = max(0, accepted_total - self.accepted_seen)
        self.accepted_seen = max(self.accepted_seen, accepted_total)
        self.accepted += new
        if self.limit <= 0:
            return True
        self.allowance = min(self.allowance + self.limit * new, self.limit * max(window_size, 1))
        return self.allowance >= min(items, self.limit * max(window_size, 1))

    def spend(self, items: int) -> None:
        self.trained_items += items
        if self.limit > 0:
            self.allowance -= items

    @property
    def per_event(self) -> float:
        """Mean item-trainings per accepted event so far."""
        return self.trained_items / self.accepted if self.accepted else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "allowance": self.allowance, "accepted_seen": self.accepted_seen,
            "trained_items": self.trained_items, "accepted": self.accepted,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.allowance = float(state["allowance"])
        self.accepted_seen = int(state["accepted_seen"])
        self.trained_items = int(state["trained_items"])
        self.accepted = int(state["accepted"])
