"""The sharded checkpoints under one root (``CHECKPOINT_DIR``): listing, reporting damage, pruning.

Pruning deletes a checkpoint's manifest first and fsyncs the directory before removing
the rest, so a half-deleted checkpoint is never taken for a complete one. Only rank 0
prunes, and only right after sealing a checkpoint, when no other checkpoint can be in
flight; it keeps every checkpoint a kept one's delta shards build on. The same root may
also hold one-file checkpoints (a world of one rank writes those); :func:`load_latest_common`
reads the newest of either kind.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamtrain.checkpoint.codec import skeleton_entry
from streamtrain.checkpoint.files import fsync_directory
from streamtrain.checkpoint.format import CorruptCheckpoint, LoadedCheckpoint, read_header
from streamtrain.checkpoint.manifest import Manifest, read_common, read_manifest
from streamtrain.checkpoint.shards import DIR_NAME, MANIFEST_NAME, checkpoint_dir_name
from streamtrain.checkpoint.store import CheckpointInfo, CheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointDirInfo:
    """A checkpoint directory as its name describes it (not yet verified)."""

    path: Path
    step: int
    created_ms: int
    complete: bool  # it has a manifest (not yet read)

    @property
    def order(self) -> tuple[int, int]:
        return (self.step, self.created_ms)


class ShardedCheckpointStore:
    """The sharded checkpoints under one root (``CHECKPOINT_DIR``), newest first.

    Writing goes through :class:`~streamtrain.checkpoint.collective.DistributedCheckpointer`
    (all ranks together); this class lists, reads and prunes.
    """

    def __init__(
        self,
        root: Path | str,
        keep: int = 3,
        on_corrupt: Callable[[Path, str], None] | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint")
        self.root = Path(root)
        self.keep = keep
        self.on_corrupt = on_corrupt
        self._reported: set[tuple[str, str]] = set()

    def directory_for(self, step: int, created_ms: int) -> Path:
        return self.root / checkpoint_dir_name(step, created_ms)

    def create_directory(self, step: int, created_ms: int) -> Path:
        """Make (or find) the directory of one checkpoint; every rank calls it."""
        path = self.directory_for(step, created_ms)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def scan(self) -> list[CheckpointDirInfo]:
        """Checkpoint directories by name, newest first (step, then creation time)."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        infos = []
        for entry in entries:
            match = DIR_NAME.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            complete = os.path.exists(os.path.join(entry.path, MANIFEST_NAME))
            infos.append(CheckpointDirInfo(Path(entry.path), int(match.group(1)), int(match.group(2)), complete))
        infos.sort(key=lambda info: info.order, reverse=True)
        return infos

    def manifests(self) -> list[Manifest]:
        """The manifests that parse, newest first; the rest are reported once and skipped."""
        found = []
        for info in self.scan():
            if not info.complete:
                continue
            try:
                found.append(read_manifest(info.path))
            except CorruptCheckpoint as err:
                self.report_corrupt(err)
        return found

    def report_corrupt(self, err: CorruptCheckpoint) -> None:
        key = (str(err.path), err.reason)
        if key in self._reported:
            return
        self._reported.add(key)
        log.warning("skipping checkpoint %s: %s; falling back to an older one", err.path, err.reason)
        if self.on_corrupt is not None:
            try:
                self.on_corrupt(err.path, err.reason)
            except Exception:  # noqa: BLE001
                log.exception("on_corrupt callback failed for %s", err.path)

    def delete(self, path: Path) -> None:
        """Delete one checkpoint directory, its manifest FIRST (then it is no longer complete)."""
        manifest = path / MANIFEST_NAME
        if manifest.exists():
            manifest.unlink()
            fsync_directory(path)
        shutil.rmtree(path)

    def prune(self, just_written: Path) -> list[Path]:
        """Keep the ``keep`` newest complete checkpoints and what their delta shards build on;
        delete older ones and older leftovers.

        Incomplete directories older than the one just written are failed attempts and go
        too; anything newer than it is left alone (and logged), as is ``just_written``. With
        ``keep >= 2``, while every kept checkpoint builds on one checkpoint (a base of their
        chains), the newest older checkpoint that does not is kept too: one damaged base
        never costs every restore point.
        """
        infos = self.scan()
        written = next((info for info in infos if info.path == just_written), None)
        if written is None:
            return []
        kept: list[CheckpointDirInfo] = []
        older: list[CheckpointDirInfo] = []
        for info in infos:
            if info.order > written.order:
                if info.complete:
                    kept.append(info)
                log.warning(
                    "checkpoint %s sorts after the one just written (%s); restore will prefer it. "
                    "Give each run its own checkpoint directory.",
                    info.path.name,
                    just_written.name,
                )
            elif info.path == just_written or (info.complete and len(kept) < self.keep):
                kept.append(info)
            else:
                older.append(info)
        needs = {info.path.name: self._needs(info) for info in kept}
        needed = set().union(*needs.values())
        shared = set.intersection(*needs.values()) if self.keep >= 2 else set()
        for info in older if shared else []:  # one damaged checkpoint would cost every kept one
            spare = self._needs(info) if info.complete else set()
            if spare and not spare & shared:  # a restore point beside them
                needed |= spare
                break
        deleted = []
        for info in older:
            if info.path.name in needed:
                continue
            try:
                self.delete(info.path)
                deleted.append(info.path)
            except OSError as exc:
                log.warning("could not delete old checkpoint %s: %s", info.path, exc)
        return deleted

    def _needs(self, info: CheckpointDirInfo) -> set[str]:
        """The checkpoint itself and those its delta shards build on (directory names); empty
        when its manifest does not parse (it restores nothing)."""
        try:
            return {info.path.name, *read_manifest(info.path).builds_on}
        except CorruptCheckpoint:
            return set()


def _newest_first(sharded: ShardedCheckpointStore, single_file: CheckpointStore) -> list[Manifest | CheckpointInfo]:
    """The checkpoints of both kinds under one root, newest first by (step, creation time); not verified."""
    candidates: list[tuple[int, int, Manifest | CheckpointInfo]] = [
        (m.step, m.created_ms, m) for m in sharded.manifests()
    ]
    candidates += [(i.step, i.created_ms, i) for i in single_file.list()]
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    return [candidate for _, _, candidate in candidates]


def load_latest_common(root: Path | str) -> LoadedCheckpoint | None:
    """The shared state (``{"trainer": ...}``) of the newest valid checkpoint of either kind.

    For readers that need only the model (``streamtrain export``): a sharded checkpoint's
    common state verified against its manifest, or a one-file checkpoint (whose state also
    holds the window). Newest by (step, creation time); damaged ones are skipped.
    """
    sharded = ShardedCheckpointStore(root)
    single_file = CheckpointStore(root)
    for candidate in _newest_first(sharded, single_file):
        if isinstance(candidate, Manifest):
            try:
                return read_common(candidate)
            except CorruptCheckpoint as err:
                sharded.report_corrupt(err)
                continue
        loaded = single_file.read(candidate.path)
        if loaded is not None:
            return loaded
    return None


def newest_model_config(root: Path | str) -> dict[str, Any] | None:
    """The model configuration (``trainer.model_config``) of the newest checkpoint of either kind,
    from its header alone; None when there is none.

    A look before the service builds its model, read without the payload (a one-file
    checkpoint holds the window too: gigabytes) and so not verified; the restore that
    follows verifies everything and refuses a model that does not fit. Checkpoints whose
    header cannot be read are passed over for the next newest, as the restore passes them.
    """
    for candidate in _newest_first(ShardedCheckpointStore(root), CheckpointStore(root)):
        path = candidate.directory / candidate.common["file"] if isinstance(candidate, Manifest) else candidate.path
        try:
            config = skeleton_entry(read_header(path)["skeleton"], "trainer", "model_config")
        except (CorruptCheckpoint, ValueError, TypeError, KeyError, RecursionError):
            continue
        if isinstance(config, dict):
            return config
    return None
