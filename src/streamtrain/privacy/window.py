"""The DP window: admission per public-clock step, eligibility for exactly K steps.

The recency reservoir cannot be used under DP: there, an event x displaces some y, and
after x leaves y is still gone, so x's presence echoes through the window for as long
as it stays full. Here every unit's influence ends:

* arrivals are assigned to a step of the public clock by arrival time; at most R records
  are admitted per step, a uniformly random R of the candidates (OS CSPRNG keys, the R
  smallest win: a bottom-R sample, memory R per pending step). Whether a record is
  admitted depends only on that step's candidates, never on the window's contents;
* a record admitted at step s is eligible at steps s .. s+K-1 (ages 0..K-1) and then
  removed, so the window holds at most R·K records.

The privacy unit decides what a record is. ``unit="event"``: one event. ``unit="sensor"``:
a *group* of at most b events of one sensor that arrived for the same step (a uniformly
random b of them); a sensor becomes a candidate at most once every K steps and at most
``max_groups`` times in its life, decided from its own arrivals alone (the ledger), so a
sensor has at most one group in the window and no sensor's admission depends on another's.

Every offered event carries its Kafka (partition, offset). Closing a step *decides* every
arrival of that step (admitted or not); the per-partition watermark — one past the highest
decided offset — and the admitted offsets are what the admission record keeps
(``admissions.py``), and an offset below the watermark is never offered again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamtrain.data.randomness import Randomness
from streamtrain.events import EventBatch, SensorEvent

UNITS = ("event", "sensor")
#: Why an arrival was never offered, or a group never became a candidate: its partition is
#: not this process's, its offset was decided before (a redelivery), its sensor was out of
#: the ledger's rule when it arrived (spent, or a candidate fewer than K steps ago), or its
#: group was proposed at the step's close and the shared ledger refused it.
TURNED_AWAY = ("not_owned", "decided_before", "sensor_ruled_out", "group_refused")


@dataclass
class _Item:
    """One arrival kept for a pending step."""

    key: int
    values: np.ndarray
    label: int
    partition: int
    offset: int


@dataclass
class _Pending:
    """Arrivals of one pending step: the R smallest-keyed records, plus what every arrival moved.

    Event unit: ``records`` maps a key to a one-item list. Sensor unit: ``groups`` maps a
    sensor to its (group key, its b smallest-keyed items); the R smallest group keys among
    the candidates are chosen when the step closes (candidacy is the ledger's decision).
    """

    records: dict[int, list[_Item]] = field(default_factory=dict)
    groups: dict[str, tuple[int, list[_Item]]] = field(default_factory=dict)
    arrivals: int = 0
    watermarks: dict[int, int] = field(default_factory=dict)  # partition -> one past the highest offered offset


@dataclass
class _Slot:
    """The records admitted at one step (oldest slot first in the window)."""

    values: list[np.ndarray]
    labels: np.ndarray  # int64 [n]
    partitions: np.ndarray  # int64 [n]
    offsets: np.ndarray  # int64 [n]
    groups: np.ndarray  # int64 [n]: record number within the slot (events of one sensor group share it)


@dataclass(frozen=True)
class StepDecision:
    """What closing one step decided: the admission record's entry for it."""

    step: int
    admitted: dict[int, list[int]]  # partition -> admitted offsets (ascending)
    watermarks: dict[int, int]  # partition (decided at this step) -> one past its highest decided offset
    candidates: dict[int, list[str]]  # sensor unit: partition -> sensors that became candidates
    admitted_records: int


@dataclass(frozen=True)
class EligibleSet:
    """The events eligible at one step, oldest slot first, with their records."""

    values: list[np.ndarray]  # float32 [L_i, C]
    labels: np.ndarray  # int64 [n]
    ages: np.ndarray  # int64 [n], steps since admission (0..K-1)
    groups: np.ndarray  # int64 [n], record id (one per event, or one per sensor group)

    def __len__(self) -> int:
        return len(self.values)


def _as_event_batch(events: EventBatch | Sequence[SensorEvent]) -> EventBatch:
    return events if isinstance(events, EventBatch) else EventBatch.from_events(list(events))


class DPWindow:
    """At most R records admitted per clock step, each eligible for exactly K steps.

    Thread-safe: the ingest thread calls :meth:`admit`, the trainer :meth:`close_step` and
    :meth:`eligible`, a rebalance :meth:`drop_partitions`.
    """

    def __init__(
        self,
        eligible_steps: int,
        admit_per_step: int,
        randomness: Randomness,
        *,
        unit: str = "event",
        sensor_events: int = 1,
        max_groups: int | None = None,
    ) -> None:
        if eligible_steps < 1 or admit_per_step < 1:
            raise ValueError(f"DPWindow: need K >= 1 and R >= 1, got K={eligible_steps}, R={admit_per_step}")
        if unit not in UNITS:
            raise ValueError(f"DPWindow: unit must be one of {UNITS}, got {unit!r}")
        if sensor_events < 1:
            raise ValueError(f"DPWindow: need b >= 1 events per sensor group, got {sensor_events}")
        self.eligible_steps = int(eligible_steps)
        self.admit_per_step = int(admit_per_step)
        self.randomness = randomness
        self.unit = unit
        self.sensor_events = int(sensor_events)
        self.max_groups = max_groups
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._slots: dict[int, _Slot] = {}  # admission step -> records
        self.closed_step = 0  # the last step whose admission is decided
        self.first_admit_step: int | None = None
        self.arrived_total = 0
        self.admitted_total = 0  # records
        self.expired_total = 0
        #: Arrivals this process turned away, by reason, since it started (operator plane only):
        #: what tells a window that stops admitting apart from a stream that stopped.
        self.turned_away: dict[str, int] = dict.fromkeys(TURNED_AWAY, 0)
        self.next_offsets: dict[int, int] = {}
        self.watermarks: dict[int, int] = {}  # partition -> one past the highest decided offset
        self.ledger: dict[str, tuple[int, int]] = {}  # sensor -> (candidate groups so far, last candidate step)
        #: Sensor unit across processes: decides and records a step's candidacies on the shared
        #: ledger (privacy/ledger.py), which also owns :attr:`ledger`; None: this window alone.
        self.claim: Callable[[int, list[str], Callable[[str, int], bool]], set[str]] | None = None
        self.gaps: list[tuple[int, int]] = []  # admission-step ranges dropped at a restart (never eligible again)
        self.owned: set[int] | None = None  # partitions this process may admit from (None: all)

    # -- ingest side ------------------------------------------------------------------------

    def admit(
        self, events: EventBatch | Sequence[SensorEvent], step: int, next_offsets: Mapping[int, int] | None = None
    ) -> int:
        """Offer ``events`` as arrivals of clock ``step``; returns the step they were assigned.

        An arrival for a step whose admission was already decided goes to the next open one.
        Events whose (partition, offset) lies below that partition's watermark were decided
        before (by this process or a predecessor) and are never offered again; events of a
        partition this process no longer owns are dropped.
        """
        batch = _as_event_batch(events)
        with self._lock:
            step = max(int(step), self.closed_step + 1)
            if next_offsets:
                self.next_offsets.update({int(p): int(o) for p, o in next_offsets.items()})
            n = len(batch)
            if n == 0:
                return step
            partitions = np.asarray(batch.partitions, dtype=np.int64)
            offsets = np.asarray(batch.offsets, dtype=np.int64)
            fresh = np.ones(n, dtype=bool)
            for partition in np.unique(partitions).tolist():
                rows = partitions == partition
                if self.owned is not None and partition not in self.owned:
                    fresh &= ~rows
                    self.turned_away["not_owned"] += int(rows.sum())
                    continue
                mark = self.watermarks.get(int(partition))
                if mark is not None:
                    decided = rows & (offsets >= 0) & (offsets < mark)
                    fresh &= ~decided
                    self.turned_away["decided_before"] += int(decided.sum())
            keep = np.flatnonzero(fresh)
            if keep.size == 0:
                return step
            pending = self._pending.setdefault(step, _Pending())
            pending.arrivals += int(keep.size)
            self.arrived_total += int(keep.size)
            for partition in np.unique(partitions[keep]).tolist():
                top = int(offsets[keep][partitions[keep] == partition].max()) + 1
                pending.watermarks[int(partition)] = max(pending.watermarks.get(int(partition), 0), top)
            keys = self.randomness.raw_uint64(int(keep.size))
            starts = batch.starts
            if self.unit == "event":
                self._offer_events(pending, batch, keep, keys, starts)
            else:
                self._offer_groups(pending, batch, keep, keys, starts, step)
            return step

    def _item(self, batch: EventBatch, j: int, key: int, starts: np.ndarray) -> _Item:
        # copy only the kept readings, so the poll batch is not pinned
        values = np.array(batch.values[starts[j] : starts[j] + batch.lengths[j]], dtype=np.float32)
        return _Item(key, values, int(batch.labels[j]), int(batch.partitions[j]), int(batch.offsets[j]))

    def _offer_events(
        self, pending: _Pending, batch: EventBatch, keep: np.ndarray, keys: np.ndarray, starts: np.ndarray
    ) -> None:
        """Keep the R smallest keys among the step's arrivals so far (a bottom-R sample)."""
        old = list(pending.records.items())
        all_keys = np.concatenate([np.asarray([k for k, _ in old], dtype=np.uint64), keys])
        chosen = np.arange(all_keys.size)
        if all_keys.size > self.admit_per_step:
            chosen = np.argpartition(all_keys, self.admit_per_step - 1)[: self.admit_per_step]
        records: dict[int, list[_Item]] = {}
        for index in chosen.tolist():
            if index < len(old):
                records[old[index][0]] = old[index][1]
            else:
                j, key = int(keep[index - len(old)]), int(all_keys[index])
                records[key] = [self._item(batch, j, key, starts)]
        pending.records = records

    def _offer_groups(
        self, pending: _Pending, batch: EventBatch, keep: np.ndarray, keys: np.ndarray, starts: np.ndarray, step: int
    ) -> None:
        """Keep, per sensor, the b smallest keys among its arrivals for the step (its group)."""
        b = self.sensor_events
        for j, key in zip(keep.tolist(), keys.tolist(), strict=True):
            sensor = str(batch.sensor_ids[j])
            if not self._may_be_candidate(sensor, step):
                self.turned_away["sensor_ruled_out"] += 1
                continue  # ruled out already; ledger entries only grow before the step closes
            group = pending.groups.get(sensor)
            if group is None:
                group = pending.groups[sensor] = (int(self.randomness.raw_uint64(1)[0]), [])
            items = group[1]
            if len(items) >= b:
                largest = max(range(len(items)), key=lambda i: items[i].key)
                if key >= items[largest].key:
                    continue
                items.pop(largest)
            items.append(self._item(batch, j, key, starts))

    def _may_be_candidate(self, sensor: str, step: int) -> bool:
        """The ledger's rule: at most once every K steps, at most ``max_groups`` times ever."""
        entry = self.ledger.get(sensor)
        if entry is None:
            return True
        groups, last = entry
        if self.max_groups is not None and groups >= self.max_groups:
            return False
        return step - last >= self.eligible_steps

    # -- trainer side ------------------------------------------------------------------------

    def close_step(self, step: int) -> StepDecision:
        """Decide step ``step``'s admissions, drop records that have been eligible K steps."""
        with self._lock:
            if step != self.closed_step + 1:
                raise ValueError(
                    f"DPWindow.close_step: steps close in order; expected {self.closed_step + 1}, got {step}"
                )
            pending = self._pending.pop(step, None) or _Pending()
            admitted_items: list[list[_Item]]
            candidates: dict[int, list[str]] = {}
            if self.unit == "event":
                admitted_items = [pending.records[k] for k in sorted(pending.records)]
            else:
                proposed = [sensor for sensor, (_, items) in pending.groups.items() if items]
                if self.claim is not None:
                    accepted = self.claim(step, proposed, self._may_be_candidate)
                else:
                    accepted = {sensor for sensor in proposed if self._may_be_candidate(sensor, step)}
                    for sensor in accepted:
                        self.ledger[sensor] = (self.ledger.get(sensor, (0, 0))[0] + 1, step)
                self.turned_away["group_refused"] += len(proposed) - len(accepted)
                eligible = []
                for sensor, (group_key, items) in pending.groups.items():
                    if sensor in accepted:
                        eligible.append((group_key, sensor, items))
                        candidates.setdefault(items[0].partition, []).append(sensor)
                eligible.sort(key=lambda entry: entry[0])
                admitted_items = [
                    sorted(items, key=lambda item: item.key) for _, _, items in eligible[: self.admit_per_step]
                ]
            admitted: dict[int, list[int]] = {}
            if admitted_items:
                flat = [item for record in admitted_items for item in record]
                group_of = np.repeat(np.arange(len(admitted_items), dtype=np.int64), [len(r) for r in admitted_items])
                self._slots[step] = _Slot(
                    values=[item.values for item in flat],
                    labels=np.asarray([item.label for item in flat], dtype=np.int64),
                    partitions=np.asarray([item.partition for item in flat], dtype=np.int64),
                    offsets=np.asarray([item.offset for item in flat], dtype=np.int64),
                    groups=group_of,
                )
                for item in flat:
                    admitted.setdefault(item.partition, []).append(item.offset)
                self.admitted_total += len(admitted_items)
                if self.first_admit_step is None:
                    self.first_admit_step = step
            for partition, mark in pending.watermarks.items():
                self.watermarks[partition] = max(self.watermarks.get(partition, 0), mark)
            self._expire(step)
            self.closed_step = step
            return StepDecision(
                step=step,
                admitted={p: sorted(o) for p, o in admitted.items()},
                watermarks={p: self.watermarks[p] for p in pending.watermarks},  # all this process knew decided
                candidates=candidates,
                admitted_records=len(admitted_items),
            )

    def _expire(self, step: int) -> None:
        for admitted_at in [s for s in self._slots if s <= step - self.eligible_steps]:
            self.expired_total += int(self._slots.pop(admitted_at).groups.max(initial=-1)) + 1
        self.gaps = [(lo, hi) for lo, hi in self.gaps if hi > step - self.eligible_steps]

    def eligible(self) -> EligibleSet:
        """Events eligible at the last closed step, with their ages and record ids."""
        with self._lock:
            steps = sorted(self._slots)
            values = [item for s in steps for item in self._slots[s].values]
            counts = [len(self._slots[s].values) for s in steps]
            labels = np.concatenate([self._slots[s].labels for s in steps]) if steps else np.zeros(0, np.int64)
            ages = np.repeat(self.closed_step - np.asarray(steps, dtype=np.int64), counts)
            groups, base = [], 0
            for s in steps:
                groups.append(self._slots[s].groups + base)
                base += int(self._slots[s].groups.max(initial=-1)) + 1
            record_ids = np.concatenate(groups) if groups else np.zeros(0, np.int64)
            return EligibleSet(values, labels, ages.astype(np.int64), record_ids.astype(np.int64))

    def eligible_ranges(self) -> list[tuple[int, int]]:
        """Admission steps whose records are eligible at the last closed step, as inclusive ranges.

        [closed - K + 1, closed] minus the ranges dropped at restarts: the admission record's
        clock entry, from which each event's participation count follows.
        """
        with self._lock:
            low, high = max(1, self.closed_step - self.eligible_steps + 1), self.closed_step
            ranges = [(low, high)] if low <= high else []
            for gap_lo, gap_hi in sorted(self.gaps):
                split = []
                for lo, hi in ranges:
                    if gap_hi < lo or gap_lo > hi:
                        split.append((lo, hi))
                        continue
                    if lo < gap_lo:
                        split.append((lo, gap_lo - 1))
                    if gap_hi < hi:
                        split.append((gap_hi + 1, hi))
                ranges = split
            return ranges

    def steps_eligible_so_far(self) -> int:
        """How many steps the earliest-admitted record has been eligible for (capped at K)."""
        if self.first_admit_step is None:
            return 0
        return min(self.closed_step - self.first_admit_step + 1, self.eligible_steps)

    def most_groups(self) -> int:
        """Sensor unit: the most candidate groups any one sensor has had."""
        with self._lock:
            return max((count for count, _ in self.ledger.values()), default=0)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(slot.values) for slot in self._slots.values())

    @property
    def pending_steps(self) -> int:
        return len(self._pending)

    # -- rebalance and restart ---------------------------------------------------------------

    def drop_partitions(self, partitions: Sequence[int]) -> None:
        """Stop admitting from ``partitions`` (revoked): their undecided arrivals are dropped.

        Their decided events stay (their K steps run here); a new owner starts at the
        watermark, so nothing is offered twice.
        """
        gone = {int(p) for p in partitions}
        with self._lock:
            if self.owned is not None:
                self.owned -= gone
            for pending in self._pending.values():
                pending.records = {k: r for k, r in pending.records.items() if r[0].partition not in gone}
                pending.groups = {
                    s: (key, [i for i in items if i.partition not in gone])
                    for s, (key, items) in pending.groups.items()
                }
                for partition in gone:
                    pending.watermarks.pop(partition, None)

    def own(self, partitions: Sequence[int], watermarks: Mapping[int, int]) -> None:
        """Start admitting from ``partitions`` (assigned), above the recorded ``watermarks``."""
        with self._lock:
            if self.owned is None:
                self.owned = set()
            self.owned |= {int(p) for p in partitions}
            for partition, mark in watermarks.items():
                self.watermarks[int(partition)] = max(self.watermarks.get(int(partition), 0), int(mark))

    def resume(self, step: int, watermarks: Mapping[int, int], candidates: Mapping[int, Sequence[str]]) -> None:
        """After a restore: continue after ``step``, the last step the admission record shows.

        Steps after this window's checkpoint up to ``step`` ran before the crash: their
        admissions are not in this window and are never made again (their slots become a
        gap), pending arrivals of those steps were decided then and are dropped, offsets
        below ``watermarks`` are not offered again, and the sensors that became candidates
        then (``candidates``: step -> sensors) are charged to the ledger.
        """
        with self._lock:
            checkpoint_step = self.closed_step
            if step > checkpoint_step:
                self.gaps.append((checkpoint_step + 1, step))
                for s in [s for s in self._pending if s <= step]:
                    del self._pending[s]
                for s, sensors in sorted(candidates.items()):
                    if checkpoint_step < s <= step:
                        for sensor in sensors:
                            count = self.ledger.get(sensor, (0, 0))[0]
                            self.ledger[sensor] = (count + 1, int(s))
                self.closed_step = int(step)
                self._expire(step)
            for partition, mark in watermarks.items():
                self.watermarks[int(partition)] = max(self.watermarks.get(int(partition), 0), int(mark))
            for pending in self._pending.values():

                def undecided(item: _Item) -> bool:
                    return item.offset < 0 or item.offset >= self.watermarks.get(item.partition, 0)

                pending.records = {k: r for k, r in pending.records.items() if undecided(r[0])}
                pending.groups = {
                    s: (key, [i for i in items if undecided(i)]) for s, (key, items) in pending.groups.items()
                }

    # -- checkpoints --------------------------------------------------------------------------

    @staticmethod
    def _pack(rows: list[tuple[int, int, _Item]]) -> dict[str, np.ndarray]:
        """(step, group, item) rows as columns."""
        values = [item.values for _, _, item in rows]
        channels = values[0].shape[1] if values else 1
        return {
            "steps": np.asarray([s for s, _, _ in rows], dtype=np.int64),
            "groups": np.asarray([g for _, g, _ in rows], dtype=np.int64),
            "keys": np.asarray([item.key for _, _, item in rows], dtype=np.uint64),
            "lengths": np.asarray([len(v) for v in values], dtype=np.int64),
            "values": np.concatenate(values).astype(np.float32) if values else np.zeros((0, channels), np.float32),
            "labels": np.asarray([item.label for _, _, item in rows], dtype=np.int64),
            "partitions": np.asarray([item.partition for _, _, item in rows], dtype=np.int64),
            "offsets": np.asarray([item.offset for _, _, item in rows], dtype=np.int64),
        }

    @staticmethod
    def _unpack(packed: Mapping[str, Any]) -> list[tuple[int, int, _Item]]:
        lengths = np.asarray(packed["lengths"], dtype=np.int64)
        flat = np.asarray(packed["values"], dtype=np.float32)
        values = np.split(flat, np.cumsum(lengths)[:-1]) if lengths.size else []
        columns = [
            np.asarray(packed[name]).tolist() for name in ("steps", "groups", "keys", "labels", "partitions", "offsets")
        ]
        return [
            (int(s), int(g), _Item(int(k), np.array(v, dtype=np.float32), int(label), int(p), int(o)))
            for s, g, k, label, p, o, v in zip(*columns, values, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        """Eligible records with their admission steps, pending arrivals with their keys, ledger."""
        with self._lock:
            eligible = []
            for s in sorted(self._slots):
                slot = self._slots[s]
                for i, v in enumerate(slot.values):
                    item = _Item(0, v, int(slot.labels[i]), int(slot.partitions[i]), int(slot.offsets[i]))
                    eligible.append((s, int(slot.groups[i]), item))
            pending_rows, group_keys, sensors = [], [], []
            for s in sorted(self._pending):
                entry = self._pending[s]
                for record in entry.records.values():
                    pending_rows.append((s, -1, record[0]))
                for number, (sensor, (key, items)) in enumerate(entry.groups.items()):
                    sensors.append(sensor)
                    group_keys.append((s, number, key))
                    pending_rows.extend((s, len(sensors) - 1, item) for item in items)
            return {
                "unit": self.unit,
                "eligible_steps": self.eligible_steps,
                "admit_per_step": self.admit_per_step,
                "closed_step": self.closed_step,
                "first_admit_step": -1 if self.first_admit_step is None else self.first_admit_step,
                "counters": np.asarray([self.arrived_total, self.admitted_total, self.expired_total], dtype=np.int64),
                "eligible": self._pack(eligible),
                "pending": self._pack(pending_rows),
                "pending_sensors": sensors,
                "pending_group_keys": np.asarray([k for _, _, k in group_keys], dtype=np.uint64),
                "pending_arrivals": {str(s): p.arrivals for s, p in self._pending.items()},
                "pending_watermarks": {
                    str(s): {str(k): v for k, v in p.watermarks.items()} for s, p in self._pending.items()
                },
                "next_offsets": {str(p): o for p, o in self.next_offsets.items()},
                "watermarks": {str(p): o for p, o in self.watermarks.items()},
                "ledger_sensors": list(self.ledger),
                "ledger": np.asarray(list(self.ledger.values()), dtype=np.int64).reshape(-1, 2),
                "gaps": np.asarray(self.gaps, dtype=np.int64).reshape(-1, 2),
            }

    def share_state(self, states: Sequence[Mapping[str, Any]], owns: Callable[[int], bool]) -> dict[str, Any]:
        """This window's share (a :meth:`load_state_dict` state) of the windows of one cut made
        under another world size: ``states`` are the old windows (every rank's, or one
        process's), ``owns(p)`` whether this window now admits partition p.

        Records follow their partitions, so every rank's share together is the old windows,
        each record once: an eligible record goes whole (a sensor group may hold events of
        several partitions) to the owner of its lowest partition, with its admission step,
        so it stays eligible exactly at the steps it had left; an undecided (pending)
        arrival goes to the owner of its partition, and what one step's pending arrivals
        here exceed is cut by their random keys as :meth:`admit` cuts it (the R smallest
        event keys, a sensor's b smallest). Watermarks and next offsets of owned partitions
        (the largest), the ledger (per sensor, the largest count and step) and the restart
        gaps (all) are kept; the operator counters start again from zero.
        """
        if not states:
            raise ValueError("DPWindow.share_state: no window states to take a share of")
        closed = {int(state["closed_step"]) for state in states}
        if len(closed) != 1:
            raise ValueError(
                f"DPWindow.share_state: the windows were closed at different steps {sorted(closed)}, "
                "not one checkpoint's cut"
            )
        for state in states:
            if int(state["eligible_steps"]) != self.eligible_steps or str(state.get("unit", "event")) != self.unit:
                raise ValueError(
                    f"DPWindow.share_state: a window of K={state['eligible_steps']}, unit {state.get('unit')} "
                    f"cannot be shared into one of K={self.eligible_steps}, unit {self.unit}; restore the "
                    "STREAMTRAIN_DP_* settings of the checkpoint"
                )
        records: dict[int, list[list[_Item]]] = {}  # admission step -> records kept
        events: dict[int, list[_Item]] = {}  # step -> pending event records kept (event unit)
        groups: dict[int, dict[str, tuple[int, list[_Item]]]] = {}  # step -> sensor -> pending group kept
        marks: dict[int, dict[int, int]] = {}  # step -> partition -> pending watermark
        next_offsets: dict[int, int] = {}
        watermarks: dict[int, int] = {}
        ledger: dict[str, tuple[int, int]] = {}
        gaps: set[tuple[int, int]] = set()
        first_admits: list[int] = []
        for state in states:
            by_record: dict[tuple[int, int], list[_Item]] = {}
            for step, group, item in self._unpack(state["eligible"]):
                by_record.setdefault((step, group), []).append(item)
            for (step, _), items in sorted(by_record.items()):
                if owns(min(item.partition for item in items)):
                    records.setdefault(step, []).append(items)
            sensors = list(state.get("pending_sensors", []))
            keys = np.asarray(state.get("pending_group_keys", np.zeros(0, np.uint64)), dtype=np.uint64).tolist()
            for step, group, item in self._unpack(state["pending"]):
                if not owns(item.partition):
                    continue
                if group < 0:
                    events.setdefault(step, []).append(item)
                    continue
                sensor = sensors[group]
                key, items = groups.setdefault(step, {}).get(sensor, (int(keys[group]), []))
                groups[step][sensor] = (min(key, int(keys[group])), [*items, item])
            for step, partition_marks in dict(state.get("pending_watermarks", {})).items():
                for partition, mark in dict(partition_marks).items():
                    if owns(int(partition)):
                        at = marks.setdefault(int(step), {})
                        at[int(partition)] = max(at.get(int(partition), 0), int(mark))
            for target, source in ((next_offsets, state["next_offsets"]), (watermarks, state.get("watermarks", {}))):
                for partition, offset in dict(source).items():
                    if owns(int(partition)):
                        target[int(partition)] = max(target.get(int(partition), 0), int(offset))
            counts = np.asarray(state.get("ledger", np.zeros((0, 2), np.int64)), dtype=np.int64).reshape(-1, 2)
            for sensor, (count, last) in zip(state.get("ledger_sensors", []), counts.tolist(), strict=True):
                have = ledger.get(str(sensor), (0, last))
                ledger[str(sensor)] = (max(have[0], int(count)), max(have[1], int(last)))
            old_gaps = np.asarray(state.get("gaps", np.zeros((0, 2))), dtype=np.int64).reshape(-1, 2).tolist()
            gaps.update((int(lo), int(hi)) for lo, hi in old_gaps)
            if int(state["first_admit_step"]) >= 0:
                first_admits.append(int(state["first_admit_step"]))
        eligible = [(step, number, item) for step in sorted(records) for number, items in enumerate(records[step])
                    for item in items]  # fmt: skip
        pending: list[tuple[int, int, _Item]] = []
        pending_sensors: list[str] = []
        group_keys: list[int] = []
        arrivals: dict[int, int] = {}
        for step, items in events.items():
            kept = sorted(items, key=lambda item: item.key)[: self.admit_per_step]
            pending.extend((step, -1, item) for item in kept)
            arrivals[step] = len(kept)
        for step, by_sensor in groups.items():
            for sensor, (key, items) in by_sensor.items():
                pending_sensors.append(sensor)
                group_keys.append(key)
                kept = sorted(items, key=lambda item: item.key)[: self.sensor_events]
                pending.extend((step, len(pending_sensors) - 1, item) for item in kept)
                arrivals[step] = arrivals.get(step, 0) + len(kept)
        return {
            "unit": self.unit,
            "eligible_steps": self.eligible_steps,
            "admit_per_step": self.admit_per_step,
            "closed_step": closed.pop(),
            "first_admit_step": min(first_admits, default=-1),
            "counters": np.zeros(3, dtype=np.int64),
            "eligible": self._pack(eligible),
            "pending": self._pack(pending),
            "pending_sensors": pending_sensors,
            "pending_group_keys": np.asarray(group_keys, dtype=np.uint64),
            "pending_arrivals": {str(step): count for step, count in arrivals.items()},
            "pending_watermarks": {str(step): {str(p): m for p, m in at.items()} for step, at in marks.items()},
            "next_offsets": {str(p): o for p, o in next_offsets.items()},
            "watermarks": {str(p): o for p, o in watermarks.items()},
            "ledger_sensors": list(ledger),
            "ledger": np.asarray(list(ledger.values()), dtype=np.int64).reshape(-1, 2),
            "gaps": np.asarray(sorted(gaps), dtype=np.int64).reshape(-1, 2),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["eligible_steps"]) != self.eligible_steps:
            raise ValueError(
                f"DPWindow.load_state_dict: checkpoint has K={state['eligible_steps']}, "
                f"this run K={self.eligible_steps}; "
                "restore STREAMTRAIN_DP_ELIGIBLE_STEPS or start from an empty checkpoint directory"
            )
        if str(state.get("unit", "event")) != self.unit:
            raise ValueError(
                f"DPWindow.load_state_dict: checkpoint was written with DP_UNIT={state.get('unit')}, this run uses "
                f"{self.unit}; restore STREAMTRAIN_DP_UNIT or start from an empty checkpoint directory"
            )
        with self._lock:
            slots: dict[int, list[tuple[int, _Item]]] = {}
            for s, g, item in self._unpack(state["eligible"]):
                slots.setdefault(s, []).append((g, item))
            self._slots = {
                s: _Slot(
                    values=[i.values for _, i in rows],
                    labels=np.asarray([i.label for _, i in rows], dtype=np.int64),
                    partitions=np.asarray([i.partition for _, i in rows], dtype=np.int64),
                    offsets=np.asarray([i.offset for _, i in rows], dtype=np.int64),
                    groups=np.asarray([g for g, _ in rows], dtype=np.int64),
                )
                for s, rows in slots.items()
            }
            sensors = list(state.get("pending_sensors", []))
            group_keys = np.asarray(state.get("pending_group_keys", np.zeros(0, np.uint64)), dtype=np.uint64).tolist()
            self._pending = {}
            for s, g, item in self._unpack(state["pending"]):
                entry = self._pending.setdefault(s, _Pending())
                if g < 0:
                    entry.records[item.key] = [item]
                else:
                    sensor = sensors[g]
                    entry.groups.setdefault(sensor, (int(group_keys[g]), []))[1].append(item)
            for s, arrivals in dict(state["pending_arrivals"]).items():
                self._pending.setdefault(int(s), _Pending()).arrivals = int(arrivals)
            for s, marks in dict(state.get("pending_watermarks", {})).items():
                self._pending.setdefault(int(s), _Pending()).watermarks = {
                    int(p): int(o) for p, o in dict(marks).items()
                }
            self.closed_step = int(state["closed_step"])
            first = int(state["first_admit_step"])
            self.first_admit_step = None if first < 0 else first
            self.arrived_total, self.admitted_total, self.expired_total = (
                int(c) for c in np.asarray(state["counters"])
            )
            self.next_offsets = {int(p): int(o) for p, o in dict(state["next_offsets"]).items()}
            self.watermarks = {int(p): int(o) for p, o in dict(state.get("watermarks", {})).items()}
            ledger = np.asarray(state.get("ledger", np.zeros((0, 2), np.int64)), dtype=np.int64).reshape(-1, 2)
            self.ledger = {
                str(s): (int(c), int(t))
                for s, (c, t) in zip(state.get("ledger_sensors", []), ledger.tolist(), strict=True)
            }
            self.gaps = [
                (int(lo), int(hi))
                for lo, hi in np.asarray(state.get("gaps", np.zeros((0, 2))), dtype=np.int64).reshape(-1, 2).tolist()
            ]
