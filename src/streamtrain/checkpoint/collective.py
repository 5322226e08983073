"""Cutting and restoring sharded checkpoints with every rank, in lockstep.

Every rank takes part in every collective below, whatever happens on it: a rank that
fails to write still reports its failure in the gather, so the others never wait on
it, and the outcome (sealed or not, the step restored) is the same on every rank. No
two ranks ever restore different checkpoints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamtrain.checkpoint.format import CorruptCheckpoint, LoadedCheckpoint
from streamtrain.checkpoint.incremental import Kind, PendingWindow, WindowChain
from streamtrain.checkpoint.manifest import read_manifest, write_manifest
from streamtrain.checkpoint.rescale import CheckpointMismatch, RestoredShare, restore_share, share_from_single_file
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.shards import FileReceipt, shard_name, shard_present, write_common, write_shard
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.ownership import Ownership
from streamtrain.window.reservoir import WindowCapture

log = logging.getLogger(__name__)

# a restore candidate's kind, as broadcast to every rank
_SHARDED, _SINGLE_FILE = 0, 1
# a candidate's verdict on one rank; the worst over the ranks decides
_LOADED, _CORRUPT, _MISMATCH = 0, 1, 2


@dataclass(frozen=True)
class SaveResult:
    """The outcome of one collective checkpoint, the same on every rank (but next_offsets)."""

    ok: bool  # the manifest is durable: the checkpoint is complete
    step: int
    path: Path
    next_offsets: dict[int, int]  # this rank's partitions: commit them to the group once ok
    error: str | None
    seconds: float
    kind: Kind = "base"  # this rank's shard: its window whole, or a delta on its last sealed shard
    shard_bytes: int = 0  # of this rank's shard, once sealed


class DistributedCheckpointer:
    """Cuts and restores sharded checkpoints with every rank, in lockstep.

    ``save`` must be called by every rank at the same step (the lockstep agreement
    decides when): each writes its shard, rank 0 also the shared state; the receipts are
    gathered; rank 0 seals the checkpoint with the manifest and tells everyone. A rank
    that fails to write makes the whole checkpoint fail (no manifest), on every rank alike.

    ``restore`` walks the complete checkpoints newest first, as rank 0 lists them, until
    one loads on every rank; a corrupt one anywhere makes every rank fall back together,
    so no two ranks ever restore different steps.
    """

    def __init__(
        self,
        store: ShardedCheckpointStore,
        collectives: Collectives,
        *,
        topic: str,
        chain: WindowChain | None = None,
    ) -> None:
        self.store = store
        self.collectives = collectives
        self.topic = topic
        # this rank's shards: each a delta on its shard of the last sealed checkpoint, or a base
        self.chain = chain if chain is not None else WindowChain(by_partition=True)
        if not self.chain.by_partition:
            raise ValueError("a shard splits its window by partition: pass WindowChain(by_partition=True)")

    @property
    def rank(self) -> int:
        return self.collectives.rank

    def save(
        self,
        *,
        step: int,
        partition_count: int,
        window_state: Mapping[str, Any] | WindowCapture,
        common_state: Mapping[str, Any] | None,
        rank_state: Mapping[str, Any] | None = None,
        partitioned_state: Mapping[str, Any] | None = None,
        veto: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> SaveResult:
        """Cut this rank's part of the checkpoint of ``step``; every rank calls it together.

        ``window_state``: this rank's window, whole (:meth:`RecencyWindow.state_dict`, written
        as a base), or captured (:meth:`RecencyWindow.capture_state`): then the shard is a
        delta on this rank's shard of the last checkpoint this checkpointer sealed, where
        :attr:`chain` allows one. ``rank_state`` and ``partitioned_state`` (whole in a delta
        shard too): see :func:`~streamtrain.checkpoint.shards.write_shard`. ``veto`` (a
        reason) makes this rank refuse the checkpoint while still taking part in its
        collectives, e.g. when its dead letters are not acknowledged: then no manifest is
        written and every rank gets ``ok=False``.
        """
        started = time.perf_counter()
        c = self.collectives
        if c.rank == 0 and common_state is None:
            raise ValueError("rank 0 writes the shared state: pass common_state")
        held = (
            _partitions_held(window_state.partitions, window_state.next_offsets)
            if isinstance(window_state, WindowCapture)
            else _partitions_held(window_state["partitions"], window_state["next_offsets"])
        )
        # rank 0's clock names the directory; the partition count is the largest any rank saw,
        # and at least covers every partition a window holds state of
        partition_count = max(int(partition_count), held)
        proposal = c.all_gather_rows(
            torch.tensor([int(clock() * 1000), int(step), int(partition_count)], dtype=torch.int64)
        )
        created_ms = int(proposal[0, 0])
        if bool((proposal[:, 1] != step).any()):
            raise RuntimeError(
                f"ranks cut a checkpoint at different steps {proposal[:, 1].tolist()}; they must run in lockstep"
            )
        partition_count = int(proposal[:, 2].max())
        ownership = Ownership(world_size=c.world_size, partition_count=partition_count)
        created_at = created_ms / 1000
        directory = self.store.directory_for(step, created_ms)
        error: str | None = None
        receipt = FileReceipt(file=shard_name(c.rank), size=0, sha256="0" * 64, index_sha256="0" * 64)
        common_receipt: FileReceipt | None = None
        window: Mapping[str, Any] | PendingWindow = {}
        try:
            if veto is not None:
                raise RuntimeError(veto)
            if isinstance(window_state, WindowCapture):
                window = self.chain.next_window(
                    window_state,
                    parent_present=lambda parent: shard_present(self.store.root, parent),
                    scope=(c.rank, ownership),
                )
            else:
                window = window_state
            self.store.create_directory(step, created_ms)
            receipt = write_shard(
                directory,
                step=step,
                rank=c.rank,
                ownership=ownership,
                topic=self.topic,
                window_state=window,
                rank_state=rank_state,
                partitioned_state=partitioned_state,
                created_at=created_at,
            )
            if c.rank == 0:
                common_receipt = write_common(directory, common_state or {}, step=step, created_at=created_at)
        except Exception as err:  # noqa: BLE001 - the others must hear about it, not wait for us
            error = (
                f"rank {c.rank} could not write its part of checkpoint {directory.name}: {type(err).__name__}: {err}"
            )
            log.error("%s", error)
        rows = c.all_gather_rows(receipt.as_row(ok=error is None))
        sealed = False
        if c.rank == 0:
            receipts = []
            failed = []
            for rank, row in enumerate(rows.tolist()):
                ok, shard_receipt = FileReceipt.from_row(row, shard_name(rank))
                receipts.append(shard_receipt)
                if not ok:
                    failed.append(rank)
            if failed or common_receipt is None:
                error = error or f"ranks {failed} could not write their shards of {directory.name}"
            else:
                try:
                    write_manifest(
                        directory,
                        step=step,
                        topic=self.topic,
                        ownership=ownership,
                        common=common_receipt,
                        shards=receipts,
                        created_at=created_at,
                    )
                    sealed = True
                except Exception as err:  # noqa: BLE001
                    error = f"could not seal checkpoint {directory.name}: {type(err).__name__}: {err}"
                    log.error("%s", error)
        sealed = bool(c.broadcast_ints([1 if sealed else 0])[0])
        if sealed and c.rank == 0:
            try:
                self.store.prune(directory)
            except OSError as exc:
                log.warning("could not prune checkpoints in %s: %s", self.store.root, exc)
        if not sealed and error is None:
            error = f"checkpoint {directory.name} was not sealed (another rank failed; see its log)"
        state = window.state if isinstance(window, PendingWindow) else window
        kind: Kind = window.kind if isinstance(window, PendingWindow) else "base"
        if sealed and isinstance(window, PendingWindow):
            self.chain.linked(window, receipt.parent_ref(directory.name), receipt.size)
        offsets = {int(p): int(o) for p, o in dict(state.get("next_offsets") or {}).items()}
        return SaveResult(
            ok=sealed,
            step=step,
            path=directory,
            next_offsets=offsets if sealed else {},
            error=None if sealed else error,
            seconds=time.perf_counter() - started,
            kind=kind,
            shard_bytes=receipt.size if sealed else 0,
        )

    def restore(
        self,
        *,
        partition_count: int | None,
        single_file: CheckpointStore | None = None,
    ) -> RestoredShare | None:
        """This rank's share of the newest checkpoint that loads on every rank, or None.

        Sharded checkpoints and, with ``single_file``, the one-file checkpoints a world of
        one rank writes (a :class:`~streamtrain.checkpoint.store.CheckpointStore` in the
        same directory) are candidates together, newest first by (step, creation time):
        whichever world size wrote the newest, it is the one restored. A candidate that
        does not verify on some rank is skipped by every rank alike.

        ``partition_count``: the topic's partition count as this rank knows it, or None
        to take each checkpoint's (ownership does not depend on the count). CheckpointMismatch
        (on every rank) when the newest complete checkpoint belongs to another topic, or
        to a topic with more partitions: a configuration error, not damage, which falling
        back to an older checkpoint would not cure.
        """
        c = self.collectives
        known = c.max_int(-1 if partition_count is None else int(partition_count))
        count = None if known < 0 else known
        candidates: list[tuple[int, int, int]] = []  # (step, created_ms, kind)
        if c.rank == 0:
            candidates = [(m.step, m.created_ms, _SHARDED) for m in self.store.manifests()]
            if candidates and single_file is not None:
                candidates += [(info.step, info.created_ms, _SINGLE_FILE) for info in single_file.list()]
            candidates.sort(reverse=True)
        if c.broadcast_ints([len(candidates)])[0] == 0:
            # no sharded checkpoint: the one-file store's own rule, the newest file that verifies
            return None if single_file is None else self._restore_single_file(single_file.load_latest, count)
        position = 0
        while True:
            proposal = list(candidates[position]) if c.rank == 0 and position < len(candidates) else [-1, -1, -1]
            step, created_ms, kind = c.broadcast_ints(proposal)
            if step < 0:
                return None
            status, share, reason = _LOADED, None, ""
            try:
                if kind == _SHARDED:
                    manifest = read_manifest(self.store.directory_for(step, created_ms))
                    share = restore_share(
                        manifest, rank=c.rank, world_size=c.world_size, partition_count=count, topic=self.topic
                    )
                else:
                    assert single_file is not None  # every rank passes the same stores: rank 0 listed its files
                    share = self._read_single_file(single_file, step, created_ms, count)
                    status = _LOADED if share is not None else _CORRUPT
            except CheckpointMismatch as err:
                status, reason = _MISMATCH, str(err)
            except CorruptCheckpoint as err:
                self.store.report_corrupt(err)
                status = _CORRUPT
            verdict = c.max_int(status)
            if verdict == _LOADED:
                assert share is not None
                log.info(
                    "restored step %d from %s: %d items of partitions %s%s",
                    share.step,
                    share.path.name,
                    len(share.window_state["lengths"]),
                    share.owned_partitions,
                    " (rescaled)" if share.topology_changed else "",
                )
                return share
            if verdict == _MISMATCH:
                raise CheckpointMismatch(reason or f"another rank refused checkpoint step {step}; see rank 0's log")
            position += 1

    def _read_single_file(
        self, single_file: CheckpointStore, step: int, created_ms: int, partition_count: int | None
    ) -> RestoredShare | None:
        """This rank's share of the one-file checkpoint named by (step, created_ms); None when it is corrupt."""
        c = self.collectives
        info = next((i for i in single_file.list() if (i.step, i.created_ms) == (step, created_ms)), None)
        loaded = None if info is None else single_file.read(info.path)  # reports a corrupt file itself
        if loaded is None:
            return None
        return share_from_single_file(loaded, rank=c.rank, world_size=c.world_size, partition_count=partition_count)

    def _restore_single_file(
        self, load_latest: Callable[[], LoadedCheckpoint | None], partition_count: int | None
    ) -> RestoredShare | None:
        c = self.collectives
        loaded = load_latest()
        step = -1 if loaded is None else loaded.step
        # both collectives on every rank: a rank that stopped after the first would leave the
        # others waiting in the second
        highest, lowest = c.max_int(step), -c.max_int(-step)
        if highest != step or lowest != step:
            raise RuntimeError(
                "ranks found different one-file checkpoints; CHECKPOINT_DIR must be one shared directory"
            )
        if loaded is None:
            return None
        share = share_from_single_file(loaded, rank=c.rank, world_size=c.world_size, partition_count=partition_count)
        log.info("restored one-file checkpoint %s as rank %d of %d", loaded.path.name, c.rank, c.world_size)
        return share


def _partitions_held(partitions: Any, next_offsets: Mapping[Any, int]) -> int:
    """1 + the largest partition a window holds items or an offset of (0 for none)."""
    items = np.asarray(partitions, dtype=np.int64).reshape(-1)
    held = [int(items.max()) if items.size else -1, *(int(p) for p in next_offsets)]
    return max(held) + 1
