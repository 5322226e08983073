"""The admission record: durable only after sync, torn tails skipped, damage refused, participation counted."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

import pytest

from streamtrain.privacy import admissions
from streamtrain.privacy.admissions import _SCAN_CHUNK as SCAN_CHUNK
from streamtrain.privacy.admissions import AdmissionRecord, AdmissionRecordError, participation, segments
from streamtrain.privacy.jsonlines import verified_entries
from streamtrain.privacy.ledger import LEDGER_LOG
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


# --------------------------------------------------------------------------------------- the files themselves


def lines_of(path: Path) -> list[dict]:
    return list(verified_entries(path.read_bytes(), path))


def test_segments_are_the_numbered_closed_files_in_order_then_the_open_one(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    for name in ("log.jsonl.2", "log.jsonl.10", "log.jsonl.1", "log.jsonl.bak", "other.jsonl.3", "snapshot-0012"):
        (tmp_path / name).write_bytes(b"")  # "snapshot-0012" has digits where a segment number would be
    closed = [tmp_path / f"log.jsonl.{n}" for n in (1, 2, 10)]
    assert segments(log) == closed  # a crash between closing a segment and opening the next: no open one
    log.write_bytes(b"")
    assert segments(log) == [*closed, log]
    assert segments(tmp_path / "missing" / "log.jsonl") == []


def test_a_record_names_its_writer_and_its_files_are_private(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        record = AdmissionRecord(tmp_path / "a" / "b" / "adm", tmp_path / "ckpt" / "dp-clock.jsonl", writer="w1")
        record.append(decision(1, {0: [3]}, {0: 4}), [(1, 1)])
        record.sync()
    finally:
        os.umask(umask)
    assert record.writer == "w1"
    assert lines_of(record.partition_path(0)) == [{"s": 1, "w": 4, "a": [3], "by": "w1"}]
    assert lines_of(record.clock_path) == [{"s": 1, "l": 0, "e": [[1, 1]], "by": "w1"}]
    assert stat.S_IMODE((tmp_path / "a" / "b" / "adm").stat().st_mode) == 0o700
    assert stat.S_IMODE(record.partition_path(0).stat().st_mode) == 0o600
    assert stat.S_IMODE(record.clock_path.stat().st_mode) == 0o600


def test_noted_watermarks_are_lines_of_the_record_format(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.note_watermarks(7, {3: 101, 1: 5})
    record.sync()
    assert lines_of(record.partition_path(3)) == [{"s": 7, "w": 101, "a": []}]
    assert lines_of(record.partition_path(1)) == [{"s": 7, "w": 5, "a": []}]


def test_a_partition_with_admissions_and_no_watermark_is_recorded_with_watermark_0(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.append(decision(1, {2: [5]}, {}), [(1, 1)])
    record.sync()
    assert make(tmp_path).load().watermarks == {2: 0}
    assert participation(tmp_path / "adm", record.clock_path).admissions == {(2, 5): [1]}


def test_every_load_starts_a_new_life_after_the_largest_recorded(tmp_path: Path) -> None:
    for life, step in ((0, 1), (1, 2), (2, 3)):
        record = make(tmp_path)
        if step > 1:
            assert record.load().life == life - 1
        assert record.life == life
        record.append(decision(step, {0: [step]}, {0: step + 1}), [(step, step)])
        record.sync()
    assert [line["l"] for line in lines_of(tmp_path / "ckpt" / "dp-clock.jsonl")] == [0, 1, 2]


def test_with_a_shared_ledger_the_record_leaves_candidacies_to_it(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.append(decision(3, {0: [1]}, {0: 2}, {0: ["a"]}), [(3, 3)])
    record.sync()
    (tmp_path / "adm" / LEDGER_LOG).write_bytes(b"")  # the shared ledger exists: it holds the candidacies
    assert make(tmp_path).load().candidates == {}


def test_sync_without_the_clock_and_a_fresh_records_sync(tmp_path: Path) -> None:
    """``clock=False``: the partition logs only; a step is durable only once no clock line of it waits."""
    assert make(tmp_path).sync() == 0  # nothing appended, nothing durable
    record = make(tmp_path)
    record.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    assert record.sync(clock=False) == 0 and record.synced_step == 0
    assert record.partition_path(0).exists() and not record.clock_path.exists() and record.pending
    assert record.sync() == 1 and lines_of(record.clock_path)[0]["s"] == 1
    record.append(decision(2, {0: [2]}, {0: 3}), [(1, 2)], clock=False)  # another rank writes the clock
    assert record.sync(clock=False) == 2 and not record.pending


def test_a_segment_is_closed_only_once_it_is_past_segment_bytes(tmp_path: Path) -> None:
    first = make(tmp_path)
    first.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    first.sync()
    size = first.partition_path(0).stat().st_size
    record = AdmissionRecord(tmp_path / "adm", tmp_path / "ckpt" / "dp-clock.jsonl", segment_bytes=size)
    record.append(decision(2, {0: [2]}, {0: 3}), [(1, 2)])
    record.sync()  # the log held exactly segment_bytes: appended to
    assert segments(record.partition_path(0)) == [record.partition_path(0)]
    record.append(decision(3, {0: [3]}, {0: 4}), [(1, 3)])
    record.sync()  # now past it: closed as .1, the new open segment starts with the largest watermark
    path = record.partition_path(0)
    assert segments(path) == [path.with_name("partition-0.jsonl.1"), path]
    assert [line["w"] for line in lines_of(path)] == [3, 4]


def test_each_new_segment_starts_with_one_line_carrying_the_largest_watermark_so_far(tmp_path: Path) -> None:
    record = AdmissionRecord(tmp_path / "adm", tmp_path / "clock.jsonl", segment_bytes=100)
    for step in range(1, 13):
        record.append(decision(step, {0: [10 * step]}, {0: 10 * step + 1}), [(1, step)])
        record.sync()
    parts = segments(record.partition_path(0))
    assert [p.name for p in parts[:-1]] == [f"partition-0.jsonl.{n}" for n in range(1, len(parts))]  # 1, 2, ...
    for previous, part in zip(parts, parts[1:]):
        entries = lines_of(part)
        assert entries[0] == {"s": 0, "w": max(line["w"] for line in lines_of(previous)), "a": []}
        assert all(line["s"] > 0 for line in entries[1:])  # one carried line, at the start only
    assert all(line["s"] > 0 for line in lines_of(record.clock_path))  # a clock segment carries no watermark


def test_a_crash_around_a_rotation_leaves_the_watermark_in_the_last_closed_segment(tmp_path: Path) -> None:
    record = AdmissionRecord(tmp_path / "adm", tmp_path / "clock.jsonl", segment_bytes=100)
    for step in range(1, 6):
        record.append(decision(step, {0: [10 * step]}, {0: 10 * step + 1}), [(1, step)])
        record.sync()
    path = record.partition_path(0)
    newest_closed = segments(path)[-2]
    path.write_bytes(b"")  # the new open segment was created, nothing written to it yet
    expected = {0: max(line["w"] for line in lines_of(newest_closed))}
    assert make(tmp_path).watermarks([0]) == expected
    path.unlink()  # or the crash came before it was created
    assert make(tmp_path).watermarks([0]) == expected


def test_a_log_of_only_a_torn_line_is_cut_to_nothing_before_the_next_append(tmp_path: Path) -> None:
    record = make(tmp_path)
    path = record.partition_path(0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"s":1,"w"')  # the very first write was cut short
    assert make(tmp_path).load().watermarks == {}
    record.append(decision(2, {0: [5]}, {0: 6}), [(1, 2)])
    record.sync()
    assert lines_of(path) == [{"s": 2, "w": 6, "a": [5], "by": record.writer}]


def test_a_torn_tail_one_byte_short_of_the_scan_chunk_keeps_the_line_before_it(tmp_path: Path) -> None:
    """The last newline is then the first byte of the scanned chunk: it still ends a complete line."""
    record = make(tmp_path)
    record.append(decision(1, {0: [5]}, {0: 6}), [(1, 1)])
    record.sync()
    with open(record.partition_path(0), "ab") as file:
        file.write(b"x" * (SCAN_CHUNK - 1))
    again = make(tmp_path)
    again.load()
    again.append(decision(2, {0: [7]}, {0: 8}), [(1, 2)])
    again.sync()
    assert [line["a"] for line in lines_of(record.partition_path(0))] == [[5], [7]]


def test_cutting_a_torn_line_is_logged_and_a_clean_append_logs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record = make(tmp_path)
    record.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    with caplog.at_level("WARNING", logger="streamtrain.privacy"):
        record.sync()
        record.append(decision(2, {0: [2]}, {0: 3}), [(1, 2)])
        record.sync()
    assert caplog.records == []
    path = record.partition_path(0)
    with open(path, "ab") as file:
        file.write(b'{"s":3,')
    again = make(tmp_path)
    again.append(decision(3, {0: [3]}, {0: 4}), [(1, 3)])
    with caplog.at_level("WARNING", logger="streamtrain.privacy.admissions"):
        again.sync()
    assert [r.getMessage() for r in caplog.records] == [f"admission record {path}: cutting a torn last line (7 bytes)"]


def test_a_damaged_line_is_refused_naming_its_file(tmp_path: Path) -> None:
    record = make(tmp_path)
    record.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    record.sync()
    path = record.partition_path(0)
    path.write_bytes(path.read_bytes().replace(b'"w":2', b'"w":3'))
    with pytest.raises(AdmissionRecordError) as refused:
        make(tmp_path).watermarks([0])
    assert f"admission record {path} line 1 is damaged" in str(refused.value)


def test_the_directory_is_synced_when_a_log_file_is_created_and_only_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    monkeypatch.setattr(admissions, "fsync_directory", lambda directory: synced.append(Path(directory)))
    record = AdmissionRecord(tmp_path / "adm", tmp_path / "ckpt" / "dp-clock.jsonl", segment_bytes=100)
    record.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    record.sync()
    assert sorted(synced) == [tmp_path / "adm", tmp_path / "ckpt"]  # two new files
    synced.clear()
    record.append(decision(2, {0: [2]}, {0: 3}), [(1, 2)])
    record.sync()
    assert synced == []  # appended to files that existed
    record.append(decision(3, {0: [3]}, {0: 4}), [(1, 3)])
    record.sync()  # past 100 bytes, both logs: the rename and the new open segment of each
    assert (tmp_path / "adm" / "partition-0.jsonl.1").exists() and (tmp_path / "ckpt" / "dp-clock.jsonl.1").exists()
    assert synced == [tmp_path / "adm"] * 2 + [tmp_path / "ckpt"] * 2


def test_short_writes_are_continued_where_they_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: pwrite(fd, data[:7], offset))
    record = make(tmp_path)
    for step in (1, 2):
        record.append(decision(step, {0: [step]}, {0: step + 1}), [(1, step)])
        record.sync()
    assert [line["a"] for line in lines_of(record.partition_path(0))] == [[1], [2]]


def test_a_segment_renamed_while_its_lock_was_awaited_is_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer closed the segment (renamed it away) while this one waited for the lock."""
    record = make(tmp_path)
    record.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    record.sync()
    path = record.partition_path(0)
    lockf, moved = fcntl.lockf, []

    def rotated_meanwhile(fd: int, operation: int) -> None:
        if not moved:
            moved.append(path.rename(path.with_name("partition-0.jsonl.1")))
        lockf(fd, operation)

    monkeypatch.setattr(fcntl, "lockf", rotated_meanwhile)
    record.append(decision(2, {0: [2]}, {0: 3}), [(1, 2)])
    record.sync()
    assert [line["a"] for line in lines_of(path)] == [[], [2]]  # the carried watermark, then the new line
    assert make(tmp_path).watermarks([0]) == {0: 3}


def test_a_failing_lock_is_raised_and_the_lines_stay_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "no locks available")

    record = make(tmp_path)
    record.append(decision(1, {0: [1]}, {0: 2}), [(1, 1)])
    monkeypatch.setattr(fcntl, "lockf", no_locks)
    with pytest.raises(OSError, match="no locks available"):
        record.sync()
    assert record.pending and record.synced_step == 0


def test_participation_over_several_clocks_matches_each_admission_with_its_writers_clock(tmp_path: Path) -> None:
    clocks = [tmp_path / name / "dp-clock.jsonl" for name in ("a", "b", "c")]
    for writer, clock, steps in (("a", clocks[0], 3), ("b", clocks[1], 2), ("c", clocks[2], 1)):
        record = AdmissionRecord(tmp_path / "adm", clock, writer=writer)
        record.append(decision(1, {ord(writer): [1]}, {ord(writer): 2}), [(1, 1)])
        for step in range(2, steps + 1):
            record.append(decision(step, {}, {}), [(1, step)])
        record.sync()
    before = sorted(p for p in tmp_path.rglob("*"))
    counted = participation(tmp_path / "adm", [str(clocks[0]), clocks[1]])  # c's clock is not given
    assert sorted(p for p in tmp_path.rglob("*")) == before  # the audit writes nothing
    assert counted.steps == {(97, 1): 3, (98, 1): 2, (99, 1): 0}
    assert counted.writers == {(97, 1): ["a"], (98, 1): ["b"], (99, 1): ["c"]}
