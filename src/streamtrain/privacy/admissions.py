"""The admission record: what the DP window decided, durable before any model that used it is published.

Two append-only logs of JSON lines, each line closed by its CRC-32:

* per Kafka partition, ``<dir>/partition-<p>.jsonl``: for every closed step that decided
  arrivals of partition p, ``{"s": step, "w": watermark, "a": [admitted offsets],
  "c": [sensors that became candidates]}``; the watermark is one past the highest offset
  of p the writer knew decided. Keyed by partition, so a partition's record moves with it
  between processes (``DP_ADMISSION_DIR`` on a volume the replicas share);
* per process, the clock log ``<checkpoint dir>/dp-clock.jsonl``: for every step that ran,
  ``{"s": step, "l": life, "e": [[lo, hi], ...]}`` — the admission steps whose records
  were eligible at it (``life`` counts the process's restarts).

Several processes may append to one partition log (a partition moving between replicas, a
restored process noting what its checkpoint knew), in any order: a partition's watermark
is the **largest** in its log, never the last, so it only grows. Each append holds a POSIX
record lock (``fcntl.lockf``; NFS v3 with lockd and v4 support it, as do local and
ReadWriteMany volumes) over the cut of a torn tail, the write and the ``fsync``, so lines
of two writers cannot interleave. A log past ``segment_bytes`` is closed as
``<name>.<n>`` (n = 1, 2, ...; none is ever deleted: the participation proof reads them
all) and its successor starts with a line carrying the closed segment's largest
watermark, so a reader needs only the open segment.

Lines are buffered and written with ``fsync`` by :meth:`AdmissionRecord.sync`, which the
DP trainer calls before it publishes a model (and a rebalance before it gives a partition
away). On restart the record says the last step that ran (the clock continues after it)
and each partition's watermark (offsets below it are never offered again), so an event
takes part in at most its K eligible steps across crashes, restarts and partition moves
(docs/privacy.md). A torn last line (a crash mid-write, never synced, so never published)
is ignored and cut before the next append — only the bytes after the last complete line,
however long that line is; a damaged complete line is refused.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamtrain.checkpoint.files import fsync_directory
from streamtrain.privacy.jsonlines import AdmissionRecordError as AdmissionRecordError
from streamtrain.privacy.jsonlines import encode_line, verified_entries
from streamtrain.privacy.ledger import LEDGER_LOG, SensorLedger, writer_id
from streamtrain.privacy.window import StepDecision

log = logging.getLogger(__name__)

CLOCK_LOG = "dp-clock.jsonl"
ADMISSION_DIR = "dp-admissions"
SEGMENT_BYTES = 8 << 20  # an open log past this size is closed as <name>.<n> and a new one begun
_PARTITION_FILE = re.compile(r"^partition-(\d+)\.jsonl(\.\d+)?$")
_SCAN_CHUNK = 1 << 20


def segments(path: Path) -> list[Path]:
    """A log's files in write order: its closed segments ``<name>.1``, ``<name>.2``, ..., then the open one."""
    closed: list[tuple[int, Path]] = []
    try:
        names = os.listdir(path.parent)
    except FileNotFoundError:
        return []
    prefix = path.name + "."
    for name in names:
        suffix = name[len(prefix) :] if name.startswith(prefix) else ""
        if suffix.isdigit():
            closed.append((int(suffix), path.with_name(name)))
    found = [p for _, p in sorted(closed)]
    return found + [path] if path.exists() else found


def _read_segment(part: Path) -> Iterator[dict[str, Any]]:
    """Verified entries of one file (see :func:`_entries`)."""
    try:
        data = part.read_bytes()
    except FileNotFoundError:
        return
    yield from verified_entries(data, part)


def _read_lines(path: Path) -> Iterator[dict[str, Any]]:
    """Verified entries of one log, every segment in write order."""
    for part in segments(path):
        yield from _read_segment(part)


def _largest_watermark(entries: Iterator[dict[str, Any]]) -> int | None:
    """The largest watermark among one file's entries (the open segment starts with its predecessor's)."""
    marks = [int(entry["w"]) for entry in entries if "w" in entry]
    return max(marks) if marks else None


def _complete_length(fd: int, size: int) -> int:
    """The length of the file up to and including its last newline (0 if it has none)."""
    end = size
    while end > 0:
        start = max(0, end - _SCAN_CHUNK)
        chunk = os.pread(fd, end - start, start)
        newline = chunk.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def _lock_open_segment(path: Path) -> int:
    """Open ``path`` and hold its write lock, retrying if another writer closed the segment meanwhile.

    A POSIX record lock belongs to the process and ends when *any* of its descriptors of the
    file is closed: while it is held, the process must not open and close the file elsewhere
    (:class:`AdmissionRecord` reads under its own lock, and rotation reads through this one).
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass  # renamed away between the lock and the stat: open the new segment
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@dataclass
class RecordState:
    """What the record says on start-up."""

    last_step: int = 0  # the last step that ran, per the clock log
    life: int = 0  # restarts so far
    watermarks: dict[int, int] = field(default_factory=dict)
    candidates: dict[int, list[str]] = field(default_factory=dict)  # step -> sensors (sensor unit)


class AdmissionRecord:
    """Buffered, fsync'd admission logs; thread-safe (trainer appends and syncs, a rebalance syncs)."""

    def __init__(
        self,
        directory: Path | str,
        clock_path: Path | str,
        segment_bytes: int = SEGMENT_BYTES,
        writer: str | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.clock_path = Path(clock_path)
        self.segment_bytes = int(segment_bytes)
        #: This process's name in the shared record (its checkpoint directory keeps it across restarts).
        self.writer = writer if writer is not None else writer_id(self.clock_path.parent)
        self.ledger = SensorLedger(self.directory / LEDGER_LOG, self.writer)
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
        with self._lock:
            for entry in _read_lines(self.clock_path):
                state.last_step = max(state.last_step, int(entry["s"]))
                state.life = max(state.life, int(entry.get("l", 0)))
            shared_ledger = self.ledger.path.exists()
            for partition in self.partitions():
                self._read_partition(partition, state)
            if shared_ledger:
                state.candidates = {}  # the shared ledger has them, with their writers (privacy/ledger.py)
                self.ledger.refresh()
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

        The largest watermark any writer recorded, whatever order they wrote in; only the
        open segment is read (it starts with the largest of the closed ones). Raises
        :class:`AdmissionRecordError` for a damaged line.
        """
        found: dict[int, int] = {}
        with self._lock:  # not while this process holds a log's record lock (see _lock_open_segment)
            for partition in partitions:
                found.update(self._watermark(int(partition)))
        return found

    def _watermark(self, partition: int) -> dict[int, int]:
        """The open segment's largest watermark; the last closed one's if a crash left none open."""
        for part in reversed(segments(self.partition_path(partition))):
            mark = _largest_watermark(_read_segment(part))
            if mark is not None:
                return {partition: mark}
        return {}

    # -- writing ---------------------------------------------------------------------------

    def append(self, decision: StepDecision, eligible: Sequence[tuple[int, int]], *, clock: bool = True) -> None:
        """Buffer the entries of one step (its decisions, then the clock entry); nothing is written yet.

        ``clock=False``: the step's clock entry is another process's to write (a rank other than
        rank 0 of a DP group: the group has one clock, and one line per step keeps the count of
        each admission's eligible steps exact, see :func:`participation`).
        """
        with self._lock:
            partitions = set(decision.watermarks) | set(decision.admitted) | set(decision.candidates)
            for partition in sorted(partitions):
                entry: dict[str, Any] = {
                    "s": decision.step,
                    "w": int(decision.watermarks.get(partition, 0)),
                    "a": [int(o) for o in decision.admitted.get(partition, [])],
                    "by": self.writer,
                }
                if decision.candidates.get(partition):
                    entry["c"] = list(decision.candidates[partition])
                self._buffers.setdefault(self.partition_path(partition), []).append(encode_line(entry))
            if clock:
                entry = {
                    "s": decision.step,
                    "l": self.life,
                    "e": [[int(lo), int(hi)] for lo, hi in eligible],
                    "by": self.writer,
                }
                self._buffers.setdefault(self.clock_path, []).append(encode_line(entry))
            self._appended_step = max(self._appended_step, decision.step)

    def note_watermarks(self, step: int, watermarks: Mapping[int, int]) -> None:
        """Buffer partition entries that carry known watermarks (no admissions, no clock entry)."""
        with self._lock:
            for partition, mark in sorted(watermarks.items()):
                entry = {"s": int(step), "w": int(mark), "a": []}
                self._buffers.setdefault(self.partition_path(partition), []).append(encode_line(entry))

    @property
    def pending(self) -> bool:
        return any(self._buffers.values())

    def sync(self, *, clock: bool = True) -> int:
        """Write and fsync everything buffered; returns the last durable step. Raises OSError.

        What could not be written stays buffered for the next call; the partition logs are
        made durable before the clock log, so the clock never shows a step whose decisions
        are missing. ``clock=False`` leaves the clock log buffered: a DP group's rank 0 writes
        it only once every rank's decisions are durable (:meth:`DPEngine.sync_record`).
        """
        with self._lock:
            target = self._appended_step
            self.ledger.sync()  # candidacies first: a partition log never points at a lost one
            paths = sorted((p for p in self._buffers if p != self.clock_path), key=str)
            if clock and self.clock_path in self._buffers:
                paths.append(self.clock_path)
            for path in paths:
                lines = self._buffers.get(path)
                if lines:
                    self._write(path, lines)
                    self._buffers[path] = []
            if clock or not self._buffers.get(self.clock_path):  # no clock line left waiting: all durable
                self.synced_step = target
            return self.synced_step

    def _write(self, path: Path, lines: list[bytes]) -> None:
        """Append ``lines`` under the log's lock: cut a torn tail, close a full segment, write, fsync."""
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        existed = path.exists()
        fd = _lock_open_segment(path)
        try:
            while True:
                size = os.lseek(fd, 0, os.SEEK_END)
                complete = _complete_length(fd, size)
                if complete < size:  # a crash mid-write left a line without its newline: never synced
                    log.warning("admission record %s: cutting a torn last line (%d bytes)", path, size - complete)
                    os.ftruncate(fd, complete)
                if complete <= self.segment_bytes:
                    break
                earlier = segments(path)[:-1]
                number = int(earlier[-1].name.rsplit(".", 1)[1]) + 1 if earlier else 1
                os.rename(path, path.with_name(f"{path.name}.{number}"))  # writers waiting reopen the new one
                fsync_directory(path.parent)
                new_fd = _lock_open_segment(path)  # maybe already begun by another writer
                os.close(fd)  # releases the closed segment's lock
                fd, existed = new_fd, False
            if complete == 0 and path != self.clock_path:
                earlier = segments(path)[:-1]
                carried = _largest_watermark(_read_segment(earlier[-1])) if earlier else None
                if carried is not None:  # a new open segment starts with the largest watermark so far
                    lines = [encode_line({"s": 0, "w": carried, "a": []}), *lines]
            data = b"".join(lines)
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], complete + written)
            os.fsync(fd)
        finally:
            os.close(fd)
        if not existed:
            fsync_directory(path.parent)


# --------------------------------------------------------------------------------------------
# participation: what the record proves about every event
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Participation:
    """Per event (partition, offset): how often it was admitted and in how many steps it was eligible."""

    admissions: dict[tuple[int, int], list[int]]  # -> admission steps
    steps: dict[tuple[int, int], int]  # -> steps (all lives) at which one of its admissions was eligible
    writers: dict[tuple[int, int], list[str | None]]  # -> the process that made each admission


def participation(directory: Path | str, clock_paths: Path | str | Sequence[Path | str]) -> Participation:
    """Count, from the record alone, every admitted event's admissions and eligible steps.

    ``clock_paths``: the clock log of every process that wrote to ``directory`` (one per
    replica). An admission is matched with the clock of the process that made it (each
    line names its writer; lines of a record from before writers were named share one).
    """
    paths = [Path(clock_paths)] if isinstance(clock_paths, (str, Path)) else [Path(p) for p in clock_paths]
    record = AdmissionRecord(directory, paths[0], writer="participation-audit")
    admissions: dict[tuple[int, int], list[int]] = {}
    made_by: dict[tuple[int, int], list[str | None]] = {}
    for partition in record.partitions():
        for entry in _read_lines(record.partition_path(partition)):
            for offset in entry.get("a", []):
                admissions.setdefault((partition, int(offset)), []).append(int(entry["s"]))
                made_by.setdefault((partition, int(offset)), []).append(entry.get("by"))
    # per writer: steps at which each admission step's records were eligible, over every life
    eligible_at: dict[str | None, dict[int, int]] = {}
    for path in paths:
        for entry in _read_lines(path):
            counts = eligible_at.setdefault(entry.get("by"), {})
            for lo, hi in entry.get("e", []):
                for admitted_at in range(int(lo), int(hi) + 1):
                    counts[admitted_at] = counts.get(admitted_at, 0) + 1
    steps = {
        event: sum(eligible_at.get(by, {}).get(s, 0) for s, by in zip(at, made_by[event], strict=True))
        for event, at in admissions.items()
    }
    return Participation(admissions, steps, made_by)
