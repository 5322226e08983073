"""A directory of one-file checkpoints: written atomically, read verified, pruned to the newest.

The trainer restarts from what it last wrote: model, optimizer, normalization statistics,
RNG states and the window with the Kafka offsets it reflects. A crash mid-write or a full
disk must cost at most one checkpoint, a flipped bit at most the checkpoints built on the
damaged file (with ``keep >= 2``, never all of them once an older chain exists), and
reading one must never run code from the file. One checkpoint is one file,
``ckpt-{step:012d}-{unix_ms}.stck``, in the format of :mod:`streamtrain.checkpoint.format`,
written through :func:`streamtrain.checkpoint.files.write_atomically`; a file whose name
and header disagree on the step is refused. A file's window may be a delta on an older file
(:mod:`streamtrain.checkpoint.incremental`): reading it reads and verifies the chain back to
its base and replays it, and a broken chain makes the file unusable like a corrupt one;
pruning keeps what the kept files build on. A service of one process (a world of one rank)
writes these; scaled out, ranks write sharded checkpoints into the same directory
(:mod:`streamtrain.checkpoint.sharded_store`), and restore takes the newest of either kind.
"""

from __future__ import annotations

import builtins  # the store has a method named list
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamtrain.checkpoint.files import TEMP_SUFFIX, write_atomically
from streamtrain.checkpoint.format import (
    CorruptCheckpoint,
    LoadedCheckpoint,
    encode_checkpoint,
    read_checkpoint_file,
    read_digest,
)
from streamtrain.checkpoint.incremental import parent_of, replay

logger = logging.getLogger(__name__)

CHECKPOINT_SUFFIX = ".stck"

_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)-(\d+)\.stck$")
# files.temp_path of a checkpoint name: the pid of the process that writes it
_TEMP_NAME = re.compile(r"^\.ckpt-\d+-\d+\.stck\.(\d+)" + re.escape(TEMP_SUFFIX) + "$")


class CheckpointWriteError(Exception):
    """Writing a checkpoint failed (unwritable or full directory); nothing partial is left."""

    def __init__(self, directory: Path, step: int, cause: OSError) -> None:
        super().__init__(
            f"could not write the step-{step} checkpoint to {directory}: {cause}. "
            "Free space on that volume or make the directory writable by the service user "
            "(STREAMTRAIN_CHECKPOINT_DIR)."
        )
        self.directory = directory
        self.step = step
        self.cause = cause


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint file as its name describes it (not yet verified)."""

    path: Path
    step: int
    created_at: float  # Unix seconds, millisecond precision (from the file name)
    size_bytes: int

    @property
    def created_ms(self) -> int:
        """The creation time in the file's name, which orders checkpoints of one step."""
        return int(round(self.created_at * 1000))


def read_checkpoint(path: Path | str) -> LoadedCheckpoint:
    """Read, verify and decode a checkpoint file, and the chain its window builds on (if a delta).

    The window comes back whole, as a store's ``read`` gives it; CorruptCheckpoint names
    what failed: the file itself, or a link of its chain.
    """
    path = Path(path)
    reasons: builtins.list[tuple[Path, str]] = []
    loaded = CheckpointStore(path.parent, on_corrupt=lambda bad, reason: reasons.append((bad, reason))).read(path)
    if loaded is None:
        raise CorruptCheckpoint(path, next((reason for bad, reason in reasons if bad == path), "unreadable"))
    return loaded


def read_checkpoint_link(path: Path | str) -> LoadedCheckpoint:
    """Read, verify and decode one checkpoint file alone: a delta's window stays a delta.

    Its name must agree with its header.
    """
    path = Path(path)
    try:
        loaded = read_checkpoint_file(path)
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    name = _CHECKPOINT_NAME.match(path.name)
    if name is not None and int(name.group(1)) != loaded.step:
        raise CorruptCheckpoint(path, f"file name says step {int(name.group(1))}, header says step {loaded.step}")
    return loaded


_FileSignature = tuple[int, int, int]  # size, mtime_ns, inode: changes whenever the file does


@dataclass(frozen=True)
class _Verdict:
    """What reading a file found, valid while its signature stays the same."""

    signature: _FileSignature
    reason: str | None  # why the file itself is corrupt; None when it verifies
    parent: tuple[str, str] | None  # the checkpoint its window is a delta on: (name, prefix SHA-256)


class CheckpointStore:
    """A directory of the last `keep` good checkpoints, written atomically, read verified.

    `save` never leaves a partial file under a checkpoint name (temp file, fsync, rename,
    fsync of the directory) and raises CheckpointWriteError on any OS failure so the caller
    can count it and retry. `load_latest` falls back past corrupt files, logging each and
    calling ``on_corrupt(path, reason)`` once per file. Thread-safe; do not call it from a
    signal handler (set a flag there and save from the training loop).
    """

    def __init__(
        self,
        directory: Path | str,
        keep: int = 3,
        on_corrupt: Callable[[Path, str], None] | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: a checkpoint store must keep at least 1 checkpoint; pass keep >= 1")
        self.directory = Path(directory)
        self.keep = keep
        self.on_corrupt = on_corrupt
        self._clock = clock
        self._lock = threading.Lock()
        # verdicts of files already read: name -> their own integrity and the parent they build on
        self._verdicts: dict[str, _Verdict] = {}
        self._chain_reported: set[tuple[str, str]] = set()  # broken chains already reported

    # -- writing ---------------------------------------------------------------------------

    def save(self, state: Mapping[str, Any], step: int) -> Path:
        """Write `state` as the checkpoint of `step`, then prune; returns the new file."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: a checkpoint step must be a non-negative int")
        if not isinstance(state, Mapping):
            raise TypeError(f"state is a {type(state).__qualname__}; a checkpoint state must be a dict")
        created_at = float(self._clock())
        chunks = encode_checkpoint(state, step=step, created_at=created_at)
        with self._lock:
            final = self.directory / f"ckpt-{step:012d}-{int(created_at * 1000)}{CHECKPOINT_SUFFIX}"
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                written = write_atomically(final, chunks)
            except OSError as exc:
                raise CheckpointWriteError(self.directory, step, exc) from exc
            window = state.get("window")
            parent = parent_of(window) if isinstance(window, Mapping) else None
            self._verdicts[final.name] = _Verdict(_signature(written.stat), None, parent)
            try:
                self._prune(just_written=final)
            except OSError as exc:  # the checkpoint itself is safely written; pruning retries next save
                logger.warning("could not prune checkpoint directory %s: %s", self.directory, exc)
        logger.info("wrote checkpoint %s (step %d, %d bytes)", final, step, written.size)
        return final

    def _prune(self, just_written: Path) -> None:
        """Delete what is older than the `keep` newest good checkpoints, and stale temp files.

        Files newer than those (corrupt ones, or ones from a run at higher steps) stay, and
        so does the file just written even if its step sorts below them, every older
        checkpoint a kept delta builds on, and (``keep >= 2``) one checkpoint of an older
        chain while all kept ones build on one base.
        """
        valid: builtins.list[Path] = []
        doomed: builtins.list[Path] = []
        for info in self._scan():
            if len(valid) >= self.keep:
                doomed.append(info.path)
            elif info.path == just_written or self._chain_reason(info.path) is None:
                valid.append(info.path)
        spare = self._spare_restore_point(valid, doomed)
        if spare is not None:
            valid.append(spare)
        needed = {name for path in valid for name in self._ancestors(path.name)}  # the bases their deltas build on
        doomed = [path for path in doomed if path.name not in needed and path not in valid]
        if valid and valid[0] != just_written:
            logger.warning(
                "saved %s, but %s sorts after it (higher step); load_latest will prefer that one. "
                "Give each run its own checkpoint directory.",
                just_written.name,
                valid[0].name,
            )
        for path in doomed:
            if path != just_written:
                self._remove(path)
        for path in self._stale_temp_files():
            self._remove(path)

    def _spare_restore_point(self, kept: builtins.list[Path], older: builtins.list[Path]) -> Path | None:
        """With ``keep >= 2`` and every kept checkpoint built on one base: the newest sound
        checkpoint of another chain, so that one damaged base never costs every checkpoint."""
        if self.keep < 2 or not kept:
            return None
        roots = {self._root(path.name) for path in kept}
        if len(roots) > 1:
            return None
        for path in older:  # verified first: that also tells which base it builds on
            if self._chain_reason(path) is None and self._root(path.name) not in roots:
                return path
        return None

    def _root(self, name: str) -> str:
        """The base the window of ``name`` builds on (``name`` itself for a base)."""
        ancestors = self._ancestors(name)
        return ancestors[-1] if ancestors else name

    def _remove(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not delete old checkpoint file %s: %s", path, exc)
        self._verdicts.pop(path.name, None)

    def _stale_temp_files(self) -> builtins.list[Path]:
        stale = []
        for entry in os.scandir(self.directory):
            match = _TEMP_NAME.match(entry.name)
            # ours (we hold the lock, so no save is in flight) or from a process that is gone
            if match and (int(match.group(1)) == os.getpid() or not _process_alive(int(match.group(1)))):
                stale.append(Path(entry.path))
        return stale

    # -- reading ---------------------------------------------------------------------------

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies, or None; corrupt ones are logged and skipped."""
        with self._lock:
            try:
                infos = self._scan()
            except OSError as exc:
                logger.warning(
                    "cannot list checkpoint directory %s (%s); starting without a checkpoint", self.directory, exc
                )
                return None
            for info in infos:
                loaded = self._read(info.path)
                if loaded is not None:
                    logger.info("loaded checkpoint %s (step %d)", info.path, loaded.step)
                    return loaded
            return None

    def read(self, path: Path | str) -> LoadedCheckpoint | None:
        """Read and verify one checkpoint file of this store; None (logged and reported once) when corrupt."""
        with self._lock:
            return self._read(Path(path))

    def list(self) -> builtins.list[CheckpointInfo]:
        """Checkpoint files by name, newest first (step, then time); not verified."""
        with self._lock:
            return self._scan()

    @property
    def latest_step(self) -> int | None:
        """Step of the newest checkpoint that verifies (reads each file at most once)."""
        with self._lock:
            for info in self._scan():
                if self._is_valid(info.path):
                    return info.step
            return None

    def _scan(self) -> builtins.list[CheckpointInfo]:
        infos = []
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        for entry in entries:
            match = _CHECKPOINT_NAME.match(entry.name)
            if match is None:
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:
                continue
            infos.append(
                CheckpointInfo(
                    path=Path(entry.path),
                    step=int(match.group(1)),
                    created_at=int(match.group(2)) / 1000,
                    size_bytes=size,
                )
            )
        infos.sort(key=lambda info: (info.step, info.created_at), reverse=True)
        return infos

    def _is_valid(self, path: Path) -> bool:
        return self._chain_reason(path) is None

    def _inspect(self, path: Path) -> tuple[_Verdict | None, LoadedCheckpoint | None]:
        """The file's own verdict (cached by signature), and its contents when it had to read them."""
        try:
            signature = _signature(path.stat())
        except OSError as exc:
            self._report_corrupt(path, f"unreadable: {exc}", None)
            return None, None
        verdict = self._verdicts.get(path.name)
        if verdict is not None and verdict.signature == signature:
            return verdict, None
        try:
            loaded = read_checkpoint_link(path)
        except CorruptCheckpoint as exc:
            verdict = _Verdict(signature, exc.reason, None)
            self._report_corrupt(path, exc.reason, verdict)
            return verdict, None
        window = loaded.state.get("window")
        verdict = _Verdict(signature, None, parent_of(window) if isinstance(window, Mapping) else None)
        self._verdicts[path.name] = verdict
        return verdict, loaded

    def _walk(self, path: Path) -> tuple[builtins.list[Path], str | None, dict[Path, LoadedCheckpoint]]:
        """``path`` and the checkpoints its window builds on, newest first, or why that chain is
        broken; and the contents of the links it had to read to verify them.

        A broken chain is reported (once) against ``path``; a corrupt file, against itself.
        """
        chain = [path]
        contents: dict[Path, LoadedCheckpoint] = {}
        verdict, loaded = self._inspect(path)
        while True:
            if loaded is not None:
                contents[chain[-1]] = loaded
            if verdict is None or verdict.reason is not None:
                reason = "unreadable" if verdict is None else verdict.reason
                if len(chain) == 1:
                    return chain, reason, contents
                return chain, self._report_chain(path, f"its window builds on {chain[-1].name}: {reason}"), contents
            if verdict.parent is None:
                return chain, None, contents
            name, sha256 = verdict.parent
            parent = self.directory / name
            try:
                replaced = read_digest(parent) != sha256
            except OSError:
                return chain, self._report_chain(path, f"its window is a delta on {name}, which is missing"), contents
            if replaced or parent in chain:
                reason = f"its window is a delta on {name}, which was replaced by another file"
                return chain, self._report_chain(path, reason), contents
            chain.append(parent)
            verdict, loaded = self._inspect(parent)

    def _chain_reason(self, path: Path) -> str | None:
        """Why ``path`` cannot be restored (itself or a link of its chain damaged), or None."""
        return self._walk(path)[1]

    def _ancestors(self, name: str) -> builtins.list[str]:
        """The checkpoints the window of ``name`` builds on, by the verdicts already known."""
        names: builtins.list[str] = []
        verdict = self._verdicts.get(name)
        while verdict is not None and verdict.parent is not None and verdict.parent[0] not in names:
            names.append(verdict.parent[0])
            verdict = self._verdicts.get(verdict.parent[0])
        return names

    def _read(self, path: Path) -> LoadedCheckpoint | None:
        """Read and verify ``path`` (and the chain its window builds on); None (reported once) when corrupt."""
        chain, reason, contents = self._walk(path)
        if reason is not None:
            return None
        loaded = []
        for link in chain:
            try:
                loaded.append(contents.pop(link) if link in contents else read_checkpoint_link(link))
            except CorruptCheckpoint as exc:  # changed since it was inspected
                self._verdicts.pop(link.name, None)
                self._report_corrupt(link, exc.reason, None)
                return None
        newest, base = loaded[0], loaded[-1]
        if len(loaded) == 1:
            return newest
        window = replay(base.state["window"], [link.state["window"] for link in reversed(loaded[:-1])])
        logger.info("read checkpoint %s as a base and %d window deltas", path.name, len(loaded) - 1)
        return LoadedCheckpoint(
            state={**newest.state, "window": window}, step=newest.step, path=newest.path, created_at=newest.created_at
        )

    def _report_chain(self, path: Path, reason: str) -> str:
        """Report (once per file and reason) that ``path``'s chain is broken; returns the reason."""
        if (path.name, reason) not in self._chain_reported:
            self._chain_reported.add((path.name, reason))
            self._report_corrupt(path, reason, None)
        return reason

    def _report_corrupt(self, path: Path, reason: str, verdict: _Verdict | None) -> None:
        if verdict is not None:
            self._verdicts[path.name] = verdict
        logger.warning("skipping corrupt checkpoint %s: %s; falling back to an older one", path, reason)
        if self.on_corrupt is not None:
            try:
                self.on_corrupt(path, reason)
            except Exception:
                logger.exception("on_corrupt callback failed for %s", path)


def _signature(stat: os.stat_result) -> _FileSignature:
    return (stat.st_size, stat.st_mtime_ns, stat.st_ino)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True
