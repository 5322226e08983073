"""The long-lived service: window + ingest + trainer + checkpoints, wired together.

Start order matters for exactly-once: restore the newest valid checkpoint (window with
its offsets, model, optimizer), then start ingest, which seeks every assigned partition
to the stored offset. A checkpoint saves the trainer state and the window state with the
offsets that state covers, after the dead letters of those offsets are acknowledged; the
offsets are committed to the consumer group only once the file is durable.

A checkpoint written under other settings: another ``HALF_LIFE_S`` re-keys the window
(see ``window.py``); another model shape (``CHANNELS``, ``N_CLASSES``, ``D_MODEL``,
``N_HEADS``, ``N_LAYERS``, ``MAX_LEN``) cannot be loaded, and start-up stops with
:class:`IncompatibleCheckpoint`, one line naming the settings and the way out. It is a
refusal, not a fresh start: a fresh start would write lower-step checkpoints beside the
old ones, which the store ranks first, so every restart would silently start over.

Locks: a checkpoint waits for the trainer's step in progress *before* it takes ingest's
``apply_lock`` (lock order: trainer, then ingest), holds both only while it copies the
trainer state and fixes the window's columns, and gathers readings and writes the file
with neither held.

Scale-out (``WORLD_SIZE`` > 1, ``docs/scale-out.md``): the service is one rank of a group.
Start joins the process group, then restores this rank's share of the newest checkpoint
of any world size (:class:`~streamtrain.checkpoint.shards.DistributedCheckpointer`) and
makes every rank's model rank 0's. Ingest is assigned the partitions ``p`` with
``p mod WORLD_SIZE == RANK``; the window holds this rank's share of ``WINDOW_CAPACITY``.
The trainer thread runs the lockstep loop (``scale_out.py``); the checkpoint timer and
the admin route only ask for a checkpoint, which every rank then cuts together on its
trainer thread, as one sharded checkpoint (offsets committed once its manifest is
durable). A stop is agreed too: all ranks cut one final checkpoint, then every rank's
HTTP server shuts down (``on_agreed_stop``). A world of one rank is the service above,
unchanged (one-file checkpoints, a consumer group); it restores a sharded checkpoint
when that is the newest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamtrain.checkpoint.shards import (
    CheckpointMismatch,
    DistributedCheckpointer,
    RestoredShare,
    ShardedCheckpointStore,
)
from streamtrain.checkpoint.store import CheckpointStore, CheckpointWriteError, LoadedCheckpoint
from streamtrain.config import Settings
from streamtrain.data.randomness import derive_seed
from streamtrain.distributed.launch import Collectives, DistContext, capacity_share, rank_device, resolve_backend
from streamtrain.distributed.lockstep import LockstepLoop, check_settings_agree, join_trainer_state, split_trainer_state
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.metrics import Metrics
from streamtrain.training.registry import UnknownVersion
from streamtrain.training.trainer import PublishedModel, Trainer
from streamtrain.window import RecencyWindow

log = logging.getLogger(__name__)

_CHECKPOINT_RETRY_S = 5.0
_DEAD_LETTERS_LATE_S = 30.0  # unacknowledged this long: /readyz lists them (checkpoints wait for them)


class IncompatibleCheckpoint(ValueError):
    """The newest checkpoint was written under settings it cannot be loaded with (one line)."""


class RollbackNotTaken(RuntimeError):
    """Scaled out: the ranks did not take an admin's rollback (they stopped, or it timed out)."""


def _detached_copy(tree: Any) -> Any:
    """A copy of a state tree whose tensors and arrays no later training step can change."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, (np.ndarray, np.generic)):
        return tree.copy()
    if isinstance(tree, dict):
        copied = type(tree)((key, _detached_copy(value)) for key, value in tree.items())
        if hasattr(tree, "_metadata"):
            copied._metadata = tree._metadata  # type: ignore[attr-defined]  # Module.load_state_dict reads it
        return copied
    if isinstance(tree, (list, tuple)):
        return type(tree)(_detached_copy(item) for item in tree)
    return tree


class Service:
    """Everything ``streamtrain serve`` runs, minus the HTTP server.

    ``ctx``: this process's place among ``WORLD_SIZE`` ranks (default: one process).
    """

    def __init__(self, settings: Settings, ctx: DistContext | None = None) -> None:
        self.settings = settings
        self.ctx = ctx if ctx is not None else DistContext()
        self.scaled_out = self.ctx.distributed
        if self.scaled_out and settings.dp == "on":
            raise ValueError(
                f"DP=on with WORLD_SIZE={self.ctx.world_size}: differentially private training runs as one process "
                "only (its noise and accounting are not yet split across ranks); unset WORLD_SIZE, or set "
                "STREAMTRAIN_DP=off to scale out"
            )
        gpus_shared = False
        if self.scaled_out:  # several ranks on one host: each its own GPU (LOCAL_RANK), where there are enough
            device, gpus_shared = rank_device(settings.device, self.ctx)
            if str(device) != settings.device:
                log.info(
                    "rank %d (local rank %d) trains on %s (DEVICE=%s)",
                    self.ctx.rank,
                    self.ctx.local_rank,
                    device,
                    settings.device,
                )
                settings = self.settings = settings.model_copy(update={"device": str(device)})
            resolve_backend(settings.dist_backend, settings.device, gpus_shared=gpus_shared)  # refused before any work
        # Process-wide on purpose: torch keeps one intra-op default that every thread
        # (trainer, prefetch, predict workers) takes on its first parallel op.
        torch.set_num_threads(settings.torch_threads)
        self.metrics = Metrics()
        capacity = self.ctx.capacity_share(settings.window_capacity)  # all of it for one process
        self.window = RecencyWindow(
            capacity,
            settings.half_life_s,
            channels=settings.channels,
            max_age_s=settings.max_age_s,
        )
        self.trainer = self._build_trainer()
        quality = getattr(self.trainer, "quality", None)  # DP mode: no scoring of private events
        self.ingest = Ingestor(
            settings,
            self.window,
            self.metrics,
            on_events=getattr(self.trainer, "admit", None),
            on_assigned=getattr(self.trainer, "on_partitions_assigned", None),
            on_revoked=getattr(self.trainer, "on_partitions_revoked", None),
            before_insert=None if quality is None else quality.observe,
            owned_partitions=self.ctx.owned_partitions if self.scaled_out else None,
        )
        self.store = CheckpointStore(
            settings.checkpoint_dir, keep=settings.checkpoint_keep, on_corrupt=self._on_corrupt
        )
        self.collectives = Collectives(
            self.ctx,
            backend=settings.dist_backend if self.scaled_out else "auto",
            device=settings.device,  # auto: NCCL when training on CUDA with a GPU per rank, else gloo
            timeout_s=settings.dist_timeout_s,
            gpus_shared=gpus_shared,
        )
        self.sharded_store = ShardedCheckpointStore(
            settings.checkpoint_dir, keep=settings.checkpoint_keep, on_corrupt=self._on_corrupt
        )
        self.checkpointer = DistributedCheckpointer(self.sharded_store, self.collectives, topic=settings.topic)
        self.loop: LockstepLoop | None = None
        if self.scaled_out:
            self.loop = LockstepLoop(
                self.trainer, self.collectives, checkpoint=self._cut_checkpoint, on_stopped=self._agreed_stop
            )
            self.trainer.loop = self.loop
        #: Scale-out: called once the ranks agreed to stop and cut the final checkpoint (the CLI stops HTTP).
        self.on_agreed_stop: Callable[[], None] | None = None
        self._cuts = threading.Condition()
        self._cuts_started = self._cuts_finished = 0
        self._last_cut: Path | None = None
        self.checkpoint_error: str | None = None
        #: Why the final checkpoint of :meth:`stop` was not written (None: written, or not asked for).
        self.final_checkpoint_error: str | None = None
        self.last_checkpoint: Path | None = None
        self.last_checkpoint_at: float | None = None
        self.restored_from: Path | None = None
        self.started_at = time.time()
        self._checkpoint_lock = threading.Lock()
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self.metrics.window_capacity.set(capacity)
        self.metrics.rank_info.labels(str(self.ctx.rank), str(self.ctx.world_size)).set(1)
        self.metrics.watch_window_age(lambda: tuple(self.window.age_quantiles([0.5, 0.9])))  # type: ignore[arg-type]
        self.metrics.watch_models(self._model_versions)

    def _build_trainer(self) -> Any:
        if self.settings.dp == "on":
            from streamtrain.privacy.trainer import DPTrainer  # DP mode brings its own window rule

            return DPTrainer(self.settings, self.window, self.metrics)
        if not self.scaled_out:
            return Trainer(self.settings, self.window, self.metrics)
        # a rank plans passes over its own window share, from a stream of its own, and
        # waits for its share of the minimum window
        ctx = self.ctx
        return Trainer(
            self.settings,
            self.window,
            self.metrics,
            data_seed=derive_seed(self.settings.seed, 0, ctx.rank, purpose="plan"),
            min_items=capacity_share(self.settings.min_window_items, ctx.rank, ctx.world_size),
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.scaled_out:
            self.collectives.start()  # waits for every rank (up to 15 minutes)
            check_settings_agree(self.collectives, self.settings)  # SettingsMismatch: one line, every rank
        self.restore()
        if self.scaled_out:
            self.collectives.broadcast_module(self.trainer.model)  # one model, whatever each rank built
        self.ingest.start()
        self.trainer.start()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="checkpointer", daemon=True)
        self._checkpointer.start()

    def stop(self, final_checkpoint: bool = True) -> None:
        """Graceful stop (SIGTERM): stop training, write a last checkpoint, stop ingest.

        Idempotent: the HTTP app's shutdown and the CLI both call it. Scaled out, the stop
        is asked of every rank and the final checkpoint is cut by all of them together
        (always: one rank cannot leave a cut out); it returns once that is done. A final
        checkpoint that was not written leaves the reason in ``final_checkpoint_error``
        (the CLI then exits non-zero).
        """
        if self._stop.is_set():
            return
        self._stop.set()
        if self.loop is not None:
            self.loop.stop_requested.set()
            while self.trainer.running and not self.loop.finished.wait(1.0):
                pass  # a dead or hung peer ends this process (DIST_TIMEOUT_S) rather than this wait
            if not self.loop.finished.is_set():  # the loop ended without the agreed stop and its cut
                self.final_checkpoint_error = "the ranks did not cut a final checkpoint" + (
                    f" (trainer: {self.trainer.last_error})" if self.trainer.last_error else ""
                )
            self.trainer.stop()
            self.ingest.stop()
            self.collectives.close()
            return
        self.trainer.stop()
        if final_checkpoint:
            try:
                written = self.checkpoint()
            except Exception as err:  # noqa: BLE001 - ingest must still stop; the CLI reports it
                written = self._checkpoint_failed(f"{type(err).__name__}: {err}")
            if written is None:
                self.final_checkpoint_error = self.checkpoint_error or "not written"
        self.ingest.stop()

    @property
    def published(self) -> PublishedModel | None:
        return self.trainer.published

    def _model_versions(self) -> tuple[list[int], int | None, float | None]:
        """(kept versions, the serving one, when it was published) for the model metrics."""
        registry = self.trainer.registry
        serving = registry.serving
        return (
            registry.versions(),
            None if serving is None else serving.version,
            None if serving is None else serving.published_at,
        )

    # ------------------------------------------------------------------ checkpoints
    def restore(self) -> LoadedCheckpoint | RestoredShare | None:
        """Load the newest valid checkpoint (corrupt ones are skipped, logged and counted).

        Raises :class:`IncompatibleCheckpoint` before anything is loaded when the
        checkpoint's model or window cannot serve the configured settings. One process
        with one-file checkpoints only restores as it always did; otherwise the newest
        checkpoint of either kind is restored, this rank's share of it (collectively). In DP
        mode the admission record then decides where the DP clock and every partition's
        admissions continue (privacy/service.py), checkpoint or not (DP runs in one process).
        """
        restored = self._load_checkpoint()
        resume = getattr(self.trainer, "resume_from_record", None)
        if resume is not None:
            resume()
        return restored

    def _load_checkpoint(self) -> LoadedCheckpoint | RestoredShare | None:
        if not self.scaled_out and not any(info.complete for info in self.sharded_store.scan()):
            return self._restore_one_file(self.store.load_latest())
        try:
            share = self.checkpointer.restore(partition_count=None, legacy=self.store)
        except CheckpointMismatch as err:
            raise IncompatibleCheckpoint(str(err)) from None
        if share is None:
            log.info("no checkpoint in %s: starting fresh", self.settings.checkpoint_dir)
            return None
        if share.loaded is not None and not self.scaled_out:
            return self._restore_one_file(share.loaded)
        trainer_state = share.common["trainer"]
        self._check_compatible(share.path, trainer_state, share.window_state)
        self.window.load_state_dict(share.window_state)
        self.trainer.load_state_dict(join_trainer_state(self.trainer, trainer_state, share.rank_state))
        self.restored_from = share.path
        log.info(
            "restored %s as rank %d of %d: step %d, window %d items of partitions %s, offsets %s%s",
            share.path.name,
            self.ctx.rank,
            self.ctx.world_size,
            share.step,
            len(self.window),
            share.owned_partitions,
            self.window.next_offsets,
            " (rescaled: another world size or partition count)" if share.topology_changed else "",
        )
        return share

    def _restore_one_file(self, loaded: LoadedCheckpoint | None) -> LoadedCheckpoint | None:
        if loaded is None:
            log.info("no checkpoint in %s: starting fresh", self.settings.checkpoint_dir)
            return None
        self._check_compatible(loaded.path, loaded.state["trainer"], loaded.state["window"])
        self.window.load_state_dict(loaded.state["window"])
        self.trainer.load_state_dict(loaded.state["trainer"])
        self.restored_from = loaded.path
        log.info(
            "restored %s: step %d, window %d items, offsets %s",
            loaded.path.name,
            loaded.step,
            len(self.window),
            self.window.next_offsets,
        )
        return loaded

    def _check_compatible(self, path: Path, trainer_state: Mapping[str, Any], window_state: Mapping[str, Any]) -> None:
        saved_dp = "on" if "dp" in trainer_state else "off"
        if saved_dp != self.settings.dp:
            raise IncompatibleCheckpoint(
                f"checkpoint {path} was written with DP={saved_dp}; this service is configured with "
                f"DP={self.settings.dp}, and a model cannot change DP mode (a DP model must never have seen data "
                "outside the DP window). Point STREAMTRAIN_CHECKPOINT_DIR at an empty directory to start a new model"
            )
        saved = dict(trainer_state.get("model_config", {}))
        saved["channels"] = window_state.get("channels", saved.get("channels"))
        configured = dict(self.trainer.model.config)
        changed = sorted(k for k, v in configured.items() if k in saved and saved[k] != v)
        if changed:
            was = ", ".join(f"{k.upper()}={saved[k]}" for k in changed)
            now = ", ".join(f"{k.upper()}={configured[k]}" for k in changed)
            raise IncompatibleCheckpoint(
                f"checkpoint {path} was written with {was}; this service is configured with {now}, "
                "which that model and window cannot serve. Set the old values again, or point "
                "STREAMTRAIN_CHECKPOINT_DIR at an empty directory to start a new model"
            )
        try:
            self.window.check_state(window_state)
        except ValueError as err:
            raise IncompatibleCheckpoint(f"checkpoint {path} cannot be restored: {err}") from None

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now; None (counted, logged, retried later) when it fails.

        Scaled out: ask every rank for one and wait until they have cut it.
        """
        if self.loop is not None:
            return self._request_cut()
        with self._checkpoint_lock:
            # Trainer first: waiting for a step in progress must not hold ingest back.
            with self.trainer.lock, self.ingest.apply_lock:  # both states cover the same offsets
                try:
                    trainer_state = _detached_copy(self.trainer.state_dict())  # DP: syncs the admission record first
                except OSError as err:
                    return self._checkpoint_failed(f"DP admission record not durable: {err}")
                build_window_state = self.window.capture_state()
                step = int(trainer_state["step"])
                dead_letters = self.ingest.dead_letter_mark()  # the dead letters of those offsets
            window_state = build_window_state()
            offsets = {int(p): int(o) for p, o in window_state["next_offsets"].items()}
            # Neither saved nor committed past a dead letter Kafka has not acknowledged;
            # it stays queued and retried, and the next checkpoint asks again.
            if not self.ingest.flush_dead_letters(upto=dead_letters):
                return self._checkpoint_failed(self.ingest.dead_letters.describe())
            try:
                path = self.store.save({"window": window_state, "trainer": trainer_state}, step=step)
            except CheckpointWriteError as err:
                return self._checkpoint_failed(str(err))
            self.metrics.checkpoints_written.inc()
            self.checkpoint_error = None
            self.last_checkpoint, self.last_checkpoint_at = path, time.time()
            self.ingest.request_commit(offsets)
            log.info("checkpoint %s (step %d, window %d items)", path.name, step, len(window_state["lengths"]))
            return path

    # ------------------------------------------------------------------ scaled out
    def _cut_checkpoint(self, final: bool) -> None:
        """This rank's part of a collective checkpoint, on the trainer thread (the loop calls it)."""
        with self._cuts:
            self._cuts_started += 1
        path: Path | None = None
        try:
            with self.trainer.lock, self.ingest.apply_lock:  # both states cover the same offsets
                trainer_state = self.trainer.state_dict()  # nothing trains meanwhile: this is the trainer thread
                build_window_state = self.window.capture_state()
                dead_letters = self.ingest.dead_letter_mark()
            window_state = build_window_state()
            veto = None
            if not self.ingest.flush_dead_letters(upto=dead_letters):  # the others wait in the next collective
                veto = f"dead letters not acknowledged: {self.ingest.dead_letters.describe()}"
            shared, local = split_trainer_state(trainer_state)
            result = self.checkpointer.save(
                step=int(trainer_state["step"]),
                partition_count=self.ingest.partition_count,
                window_state=window_state,
                common_state={"trainer": shared} if self.ctx.is_primary else None,
                rank_state=local,
                veto=veto,
            )
            if not result.ok:
                self._checkpoint_failed(result.error or "checkpoint not sealed")
                if final:
                    self.final_checkpoint_error = self.checkpoint_error
                return
            path = result.path
            self.metrics.checkpoints_written.inc()
            self.checkpoint_error = None
            self.last_checkpoint, self.last_checkpoint_at = path, time.time()
            self.ingest.request_commit(result.next_offsets)  # only now: the manifest is durable
            log.info(
                "%scheckpoint %s (step %d, rank %d: window %d items, %.2f s)",
                "final " if final else "",
                path.name,
                result.step,
                self.ctx.rank,
                len(window_state["lengths"]),
                result.seconds,
            )
        finally:
            with self._cuts:
                self._cuts_finished += 1
                self._last_cut = path
                self._cuts.notify_all()

    def _request_cut(self) -> Path | None:
        assert self.loop is not None
        deadline = time.monotonic() + 3 * self.settings.dist_timeout_s + 60
        with self._cuts:
            target = self._cuts_started + 1  # the next cut to start: it covers everything up to now
            self.loop.checkpoint_due.set()
            while self._cuts_finished < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self.trainer.running:
                    return self._checkpoint_failed("the ranks did not cut the checkpoint in time")
                self._cuts.wait(min(left, 1.0))
            return self._last_cut if self._cuts_finished == target else self.last_checkpoint

    def rollback(self, version: int, reason: str = "asked by an admin") -> tuple[int, int | None]:
        """Make kept ``version`` serve again: (the version that serves now, the one that served before).

        :class:`UnknownVersion` when it is not kept. Scaled out, every rank rolls back at
        the same tick: the request travels in the next agreement and this returns once
        every rank took it (:class:`RollbackNotTaken` when it lapsed or the ranks stopped).
        """
        if self.loop is None:
            before = self.published
            target = self.trainer.rollback(version, trigger="admin", reason=reason)
            return target.version, None if before is None else before.version
        self.trainer.registry.get(version)  # UnknownVersion now, before asking every rank
        ticket = self.loop.request_rollback(version, "admin", reason)
        outcome = ticket.wait(3 * self.settings.dist_timeout_s + 60)
        if outcome is None:
            raise RollbackNotTaken(f"the ranks did not take the rollback to version {version} in time")
        if outcome.unknown_version:
            raise UnknownVersion(version)  # pruned between the request and the agreed tick
        if not outcome.applied:
            raise RollbackNotTaken(f"rollback to version {version} not taken: {outcome.why_not}")
        return outcome.version, outcome.from_version

    def _agreed_stop(self) -> None:
        hook = self.on_agreed_stop
        if hook is not None:
            hook()

    def _checkpoint_failed(self, why: str) -> None:
        self.metrics.checkpoint_failures.inc()
        self.checkpoint_error = why
        log.error("checkpoint failed (training and serving go on; retrying): %s", why)
        return None

    def _checkpoint_loop(self) -> None:
        interval = self.settings.checkpoint_interval_s
        while not self._stop.wait(interval if self.checkpoint_error is None else min(interval, _CHECKPOINT_RETRY_S)):
            if self.loop is not None:
                self.loop.checkpoint_due.set()  # every rank cuts it at the next tick
                continue
            try:
                self.checkpoint()
            except Exception as err:  # noqa: BLE001 - never let the checkpointer die
                self._checkpoint_failed(f"{type(err).__name__}: {err}")

    def _on_corrupt(self, path: Path, reason: str) -> None:
        self.metrics.checkpoints_corrupt.inc()  # the store logs the file and the reason

    # ------------------------------------------------------------------ health
    def readiness(self) -> tuple[bool, list[str]]:
        """(ready, reasons): ready needs a connected, unstalled consumer and a published model."""
        blocking: list[str] = []
        security = self.ingest.security_failure  # kafka_auth_failed: / kafka_authorization_failed: (docs/contract.md)
        if security is not None:
            blocking.append(security)
        elif not self.ingest.connected:
            blocking.append("kafka_not_connected" + (f": {self.ingest.last_error}" if self.ingest.last_error else ""))
        stalled = self.ingest.stall_report()
        if stalled is not None:
            blocking.append(f"ingest_stalled: {stalled}")
        if self.published is None:
            if self.settings.dp == "on":  # window counts are data-dependent: operator plane only
                blocking.append("no_model_published: the first DP model is published on the public clock")
            else:
                age = self.ingest.last_record_age_s
                last = "no record read yet" if age is None else f"last record read {age:.0f} s ago"
                needed = getattr(getattr(self.trainer, "dataset", None), "min_items", self.settings.min_window_items)
                blocking.append(f"no_model_published: window has {len(self.window)} of {needed} items needed ({last})")
        notes = []
        if self.checkpoint_error is not None:
            notes.append(f"checkpoint_failing: {self.checkpoint_error}")
        waiting = self.ingest.dead_letters.oldest_pending_age_s()
        if waiting is not None and waiting > _DEAD_LETTERS_LATE_S:
            notes.append(f"dead_letters_pending: {self.ingest.dead_letters.describe()}")
        if not self.trainer.running and not self._stop.is_set():
            notes.append("trainer_not_running" + (f": {self.trainer.last_error}" if self.trainer.last_error else ""))
        if getattr(self.trainer, "record_error", None):
            notes.append(f"dp_admission_record_failing: {self.trainer.record_error}")
        return not blocking, blocking + notes
