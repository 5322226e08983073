"""DP window: admission caps, eligibility for exactly K steps, watermarks, the sensor unit."""

from __future__ import annotations

import numpy as np
import pytest

from streamtrain.data.randomness import SeededRandomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.privacy.window import DPWindow

Z = 5.0  # two-sided binomial bound; with fixed seeds the outcome is deterministic anyway


def events(n: int, start: int = 0) -> list[SensorEvent]:
    """Event i carries the value i (so admission can be traced) and label i % 3."""
    return [
        SensorEvent("s", 0.0, np.full((1 + i % 4, 1), float(i), np.float32), (i) % 3) for i in range(start, start + n)
    ]


def ids(values: list[np.ndarray]) -> list[int]:
    return [int(v[0, 0]) for v in values]


def within_binomial(successes: int, trials: int, p: float) -> bool:
    sd = np.sqrt(trials * p * (1 - p))
    return abs(successes - trials * p) <= Z * sd


def test_admission_caps_at_r_and_admits_all_below() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(0))
    window.admit(events(3), step=1)
    window.close_step(1)
    assert sorted(ids(window.eligible().values)) == [0, 1, 2]
    window.admit(events(4, 100), step=2)
    window.admit(events(40, 200), step=2)  # two poll batches for the same step
    window.close_step(2)
    eligible = window.eligible()
    assert len(eligible) == 3 + 5
    assert window.arrived_total == 47 and window.admitted_total == 8
    # values and labels stay paired through the reservoir
    for value, label in zip(ids(eligible.values), eligible.labels.tolist(), strict=True):
        assert label == value % 3


def test_admission_is_uniform_over_arrivals_within_binomial_bounds() -> None:
    trials, arrivals, cap = 2000, 12, 4
    counts = np.zeros(arrivals, dtype=np.int64)
    randomness = SeededRandomness(1)
    for _ in range(trials):
        window = DPWindow(eligible_steps=1, admit_per_step=cap, randomness=randomness)
        window.admit(events(5), step=1)  # arrivals split over two admit calls
        window.admit(events(7, 5), step=1)
        window.close_step(1)
        admitted = ids(window.eligible().values)
        assert len(admitted) == cap
        counts[admitted] += 1
    for count in counts:  # every arrival, early or late, is admitted with probability R / n
        assert within_binomial(int(count), trials, cap / arrivals), counts


def test_event_is_eligible_for_exactly_k_steps_then_removed() -> None:
    k = 4
    window = DPWindow(eligible_steps=k, admit_per_step=10, randomness=SeededRandomness(2))
    window.admit(events(2), step=1)
    seen = {}
    for step in range(1, 9):
        if step == 3:
            window.admit(events(1, 50), step=3)
        window.close_step(step)
        eligible = window.eligible()
        for value, age in zip(ids(eligible.values), eligible.ages.tolist(), strict=True):
            seen.setdefault(value, []).append((step, age))
        assert len(window) <= 10 * k
    assert seen[0] == [(s, s - 1) for s in range(1, 5)]
    assert seen[50] == [(s, s - 3) for s in range(3, 7)]
    assert window.expired_total == 3 and len(window) == 0
    assert window.steps_eligible_so_far() == k
    with pytest.raises(ValueError, match="in order"):
        window.close_step(20)


def test_late_arrival_goes_to_the_next_open_step() -> None:
    window = DPWindow(eligible_steps=2, admit_per_step=10, randomness=SeededRandomness(3))
    window.close_step(1)
    assert window.admit(events(1), step=1) == 2


def test_window_state_dict_round_trip() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=4, randomness=SeededRandomness(4))
    window.admit(EventBatch.from_events(events(6)), step=1, next_offsets={0: 6})
    window.close_step(1)
    window.admit(events(2, 10), step=2)
    window.admit(events(3, 20), step=3)  # pending beyond the next step
    window.close_step(2)
    clone = DPWindow(eligible_steps=3, admit_per_step=4, randomness=SeededRandomness(5))
    clone.load_state_dict(window.state_dict())
    before, after = window.eligible(), clone.eligible()
    assert ids(before.values) == ids(after.values)
    assert before.labels.tolist() == after.labels.tolist() and before.ages.tolist() == after.ages.tolist()
    assert clone.next_offsets == {0: 6} and clone.arrived_total == 11
    window.close_step(3)
    clone.close_step(3)
    assert sorted(ids(window.eligible().values)) == sorted(ids(clone.eligible().values))
    with pytest.raises(ValueError, match="K="):
        DPWindow(eligible_steps=5, admit_per_step=4, randomness=SeededRandomness(0)).load_state_dict(
            window.state_dict()
        )


def kafka_batch(offsets: list[int], partition: int = 0, sensors: list[str] | None = None) -> EventBatch:
    """Events at (partition, offset); each carries its offset as its value."""
    sensors = sensors or ["s"] * len(offsets)
    items = [
        SensorEvent(sensor, 0.0, np.full((2, 1), float(o), np.float32))
        for o, sensor in zip(offsets, sensors, strict=True)
    ]
    return EventBatch.from_events(items, partitions=[partition] * len(offsets), offsets=offsets)


def test_closing_a_step_decides_every_arrival_and_reports_it() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=2, randomness=SeededRandomness(7))
    window.admit(kafka_batch([10, 11, 12]), step=1)
    window.admit(kafka_batch([5, 6], partition=1), step=1)
    decision = window.close_step(1)
    admitted = [(p, o) for p, offsets in decision.admitted.items() for o in offsets]
    assert len(admitted) == 2 and decision.admitted_records == 2
    assert decision.watermarks == {0: 13, 1: 7}  # every arrival is decided, admitted or not
    assert window.watermarks == {0: 13, 1: 7}
    assert sorted(ids(window.eligible().values)) == sorted(o for _, o in admitted)


def test_an_offset_below_the_watermark_is_never_offered_again() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(8))
    window.admit(kafka_batch([0, 1, 2]), step=1)
    window.close_step(1)
    window.admit(kafka_batch([1, 2, 3, 4]), step=2)  # a replay of 1 and 2 (a restart re-read them)
    decision = window.close_step(2)
    assert decision.admitted == {0: [3, 4]}
    assert sorted(ids(window.eligible().values)) == [0, 1, 2, 3, 4]  # each once
    window.own([0], {0: 100})  # a recorded watermark from another process
    window.admit(kafka_batch([50, 150]), step=3)
    assert window.close_step(3).admitted == {0: [150]}
    assert window.turned_away["decided_before"] == 3  # 1, 2 and 50, for the operator to see


def test_a_revoked_partition_is_no_longer_admitted() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(9))
    window.own([0, 1], {})
    window.admit(kafka_batch([0, 1]), step=1)
    window.admit(kafka_batch([0, 1], partition=1), step=1)
    window.drop_partitions([1])  # undecided arrivals of 1 are dropped, not decided
    window.admit(kafka_batch([2], partition=1), step=1)  # an in-flight batch applied after the revocation
    decision = window.close_step(1)
    assert decision.admitted == {0: [0, 1]} and 1 not in decision.watermarks
    assert window.turned_away == {"not_owned": 1, "decided_before": 0, "sensor_ruled_out": 0, "group_refused": 0}


def test_resume_continues_after_the_recorded_step_and_never_reuses_a_step() -> None:
    k = 4
    window = DPWindow(eligible_steps=k, admit_per_step=10, randomness=SeededRandomness(10))
    for step in (1, 2):
        window.admit(kafka_batch([10 * step, 10 * step + 1]), step=step)
        window.close_step(step)
    window.admit(kafka_batch([30]), step=3)  # pending at the checkpoint
    window.admit(kafka_batch([40]), step=6)  # pending, for a step after the record's last
    saved = window.state_dict()
    restored = DPWindow(eligible_steps=k, admit_per_step=10, randomness=SeededRandomness(11))
    restored.load_state_dict(saved)
    # the record shows steps up to 4 ran (admitting 30 at step 3) before the crash
    restored.resume(4, {0: 31}, {})
    assert restored.closed_step == 4
    assert restored.eligible_ranges() == [(1, 2)]  # slots 3-4 are a gap: never eligible again
    assert restored.pending_steps == 1  # step 3's arrivals were decided before the crash
    restored.close_step(5)
    assert restored.eligible_ranges() == [(2, 2), (5, 5)]
    decision = restored.close_step(6)
    assert decision.admitted == {0: [40]}
    assert sorted(ids(restored.eligible().values)) == [40]  # slot 2 expired after step 5
    for step in range(7, 12):
        restored.close_step(step)
    assert restored.eligible_ranges() == [(8, 11)] and restored.gaps == []


def sensor_window(b: int = 2, k: int = 3, r: int = 10, max_groups: int | None = None, seed: int = 12) -> DPWindow:
    return DPWindow(eligible_steps=k, admit_per_step=r, randomness=SeededRandomness(seed), unit="sensor",
                    sensor_events=b, max_groups=max_groups)  # fmt: skip


def test_sensor_unit_keeps_at_most_b_events_per_sensor_as_one_record() -> None:
    window = sensor_window(b=2)
    window.admit(kafka_batch([0, 1, 2, 3, 4], sensors=["a", "a", "a", "b", "a"]), step=1)
    decision = window.close_step(1)
    eligible = window.eligible()
    assert decision.admitted_records == 2 and len(eligible) == 3  # a: 2 of its 4, b: 1
    by_record = {}
    for value, record in zip(ids(eligible.values), eligible.groups.tolist(), strict=True):
        by_record.setdefault(record, []).append(value)
    assert sorted(len(v) for v in by_record.values()) == [1, 2]
    assert sorted(sum(decision.candidates.values(), [])) == ["a", "b"]


def test_a_sensor_is_a_candidate_at_most_once_every_k_steps_and_max_groups_times() -> None:
    window = sensor_window(b=1, k=3, max_groups=2)
    admitted_at = []
    for step in range(1, 12):
        window.admit(kafka_batch([step], sensors=["a"]), step=step)
        if window.close_step(step).admitted:
            admitted_at.append(step)
    assert admitted_at == [1, 4]  # never two groups in the window, two groups in its life
    assert window.ledger["a"] == (2, 4) and window.most_groups() == 2
    assert window.turned_away["sensor_ruled_out"] == 9  # every other arrival, each counted


def test_a_group_the_shared_ledger_refuses_at_the_close_is_counted_and_never_admitted() -> None:
    """Another process (or rank) took the sensor between its arrival and the step's close."""
    window = sensor_window(b=1, k=3)
    window.claim = lambda step, sensors, allowed: {s for s in sensors if s != "taken" and allowed(s, step)}
    window.admit(kafka_batch([0, 1], sensors=["taken", "free"]), step=1)
    decision = window.close_step(1)
    assert decision.candidates == {0: ["free"]} and decision.admitted_records == 1
    assert window.turned_away["group_refused"] == 1 and window.turned_away["sensor_ruled_out"] == 0


def test_a_sensors_candidacy_does_not_depend_on_other_sensors() -> None:
    """The ledger sees only the sensor's own arrivals: crowding by others (R = 1) changes
    whether its group is admitted, never when it may next be a candidate."""
    crowded, alone = sensor_window(b=1, k=2, r=1, seed=13), sensor_window(b=1, k=2, r=1, seed=14)
    for step in range(1, 9):
        crowded.admit(kafka_batch([3 * step, 3 * step + 1, 3 * step + 2], sensors=["a", "x", "y"]), step=step)
        alone.admit(kafka_batch([step], sensors=["a"]), step=step)
        crowded.close_step(step)
        alone.close_step(step)
    assert crowded.ledger["a"] == alone.ledger["a"] == (4, 7)


def test_sensor_window_state_round_trip_keeps_ledger_and_groups() -> None:
    window = sensor_window(b=2)
    window.admit(kafka_batch([0, 1, 2], sensors=["a", "a", "b"]), step=1)
    window.close_step(1)
    window.admit(kafka_batch([3, 4], sensors=["c", "c"]), step=2)
    clone = sensor_window(b=2, seed=15)
    clone.load_state_dict(window.state_dict())
    assert clone.ledger == window.ledger
    assert clone.eligible().groups.tolist() == window.eligible().groups.tolist()
    assert clone.close_step(2).admitted == window.close_step(2).admitted
    with pytest.raises(ValueError, match="DP_UNIT"):
        DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(0)).load_state_dict(
            window.state_dict()
        )


# ----------------------------------------------------------------------------------------
# a window's share under another world size (scale-out: the DP window follows partitions)


def placed_batch(events_at: list[tuple[int, int, str]]) -> EventBatch:
    """Events (partition, offset, sensor), each carrying 1000 * partition + offset as its value."""
    items = [SensorEvent(sensor, 0.0, np.full((2, 1), float(1000 * p + o), np.float32)) for p, o, sensor in events_at]
    return EventBatch.from_events(items, partitions=[p for p, _, _ in events_at], offsets=[o for _, o, _ in events_at])


def records(window: DPWindow) -> list[tuple[int, tuple[int, ...]]]:
    """(admission step, the record's event values) of every eligible record, sorted."""
    eligible = window.eligible()
    found: dict[int, tuple[int, list[int]]] = {}
    for value, age, record in zip(ids(eligible.values), eligible.ages.tolist(), eligible.groups.tolist(), strict=True):
        found.setdefault(record, (window.closed_step - age, []))[1].append(value)
    return sorted((step, tuple(sorted(values))) for step, values in found.values())


def two_rank_windows(unit: str) -> list[DPWindow]:
    """The windows of ranks 0 (partitions 0, 2) and 1 (partitions 1, 3) after three steps, with arrivals
    pending for step 4; sensor "a" sends on partitions 0 and 2 (one group of rank 0 holds both), and
    also on 1 (rank 1)."""
    windows = [DPWindow(eligible_steps=4, admit_per_step=3, randomness=SeededRandomness(20 + r), unit=unit,
                        sensor_events=2) for r in range(2)]  # fmt: skip
    arrivals = {
        1: [(0, 0, "a"), (2, 0, "a"), (0, 1, "b"), (1, 0, "a"), (3, 0, "c"), (1, 1, "d")],
        2: [(0, 2, "e"), (2, 1, "f"), (1, 2, "g"), (3, 1, "h"), (3, 2, "h")],
        3: [(2, 2, "i"), (0, 3, "j"), (1, 3, "k")],
        4: [(0, 4, "m"), (2, 3, "m"), (0, 5, "n"), (2, 4, "o"), (0, 6, "p"), (1, 4, "q"), (3, 3, "q"), (1, 5, "r")],
    }
    for step in range(1, 5):
        for rank, window in enumerate(windows):
            mine = [event for event in arrivals[step] if event[0] % 2 == rank]
            if mine:
                window.admit(placed_batch(mine), step=step)
            if step < 4:
                window.close_step(step)
    return windows


@pytest.mark.parametrize("unit", ["event", "sensor"])
def test_a_share_under_another_world_size_keeps_every_record_once_whole_at_its_step(unit: str) -> None:
    old = two_rank_windows(unit)
    states = [window.state_dict() for window in old]
    before = sorted(record for window in old for record in records(window))
    assert any(len(values) == 2 for _, values in before) == (unit == "sensor")  # "a": one group, two partitions
    for world in (1, 2, 3, 4):
        shares = []
        for rank in range(world):
            share = DPWindow(eligible_steps=4, admit_per_step=6 // world + (rank < 6 % world), unit=unit,
                             randomness=SeededRandomness(40 + rank), sensor_events=2)  # fmt: skip
            share.load_state_dict(share.share_state(states, lambda p, r=rank, w=world: p % w == r))
            shares.append(share)
        after = [record for share in shares for record in records(share)]
        assert sorted(after) == before, f"{world} ranks: each record once, whole, with its admission step"
        for rank, share in enumerate(shares):  # a record lives with the owner of its lowest partition
            assert all(min(v // 1000 for v in values) % world == rank for _, values in records(share))
            assert share.closed_step == 3 and share.eligible_ranges() == [(1, 3)]
            assert set(share.watermarks) == {p for p in range(4) if p % world == rank}
        # the pending arrivals of step 4 are decided by the owner of their partition, each once
        decided = [share.close_step(4) for share in shares]
        for rank, decision in enumerate(decided):
            assert all(p % world == rank for p in decision.watermarks)
        marks = {p: m for decision in decided for p, m in decision.watermarks.items()}
        assert marks == {0: 7, 1: 6, 2: 5, 3: 4}
        admitted = [(p, o) for decision in decided for p, offsets in decision.admitted.items() for o in offsets]
        assert len(admitted) == len(set(admitted)) and len(admitted) >= 4


def test_a_share_cuts_a_steps_pending_arrivals_to_this_windows_admissions() -> None:
    """One process's window (R = 6) shared by two ranks (R = 3 each): a rank that owns all six
    pending arrivals keeps the three with the smallest random keys, as admit would have."""
    one = DPWindow(eligible_steps=3, admit_per_step=6, randomness=SeededRandomness(30))
    one.admit(placed_batch([(0, o, "s") for o in range(6)]), step=1)
    state = one.state_dict()
    keys = sorted(zip(np.asarray(state["pending"]["keys"]).tolist(), np.asarray(state["pending"]["offsets"]).tolist()))
    share = DPWindow(eligible_steps=3, admit_per_step=3, randomness=SeededRandomness(31))
    share.load_state_dict(share.share_state([state], lambda p: p % 2 == 0))
    decision = share.close_step(1)
    assert decision.admitted == {0: sorted(offset for _, offset in keys[:3])}
    assert decision.watermarks == {0: 6}  # the three cut were decided too: never offered again
    other = DPWindow(eligible_steps=3, admit_per_step=3, randomness=SeededRandomness(32))
    other.load_state_dict(other.share_state([state], lambda p: p % 2 == 1))
    assert other.close_step(1).admitted == {}


def test_a_share_keeps_the_ledger_and_refuses_windows_of_different_cuts() -> None:
    old = two_rank_windows("sensor")
    states = [window.state_dict() for window in old]
    share = DPWindow(eligible_steps=4, admit_per_step=6, randomness=SeededRandomness(50), unit="sensor",
                     sensor_events=2)  # fmt: skip
    share.load_state_dict(share.share_state(states, lambda p: True))
    assert share.ledger["a"] == (1, 1) and share.ledger["k"] == (1, 3)
    assert set(share.ledger) == set(old[0].ledger) | set(old[1].ledger)
    old[1].close_step(4)
    with pytest.raises(ValueError, match="closed at different steps"):
        share.share_state([old[0].state_dict(), old[1].state_dict()], lambda p: True)


# ----------------------------------------------------------------------------------------
# what the first mutation run of the DP window asked (docs/testing.md, "dp_window")


def test_resume_charges_the_candidacies_of_the_lost_steps_only_and_drops_decided_pending_groups() -> None:
    window = sensor_window(b=2, k=3)
    window.admit(kafka_batch([0, 1], sensors=["a", "b"]), step=1)
    window.close_step(1)
    window.admit(kafka_batch([2, 3], sensors=["c", "c"]), step=2)  # pending at the checkpoint
    window.admit(kafka_batch([10, 11], sensors=["d", "e"]), step=5)  # pending, after the record's last step
    restored = sensor_window(b=2, k=3, seed=16)
    restored.load_state_dict(window.state_dict())
    # the record: steps 2 and 3 ran; "c" was a candidate at 2, "x" at 3, "y" at 7 (not yet run: not charged),
    # and "a" at 1 (already in the ledger: not charged twice); offsets below 11 were decided
    restored.resume(3, {0: 11}, {1: ["a"], 2: ["c"], 3: ["x"], 7: ["y"]})
    assert restored.ledger == {"a": (1, 1), "b": (1, 1), "c": (1, 2), "x": (1, 3)}
    assert restored.closed_step == 3 and restored.gaps == [(2, 3)] and restored.pending_steps == 1
    decision = restored.close_step(4)
    assert decision.admitted == {} and decision.admitted_records == 0
    assert restored.close_step(5).admitted == {0: [11]}  # "d" at 10 was decided before the crash; "e" at 11 not
    assert restored.watermarks == {0: 12}


def test_resume_at_or_before_the_checkpoint_step_only_raises_the_watermarks() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(17))
    window.admit(kafka_batch([0, 1]), step=1)
    window.close_step(1)
    window.admit(kafka_batch([2, 3, 4]), step=2)
    window.resume(1, {0: 4, 1: 7}, {1: ["s"]})
    assert window.closed_step == 1 and window.gaps == [] and window.ledger == {}
    assert window.watermarks == {0: 4, 1: 7}
    window.resume(0, {0: 3}, {})  # a lower mark never lowers one
    assert window.watermarks == {0: 4, 1: 7}
    assert window.close_step(2).admitted == {0: [4]}  # 2 and 3 were decided: dropped from the pending step


def test_resume_keeps_pending_arrivals_without_an_offset() -> None:
    """Arrivals not read from Kafka (offset -1) cannot have been decided before: they stay."""
    window = DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(18))
    window.admit(events(2), step=2)  # offsets -1
    window.resume(1, {0: 100}, {})
    window.close_step(2)
    assert sorted(ids(window.eligible().values)) == [0, 1]


@pytest.mark.parametrize(
    ("gaps", "expected"),
    [
        ([(3, 4)], [(1, 2), (5, 6)]),
        ([(1, 2)], [(3, 6)]),
        ([(5, 6)], [(1, 4)]),
        ([(0, 9)], []),
        ([(2, 2), (4, 5)], [(1, 1), (3, 3), (6, 6)]),
        ([(7, 9)], [(1, 6)]),
    ],
)
def test_eligible_ranges_are_the_last_k_steps_less_the_gaps(gaps: list[tuple[int, int]], expected: list) -> None:
    window = DPWindow(eligible_steps=8, admit_per_step=1, randomness=SeededRandomness(19))
    for step in range(1, 7):
        window.close_step(step)
    window.gaps = list(gaps)
    assert window.eligible_ranges() == expected


def test_eligible_ranges_start_at_the_first_step_and_slide_with_k() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=1, randomness=SeededRandomness(19))
    assert window.eligible_ranges() == []
    window.close_step(1)
    assert window.eligible_ranges() == [(1, 1)]
    for step in range(2, 6):
        window.close_step(step)
    assert window.eligible_ranges() == [(3, 5)]


def test_steps_eligible_so_far_counts_from_the_first_admission_and_stops_at_k() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(20))
    window.close_step(1)  # nothing admitted yet
    assert window.steps_eligible_so_far() == 0
    window.admit(kafka_batch([0]), step=2)
    window.close_step(2)
    assert window.first_admit_step == 2 and window.steps_eligible_so_far() == 1
    window.close_step(3)
    assert window.steps_eligible_so_far() == 2
    for step in (4, 5, 6):
        window.close_step(step)
    assert window.steps_eligible_so_far() == 3


def test_most_groups_is_the_largest_count_in_the_ledger() -> None:
    window = sensor_window(b=1, k=1)
    assert window.most_groups() == 0
    for step, sensors in enumerate([["a", "b"], ["a"], ["a", "c"]], start=1):
        window.admit(kafka_batch(list(range(10 * step, 10 * step + len(sensors))), sensors=sensors), step=step)
        window.close_step(step)
    assert window.ledger["a"] == (3, 3) and window.most_groups() == 3


def test_dropping_partitions_drops_their_pending_groups_and_marks_and_owning_raises_marks_only() -> None:
    window = sensor_window(b=2, k=3)
    window.drop_partitions([5])  # owning nothing in particular (None: all): still admits the rest
    assert window.owned is None
    window.admit(placed_batch([(0, 0, "a"), (1, 0, "a"), (1, 1, "b")]), step=1)
    window.drop_partitions([1])
    decision = window.close_step(1)
    assert decision.admitted == {0: [0]} and decision.watermarks == {0: 1}
    assert sorted(ids(window.eligible().values)) == [0]
    window.own([2, 3], {2: 10, 3: 4})
    window.own([3], {2: 5, 3: 6})
    assert window.owned == {2, 3} and window.watermarks == {0: 1, 2: 10, 3: 6}


def test_a_share_refuses_nothing_to_share_and_another_k_or_unit_in_full() -> None:
    window = DPWindow(eligible_steps=4, admit_per_step=3, randomness=SeededRandomness(60))
    with pytest.raises(ValueError, match="^DPWindow.share_state: no window states to take a share of$"):
        window.share_state([], lambda p: True)
    other = DPWindow(eligible_steps=3, admit_per_step=3, randomness=SeededRandomness(61), unit="sensor")
    with pytest.raises(ValueError) as raised:
        window.share_state([other.state_dict()], lambda p: True)
    assert str(raised.value) == (
        "DPWindow.share_state: a window of K=3, unit sensor cannot be shared into one of K=4, unit event; "
        "restore the STREAMTRAIN_DP_* settings of the checkpoint"
    )
    closed = DPWindow(eligible_steps=4, admit_per_step=3, randomness=SeededRandomness(62))
    closed.close_step(1)
    with pytest.raises(ValueError) as raised:
        window.share_state([window.state_dict(), closed.state_dict()], lambda p: True)
    assert str(raised.value) == (
        "DPWindow.share_state: the windows were closed at different steps [0, 1], not one checkpoint's cut"
    )


def test_a_share_keeps_the_largest_offsets_and_ledger_entries_every_gap_and_the_first_admission() -> None:
    windows = []
    for rank, (first, offsets) in enumerate([(2, [5, 6]), (3, [9])]):
        window = sensor_window(b=1, k=4, seed=70 + rank)
        for step in range(1, 4):
            if step == first:
                window.admit(placed_batch([(rank, o, f"s{o}") for o in offsets]), step=step, next_offsets={rank: 50})
            window.close_step(step)
        window.ledger["shared"] = (2 + rank, 3 - rank)  # one sensor seen by both ranks, counts disagreeing
        window.gaps = [(rank + 1, rank + 1)]
        windows.append(window)
    states = [window.state_dict() for window in windows]
    share = sensor_window(b=1, k=4, seed=80)
    share.load_state_dict(share.share_state(states, lambda p: True))
    assert share.first_admit_step == 2
    assert share.ledger["shared"] == (3, 3)  # the largest count and the latest step, each
    assert share.gaps == [(1, 1), (2, 2)]
    assert share.watermarks == {0: 7, 1: 10} and share.next_offsets == {0: 50, 1: 50}
    assert share.arrived_total == share.admitted_total == share.expired_total == 0  # counters start again
    only_one = sensor_window(b=1, k=4, seed=81)
    only_one.load_state_dict(only_one.share_state(states, lambda p: p == 1))
    assert only_one.watermarks == {1: 10} and only_one.next_offsets == {1: 50}
    nothing = DPWindow(eligible_steps=4, admit_per_step=3, randomness=SeededRandomness(82))
    nothing.load_state_dict(nothing.share_state([nothing.state_dict()], lambda p: True))
    assert nothing.first_admit_step is None


class FixedKeys:
    """Randomness whose keys are given: draws come from ``keys`` in order."""

    def __init__(self, keys: list[int]) -> None:
        self.keys = list(keys)

    def raw_uint64(self, n: int) -> np.ndarray:
        drawn, self.keys = self.keys[:n], self.keys[n:]
        return np.asarray(drawn, dtype=np.uint64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eligible_steps": 0}, "DPWindow: need K >= 1 and R >= 1, got K=0, R=5"),
        ({"admit_per_step": 0}, "DPWindow: need K >= 1 and R >= 1, got K=3, R=0"),
        ({"unit": "fleet"}, "DPWindow: unit must be one of ('event', 'sensor'), got 'fleet'"),
        ({"unit": "sensor", "sensor_events": 0}, "DPWindow: need b >= 1 events per sensor group, got 0"),
    ],
)
def test_a_window_refuses_bad_settings_with_the_whole_reason(kwargs: dict, message: str) -> None:
    settings = {"eligible_steps": 3, "admit_per_step": 5, "randomness": SeededRandomness(0), **kwargs}
    with pytest.raises(ValueError) as raised:
        DPWindow(**settings)
    assert str(raised.value) == message


def test_a_sensor_group_is_one_event_unless_told_otherwise() -> None:
    assert DPWindow(3, 5, SeededRandomness(0), unit="sensor").sensor_events == 1


def test_arrivals_of_partitions_not_owned_and_offsets_decided_are_turned_away_across_partitions() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(90))
    window.own([2, 3], {2: 1, 3: 1})  # offset 0 of each was decided before
    batch = placed_batch([(0, 0, "s"), (1, 0, "s"), (2, 0, "s"), (2, 5, "s"), (3, 0, "s"), (3, 6, "s")])
    window.admit(batch, step=1)
    assert window.close_step(1).admitted == {2: [5], 3: [6]}
    assert window.turned_away["not_owned"] == 2 and window.turned_away["decided_before"] == 2


def test_a_steps_arrivals_and_pending_marks_add_up_over_its_batches() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(91))
    window.admit(kafka_batch([5, 6]), step=1)
    window.admit(kafka_batch([2]), step=1)  # a later batch of the same step, lower offsets
    state = window.state_dict()
    assert state["pending_arrivals"] == {"1": 3} and state["pending_watermarks"] == {"1": {"0": 7}}
    decision = window.close_step(1)
    assert decision.step == 1 and decision.watermarks == {0: 7} and decision.admitted == {0: [2, 5, 6]}


def test_arrivals_without_an_offset_leave_a_watermark_of_zero() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(92))
    window.admit(events(2), step=1)
    assert window.close_step(1).watermarks == {0: 0} and window.watermarks == {0: 0}
    window.own([3], {3: 0})
    window.resume(1, {4: 0}, {})
    assert window.watermarks == {0: 0, 3: 0, 4: 0}


def test_a_mark_raised_while_a_step_is_open_is_never_lowered_by_its_close() -> None:
    """A rebalance hands this window a partition's recorded mark between an arrival and its step's close."""
    window = DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(93))
    window.admit(kafka_batch([5]), step=1)
    window.own([0], {0: 100})
    window.close_step(1)
    assert window.watermarks == {0: 100}


def test_steps_close_in_order_and_say_which_is_next() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=1, randomness=SeededRandomness(94))
    window.close_step(1)
    with pytest.raises(ValueError) as raised:
        window.close_step(3)
    assert str(raised.value) == "DPWindow.close_step: steps close in order; expected 2, got 3"


def test_a_sensor_offered_for_two_open_steps_is_a_candidate_once_in_k_steps() -> None:
    """Its arrivals for steps 2 and 3 both come before either closes: only the first close may take it."""
    window = sensor_window(b=1, k=3)
    window.admit(kafka_batch([0], sensors=["a"]), step=1)
    window.admit(kafka_batch([1], sensors=["a"]), step=2)
    assert window.close_step(1).admitted == {0: [0]}
    assert window.close_step(2).admitted == {} and window.turned_away["group_refused"] == 1
    window.admit(kafka_batch([2], sensors=["b"]), step=4)
    window.admit(kafka_batch([3], sensors=["b"]), step=5)
    window.close_step(3)
    window.close_step(4)
    window.close_step(5)
    assert window.turned_away["group_refused"] == 2  # counted, not overwritten
    assert window.ledger == {"a": (1, 1), "b": (1, 4)}


def test_which_groups_fill_the_steps_r_slots_is_random_not_by_sensor_name() -> None:
    window = sensor_window(b=1, k=1, r=1, seed=95)
    first = 0
    steps = 60
    for step in range(1, steps + 1):
        window.admit(kafka_batch([2 * step, 2 * step + 1], sensors=["a", "z"]), step=step)
        if window.close_step(step).admitted == {0: [2 * step]}:
            first += 1
    assert within_binomial(first, steps, 0.5) and 0 < first < steps


def test_a_gap_is_forgotten_the_step_it_leaves_the_window() -> None:
    window = DPWindow(eligible_steps=4, admit_per_step=1, randomness=SeededRandomness(96))
    window.gaps = [(3, 4)]
    for step in range(1, 8):
        window.close_step(step)
    assert window.gaps == [(3, 4)] and window.eligible_ranges() == [(5, 7)]
    window.close_step(8)
    assert window.gaps == [] and window.eligible_ranges() == [(5, 8)]


@pytest.mark.parametrize(("gap", "expected"), [((1, 2), [(3, 6)]), ((6, 7), [(2, 5)]), ((2, 2), [(3, 6)])])
def test_a_gap_that_touches_the_eligible_range_cuts_it(gap: tuple[int, int], expected: list) -> None:
    window = DPWindow(eligible_steps=5, admit_per_step=1, randomness=SeededRandomness(97))
    for step in range(1, 7):
        window.close_step(step)
    window.gaps = [gap]
    assert window.eligible_ranges() == expected


def test_record_ids_run_from_zero_across_slots_and_an_empty_window_holds_nothing() -> None:
    window = DPWindow(eligible_steps=4, admit_per_step=2, randomness=SeededRandomness(98))
    empty = window.eligible()
    assert empty.labels.shape == (0,) and empty.groups.shape == (0,) and empty.ages.shape == (0,)
    assert empty.labels.dtype == np.int64 and empty.groups.dtype == np.int64
    window.admit(kafka_batch([0]), step=1)  # a slot of one record
    window.close_step(1)
    window.admit(kafka_batch([2, 3]), step=2)
    window.close_step(2)
    eligible = window.eligible()
    assert eligible.groups.tolist() == [0, 1, 2] and eligible.ages.tolist() == [1, 0, 0]
    assert eligible.ages.dtype == np.int64 and eligible.groups.dtype == np.int64


def test_dropping_a_partition_without_pending_arrivals_leaves_the_others_pending() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(99))
    window.admit(kafka_batch([0, 1]), step=1)
    window.drop_partitions([1])
    assert window.close_step(1).admitted == {0: [0, 1]}


def test_resume_drops_the_pending_arrivals_of_the_last_recorded_step_and_only_decided_offsets() -> None:
    window = sensor_window(b=1, k=4)
    window.admit(kafka_batch([0], sensors=["b"]), step=1)
    window.close_step(1)
    window.admit(kafka_batch([1], sensors=["b2"]), step=2)
    window.close_step(2)
    window.ledger["b"] = (1, 2)  # a count and a last step that differ
    window.admit(kafka_batch([7], sensors=["c"]), step=3)  # pending at the last recorded step: decided then
    window.admit(placed_batch([(2, 0, "d"), (2, 9, "e"), (1, 0, "f")]), step=4)  # pending after it
    window.resume(3, {2: 1}, {3: ["b"]})
    assert window.ledger["b"] == (2, 3) and window.pending_steps == 1
    decision = window.close_step(4)  # offset 0 of partition 2 was decided; partition 1 has no mark yet
    assert decision.admitted == {1: [0], 2: [9]}


def test_the_r_smallest_keys_are_admitted_and_kept_exactly() -> None:
    big = 2**63
    for keys in ([big + 9, 3, big + 1, 2**64 - 1, 7], [50, 40, 30, 20, 10], [5, big, 1, big + 2, 3]):
        window = DPWindow(eligible_steps=3, admit_per_step=2, randomness=FixedKeys(keys))  # type: ignore[arg-type]
        window.admit(kafka_batch([0, 1]), step=1)
        window.admit(kafka_batch([2, 3, 4]), step=1)
        state = window.state_dict()
        smallest = sorted(range(5), key=lambda i: keys[i])[:2]
        assert sorted(np.asarray(state["pending"]["keys"]).tolist()) == sorted(keys[i] for i in smallest)
        assert window.close_step(1).admitted == {0: sorted(smallest)}, keys


def test_a_sensor_group_keeps_its_b_smallest_keys_and_a_ruled_out_sensor_does_not_stop_the_batch() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=5, randomness=FixedKeys([30, 10, 20, 99]), unit="sensor",
                      sensor_events=2)  # type: ignore[arg-type]  # fmt: skip
    window.admit(kafka_batch([0, 1, 2], sensors=["a", "a", "a"]), step=1)
    assert window.close_step(1).admitted == {0: [1, 2]}  # keys 10 and 20, not 30
    ruled = sensor_window(b=1, k=3, seed=100)
    ruled.ledger["x"] = (1, 1)
    ruled.admit(kafka_batch([0, 1], sensors=["x", "y"]), step=2)
    ruled.close_step(1)
    assert ruled.close_step(2).admitted == {0: [1]}


def strip_optional_keys(state: dict) -> dict:
    """A state as written before the keys that came later (unit, sensors, marks, ledger, gaps)."""
    optional = ("unit", "pending_sensors", "pending_group_keys", "pending_watermarks", "watermarks", "ledger",
                "ledger_sensors", "gaps")  # fmt: skip
    return {k: v for k, v in state.items() if k not in optional}


def test_an_old_state_without_the_later_keys_loads_and_shares_with_empty_defaults() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(101))
    window.admit(kafka_batch([0, 1]), step=1)
    window.close_step(1)
    window.admit(kafka_batch([2]), step=2)
    old = strip_optional_keys(window.state_dict())
    loaded = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(102))
    loaded.load_state_dict(old)
    assert loaded.ledger == {} and loaded.gaps == [] and loaded.watermarks == {}
    assert sorted(ids(loaded.eligible().values)) == [0, 1] and loaded.pending_steps == 1
    share = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(103))
    shared = share.share_state([old], lambda p: True)
    assert shared["ledger_sensors"] == [] and shared["gaps"].shape == (0, 2) and shared["watermarks"] == {}
    share.load_state_dict(shared)
    assert sorted(ids(share.eligible().values)) == [0, 1] and share.close_step(2).admitted == {0: [2]}


def test_a_state_round_trips_its_records_pending_groups_and_counts() -> None:
    window = sensor_window(b=2, k=3, seed=104)
    window.admit(kafka_batch([0, 1, 2], sensors=["a", "a", "b"]), step=1)
    window.close_step(1)
    window.admit(kafka_batch([3, 4, 5], sensors=["c", "d", "d"]), step=2)
    state = window.state_dict()
    clone = sensor_window(b=2, k=3, seed=105)
    clone.load_state_dict(state)
    again = clone.state_dict()
    for key in ("pending_sensors", "pending_arrivals", "pending_watermarks", "ledger_sensors", "first_admit_step"):
        assert again[key] == state[key], key
    for key in ("steps", "groups", "labels", "partitions", "offsets", "lengths"):
        np.testing.assert_array_equal(again["eligible"][key], state["eligible"][key])
        np.testing.assert_array_equal(again["pending"][key], state["pending"][key])
    assert clone.close_step(2).candidates == {0: ["c", "d"]}


def test_loading_another_k_or_unit_is_refused_with_the_whole_reason() -> None:
    sensor_state = sensor_window(k=3).state_dict()
    with pytest.raises(ValueError) as raised:
        DPWindow(eligible_steps=3, admit_per_step=10, randomness=SeededRandomness(0)).load_state_dict(sensor_state)
    assert str(raised.value) == (
        "DPWindow.load_state_dict: checkpoint was written with DP_UNIT=sensor, this run uses event; "
        "restore STREAMTRAIN_DP_UNIT or start from an empty checkpoint directory"
    )
    with pytest.raises(ValueError) as raised:
        sensor_window(k=4).load_state_dict(sensor_state)
    assert str(raised.value) == (
        "DPWindow.load_state_dict: checkpoint has K=3, this run K=4; "
        "restore STREAMTRAIN_DP_ELIGIBLE_STEPS or start from an empty checkpoint directory"
    )
    with pytest.raises(ValueError, match="cannot be shared into one of K=4, unit sensor"):
        sensor_window(k=4).share_state([sensor_state], lambda p: True)


def test_a_share_merges_one_sensors_pending_groups_and_the_largest_marks_across_windows() -> None:
    """Two old windows both hold a pending group of sensor "s" for step 1 (it sent on a partition of each)."""
    windows = []
    for rank, (keys, marks, offsets) in enumerate([([40, 10, 5], {0: 9}, [30, 31]), ([20, 30, 6], {0: 4}, [20, 21])]):
        window = DPWindow(eligible_steps=3, admit_per_step=5, randomness=FixedKeys(keys), unit="sensor",
                          sensor_events=2)  # type: ignore[arg-type]  # fmt: skip
        window.own([rank, 0], marks)
        window.admit(placed_batch([(rank, offsets[0], "s"), (0, offsets[1], "s")]), step=1)
        windows.append(window)
    states = [window.state_dict() for window in windows]
    share = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(106), unit="sensor",
                     sensor_events=2)  # fmt: skip
    shared = share.share_state(states, lambda p: True)
    assert shared["pending_sensors"] == ["s"] and shared["pending_arrivals"] == {"1": 2}
    assert np.asarray(shared["pending_group_keys"]).tolist() == [5]  # the smaller group key
    assert sorted(np.asarray(shared["pending"]["keys"]).tolist()) == [10, 20]  # its two smallest event keys
    assert np.asarray(shared["pending"]["groups"]).tolist() == [0, 0]  # both events in sensor "s"'s group
    # the largest of each partition's marks, pending or decided, whichever window holds it first
    assert shared["watermarks"] == {"0": 9} and shared["pending_watermarks"] == {"1": {"0": 32, "1": 21}}


def test_a_share_counts_every_sensors_pending_events_and_keeps_zero_marks() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(107), unit="sensor")
    window.admit(placed_batch([(3, 3, "a"), (3, 4, "b")]), step=1)
    window.admit(events(1), step=1)  # no offset (partition 0): a pending mark of 0
    window.own([5], {5: 0})
    window.next_offsets[5] = 0
    share = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(108), unit="sensor")
    shared = share.share_state([window.state_dict()], lambda p: True)
    assert shared["pending_arrivals"] == {"1": 3} and sorted(shared["pending_sensors"]) == ["a", "b", "s"]
    assert shared["pending_watermarks"] == {"1": {"3": 5, "0": 0}} and shared["watermarks"] == {"5": 0}
    assert shared["next_offsets"] == {"5": 0}


def test_a_step_whose_arrivals_were_all_ruled_out_is_still_pending_after_a_restore() -> None:
    """Its arrivals count and its marks move the watermark when it closes, though no group is left."""
    window = sensor_window(b=1, k=3)
    window.ledger["x"] = (1, 1)
    window.admit(kafka_batch([8], sensors=["x"]), step=2)  # ruled out: no group, but arrived and decided
    clone = sensor_window(b=1, k=3, seed=109)
    clone.load_state_dict(window.state_dict())
    assert clone.state_dict()["pending_arrivals"] == {"2": 1}
    clone.close_step(1)
    assert clone.close_step(2).watermarks == {0: 9}
