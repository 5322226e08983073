"""The long-lived service: window + ingest + trainer + checkpoints, wired together.

Start order matters for exactly-once: restore the newest valid checkpoint (window with
its offsets, model, optimizer), then start ingest, which seeks every assigned partition
to the stored offset. A checkpoint saves the trainer state and the window state with the
offsets that state covers, after the dead letters of those offsets are acknowledged; the
offsets are committed to the consumer group only once the file is durable.

A checkpoint written under other settings: another ``HALF_LIFE_S`` re-keys the window
(see ``window/reservoir.py``); a model's attention heads are its checkpoint's unless ``N_HEADS``
is set (:func:`heads_of_the_checkpoint`); another model shape (``CHANNELS``, ``N_CLASSES``,
``D_MODEL``, ``N_HEADS`` set by hand, ``N_LAYERS``, ``MAX_LEN``) cannot be loaded, and start-up stops with
:class:`IncompatibleCheckpoint`, one line naming the settings and the way out. It is a
refusal, not a fresh start: a fresh start would write lower-step checkpoints beside the
old ones, which the store ranks first, so every restart would silently start over.

Locks: a checkpoint waits for the trainer's step in progress *before* it takes ingest's
``apply_lock`` (lock order: trainer, then ingest), holds both only while it copies the
trainer state and fixes the window's columns, and gathers readings and writes the file
with neither held.

Scale-out (``WORLD_SIZE`` > 1, ``docs/scale-out.md``): the service is one rank of a group.
Start joins the process group, then restores this rank's share of the newest checkpoint
of any world size (:class:`~streamtrain.checkpoint.collective.DistributedCheckpointer`) and
makes every rank's model rank 0's. Ingest is assigned the partitions ``p`` with
``p mod WORLD_SIZE == RANK``; the window holds this rank's share of ``WINDOW_CAPACITY``.
The trainer thread runs the lockstep loop (``distributed/lockstep.py``); the checkpoint
timer and the admin route only ask for a checkpoint, which every rank then cuts together
on its trainer thread, as one sharded checkpoint (offsets committed once its manifest is
durable). A stop is agreed too: all ranks cut one final checkpoint, then every rank's
HTTP server shuts down (``on_agreed_stop``). A world of one rank is the service above
(one-file checkpoints, a consumer group); it restores a sharded checkpoint when that is
the newest. Everything that depends on this choice lives in the :class:`Topology` the
service picks at construction (``runtime/topology.py``); the service itself never
branches on it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.format import LoadedCheckpoint
from streamtrain.checkpoint.incremental import Kind, WindowChain
from streamtrain.checkpoint.rescale import RestoredShare
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore, newest_model_config
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.config import Settings
from streamtrain.distributed.launch import DistContext
from streamtrain.distributed.lockstep import LockstepControl
from streamtrain.distributed.ownership import owner
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.metrics import Metrics
from streamtrain.runtime.topology import IncompatibleCheckpoint, LockstepGroup, OneProcess, Topology
from streamtrain.training.protocol import ContinuousTrainer, RestoredParts
from streamtrain.training.publishing import PublishedModel
from streamtrain.window.reservoir import RecencyWindow

log = logging.getLogger(__name__)


def heads_of_the_checkpoint(settings: Settings) -> Settings:
    """``settings`` with the newest checkpoint's ``N_HEADS`` when it was not set by hand.

    The heads split the same weights differently (no parameter's shape depends on them),
    so a checkpoint's model computes what it learnt only with its own heads; nothing else
    about it needs them set again. So a model trained with ``N_HEADS`` set, or under the GPU
    profile's heads, resumes without it, and the default can change (docs/performance.md,
    "Fewer, wider heads") without stopping the models written under the old one.
    ``N_HEADS`` set by hand is kept, and a checkpoint with other heads is refused as any
    other shape is.
    """
    if "n_heads" in settings.model_fields_set:
        return settings
    heads = (newest_model_config(settings.checkpoint_dir) or {}).get("n_heads")
    if type(heads) is not int or heads == settings.n_heads or heads < 1 or settings.d_model % heads:
        return settings  # a header that does not fit is left to the restore's own checks
    log.info("N_HEADS=%d, the newest checkpoint's (N_HEADS is not set; its default is %d)", heads, settings.n_heads)
    adopted = settings.model_copy(update={"n_heads": heads})
    adopted.__pydantic_fields_set__.discard("n_heads")  # still not set by hand
    return adopted


_CHECKPOINT_RETRY_S = 5.0
_DEAD_LETTERS_LATE_S = 30.0  # unacknowledged this long: /readyz lists them (checkpoints wait for them)


class Service:
    """Everything ``streamtrain serve`` runs, minus the HTTP server.

    ``ctx``: this process's place among ``WORLD_SIZE`` ranks (default: one process).
    """

    def __init__(self, settings: Settings, ctx: DistContext | None = None) -> None:
        self.settings = settings
        self.ctx = ctx if ctx is not None else DistContext()
        self.scaled_out = self.ctx.distributed
        self.topology: Topology = LockstepGroup(self) if self.scaled_out else OneProcess(self)
        settings = self.settings = heads_of_the_checkpoint(self.topology.placed(settings))  # before any model is built
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
        self.store = CheckpointStore(
            settings.checkpoint_dir, keep=settings.checkpoint_keep, on_corrupt=self._on_corrupt
        )
        # each checkpoint's window a delta on the last, or a base (scaled out: this rank's shards)
        self.window_chain = WindowChain(by_partition=self.scaled_out)
        self.collectives = self.topology.collectives()
        self.sharded_store = ShardedCheckpointStore(
            settings.checkpoint_dir, keep=settings.checkpoint_keep, on_corrupt=self._on_corrupt
        )
        self.checkpointer = DistributedCheckpointer(
            self.sharded_store,
            self.collectives,
            topic=settings.topic,
            chain=self.window_chain if self.scaled_out else None,
        )
        self.trainer: ContinuousTrainer = self.topology.build_trainer()
        quality = self.trainer.quality  # None in DP mode: private events are not scored
        self.ingest = Ingestor(
            settings,
            self.window,
            self.metrics,
            on_events=self.trainer.admit,
            on_assigned=self.trainer.on_partitions_assigned,
            on_revoked=self.trainer.on_partitions_revoked,
            before_insert=None if quality is None else quality.observe,
            on_idle=None if quality is None else quality.score_if_due,
            owned_partitions=self.topology.owned_partitions,
        )
        #: Scale-out: called once the ranks agreed to stop and cut the final checkpoint (the CLI stops HTTP).
        self.on_agreed_stop: Callable[[], None] | None = None
        self.checkpoint_error: str | None = None
        #: Why the final checkpoint of :meth:`stop` was not written (None: written, or not asked for).
        self.final_checkpoint_error: str | None = None
        self.last_checkpoint: Path | None = None
        self.last_checkpoint_at: float | None = None
        self.restored_from: Path | None = None
        self.started_at = time.time()
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self.metrics.window_capacity.set(capacity)
        self.metrics.rank_info.labels(str(self.ctx.rank), str(self.ctx.world_size)).set(1)
        self.metrics.watch_window_age(self._window_age)
        self.metrics.watch_models(self._model_versions)

    # ------------------------------------------------------------------ lifecycle
    @property
    def loop(self) -> LockstepControl[Any] | None:
        """Scaled out: the lockstep loop every rank trains in (None for one process)."""
        return self.topology.loop

    def start(self) -> None:
        self.topology.join()
        self.restore()
        self.topology.after_restore()
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
        self.topology.stop(final_checkpoint)

    @property
    def published(self) -> PublishedModel | None:
        return self.trainer.published

    def _window_age(self) -> tuple[float, float]:
        """(median, 90th percentile) item age, for the window-age metric."""
        median, p90 = self.window.age_quantiles([0.5, 0.9])
        return median, p90

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
        with only one-file checkpoints restores the newest of them; otherwise the newest
        checkpoint of either kind is restored, this rank's share of it (collectively). In DP
        mode the admission record then decides where the DP clock and every partition's
        admissions continue (privacy/trainer.py), checkpoint or not (scaled out: with every rank).
        """
        restored = self.topology.restore()
        self.trainer.resume_after_restore()
        return restored

    def restore_share(self, share: RestoredShare) -> RestoredShare:
        """Load this rank's share of a sharded checkpoint (all of it for one process): its
        window's partitions, and the trainer state the trainer joins from the checkpoint's
        parts (DP: this rank's share of the DP windows)."""
        trainer_state = share.common["trainer"]
        self._check_compatible(share.path, trainer_state, share.window_state)
        self.window.load_state_dict(share.window_state)
        rank, world_size = self.ctx.rank, self.ctx.world_size
        parts = RestoredParts(
            shared=trainer_state,
            rank_local=share.rank_state,
            by_partition=share.partitioned_states,
            owns=lambda partition: owner(partition, world_size) == rank,
            unchanged=not share.topology_changed,
        )
        self.trainer.load_state_dict(self.trainer.state_from_parts(parts))
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

    def restore_one_file(self, loaded: LoadedCheckpoint | None) -> LoadedCheckpoint | None:
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
        return self.topology.checkpoint()

    def rollback(self, version: int, reason: str = "asked by an admin") -> tuple[int, int | None]:
        """Make kept ``version`` serve again: (the version that serves now, the one that served before).

        :class:`UnknownVersion` when it is not kept. Scaled out, every rank rolls back at
        the same tick: the request travels in the next agreement and this returns once
        every rank took it (:class:`RollbackNotTaken` when it lapsed or the ranks stopped).
        """
        return self.topology.rollback(version, reason)

    def agreed_stop(self) -> None:
        """Scale-out: the ranks agreed to stop and cut the final checkpoint (the loop calls it)."""
        hook = self.on_agreed_stop
        if hook is not None:
            hook()

    def checkpoint_written(self, path: Path, offsets: Mapping[int, int], kind: Kind, size: int) -> None:
        """A checkpoint is durable: count it and the ``size`` bytes this process wrote of it (its
        file, or its shard), and commit the offsets it covers."""
        self.metrics.checkpoints_written.inc()
        self.metrics.checkpoint_bytes.labels(kind).inc(size)
        self.metrics.checkpoint_chain_length.set(self.window_chain.report().chain_length)
        self.checkpoint_error = None
        self.last_checkpoint, self.last_checkpoint_at = path, time.time()
        self.ingest.request_commit(dict(offsets))

    def checkpoint_failed(self, why: str) -> None:
        """Count and log a checkpoint that was not written (the timer retries sooner)."""
        self.metrics.checkpoint_failures.inc()
        self.checkpoint_error = why
        log.error("checkpoint failed (training and serving go on; retrying): %s", why)
        return None

    def _checkpoint_loop(self) -> None:
        interval = self.settings.checkpoint_interval_s
        while not self._stop.wait(interval if self.checkpoint_error is None else min(interval, _CHECKPOINT_RETRY_S)):
            self.topology.checkpoint_due()

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
                needed = self.trainer.min_window_items
                blocking.append(f"no_model_published: window has {len(self.window)} of {needed} items needed ({last})")
        notes = []
        if self.ingest.kafka_degraded is not None:  # a broker down: ingest goes on from what remains
            notes.append(self.ingest.kafka_degraded)
        if self.checkpoint_error is not None:
            notes.append(f"checkpoint_failing: {self.checkpoint_error}")
        waiting = self.ingest.dead_letters.oldest_pending_age_s()
        if waiting is not None and waiting > _DEAD_LETTERS_LATE_S:
            notes.append(f"dead_letters_pending: {self.ingest.dead_letters.describe()}")
        if not self.trainer.running and not self._stop.is_set():
            notes.append("trainer_not_running" + (f": {self.trainer.last_error}" if self.trainer.last_error else ""))
        notes += self.trainer.readiness_notes()
        return not blocking, blocking + notes
