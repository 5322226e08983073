"""The ingest watchdog: notices a consumer that has silently stopped, so ingest can start over.

It judges what the ingest thread sees of its consumer (a :class:`ConsumerProbe`, taken
after every poll) and knows nothing of Kafka itself, so any way of owning partitions
(group subscription today, fixed assignment later) plugs in by filling the probe. Three
conditions count as a stall once they last ``timeout_s``:

``unassigned``
    nothing to fetch while the group membership is not stable (a rebalance that never
    completes), or partitions assigned but none fetchable. A stable member with no
    partitions is idle, not stalled: the group has more members than partitions.
``no_fetch_progress``
    a partition has records waiting (its log end lies beyond the next offset to read),
    yet nothing was read from it.
``no_heartbeat``
    a stable group member whose heartbeats have not got through (the broker will expire
    it, or already has); this one waits at least three heartbeat intervals.

While no broker connection is up, nothing is judged: an outage is reported as such, and
a new consumer would not help. The ingest thread recreates its consumer for an overdue
stall; ``/readyz`` reports a stall from half the timeout on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

#: Stable group-membership state, as ``ConsumerProbe.group_state`` names it.
STABLE = "stable"


@dataclass(frozen=True)
class ConsumerProbe:
    """What the ingest thread sees of its consumer at one moment (no request needed, except ``log_ends``)."""

    connected: bool  # a broker connection is up
    group_state: str | None  # "stable", "rebalancing", "unjoined"; None when partitions are assigned by hand
    assigned: frozenset[int]
    fetchable: frozenset[int]  # assigned, with a position, not paused or being revoked
    heartbeat_age_s: float | None  # since the last heartbeat that got through; None outside a group
    positions: Mapping[int, int] = field(default_factory=dict)  # next offset to read, per partition
    log_ends: Mapping[int, int] | None = None  # end offsets, when this probe asked for them


@dataclass(frozen=True)
class Stall:
    reason: str  # "unassigned", "no_fetch_progress" or "no_heartbeat"
    detail: str  # one clause that names the cause, for logs and /readyz
    since: float  # watchdog clock time the condition began

    def age(self, now: float) -> float:
        return max(0.0, now - self.since)


class IngestWatchdog:
    """Tracks how long each stall condition has held; see the module docstring."""

    def __init__(
        self, timeout_s: float, heartbeat_interval_s: float = 3.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.heartbeat_timeout_s = max(timeout_s, 3 * heartbeat_interval_s)
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """Forget every condition (a new consumer starts with a clean slate)."""
        self._unassigned_since: float | None = None
        self._positions: dict[int, int] = {}
        self._behind_since: dict[int, float] = {}  # partition -> since when records wait, unread
        self._ends: dict[int, int] = {}
        self._last_observed: float | None = None
        self.current: Stall | None = None

    def observe(self, probe: ConsumerProbe) -> Stall | None:
        """Judge one probe; returns the longest-standing stall condition now holding (any age)."""
        now = self._clock()
        if not probe.connected:
            self.reset()
            return None
        self._discount_absence(now)
        found: list[Stall] = []
        # unassigned: nothing to fetch, and not because the group gave this member nothing
        idle_member = not probe.assigned and probe.group_state in (None, STABLE)
        if not probe.fetchable and not idle_member:
            if self._unassigned_since is None:
                self._unassigned_since = now
            if probe.assigned:
                what = f"partitions {sorted(probe.assigned)} assigned but none fetchable"
            else:
                what = "no partition assigned"
            found.append(Stall("unassigned", f"{what} (group membership: {probe.group_state})", self._unassigned_since))
        else:
            self._unassigned_since = None
        # no_heartbeat: a stable member whose heartbeats do not get through
        age = probe.heartbeat_age_s
        if probe.group_state == STABLE and age is not None and age > self.heartbeat_timeout_s / 2:
            found.append(Stall("no_heartbeat", f"no group heartbeat got through for {age:.0f} s", now - age))
        # no_fetch_progress: records wait in a fetchable partition, and its position does not move
        if probe.log_ends is not None:
            self._ends.update(probe.log_ends)
        for partition in list(self._behind_since):
            if partition not in probe.fetchable:
                del self._behind_since[partition]
        for partition in probe.fetchable:
            position = probe.positions.get(partition)
            if position is None:
                continue
            if self._positions.get(partition) != position:  # it read something (or was sought)
                self._positions[partition] = position
                self._behind_since.pop(partition, None)
            end = self._ends.get(partition)
            if end is None or end <= position:
                self._behind_since.pop(partition, None)
            else:  # records wait (log ends only grow): the clock runs from its last read
                self._behind_since.setdefault(partition, now)
        if self._behind_since:
            partition, since = min(self._behind_since.items(), key=lambda item: item[1])
            position, end = self._positions[partition], self._ends[partition]
            found.append(
                Stall(
                    "no_fetch_progress",
                    f"partition {partition} has {end - position} records waiting "
                    f"(next offset {position}, log end {end}) "
                    f"but none was read for {now - since:.0f} s",
                    since,
                )
            )
        self.current = min(found, key=lambda s: s.since) if found else None
        return self.current

    def _discount_absence(self, now: float) -> None:
        """Time the ingest thread did not probe (it was busy applying a batch, waiting for a
        checkpoint's lock) is not the consumer's fault: its clocks move on by that much."""
        last, self._last_observed = self._last_observed, now
        gap = 0.0 if last is None else now - last
        if gap <= self.timeout_s / 3:
            return
        if self._unassigned_since is not None:
            self._unassigned_since += gap
        for partition in self._behind_since:
            self._behind_since[partition] += gap

    def overdue(self, stall: Stall | None) -> bool:
        """True when ``stall`` has held long enough to recreate the consumer."""
        if stall is None:
            return False
        limit = self.heartbeat_timeout_s if stall.reason == "no_heartbeat" else self.timeout_s
        return stall.age(self._clock()) >= limit

    def reportable(self, stall: Stall | None) -> bool:
        """True when ``stall`` has held long enough to report (half the timeout)."""
        return stall is not None and stall.age(self._clock()) >= self.timeout_s / 2
