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


def test_a_partitions_watermark_is_the_largest_recorded_whatever_order_writers_appended(tmp_path: Path) -> None:
    """The rollback reproduction: the owner reached 251, then a restored process noted its checkpoint's 101."""
    owner = make(tmp_path)
    owner.append(decision(7, {3: [250]}, {3: 251}), [(1, 7)])
    owner.sync()
    restored = AdmissionRecord(tmp_path / "adm", tmp_path / "ckpt-b" / "dp-clock.jsonl")  # a replica, same dir
    restored.note_watermarks(2, {3: 101})
    restored.sync()
    assert make(tmp_path).watermarks([3]) == {3: 251}
    assert make(tmp_path).load().watermarks == {3: 251}


def test_a_torn_line_longer_than_the_scan_chunk_costs_no_synced_line(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.append(decision(1, {0: [5]}, {0: 6}), [(1, 1)])
    record.sync()
    with open(record.partition_path(0), "ab") as file:
        file.write(b'{"s":2,"w":9,"a":[' + b"1," * (1 << 20))  # a 2 MiB line cut short by a crash
    again = make(tmp_path)
    again.load()
    again.append(decision(2, {0: [7]}, {0: 8}), [(1, 2)])
    again.sync()
    state = make(tmp_path).load()
    assert state.watermarks == {0: 8}
    counted = participation(tmp_path / "adm", tmp_path / "ckpt" / "dp-clock.jsonl")
    assert counted.admissions == {(0, 5): [1], (0, 7): [2]}  # the synced line before the torn one is kept


def test_rotation_keeps_every_segment_and_the_open_one_carries_the_largest_watermark(tmp_path: Path) -> None:
    record = AdmissionRecord(tmp_path / "adm", tmp_path / "clock.jsonl", segment_bytes=100)
    for step in range(1, 13):
        record.append(decision(step, {0: [10 * step]}, {0: 10 * step + 1}), [(1, step)])
        record.sync()
    closed = sorted((tmp_path / "adm").glob("partition-0.jsonl.*"))
    assert len(closed) >= 3  # rotated several times: an old segment is never deleted
    counted = participation(tmp_path / "adm", tmp_path / "clock.jsonl")
    assert sorted(counted.admissions) == [(0, 10 * step) for step in range(1, 13)]
    away = tmp_path / "closed"
    away.mkdir()
    for segment in closed:
        segment.rename(away / segment.name)  # the open segment alone says the largest watermark ...
    record.append(decision(13, {}, {0: 5}), [(1, 13)])  # ... and a lower mark appended later does not win
    record.sync()
    assert AdmissionRecord(tmp_path / "adm", tmp_path / "other.jsonl").watermarks([0]) == {0: 121}


def _append_many(directory: str, clock: str, writer: int, count: int) -> None:
    record = AdmissionRecord(directory, clock, segment_bytes=1 << 16)
    for step in range(1, count + 1):
        offsets = list(range(writer * 100_000 + step * 100, writer * 100_000 + step * 100 + 60))
        record.append(decision(step, {0: offsets}, {0: offsets[-1] + 1}), [(1, step)])
        record.sync()


def test_processes_appending_to_one_log_at_once_never_interleave_a_line(tmp_path: Path) -> None:
    import multiprocessing

    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_append_many, args=(str(tmp_path / "adm"), str(tmp_path / f"clock-{w}.jsonl"), w, 150))
        for w in range(3)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    record = AdmissionRecord(tmp_path / "adm", tmp_path / "clock-0.jsonl")
    state = record.load()  # a damaged line would raise here
    assert state.watermarks == {0: 2 * 100_000 + 150 * 100 + 60}
    counted = participation(tmp_path / "adm", tmp_path / "clock-0.jsonl")
    assert len(counted.admissions) == 3 * 150 * 60  # every line of every writer, none lost or merged
