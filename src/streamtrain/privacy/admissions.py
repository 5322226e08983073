"""The admission record: what the DP window decided, durable before any model that used it is published.

Two append-only logs of JSON lines, each line closed by its CRC-32:

* per Kafka partition, ``<dir>/partition-<p>.jsonl``: for every closed step that decided
  arrivals of partition p, ``{"s": step, "w": watermark, "a": [admitted offsets],
  "c": [sensors that became candidates]}``; the watermark is one past the highest offset
  of p decided so far. Keyed by partition, so a partition's record moves with it between
  processes (``DP_ADMISSION_DIR`` on a volume the replicas share);
* per process, the clock log ``<checkpoint dir>/dp-clock.jsonl``: for every step that ran,
  ``{"s": step, "l": life, "e": [[lo, hi], ...]}`` — the admission steps whose records
  were eligible at it (``life`` counts the process's restarts).

Lines are buffered and written with ``fsync`` by :meth:`AdmissionRecord.sync`, which the
DP trainer calls before it publishes a model (and a rebalance before it gives a partition
away). On restart the record says the last step that ran (the clock continues after it)
and each partition's watermark (offsets below it are never offered again), so an event
takes part in at most its K eligible steps across crashes, restarts and partition moves
(docs/privacy.md). A torn last line (a crash mid-write, never synced, so never published)
is ignored; a damaged line before it is refused.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamtrain.checkpoint.files import fsync_directory
from streamtrain.privacy.window import StepDecision

log = logging.getLogger(__name__)

CLOCK_LOG = "dp-clock.jsonl"
ADMISSION_DIR = "dp-admissions"
SEGMENT_BYTES = 64 << 20  # a log past this size is rotated to <name>.1 (one old segment kept)
_PARTITION_FILE = re.compile(r"^partition-(\d+)\.jsonl(\.1)?$")


class AdmissionRecordError(ValueError):
    """The admission record is damaged or older than the checkpoint: restoring would re-admit events."""


def _encode(entry: Mapping[str, Any]) -> bytes:
    body = json.dumps(entry, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return f"{body}\t{zlib.crc32(body.encode('ascii')):08x}\n".encode("ascii")


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    """Verified entries of one log (its rotated segment first).

    A line without its newline is the torn end of a write that never completed — never
    synced, so nothing published depended on it — and is skipped. A complete line that
    fails its CRC is damage, and refused.
    """
    for part in (path.with_name(path.name + ".1"), path):
        try:
            data = part.read_bytes()
        except FileNotFoundError:
            continue
        *complete, tail = data.split(b"\n")
        if tail:
            log.warning("admission record %s: skipping a torn last line (%d bytes)", part, len(tail))
        for number, line in enumerate(complete, start=1):
            try:
                body, _, crc = line.decode("ascii").rpartition("\t")
                if int(crc, 16) != zlib.crc32(body.encode("ascii")):
                    raise ValueError("CRC mismatch")
                yield json.loads(body)
            except (ValueError, UnicodeDecodeError) as error:
                raise AdmissionRecordError(
                    f"admission record {part} line {number} is damaged ({error}); restore the file from backup "
                    "or start a new DP deployment (empty CHECKPOINT_DIR and DP_ADMISSION_DIR)"
                ) from None


def _last_watermark(path: Path, tail_bytes: int = 1 << 16) -> int | None:
    """The watermark of the last verified entry of one log file, reading only its tail."""
    try:
        with open(path, "rb") as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - tail_bytes))
            tail = file.read()
    except FileNotFoundError:
        return None
    for line in reversed(tail.split(b"\n")[1 if size > tail_bytes else 0 : -1]):  # complete lines only
        try:
            body, _, crc = line.decode("ascii").rpartition("\t")
            if int(crc, 16) == zlib.crc32(body.encode("ascii")):
                return int(json.loads(body)["w"])
        except (ValueError, UnicodeDecodeError, KeyError):
            continue
    if size > tail_bytes:  # no verified line in the tail: read it all (and refuse damage)
        marks = [int(entry["w"]) for entry in _read_lines(path)]
        return max(marks) if marks else None
    return None


def _cut_torn_tail(path: Path) -> None:
    """Before appending: drop a torn last line, so it cannot merge with the next one."""
    try:
        with open(path, "rb+") as file:
            size = file.seek(0, os.SEEK_END)
            if size == 0:
                return
            file.seek(size - 1)
            if file.read(1) == b"\n":
                return
            chunk = min(size, 1 << 20)
            file.seek(size - chunk)
            last_newline = file.read(chunk).rfind(b"\n")
            file.truncate(size - chunk + last_newline + 1 if last_newline >= 0 else 0)
    except FileNotFoundError:
        return


@dataclass
class RecordState:
    """What the record says on start-up."""

    last_step: int = 0  # the last step that ran, per the clock log
    life: int = 0  # restarts so far
    watermarks: dict[int, int] = field(default_factory=dict)
    candidates: dict[int, list[str]] = field(default_factory=dict)  # step -> sensors (sensor unit)


class AdmissionRecord:
    """Buffered, fsync'd admission logs; thread-safe (trainer appends and syncs, a rebalance syncs)."""

    def __init__(self, directory: Path | str, clock_path: Path | str, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self.clock_path = Path(clock_path)
        self.segment_bytes = int(segment_bytes)
        self._lock = threading.Lock()
        self._buffers: dict[Path, list[bytes]] = {}
        self.synced_step = 0  # every step up to this one is durable
        self._appended_step = 0
        self.life = 0

    def partition_path(self, partition: int) -> Path:
        return self.directory / f"partition-{int(partition)}.jsonl"

    # -- reading ---------------------------------------------------------------------------

    def load(self) -> RecordState:
        """Read both logs: the last step, the life count, watermarks and sensor candidacies."""
        state = RecordState()
        for entry in _read_lines(self.clock_path):
            state.last_step = max(state.last_step, int(entry["s"]))
            state.life = max(state.life, int(entry.get("l", 0)))
        for partition in self.partitions():
            self._read_partition(partition, state)
        self.synced_step = self._appended_step = state.last_step
        self.life = state.life + 1
        return state

    def partitions(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = {int(m.group(1)) for name in os.listdir(self.directory) if (m := _PARTITION_FILE.match(name))}
        return sorted(found)

    def _read_partition(self, partition: int, state: RecordState) -> None:
        for entry in _read_lines(self.partition_path(partition)):
            state.watermarks[partition] = max(state.watermarks.get(partition, 0), int(entry["w"]))
            if entry.get("c"):
                state.candidates.setdefault(int(entry["s"]), []).extend(str(s) for s in entry["c"])

    def watermarks(self, partitions: Sequence[int]) -> dict[int, int]:
        """The recorded watermark of each of ``partitions`` (read now: another process may have moved them).

        Watermarks only grow, so the last complete line of a log holds its partition's; only
        the log's tail is read (this runs in Kafka's rebalance callback).
        """
        found: dict[int, int] = {}
        for partition in partitions:
            path = self.partition_path(int(partition))
            for part in (path, path.with_name(path.name + ".1")):
                mark = _last_watermark(part)
                if mark is not None:
                    found[int(partition)] = mark
                    break
        return found

    # -- writing ---------------------------------------------------------------------------

    def append(self, decision: StepDecision, eligible: Sequence[tuple[int, int]]) -> None:
        """Buffer the entries of one step (its decisions, then the clock entry); nothing is written yet."""
        with self._lock:
            partitions = set(decision.watermarks) | set(decision.admitted) | set(decision.candidates)
            for partition in sorted(partitions):
                entry: dict[str, Any] = {
                    "s": decision.step,
                    "w": int(decision.watermarks.get(partition, 0)),
                    "a": [int(o) for o in decision.admitted.get(partition, [])],
                }
                if decision.candidates.get(partition):
                    entry["c"] = list(decision.candidates[partition])
                self._buffers.setdefault(self.partition_path(partition), []).append(_encode(entry))
            clock = {"s": decision.step, "l": self.life, "e": [[int(lo), int(hi)] for lo, hi in eligible]}
            self._buffers.setdefault(self.clock_path, []).append(_encode(clock))
            self._appended_step = max(self._appended_step, decision.step)

    def note_watermarks(self, step: int, watermarks: Mapping[int, int]) -> None:
        """Buffer partition entries that carry known watermarks (no admissions, no clock entry)."""
        with self._lock:
            for partition, mark in sorted(watermarks.items()):
                entry = {"s": int(step), "w": int(mark), "a": []}
                self._buffers.setdefault(self.partition_path(partition), []).append(_encode(entry))

    @property
    def pending(self) -> bool:
        return any(self._buffers.values())

    def sync(self) -> int:
        """Write and fsync everything buffered; returns the last durable step. Raises OSError.

        What could not be written stays buffered for the next call; the partition logs are
        made durable before the clock log, so the clock never shows a step whose decisions
        are missing.
        """
        with self._lock:
            target = self._appended_step
            paths = sorted((p for p in self._buffers if p != self.clock_path), key=str)
            if self.clock_path in self._buffers:
                paths.append(self.clock_path)
            for path in paths:
                lines = self._buffers.get(path)
                if lines:
                    self._write(path, lines)
                    self._buffers[path] = []
            self.synced_step = target
            return target

    def _write(self, path: Path, lines: list[bytes]) -> None:
        new_directory = not path.parent.exists()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _cut_torn_tail(path)
        try:
            if path.stat().st_size > self.segment_bytes:
                os.replace(path, path.with_name(path.name + ".1"))
        except FileNotFoundError:
            pass
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            data = b"".join(lines)
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        if created or new_directory:
            fsync_directory(path.parent)


# --------------------------------------------------------------------------------------------
# participation: what the record proves about every event
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Participation:
    """Per event (partition, offset): how often it was admitted and in how many steps it was eligible."""

    admissions: dict[tuple[int, int], list[int]]  # -> admission steps
    steps: dict[tuple[int, int], int]  # -> steps (all lives) at which one of its admissions was eligible


def participation(directory: Path | str, clock_path: Path | str) -> Participation:
    """Count, from the record alone, every admitted event's admissions and eligible steps."""
    record = AdmissionRecord(directory, clock_path)
    admissions: dict[tuple[int, int], list[int]] = {}
    for partition in record.partitions():
        for entry in _read_lines(record.partition_path(partition)):
            for offset in entry.get("a", []):
                admissions.setdefault((partition, int(offset)), []).append(int(entry["s"]))
    # steps at which each admission step's records were eligible, over every life
    eligible_at: dict[int, int] = {}
    for entry in _read_lines(Path(clock_path)):
        for lo, hi in entry.get("e", []):
            for admitted_at in range(int(lo), int(hi) + 1):
                eligible_at[admitted_at] = eligible_at.get(admitted_at, 0) + 1
    steps = {event: sum(eligible_at.get(s, 0) for s in at) for event, at in admissions.items()}
    return Participation(admissions, steps)
