"""The shared sensor ledger: a sensor's lifetime use follows the sensor across partitions and processes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np

from streamtrain.data.randomness import SeededRandomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.privacy.admissions import AdmissionRecord
from streamtrain.privacy.ledger import NEVER, SensorLedger, writer_id
from streamtrain.privacy.window import DPWindow


def events(sensor: str, partition: int, offsets: list[int]) -> EventBatch:
    items = [SensorEvent(sensor, 0.0, np.full((2, 1), float(o), np.float32)) for o in offsets]
    return EventBatch.from_events(items, partitions=[partition] * len(offsets), offsets=offsets)


def process_window(shared: Path, name: str, max_groups: int, k: int = 3) -> tuple[DPWindow, AdmissionRecord]:
    """One process's DP window on the shared record: its own checkpoint directory, the shared admission dir."""
    record = AdmissionRecord(shared, shared.parent / name / "dp-clock.jsonl")
    record.load()
    window = DPWindow(eligible_steps=k, admit_per_step=10, randomness=SeededRandomness(len(name)), unit="sensor",
                      sensor_events=1, max_groups=max_groups)  # fmt: skip
    window.ledger = record.ledger.entries
    window.claim = record.ledger.claim
    return window, record


def test_a_sensors_lifetime_groups_follow_it_to_another_partition_and_process(tmp_path: Path) -> None:
    """The ledger-move reproduction: G = 1, the sensor's next events reach another replica."""
    shared = tmp_path / "admissions"
    first, first_record = process_window(shared, "replica-a", max_groups=1)
    first.admit(events("x", 0, [0, 1]), step=1)
    assert first.close_step(1).admitted_records == 1
    first_record.sync()
    second, _ = process_window(shared, "replica-b", max_groups=1)  # partition 3 lives here
    for step in range(1, 12):
        second.admit(events("x", 3, [10 * step]), step=step)
        second.admit(events("y", 3, [10 * step + 1]), step=step)
        decision = second.close_step(step)
        assert "x" not in sum(decision.candidates.values(), [])
    assert second.ledger["x"][0] == 1 and second.ledger["y"][0] == 1  # y had its one group; x had it elsewhere


def test_spacing_is_per_process_and_the_lifetime_count_is_shared(tmp_path: Path) -> None:
    """Two groups in different processes are never in the same release: only the count must be shared."""
    shared = tmp_path / "admissions"
    a, _ = process_window(shared, "a", max_groups=3, k=5)
    b, _ = process_window(shared, "b", max_groups=3, k=5)
    a.admit(events("x", 0, [0]), step=1)
    assert a.close_step(1).admitted_records == 1
    b.admit(events("x", 1, [0]), step=1)
    assert b.close_step(1).admitted_records == 1  # b's clock: x never had a group here
    b.admit(events("x", 1, [1]), step=2)
    assert b.close_step(2).admitted_records == 0  # but not twice within b's K steps
    for step in range(2, 7):
        a.admit(events("x", 0, [step]), step=step)
        a.close_step(step)
    assert a.ledger["x"] == (3, 6) and a.most_groups() == 3  # step 6 = 1 + K: its third group, the last
    for step in range(3, 20):
        b.admit(events("x", 1, [step]), step=step)
        assert b.close_step(step).admitted_records == 0  # G = 3 spent over both processes


def test_a_restarted_process_keeps_its_own_spacing_from_the_ledger(tmp_path: Path) -> None:
    shared = tmp_path / "admissions"
    window, record = process_window(shared, "a", max_groups=5, k=4)
    window.admit(events("x", 0, [0]), step=1)
    window.close_step(1)
    record.sync()
    # restart from a checkpoint taken before that candidacy: the ledger still has it, under this writer
    again, _ = process_window(shared, "a", max_groups=5, k=4)
    assert again.ledger["x"] == (1, 1)
    again.resume(2, {}, {})
    again.admit(events("x", 0, [1]), step=3)
    assert again.close_step(3).admitted_records == 0  # 3 - 1 < K
    other, _ = process_window(shared, "b", max_groups=5, k=4)
    assert other.ledger["x"] == (1, NEVER)  # another writer: the count, not the spacing


def _claim_once(path: str, writer: str, ready: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    ledger = SensorLedger(path, writer)
    ready.wait()
    won = 0
    for step in range(1, 200):
        won += len(ledger.claim(step, [f"s{step}"], lambda sensor, _: ledger.entries.get(sensor, (0, 0))[0] < 1))
    out.put(won)


def test_two_processes_never_both_take_a_sensors_last_group(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    ready, out = context.Barrier(3), context.Queue()
    path = str(tmp_path / "sensor-ledger.jsonl")
    workers = [context.Process(target=_claim_once, args=(path, f"w{i}", ready, out)) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert sum(out.get(timeout=5) for _ in workers) == 199  # each sensor's one group taken exactly once
    ledger = SensorLedger(path, "reader")
    assert all(count == 1 for count, _ in ledger.refresh().values()) and len(ledger.entries) == 199


def test_the_writer_id_is_kept_across_restarts(tmp_path: Path) -> None:
    name = writer_id(tmp_path / "ckpt")
    assert name == writer_id(tmp_path / "ckpt") and name != writer_id(tmp_path / "other")
