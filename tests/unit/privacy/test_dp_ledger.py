"""The shared sensor ledger: a sensor's lifetime use follows the sensor across partitions and processes."""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

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


# --- the log itself (its mutation run) ---


def everyone(sensor: str, step: int) -> bool:
    return True


def test_a_writer_id_is_16_hex_characters_private_to_its_process_in_a_new_directory(tmp_path: Path) -> None:
    directory = tmp_path / "not" / "yet"
    name = writer_id(directory)
    assert len(name) == 16 and int(name, 16) >= 0
    assert (directory / "dp-writer-id").stat().st_mode & 0o777 == 0o600
    assert writer_id(directory) == name


def test_a_writer_id_created_by_another_process_meanwhile_is_the_one_kept(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "dp-writer-id").write_text("0123456789abcdef\n", encoding="ascii")
    reads = []
    original = Path.read_text

    def not_there_at_first(self: Path, *args, **kwargs) -> str:  # the other process writes it after our first look
        reads.append(self)
        if len(reads) == 1:
            raise FileNotFoundError(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", not_there_at_first)
    assert writer_id(tmp_path) == "0123456789abcdef" and len(reads) == 2


def test_the_ledger_lives_in_a_private_directory_and_file(tmp_path: Path) -> None:
    path = tmp_path / "admissions" / "nested" / "sensor-ledger.jsonl"
    SensorLedger(path, "w").claim(1, ["a"], everyone)
    assert path.parent.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600


def test_another_ledger_reads_every_line_and_only_the_sensors_allowed_are_claimed(tmp_path: Path) -> None:
    path = tmp_path / "sensor-ledger.jsonl"
    first = SensorLedger(path, "first")
    assert first.claim(4, ["a", "b", "c"], lambda sensor, step: sensor != "b" and step == 4) == {"a", "c"}
    assert first.claim(9, ["a"], everyone) == {"a"}
    assert first.entries == {"a": (2, 9), "c": (1, 4)}
    second = SensorLedger(path, "second")
    assert second.refresh() == {"a": (2, NEVER), "c": (1, NEVER)}  # counted; not its own steps
    assert SensorLedger(path, "first").refresh() == {"a": (2, 9), "c": (1, 4)}  # the same writer after a restart


def test_a_torn_last_line_is_cut_before_the_next_claim_and_only_then(tmp_path: Path, caplog) -> None:
    path = tmp_path / "sensor-ledger.jsonl"
    SensorLedger(path, "w").claim(1, ["a"], everyone)
    whole = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="streamtrain.privacy.ledger"):
        SensorLedger(path, "w").claim(2, ["b"], everyone)
    assert [r for r in caplog.records if r.name == "streamtrain.privacy.ledger"] == []  # nothing torn: nothing cut
    with path.open("ab") as log_file:
        log_file.write(b'{"s":3,"w":"dead","c":["x"]')  # a writer died mid-append
    reader = SensorLedger(path, "w")
    assert reader.refresh() == {"a": (1, 1), "b": (1, 2)}  # the torn tail is not read
    with caplog.at_level(logging.WARNING, logger="streamtrain.privacy.ledger"):
        assert reader.claim(4, ["c"], everyone) == {"c"}
    messages = [r.getMessage() for r in caplog.records if r.name == "streamtrain.privacy.ledger"]
    assert messages == [f"sensor ledger {path}: cutting a torn last line (27 bytes)"]
    assert path.read_bytes().startswith(whole) and path.read_bytes().endswith(b"\n")
    assert SensorLedger(path, "v").refresh() == {"a": (1, NEVER), "b": (1, NEVER), "c": (1, NEVER)}


def test_a_damaged_line_is_refused_naming_the_log(tmp_path: Path) -> None:
    from streamtrain.privacy.jsonlines import AdmissionRecordError

    path = tmp_path / "sensor-ledger.jsonl"
    SensorLedger(path, "w").claim(1, ["a"], everyone)
    path.write_bytes(path.read_bytes().replace(b'"a"', b'"z"'))
    with pytest.raises(AdmissionRecordError, match=f"admission record {path} line 1 is damaged"):
        SensorLedger(path, "w").refresh()


def test_a_short_write_is_completed(tmp_path: Path, monkeypatch) -> None:
    from streamtrain.privacy import ledger as ledger_module

    original = os.pwrite
    monkeypatch.setattr(ledger_module.os, "pwrite", lambda fd, data, offset: original(fd, data[:5], offset))
    path = tmp_path / "sensor-ledger.jsonl"
    SensorLedger(path, "w").claim(1, ["a", "b"], everyone)
    monkeypatch.setattr(ledger_module.os, "pwrite", original)
    assert SensorLedger(path, "v").refresh() == {"a": (1, NEVER), "b": (1, NEVER)}


def test_a_lock_that_cannot_be_taken_raises_its_own_error(tmp_path: Path, monkeypatch) -> None:
    from streamtrain.privacy import ledger as ledger_module

    def no_locks(fd: int, operation: int) -> None:
        raise OSError("no locks on this file system")

    monkeypatch.setattr(ledger_module.fcntl, "lockf", no_locks)
    with pytest.raises(OSError, match="no locks on this file system"):
        SensorLedger(tmp_path / "sensor-ledger.jsonl", "w").refresh()


def test_sync_makes_claims_durable_once(tmp_path: Path, monkeypatch) -> None:
    from streamtrain.privacy import ledger as ledger_module

    synced: list[int] = []
    original = os.fsync
    monkeypatch.setattr(ledger_module.os, "fsync", lambda fd: synced.append(fd) or original(fd))
    ledger = SensorLedger(tmp_path / "sensor-ledger.jsonl", "w")
    ledger.sync()
    assert synced == []  # nothing claimed: nothing to make durable
    ledger.claim(1, ["a"], everyone)
    ledger.sync()
    assert len(synced) == 2  # the log, then its directory
    ledger.sync()
    assert len(synced) == 2


def test_a_checkpoints_ledger_is_merged_by_the_larger_count_and_step(tmp_path: Path) -> None:
    ledger = SensorLedger(tmp_path / "sensor-ledger.jsonl", "w")
    ledger.claim(5, ["a", "b"], everyone)
    ledger.merge({"a": (3, 2), "b": (0, 7), "c": (2, NEVER)})
    assert ledger.entries == {"a": (3, 5), "b": (1, 7), "c": (2, NEVER)}


def test_a_log_in_the_documented_format_is_read_from_its_first_byte(tmp_path: Path) -> None:
    """Lines ``{"s": step, "w": writer, "c": [sensors]}`` closed by their CRC-32, as any writer appends them."""
    from streamtrain.privacy.jsonlines import encode_line

    path = tmp_path / "sensor-ledger.jsonl"
    path.write_bytes(
        encode_line({"s": 3, "w": "other", "c": ["q", "r"]}) + encode_line({"s": 8, "w": "me", "c": ["q"]})
    )
    assert SensorLedger(path, "me").refresh() == {"q": (2, 8), "r": (1, NEVER)}
