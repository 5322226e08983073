"""The DP window: admission per public-clock step, eligibility for exactly K steps.

The recency reservoir cannot be used under DP: there, an event x displaces some y, and
after x leaves y is still gone, so x's presence echoes through the window for as long
as it stays full. Here every event's influence ends:

* arrivals are assigned to a step of the public clock by arrival time; when more than R
  arrive for one step, a uniformly random R of them (OS CSPRNG) are admitted. Whether an
  event is admitted depends only on that step's arrivals, never on the window's contents;
* an event admitted at step s is eligible at steps s .. s+K-1 (ages 0..K-1) and then
  removed, so the window holds at most R·K events.

Admission keeps the R smallest of i.i.d. uniform 64-bit CSPRNG keys, a bottom-R sample,
which is a uniformly random R-subset of the arrivals, with memory R per pending step
however many arrive.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamtrain.data.randomness import Randomness
from streamtrain.events import EventBatch, SensorEvent


class DPClock:
    """The public clock: step s (1-based) is due at ``origin + s / step_rate_hz``.

    Steps are numbered by time alone, so when a step runs and which arrivals belong to it
    never depends on the data. The origin is the first time the clock is read; after a
    restart it is re-anchored so that the saved step count continues without a burst of
    catch-up steps for the time the service was down.
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

    def arrival_step(self, now: float) -> int:
        """The step an arrival at ``now`` belongs to: the first step due after it."""
        return max(self.steps_done + 1, self.clock_step(now) + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"step_rate_hz": self.step_rate_hz, "steps_done": self.steps_done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])
        self.origin = None  # re-anchored at the next reading


@dataclass
class _Reservoir:
    """Arrivals of one pending step: at most R items, the ones with the smallest keys."""

    keys: np.ndarray  # uint64 [<= R]
    values: list[np.ndarray]
    labels: list[int]
    arrivals: int = 0


@dataclass(frozen=True)
class EligibleSet:
    """The events eligible at one step, oldest slot first."""

    values: list[np.ndarray]  # float32 [L_i, C]
    labels: np.ndarray  # int64 [n]
    ages: np.ndarray  # int64 [n], steps since admission (0..K-1)

    def __len__(self) -> int:
        return len(self.values)


def _as_event_batch(events: EventBatch | Sequence[SensorEvent]) -> EventBatch:
    return events if isinstance(events, EventBatch) else EventBatch.from_events(list(events))


class DPWindow:
    """At most R admissions per clock step, each eligible for exactly K steps.

    Thread-safe: the ingest thread calls :meth:`admit`, the trainer :meth:`close_step`
    and :meth:`eligible`.
    """

    def __init__(self, eligible_steps: int, admit_per_step: int, randomness: Randomness) -> None:
        if eligible_steps < 1 or admit_per_step < 1:
            raise ValueError(f"DPWindow: need K >= 1 and R >= 1, got K={eligible_steps}, R={admit_per_step}")
        self.eligible_steps = int(eligible_steps)
        self.admit_per_step = int(admit_per_step)
        self.randomness = randomness
        self._lock = threading.Lock()
        self._pending: dict[int, _Reservoir] = {}
        self._slots: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}  # admit step -> (values, labels)
        self.closed_step = 0  # the last step whose admission is decided
        self.first_admit_step: int | None = None
        self.arrived_total = 0
        self.admitted_total = 0
        self.expired_total = 0
        self.next_offsets: dict[int, int] = {}

    # -- ingest side ------------------------------------------------------------------------

    def admit(self, events: EventBatch | Sequence[SensorEvent], step: int, next_offsets: Mapping[int, int] | None = None) -> int:
        """Offer ``events`` as arrivals of clock ``step``; returns the step they were assigned.

        An arrival for a step whose admission was already decided goes to the next open one.
        """
        batch = _as_event_batch(events)
        with self._lock:
            step = max(int(step), self.closed_step + 1)
            if next_offsets:
                self.next_offsets.update({int(p): int(o) for p, o in next_offsets.items()})
            n = len(batch)
            if n == 0:
                return step
            reservoir = self._pending.setdefault(step, _Reservoir(np.zeros(0, np.uint64), [], []))
            reservoir.arrivals += n
            self.arrived_total += n
            new_keys = self.randomness.raw_uint64(n)
            keys = np.concatenate([reservoir.keys, new_keys])
            keep = np.arange(keys.size)
            if keys.size > self.admit_per_step:
                keep = np.sort(np.argpartition(keys, self.admit_per_step - 1)[: self.admit_per_step])
            old = len(reservoir.values)
            starts = batch.starts
            values = [reservoir.values[i] if i < old else None for i in keep]
            labels = [reservoir.labels[i] if i < old else int(batch.labels[i - old]) for i in keep]
            for position, i in enumerate(keep):
                if i >= old:  # copy only the kept readings, so the poll batch is not pinned
                    j = int(i - old)
                    values[position] = np.array(batch.values[starts[j] : starts[j] + batch.lengths[j]], dtype=np.float32)
            reservoir.keys, reservoir.values, reservoir.labels = keys[keep], values, labels
            return step

    # -- trainer side ------------------------------------------------------------------------

    def close_step(self, step: int) -> None:
        """Decide step ``step``'s admissions and drop events that have been eligible K steps."""
        with self._lock:
            if step != self.closed_step + 1:
                raise ValueError(f"DPWindow.close_step: steps close in order; expected {self.closed_step + 1}, got {step}")
            reservoir = self._pending.pop(step, None)
            if reservoir is not None and reservoir.values:
                self._slots[step] = (reservoir.values, np.asarray(reservoir.labels, dtype=np.int64))
                self.admitted_total += len(reservoir.values)
                if self.first_admit_step is None:
                    self.first_admit_step = step
            for admitted_at in [s for s in self._slots if s <= step - self.eligible_steps]:
                self.expired_total += len(self._slots.pop(admitted_at)[0])
            self.closed_step = step

    def eligible(self) -> EligibleSet:
        """Events eligible at the last closed step, with their ages."""
        with self._lock:
            steps = sorted(self._slots)
            values = [item for s in steps for item in self._slots[s][0]]
            counts = [len(self._slots[s][0]) for s in steps]
            labels = np.concatenate([self._slots[s][1] for s in steps]) if steps else np.zeros(0, np.int64)
            ages = np.repeat(self.closed_step - np.asarray(steps, dtype=np.int64), counts)
            return EligibleSet(values, labels, ages.astype(np.int64))

    def steps_eligible_so_far(self) -> int:
        """How many steps the earliest-admitted event has been eligible for (capped at K)."""
        if self.first_admit_step is None:
            return 0
        return min(self.closed_step - self.first_admit_step + 1, self.eligible_steps)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v, _ in self._slots.values())

    @property
    def pending_steps(self) -> int:
        return len(self._pending)

    # -- checkpoints --------------------------------------------------------------------------

    @staticmethod
    def _pack(groups: dict[int, tuple[list[np.ndarray], Sequence[int]]]) -> dict[str, np.ndarray]:
        steps = sorted(groups)
        values = [v for s in steps for v in groups[s][0]]
        channels = values[0].shape[1] if values else 1
        return {
            "steps": np.repeat(np.asarray(steps, dtype=np.int64), [len(groups[s][0]) for s in steps]),
            "lengths": np.asarray([len(v) for v in values], dtype=np.int64),
            "values": np.concatenate(values).astype(np.float32) if values else np.zeros((0, channels), np.float32),
            "labels": np.asarray([int(label) for s in steps for label in groups[s][1]], dtype=np.int64),
        }

    @staticmethod
    def _unpack(packed: Mapping[str, Any]) -> dict[int, tuple[list[np.ndarray], list[int]]]:
        lengths = np.asarray(packed["lengths"], dtype=np.int64)
        flat = np.asarray(packed["values"], dtype=np.float32)
        values = np.split(flat, np.cumsum(lengths)[:-1]) if lengths.size else []
        groups: dict[int, tuple[list[np.ndarray], list[int]]] = {}
        for step, item, label in zip(np.asarray(packed["steps"]).tolist(), values, np.asarray(packed["labels"]).tolist(), strict=True):
            group = groups.setdefault(int(step), ([], []))
            group[0].append(np.array(item, dtype=np.float32))
            group[1].append(int(label))
        return groups

    def state_dict(self) -> dict[str, Any]:
        """Eligible events with their admission steps, pending arrivals with their keys."""
        with self._lock:
            pending = {s: (r.values, r.labels) for s, r in self._pending.items()}
            return {
                "eligible_steps": self.eligible_steps,
                "admit_per_step": self.admit_per_step,
                "closed_step": self.closed_step,
                "first_admit_step": -1 if self.first_admit_step is None else self.first_admit_step,
                "counters": np.asarray([self.arrived_total, self.admitted_total, self.expired_total], dtype=np.int64),
                "eligible": self._pack({s: (v, l.tolist()) for s, (v, l) in self._slots.items()}),
                "pending": self._pack(pending),
                "pending_keys": np.concatenate([self._pending[s].keys for s in sorted(self._pending)])
                if self._pending
                else np.zeros(0, np.uint64),
                "pending_arrivals": {str(s): r.arrivals for s, r in self._pending.items()},
                "next_offsets": {str(p): o for p, o in self.next_offsets.items()},
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["eligible_steps"]) != self.eligible_steps:
            raise ValueError(
                f"DPWindow.load_state_dict: checkpoint has K={state['eligible_steps']}, this run K={self.eligible_steps}; "
                "restore STREAMTRAIN_DP_ELIGIBLE_STEPS or start from an empty checkpoint directory"
            )
        with self._lock:
            slots = self._unpack(state["eligible"])
            self._slots = {s: (v, np.asarray(l, dtype=np.int64)) for s, (v, l) in slots.items()}
            pending = self._unpack(state["pending"])
            keys = np.asarray(state["pending_keys"], dtype=np.uint64)
            arrivals = {int(s): int(n) for s, n in dict(state["pending_arrivals"]).items()}
            self._pending = {}
            offset = 0
            for s in sorted(pending):
                values, labels = pending[s]
                self._pending[s] = _Reservoir(keys[offset : offset + len(values)], values, labels, arrivals.get(s, len(values)))
                offset += len(values)
            self.closed_step = int(state["closed_step"])
            first = int(state["first_admit_step"])
            self.first_admit_step = None if first < 0 else first
            self.arrived_total, self.admitted_total, self.expired_total = (int(c) for c in np.asarray(state["counters"]))
            self.next_offsets = {int(p): int(o) for p, o in dict(state["next_offsets"]).items()}
