"""The holdout: fresh events kept out of the window, never trained on, that the gate judges by.

With ``HOLDOUT_SHARE > 0`` a share of fresh events (one in ``1 / share`` of each sensor's
blocks of events, from a phase drawn by the configured randomness mode) is kept out of the
window in a bounded buffer (the most recent ``HOLDOUT_CAPACITY`` events). Invariant: a
held-out event is never trained on, and neither is an event next to a held-out block that
shares readings with it (the guards of :class:`HoldoutSplitter`), so the holdout measures
forecasting, not memory.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamtrain.data.randomness import ShuffleMode, make_randomness
from streamtrain.events import EventBatch
from streamtrain.quality.config import HOLDOUT_STREAM
from streamtrain.window.storage import token_positions


@dataclass
class _SensorBlocks:
    count: int  # this sensor's events counted into blocks of ``block``
    phase: int  # its blocks with (index + phase) % period == 0 are held out
    block: int  # events per block: HOLDOUT_BLOCK_EVENTS, or twice the overlap once its events overlap
    guard: int = 0  # neighbours of a held-out block kept out too (overlapping events)
    last: np.ndarray | None = None  # its previous event's readings (to see overlap)
    grown: bool = False  # its blocks grew to twice the overlap (see HoldoutSplitter)
    trail: int = 0  # next events kept out as guards of the event held just before its blocks grew


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

    def __init__(self, share: float, block_events: int, mode: ShuffleMode, seed: int) -> None:
        self.block_events = max(1, int(block_events))
        self.period = max(2, round(1.0 / share)) if share > 0 else 0
        self.mode, self.seed = mode, seed
        self._sensors: OrderedDict[str, _SensorBlocks] = OrderedDict()

    def _held(self, sensor: _SensorBlocks, block: int) -> bool:
        # the first block of grown blocks always trains: a short stream of sliding windows keeps
        # its first readings (a held first block and its guard took 70 of 77 events)
        return block >= (1 if sensor.grown else 0) and (block + sensor.phase) % self.period == 0

    def _phase(self, sensor_id: str) -> int:
        key = int.from_bytes(hashlib.blake2b(sensor_id.encode(), digest_size=8).digest(), "little") >> 1
        rng = make_randomness(self.mode, self.seed, key, worker=HOLDOUT_STREAM)
        return int(rng.integers(self.period, 1)[0])

    def split(self, batch: EventBatch) -> tuple[np.ndarray, np.ndarray]:
        """(held-out rows, guard rows) of ``batch``, ascending; the rest trains."""
        held: list[int] = []
        guard: list[int] = []
        if self.period == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        sensor_ids = batch.sensor_ids.tolist()
        slides, last_row = self._slides(batch, sensor_ids)
        lengths = batch.lengths.tolist()
        for i, sensor_id in enumerate(sensor_ids):
            state = self._sensors.get(sensor_id)
            if state is None:
                state = _SensorBlocks(0, self._phase(sensor_id), self.block_events)
                self._sensors[sensor_id] = state
                if len(self._sensors) > self.MAX_SENSORS:
                    self._sensors.popitem(last=False)
            else:
                self._sensors.move_to_end(sensor_id)
                stride = slides[i]  # later events that share readings with one: ceil(L / stride) - 1
                state.guard = -(-lengths[i] // stride) - 1 if stride else 0
                if 2 * state.guard > state.block:  # blocks grow once, when the overlap is first seen
                    # the events that share readings with a held event just before are its guard
                    previous_held = self._held(state, (state.count - 1) // state.block)
                    state.block, state.count, state.grown = 2 * state.guard, 0, True
                    state.trail = state.guard if previous_held else 0
            block, at = divmod(state.count, state.block)
            if state.trail > 0:
                guard.append(i)
                state.trail -= 1
            elif self._held(state, block):
                held.append(i)
            elif (self._held(state, block + 1) and at >= state.block - state.guard) or (
                self._held(state, block - 1) and at < state.guard
            ):
                guard.append(i)
            state.count += 1
        starts = batch.starts
        for sensor_id, i in last_row.items():  # each sensor's newest event, to compare the next batch's with
            state = self._sensors.get(sensor_id)
            if state is not None:
                state.last = batch.values[starts[i] : starts[i] + batch.lengths[i]].copy()
        return np.array(held, dtype=np.int64), np.array(guard, dtype=np.int64)

    def _slides(self, batch: EventBatch, sensor_ids: list[str]) -> tuple[list[int], dict[str, int]]:
        """(:func:`overlap_start` of each event of ``batch`` within its sensor's previous event, or 0
        where it has none; each sensor's last row in ``batch``), found for the whole batch at once:
        per event only dictionary work is left to the loop of :meth:`split`."""
        last_row: dict[str, int] = {}
        previous: list[int] = []
        for i, sensor_id in enumerate(sensor_ids):
            previous.append(last_row.get(sensor_id, -1))
            last_row[sensor_id] = i
        previous_row = np.array(previous, dtype=np.int64)
        # a sensor's first event in the batch is compared with the event its state kept
        stored = [
            (i, last)
            for i in np.flatnonzero(previous_row < 0).tolist()
            if (state := self._sensors.get(sensor_ids[i])) is not None and (last := state.last) is not None
        ]  # fmt: skip
        readings = batch.values
        event_starts, event_lengths = batch.starts, batch.lengths
        if stored:
            readings = np.concatenate([readings, *(last for _, last in stored)])
            extra = np.array([len(last) for _, last in stored], dtype=np.int64)
            extra_starts = len(batch.values) + np.concatenate([[0], np.cumsum(extra[:-1])])
            event_starts = np.concatenate([event_starts, extra_starts])
            event_lengths = np.concatenate([event_lengths, extra])
            previous_row[[i for i, _ in stored]] = len(sensor_ids) + np.arange(len(stored))
        current = np.flatnonzero(previous_row >= 0)
        slides = np.zeros(len(sensor_ids), dtype=np.int64)
        slides[current] = overlap_starts(readings, event_starts, event_lengths, previous_row[current], current)
        return slides.tolist(), last_row

    def redundancy_sums(self) -> np.ndarray:
        """[sum over sensors of the events each reading is in, sensors]: overlapping events
        repeat readings, and a fit on them has less evidence than its rows suggest."""
        return np.array([float(sum(v.guard + 1 for v in self._sensors.values())), float(len(self._sensors))])

    def state_dict(self) -> dict[str, Any]:
        # each sensor's previous event too: without it the first event after a restart could not
        # be compared with it, so its overlap (and the guard or growth it decides) would be missed
        lasts = [v.last for v in self._sensors.values()]
        kept = [last for last in lasts if last is not None]
        return {
            "last_lengths": np.array([-1 if last is None else len(last) for last in lasts], dtype=np.int64),
            "last_values": np.concatenate(kept) if kept else np.zeros((0, 1), np.float32),
            "sensors": [str(k) for k in self._sensors],
            "counts": np.array([v.count for v in self._sensors.values()], dtype=np.int64),
            "phases": np.array([v.phase for v in self._sensors.values()], dtype=np.int64),
            "guards": np.array([v.guard for v in self._sensors.values()], dtype=np.int64),
            "blocks": np.array([v.block for v in self._sensors.values()], dtype=np.int64),
            "grown": np.array([v.grown for v in self._sensors.values()], dtype=np.bool_),
            "trails": np.array([v.trail for v in self._sensors.values()], dtype=np.int64),
        }

    def load_state_dict(self, state: dict[str, Any], channels: int | None = None) -> None:
        """``channels``: the readings' width, where the stored previous events lost their shape."""
        self._sensors.clear()
        blocks = np.asarray(state["blocks"]).tolist()
        # saved before the first grown block trained: such a state's grown blocks keep their schedule
        grown = np.asarray(state.get("grown", np.zeros(len(blocks), np.bool_))).tolist()
        trails = np.asarray(state.get("trails", np.zeros(len(blocks), np.int64))).tolist()
        lasts = _previous_events(state, len(blocks), channels)
        for name, count, phase, guard, block, was_grown, trail, last in zip(
            state["sensors"], np.asarray(state["counts"]).tolist(), np.asarray(state["phases"]).tolist(),
            np.asarray(state["guards"]).tolist(), blocks, grown, trails, lasts, strict=True,
        ):  # fmt: skip
            self._sensors[str(name)] = _SensorBlocks(
                int(count), int(phase) % max(self.period, 1), int(block), int(guard), last=last,
                grown=bool(was_grown), trail=int(trail),
            )  # fmt: skip


def _previous_events(state: dict[str, Any], sensors: int, channels: int | None) -> list[np.ndarray | None]:
    """Each sensor's previous event from a splitter's state (None for all in a state saved before
    they were kept: those sensors' first events after the restart are compared with nothing)."""
    if "last_lengths" not in state:
        return [None] * sensors
    lengths = np.asarray(state["last_lengths"], dtype=np.int64)
    flat = np.asarray(state["last_values"], dtype=np.float32)
    if channels is not None or flat.ndim != 2:
        flat = flat.reshape(-1, channels or 1)
    runs = _cut(flat, lengths[lengths >= 0])
    if runs is None or lengths.size != sensors:
        raise ValueError("holdout splitter state is inconsistent: previous events do not match the stored readings")
    kept = iter(runs)
    return [None if n < 0 else next(kept) for n in lengths.tolist()]


def _cut(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray] | None:
    """``flat``'s rows cut into consecutive events of ``lengths`` (copies), as the states store
    events; None when the lengths do not add up to the rows."""
    if int(lengths.sum()) != flat.shape[0]:
        return None
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [flat[bounds[i] : bounds[i + 1]].copy() for i in range(lengths.size)]


def overlap_start(previous: np.ndarray | None, current: np.ndarray) -> int:
    """Where ``current`` starts within ``previous`` when it repeats the end of it (a sliding
    window: its stride), else 0. An event equal to the previous one is not counted as a slide."""
    if previous is None or len(previous) == 0 or len(current) == 0:
        return 0
    candidates = np.flatnonzero((previous == current[0]).all(axis=-1))
    for start in candidates.tolist():
        shared = min(len(previous) - start, len(current))
        if start > 0 and np.array_equal(previous[start : start + shared], current[:shared]):
            return int(start)
    return 0


def overlap_starts(
    readings: np.ndarray, starts: np.ndarray, lengths: np.ndarray, previous: np.ndarray, current: np.ndarray
) -> np.ndarray:
    """:func:`overlap_start` of events ``current`` within events ``previous`` (pairs of indices into
    events ``k`` = ``readings[starts[k] : starts[k] + lengths[k]]``), all pairs at once.

    Every reading of a previous event after its first that equals its pair's first current reading
    is a candidate start; candidates are checked in rounds, each pair's next one per round, so a pair
    stops at its smallest start that matches, as :func:`overlap_start` does (most pairs settle in the
    first round: a sliding window's stride, or no candidate at all)."""
    found = np.zeros(len(current), dtype=np.int64)
    prev_start, prev_len = starts[previous], lengths[previous]
    cur_start, cur_len = starts[current], lengths[current]
    span = np.where(cur_len > 0, np.maximum(prev_len - 1, 0), 0)  # candidates after each previous event's first
    pair = np.repeat(np.arange(len(current)), span)
    if pair.size == 0:
        return found
    rows = token_positions(prev_start + 1, span)  # each previous event's readings after its first
    first = readings[np.minimum(cur_start, max(len(readings) - 1, 0))]  # each pair's first current reading
    hit = (readings[rows] == first[pair]).all(axis=-1)
    pair, offset = pair[hit], rows[hit] - prev_start[pair[hit]]  # candidates, by pair, then start
    rank = np.arange(pair.size) - np.searchsorted(pair, pair)  # each candidate's place among its pair's
    settled = np.zeros(len(current), dtype=bool)
    for r in range(int(rank.max()) + 1 if rank.size else 0):
        trial = np.flatnonzero((rank == r) & ~settled[pair])
        if trial.size == 0:
            break
        p, o = pair[trial], offset[trial]
        shared = np.minimum(prev_len[p] - o, cur_len[p])
        which = np.repeat(np.arange(trial.size), shared)
        same = readings[token_positions(prev_start[p] + o, shared)] == readings[token_positions(cur_start[p], shared)]
        same = same.all(axis=-1)
        matched = np.bincount(which, weights=~same, minlength=trial.size) == 0
        found[p[matched]] = o[matched]
        settled[p[matched]] = True
    return found


def repeated_readings(previous: np.ndarray | None, current: np.ndarray) -> int:
    """How many of ``current``'s first readings ``previous`` already held (0 without overlap)."""
    start = overlap_start(previous, current)
    return min(len(previous) - start, len(current)) if start and previous is not None else 0


class HoldoutBuffer:
    """The most recent held-out events (readings, labels and sensors), never trained on."""

    def __init__(self, capacity: int) -> None:
        self.values: deque[np.ndarray] = deque(maxlen=capacity)
        self.labels: deque[int] = deque(maxlen=capacity)
        self.sensors: deque[str] = deque(maxlen=capacity)  # whose consecutive events may share readings
        self.version = 0  # bumps when the content changes

    def __len__(self) -> int:
        return len(self.values)

    def add(self, batch: EventBatch, rows: np.ndarray) -> None:
        starts = batch.starts
        for i in rows.tolist():
            start = int(starts[i])
            self.values.append(np.array(batch.values[start : start + int(batch.lengths[i])], dtype=np.float32))
            self.labels.append(int(batch.labels[i]))
            self.sensors.append(str(batch.sensor_ids[i]))
        if rows.size:
            self.version += 1

    def state_dict(self) -> dict[str, Any]:
        lengths = np.array([len(v) for v in self.values], dtype=np.int64)
        channels = self.values[0].shape[1] if self.values else 0
        flat = np.concatenate(list(self.values)) if self.values else np.zeros((0, channels), np.float32)
        return {
            "lengths": lengths, "values": flat, "labels": np.array(list(self.labels), dtype=np.int64),
            "sensors": list(self.sensors),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], channels: int) -> None:
        lengths = np.asarray(state["lengths"], dtype=np.int64)
        runs = _cut(np.asarray(state["values"], dtype=np.float32).reshape(-1, channels), lengths)
        if runs is None:
            raise ValueError("holdout state is inconsistent: lengths do not sum to the stored values")
        labels = np.asarray(state["labels"], dtype=np.int64).tolist()
        # a holdout saved before sensors were kept: each event its own (no neighbour known)
        sensors = [str(s) for s in state.get("sensors", [f"#{i}" for i in range(len(labels))])]
        self.values.clear()
        self.labels.clear()
        self.sensors.clear()
        for values, label, sensor in zip(runs, labels, sensors, strict=True):
            self.values.append(values)
            self.labels.append(int(label))
            self.sensors.append(sensor)
        self.version += 1
