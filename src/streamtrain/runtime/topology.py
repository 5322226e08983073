"""How this process takes part in training: alone, or as one rank of a lockstep group.

The service chooses one at start-up (``WORLD_SIZE``) and asks it everything that depends
on that choice: which trainer to build, how to restore, how a checkpoint is cut, how a
rollback and a stop are agreed. Nothing else in the service branches on scale-out.

* :class:`OneProcess`: one-file checkpoints written by whichever thread asks (the timer,
  the admin route, the stop), under the trainer's and ingest's locks; it restores a
  sharded checkpoint too when that is the newest (a group scaled down to one).
* :class:`LockstepGroup`: every rank trains in the lockstep loop; a checkpoint, a
  rollback and the stop are asked of the loop, which makes every rank take them at one
  agreed tick (checkpoints as one sharded cut whose offsets are committed once its
  manifest is durable). In DP mode the trainer is the DP one, its engines one mechanism
  across the ranks, and its loop the DP lockstep loop on the public clock
  (:mod:`streamtrain.privacy.trainer`); the cut, the restore and the stop are the same.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from streamtrain.checkpoint.format import LoadedCheckpoint
from streamtrain.checkpoint.rescale import CheckpointMismatch, RestoredShare
from streamtrain.checkpoint.store import CheckpointWriteError
from streamtrain.config import Settings
from streamtrain.data.randomness import derive_seed
from streamtrain.distributed.collectives import Collectives, resolve_backend
from streamtrain.distributed.launch import capacity_share, rank_device
from streamtrain.distributed.lockstep import LockstepControl, LockstepLoop, check_settings_agree
from streamtrain.ingest.consumers import OwnedPartitions
from streamtrain.training.protocol import ContinuousTrainer
from streamtrain.training.registry import UnknownVersion
from streamtrain.training.trainer import Trainer

if TYPE_CHECKING:  # the service builds its topology
    from streamtrain.runtime.service import Service

log = logging.getLogger(__name__)


class IncompatibleCheckpoint(ValueError):
    """The newest checkpoint was written under settings it cannot be loaded with (one line)."""


class RollbackNotTaken(RuntimeError):
    """Scaled out: the ranks did not take an admin's rollback (they stopped, or it timed out)."""


def detached_copy(tree: Any) -> Any:
    """A copy of a state tree whose tensors and arrays no later training step can change."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, (np.ndarray, np.generic)):
        return tree.copy()
    if isinstance(tree, dict):
        copied = type(tree)((key, detached_copy(value)) for key, value in tree.items())
        if hasattr(tree, "_metadata"):
            copied._metadata = tree._metadata  # type: ignore[attr-defined]  # Module.load_state_dict reads it
        return copied
    if isinstance(tree, (list, tuple)):
        return type(tree)(detached_copy(item) for item in tree)
    return tree


class Topology(Protocol):
    """What depends on whether this process trains alone or in a lockstep group."""

    loop: LockstepControl[Any] | None
    owned_partitions: OwnedPartitions | None  # None: the consumer group assigns partitions

    def placed(self, settings: Settings) -> Settings:
        """``settings`` with this process's own device; refuses what cannot run this way."""

    def collectives(self) -> Collectives:
        """The collectives of this process (local ones alone)."""

    def build_trainer(self) -> ContinuousTrainer: ...

    def join(self) -> None:
        """Before restoring: meet the other ranks (nothing alone)."""

    def after_restore(self) -> None:
        """After restoring, before training: make every rank's model the same (nothing alone)."""

    def restore(self) -> LoadedCheckpoint | RestoredShare | None: ...

    def checkpoint(self) -> Path | None:
        """Write (or have the group cut) a checkpoint now; None when it failed."""

    def checkpoint_due(self) -> None:
        """The checkpoint timer fired."""

    def rollback(self, version: int, reason: str) -> tuple[int, int | None]: ...

    def stop(self, final_checkpoint: bool) -> None:
        """Stop training, cut the final checkpoint, stop ingest (the service's stop)."""


class OneProcess:
    """Training alone: checkpoints are written on the caller's thread (module docstring)."""

    loop: LockstepControl[Any] | None = None
    owned_partitions: OwnedPartitions | None = None

    def __init__(self, service: Service) -> None:
        self.service = service
        self._lock = threading.Lock()  # one checkpoint at a time

    def placed(self, settings: Settings) -> Settings:
        return settings

    def collectives(self) -> Collectives:
        s = self.service
        return Collectives(s.ctx, backend="auto", device=s.settings.device, timeout_s=s.settings.dist_timeout_s)

    def build_trainer(self) -> ContinuousTrainer:
        s = self.service
        if s.settings.dp == "on":
            from streamtrain.privacy.trainer import DPTrainer  # DP mode brings its own window rule

            return DPTrainer(s.settings, s.window, s.metrics)
        return Trainer(s.settings, s.window, s.metrics)

    def join(self) -> None:
        pass

    def after_restore(self) -> None:
        pass

    def restore(self) -> LoadedCheckpoint | RestoredShare | None:
        s = self.service
        if not any(info.complete for info in s.sharded_store.scan()):
            return s.restore_one_file(s.store.load_latest())
        try:  # a group's checkpoint is the newest: this process takes all of it
            share = s.checkpointer.restore(partition_count=None, single_file=s.store)
        except CheckpointMismatch as err:
            raise IncompatibleCheckpoint(str(err)) from None
        if share is None:
            log.info("no checkpoint in %s: starting fresh", s.settings.checkpoint_dir)
            return None
        if share.loaded is not None:
            return s.restore_one_file(share.loaded)
        return s.restore_share(share)

    def checkpoint(self) -> Path | None:
        s = self.service
        with self._lock:
            # Trainer first: waiting for a step in progress must not hold ingest back.
            with s.trainer.lock, s.ingest.apply_lock:  # both states cover the same offsets
                try:
                    trainer_state = detached_copy(s.trainer.state_dict())  # DP: syncs the admission record first
                except OSError as err:
                    s.checkpoint_failed(f"DP admission record not durable: {err}")
                    return None
                capture = s.window.capture_state()
                step = int(trainer_state["step"])
                dead_letters = s.ingest.dead_letter_mark()  # the dead letters of those offsets
            window = s.window_chain.window_state(capture, s.store.directory)  # a delta on the last one, or a base
            offsets = {int(p): int(o) for p, o in window.state["next_offsets"].items()}
            # Neither saved nor committed past a dead letter Kafka has not acknowledged;
            # it stays queued and retried, and the next checkpoint asks again.
            if not s.ingest.flush_dead_letters(upto=dead_letters):
                s.checkpoint_failed(s.ingest.dead_letters.describe())
                return None
            try:
                path = s.store.save({"window": window.state, "trainer": trainer_state}, step=step)
            except CheckpointWriteError as err:
                s.checkpoint_failed(str(err))
                return None
            s.window_chain.written(window, path)
            s.checkpoint_written(path, offsets, window.kind, path.stat().st_size)
            log.info("checkpoint %s (step %d, window %d items, %s)", path.name, step, window.seq.size, window.kind)
            return path

    def checkpoint_due(self) -> None:
        try:
            self.checkpoint()
        except Exception as err:  # noqa: BLE001 - never let the checkpointer die
            self.service.checkpoint_failed(f"{type(err).__name__}: {err}")

    def rollback(self, version: int, reason: str) -> tuple[int, int | None]:
        s = self.service
        before = s.published
        target = s.trainer.rollback(version, trigger="admin", reason=reason)
        return target.version, None if before is None else before.version

    def stop(self, final_checkpoint: bool) -> None:
        s = self.service
        s.trainer.stop()
        if final_checkpoint:
            try:
                written = self.checkpoint()
            except Exception as err:  # noqa: BLE001 - ingest must still stop; the CLI reports it
                s.checkpoint_failed(f"{type(err).__name__}: {err}")
                written = None
            if written is None:
                s.final_checkpoint_error = s.checkpoint_error or "not written"
        s.ingest.stop()


class LockstepGroup:
    """One rank of a scaled-out service: the lockstep loop takes every agreed action (module docstring)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.loop: LockstepControl[Any] | None = None
        self.owned_partitions: OwnedPartitions | None = service.ctx.owned_partitions
        self._gpus_shared = False
        self._cuts = threading.Condition()
        self._cuts_started = self._cuts_finished = 0
        self._last_cut: Path | None = None

    def placed(self, settings: Settings) -> Settings:
        """Several ranks on one host: each its own GPU (LOCAL_RANK), where there are enough."""
        ctx = self.service.ctx
        device, self._gpus_shared = rank_device(settings.device, ctx)
        if str(device) != settings.device:
            log.info(
                "rank %d (local rank %d) trains on %s (DEVICE=%s)", ctx.rank, ctx.local_rank, device, settings.device
            )
            settings = settings.model_copy(update={"device": str(device)})
        resolve_backend(settings.dist_backend, settings.device, gpus_shared=self._gpus_shared)
        return settings

    def collectives(self) -> Collectives:
        s = self.service
        return Collectives(
            s.ctx,
            backend=s.settings.dist_backend,
            device=s.settings.device,  # auto: NCCL when training on CUDA with a GPU per rank, else gloo
            timeout_s=s.settings.dist_timeout_s,
            gpus_shared=self._gpus_shared,
        )

    def build_trainer(self) -> ContinuousTrainer:
        s = self.service
        ctx = s.ctx
        if s.settings.dp == "on":  # the ranks' DP engines are one mechanism; the DP loop runs the public clock
            from streamtrain.privacy.trainer import DPLockstepLoop, DPTrainer

            def dp_lockstep(trainer: DPTrainer) -> DPLockstepLoop:
                self.loop = DPLockstepLoop(trainer, s.collectives, checkpoint=self._cut, on_stopped=s.agreed_stop)
                return self.loop

            self.trainer: ContinuousTrainer = DPTrainer(
                s.settings, s.window, s.metrics, collectives=s.collectives, loop=dp_lockstep
            )
            return self.trainer

        # a rank plans passes over its own window share, from a stream of its own, and
        # waits for its share of the minimum window
        def lockstep(trainer: Trainer) -> LockstepLoop:
            self.loop = LockstepLoop(trainer, s.collectives, checkpoint=self._cut, on_stopped=s.agreed_stop)
            return self.loop

        self.trainer = Trainer(
            s.settings,
            s.window,
            s.metrics,
            data_seed=derive_seed(s.settings.seed, 0, ctx.rank, purpose="plan"),
            min_items=capacity_share(s.settings.min_window_items, ctx.rank, ctx.world_size),
            loop=lockstep,
        )
        return self.trainer

    @property
    def _loop(self) -> LockstepControl[Any]:
        assert self.loop is not None, "build_trainer() builds the loop"
        return self.loop

    def join(self) -> None:
        s = self.service
        s.collectives.start()  # waits for every rank (up to 15 minutes)
        check_settings_agree(s.collectives, s.settings)  # SettingsMismatch: one line, every rank

    def after_restore(self) -> None:
        self.service.collectives.broadcast_module(self.trainer.model)  # one model, whatever each rank built

    def restore(self) -> LoadedCheckpoint | RestoredShare | None:
        s = self.service
        try:
            share = s.checkpointer.restore(partition_count=None, single_file=s.store)
        except CheckpointMismatch as err:
            raise IncompatibleCheckpoint(str(err)) from None
        if share is None:
            log.info("no checkpoint in %s: starting fresh", s.settings.checkpoint_dir)
            return None
        return s.restore_share(share)

    def checkpoint(self) -> Path | None:
        """Ask every rank for a checkpoint and wait until they have cut it."""
        s = self.service
        deadline = time.monotonic() + 3 * s.settings.dist_timeout_s + 60
        with self._cuts:
            target = self._cuts_started + 1  # the next cut to start: it covers everything up to now
            self._loop.checkpoint_due.set()
            while self._cuts_finished < target:
                left = deadline - time.monotonic()
                if left <= 0 or not s.trainer.running:
                    s.checkpoint_failed("the ranks did not cut the checkpoint in time")
                    return None
                self._cuts.wait(min(left, 1.0))
            return self._last_cut if self._cuts_finished == target else s.last_checkpoint

    def checkpoint_due(self) -> None:
        self._loop.checkpoint_due.set()  # every rank cuts it at the next tick

    def _cut(self, final: bool) -> None:
        """This rank's part of a collective checkpoint, on the trainer thread (the loop calls it)."""
        s = self.service
        with self._cuts:
            self._cuts_started += 1
        path: Path | None = None
        try:
            with s.trainer.lock, s.ingest.apply_lock:  # both states cover the same offsets
                try:  # nothing trains meanwhile: this is the trainer thread
                    trainer_state = s.trainer.state_dict()  # DP: syncs the admission record with every rank
                except OSError as err:  # DP: on every rank alike (the ranks agree whether all synced)
                    s.checkpoint_failed(f"DP admission record not durable: {err}")
                    if final:
                        s.final_checkpoint_error = s.checkpoint_error
                    return
                window = s.window.capture_state()  # built by the checkpointer: a delta on the last shard, or a base
                dead_letters = s.ingest.dead_letter_mark()
            veto = None
            if not s.ingest.flush_dead_letters(upto=dead_letters):  # the others wait in the next collective
                veto = f"dead letters not acknowledged: {s.ingest.dead_letters.describe()}"
            parts = s.trainer.checkpoint_parts(trainer_state)
            result = s.checkpointer.save(
                step=int(trainer_state["step"]),
                partition_count=s.ingest.partition_count,
                window_state=window,
                common_state={"trainer": parts.shared} if s.ctx.is_primary else None,
                rank_state=parts.rank_local,
                partitioned_state=parts.by_partition,  # whole in every shard, a delta's too
                veto=veto,
            )
            if not result.ok or result.path is None:
                s.checkpoint_failed(result.error or "checkpoint not sealed")
                if final:
                    s.final_checkpoint_error = s.checkpoint_error
                return
            path = result.path
            # offsets committed only now: the manifest is durable
            s.checkpoint_written(path, result.next_offsets, result.kind, result.shard_bytes)
            log.info(
                "%scheckpoint %s (step %d, rank %d: window %d items, %s, %.2f s)",
                "final " if final else "",
                path.name,
                result.step,
                s.ctx.rank,
                window.seq.size,
                result.kind,
                result.seconds,
            )
        finally:
            with self._cuts:
                self._cuts_finished += 1
                self._last_cut = path
                self._cuts.notify_all()

    def rollback(self, version: int, reason: str) -> tuple[int, int | None]:
        s = self.service
        s.trainer.registry.get(version)  # UnknownVersion now, before asking every rank
        ticket = self._loop.request_rollback(version, "admin", reason)
        outcome = ticket.wait(3 * s.settings.dist_timeout_s + 60)
        if outcome is None:
            raise RollbackNotTaken(f"the ranks did not take the rollback to version {version} in time")
        if outcome.unknown_version:
            raise UnknownVersion(version)  # pruned between the request and the agreed tick
        if not outcome.applied:
            raise RollbackNotTaken(f"rollback to version {version} not taken: {outcome.why_not}")
        return outcome.version, outcome.from_version

    def stop(self, final_checkpoint: bool) -> None:
        """Ask every rank to stop; the loop cuts the final checkpoint with all of them (always:
        one rank cannot leave a cut out)."""
        s, loop = self.service, self._loop
        loop.stop_requested.set()
        while s.trainer.running and not loop.finished.wait(1.0):
            pass  # a dead or hung peer ends this process (DIST_TIMEOUT_S) rather than this wait
        if not loop.finished.is_set():  # the loop ended without the agreed stop and its cut
            s.final_checkpoint_error = "the ranks did not cut a final checkpoint" + (
                f" (trainer: {s.trainer.last_error})" if s.trainer.last_error else ""
            )
        s.trainer.stop()
        s.ingest.stop()
        s.collectives.close()
