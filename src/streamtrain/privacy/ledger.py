"""The sensor ledger shared by every process that admits from one DP deployment (sensor unit).

A sensor's lifetime use must follow the sensor, not the process: its events may be spread
over partitions, and a partition may move between replicas. So every candidacy goes into
one append-only log in the shared ``DP_ADMISSION_DIR``, ``sensor-ledger.jsonl``: lines of
``{"s": step, "w": writer, "c": [sensors]}`` closed by their CRC-32, where ``writer`` names
the process (its checkpoint directory's ``dp-writer-id``) and ``step`` is that writer's
clock step.

A candidacy is decided by :meth:`SensorLedger.claim` under the log's POSIX record lock: it
reads what other writers appended since its last look, applies the rule, appends the
accepted candidacies and only then lets the lock go, so two processes can never both take
a sensor's last group. The rule (docs/privacy.md, the sensor unit):

* at most ``max_groups`` candidacies per sensor **in total**, over every writer — the
  lifetime bound the accountant composes;
* at most one every K steps **of the same writer's clock**: a group is eligible only in its
  own process's steps, so two groups of one sensor in *different* processes are never in
  the same release, and the spacing that keeps one record per sensor per release is a
  per-process matter (the clocks of two processes need not agree).

Durability: appended lines reach other processes at once (the lock orders them); they are
made durable by :meth:`sync`, which the admission record runs before its partition logs,
so everything a published model or checkpoint used is on disk. A line lost in a crash
belongs to a step that reached no release; another process that read it was only more
careful for it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from streamtrain.checkpoint.files import fsync_directory
from streamtrain.privacy.jsonlines import encode_line, verified_entries

log = logging.getLogger(__name__)

LEDGER_LOG = "sensor-ledger.jsonl"
WRITER_ID_FILE = "dp-writer-id"
#: The "last candidacy step" of a sensor this writer never made a candidate: any step is K past it.
NEVER = -(1 << 62)


def writer_id(directory: Path | str) -> str:
    """This process's stable name in the shared record: created once in its checkpoint directory."""
    path = Path(directory) / WRITER_ID_FILE
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    name = secrets.token_hex(8)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text(encoding="ascii").strip()
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(name + "\n")
        file.flush()
        os.fsync(file.fileno())
    fsync_directory(path.parent)
    return name


class SensorLedger:
    """Per sensor: (candidacies over every writer, this writer's last candidacy step).

    :attr:`entries` is the dict the DP window reads its rule from (the window holds the
    same object). Thread-safe; one instance per process and log (a POSIX lock is the
    process's, and closing any other descriptor of the file would drop it).
    """

    def __init__(self, path: Path | str, writer: str) -> None:
        self.path = Path(path)
        self.writer = str(writer)
        self.entries: dict[str, tuple[int, int]] = {}
        self._offset = 0  # bytes of the log already read into entries
        self._lock = threading.Lock()
        self._dirty = False

    def _apply(self, lines: Iterable[dict[str, object]]) -> None:
        for entry in lines:
            step = int(entry["s"])  # type: ignore[call-overload]
            own = entry.get("w") == self.writer
            for sensor in entry["c"]:  # type: ignore[attr-defined]
                count, last = self.entries.get(str(sensor), (0, NEVER))
                self.entries[str(sensor)] = (count + 1, max(last, step) if own else last)

    def _read_new(self, fd: int) -> None:
        """Apply the complete lines appended since the last read (a torn tail waits for its cut)."""
        size = os.lseek(fd, 0, os.SEEK_END)
        if size <= self._offset:
            return
        data = os.pread(fd, size - self._offset, self._offset)
        complete = data[: data.rfind(b"\n") + 1]
        self._apply(verified_entries(complete, self.path))
        self._offset += len(complete)

    def _locked(self) -> int:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def refresh(self) -> dict[str, tuple[int, int]]:
        """Read what every writer appended so far (start-up, and before a checkpoint is merged)."""
        with self._lock:
            fd = self._locked()
            try:
                self._read_new(fd)
            finally:
                os.close(fd)
            return self.entries

    def merge(self, known: dict[str, tuple[int, int]]) -> None:
        """Fold in a restored checkpoint's ledger (the log holds it already, unless it was lost)."""
        with self._lock:
            for sensor, (count, last) in known.items():
                have_count, have_last = self.entries.get(sensor, (0, NEVER))
                self.entries[sensor] = (max(count, have_count), max(last, have_last))

    def claim(self, step: int, sensors: list[str], allowed: Callable[[str, int], bool]) -> set[str]:
        """The ``sensors`` that become candidates at ``step``: ``allowed`` on the fresh ledger, recorded at once."""
        with self._lock:
            fd = self._locked()
            try:
                self._read_new(fd)
                size = os.lseek(fd, 0, os.SEEK_END)
                if size > self._offset:  # a torn tail (a writer died mid-append): never synced, cut it
                    log.warning("sensor ledger %s: cutting a torn last line (%d bytes)", self.path, size - self._offset)
                    os.ftruncate(fd, self._offset)
                accepted = [sensor for sensor in sensors if allowed(sensor, step)]
                if accepted:
                    line = encode_line({"s": int(step), "w": self.writer, "c": accepted})
                    written = 0
                    while written < len(line):
                        written += os.pwrite(fd, line[written:], self._offset + written)
                    self._offset += len(line)
                    self._dirty = True
                    for sensor in accepted:
                        count, _ = self.entries.get(sensor, (0, NEVER))
                        self.entries[sensor] = (count + 1, int(step))
            finally:
                os.close(fd)
            return set(accepted)

    def sync(self) -> None:
        """Make every appended line durable (OSError if it cannot be)."""
        with self._lock:
            if not self._dirty:
                return
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_directory(self.path.parent)
            self._dirty = False
