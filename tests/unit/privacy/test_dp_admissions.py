"""The admission record: durable only after sync, torn tails skipped, damage refused, participation counted."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamtrain.privacy.admissions import AdmissionRecord, AdmissionRecordError, participation
from streamtrain.privacy.window import StepDecision


def decision(step: int, admitted: dict[int, list[int]], watermarks: dict[int, int], candidates=None) -> StepDecision:
    return StepDecision(step, admitted, watermarks, candidates or {}, sum(map(len, admitted.values())))


def make(tmp_path: Path) -> AdmissionRecord:
    return AdmissionRecord(tmp_path / "adm", tmp_path / "ckpt" / "dp-clock.jsonl")


def test_nothing_is_written_before_sync_and_everything_after(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.append(decision(1, {0: [3, 4]}, {0: 6, 2: 1}), [(1, 1)])
    assert not (tmp_path / "adm").exists()  # buffered: a crash now loses only unpublished steps
    assert record.sync() == 1 and record.synced_step == 1
    state = make(tmp_path).load()
    assert state.last_step == 1 and state.watermarks == {0: 6, 2: 1} and state.life == 0
    again = make(tmp_path)
    again.load()
    assert again.life == 1  # the next run is a new life


def test_a_failed_sync_keeps_its_lines_for_the_next_one(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    (tmp_path / "adm").write_text("a file where the directory should be")
    with pytest.raises(OSError):
        record.sync()
    assert record.synced_step == 0 and record.pending
    (tmp_path / "adm").unlink()
    assert record.sync() == 1
    assert make(tmp_path).load().watermarks == {0: 2}


def test_a_torn_last_line_is_skipped_and_cut_before_the_next_append(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    record.sync()
    path = record.partition_path(0)
    with open(path, "ab") as file:
        file.write(b'{"s":2,"w":9,"a":[')  # a write cut short by a crash
    state = make(tmp_path).load()
    assert state.watermarks == {0: 2}
    second = make(tmp_path)
    second.load()
    second.append(decision(2, {0: [5]}, {0: 6}), [(1, 2)])
    second.sync()
    assert make(tmp_path).load().watermarks == {0: 6}  # the torn bytes did not merge with the new line


def test_a_damaged_complete_line_is_refused(tmp_path: Path) -> None:
    record = make(tmp_path)
    for step in (1, 2):
        record.append(decision(step, {0: [step]}, {0: step + 1}), [(1, step)])
    record.sync()
    path = record.partition_path(0)
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(AdmissionRecordError, match="damaged"):
        make(tmp_path).load()


def test_participation_counts_admissions_and_eligible_steps_over_lives(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.load()
    record.append(decision(1, {0: [0, 1]}, {0: 2}), [(1, 1)])
    record.append(decision(2, {1: [7]}, {1: 8}), [(1, 2)])
    record.append(decision(3, {}, {}), [(1, 3)])
    record.sync()
    later = make(tmp_path)  # a restart: slot 3 was lost (a gap), the clock goes on at 4
    later.load()
    later.append(decision(4, {0: [2]}, {0: 3}), [(1, 2), (4, 4)])
    later.append(decision(5, {}, {}), [(2, 2), (4, 5)])
    later.sync()
    counted = participation(tmp_path / "adm", tmp_path / "ckpt" / "dp-clock.jsonl")
    assert counted.admissions == {(0, 0): [1], (0, 1): [1], (1, 7): [2], (0, 2): [4]}
    assert counted.steps == {(0, 0): 4, (0, 1): 4, (1, 7): 4, (0, 2): 2}


def test_sensor_candidacies_are_recorded_for_the_ledger(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.append(decision(3, {0: [1]}, {0: 2}, {0: ["a", "b"]}), [(3, 3)])
    record.sync()
    assert make(tmp_path).load().candidates == {3: ["a", "b"]}


def test_a_full_log_is_rotated_and_still_read(tmp_path: Path) -> None:
    record = AdmissionRecord(tmp_path / "adm", tmp_path / "clock.jsonl", segment_bytes=64)
    for step in range(1, 6):
        record.append(decision(step, {0: [step]}, {0: step + 1}), [(1, step)])
        record.sync()
    assert (tmp_path / "adm" / "partition-0.jsonl.1").exists()
    state = AdmissionRecord(tmp_path / "adm", tmp_path / "clock.jsonl").load()
    assert state.watermarks == {0: 6} and state.last_step == 5


def test_a_moved_partitions_watermark_is_read_from_the_logs_tail(tmp_path: Path) -> None:
    record = make(tmp_path)
    for step in range(1, 400):
        record.append(decision(step, {3: [10 * step]}, {3: 10 * step + 1}), [(1, step)])
    record.sync()
    elsewhere = AdmissionRecord(tmp_path / "adm", tmp_path / "other-clock.jsonl")  # another process, same shared dir
    assert elsewhere.watermarks([3, 4]) == {3: 3991}
    with open(record.partition_path(3), "ab") as file:
        file.write(b'{"s":400,"w":99')  # torn: ignored
    assert elsewhere.watermarks([3]) == {3: 3991}
