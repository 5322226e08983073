"""The long-lived service: window + ingest + trainer + checkpoints, wired together.

Start order matters for exactly-once: restore the newest valid checkpoint (window with
its offsets, model, optimizer), then start ingest, which seeks every assigned partition
to the stored offset. A checkpoint saves the trainer state and the window state with the
offsets that state covers, after the dead letters of those offsets are acknowledged; the
offsets are committed to the consumer group only once the file is durable.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from streamtrain.checkpoint import CheckpointStore, CheckpointWriteError, LoadedCheckpoint
from streamtrain.config import Settings
from streamtrain.ingest import Ingestor
from streamtrain.metrics import Metrics
from streamtrain.train import PublishedModel, Trainer
from streamtrain.window import RecencyWindow

log = logging.getLogger(__name__)

_CHECKPOINT_RETRY_S = 5.0


class Service:
    """Everything ``streamtrain serve`` runs, minus the HTTP server."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.window = RecencyWindow(
            settings.window_capacity,
            settings.half_life_s,
            channels=settings.channels,
            max_age_s=settings.max_age_s,
        )
        self.trainer = self._build_trainer()
        self.ingest = Ingestor(
            settings,
            self.window,
            self.metrics,
            on_events=getattr(self.trainer, "admit", None),
            on_assigned=getattr(self.trainer, "on_partitions_assigned", None),
            on_revoked=getattr(self.trainer, "on_partitions_revoked", None),
        )
        self.store = CheckpointStore(settings.checkpoint_dir, keep=settings.checkpoint_keep, on_corrupt=self._on_corrupt)
        self.checkpoint_error: str | None = None
        self.last_checkpoint: Path | None = None
        self.last_checkpoint_at: float | None = None
        self.restored_from: Path | None = None
        self.started_at = time.time()
        self._checkpoint_lock = threading.Lock()
        self._stop = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self.metrics.window_capacity.set(settings.window_capacity)
        self.metrics.watch_window_age(lambda: tuple(self.window.age_quantiles([0.5, 0.9])))  # type: ignore[arg-type]

    def _build_trainer(self) -> Any:
        if self.settings.dp == "on":
            from streamtrain.privacy.service import DPTrainer  # DP mode brings its own window rule

            return DPTrainer(self.settings, self.window, self.metrics)
        return Trainer(self.settings, self.window, self.metrics)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.restore()
        self.ingest.start()
        self.trainer.start()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="checkpointer", daemon=True)
        self._checkpointer.start()

    def stop(self, final_checkpoint: bool = True) -> None:
        """Graceful stop (SIGTERM): stop training, write a last checkpoint, stop ingest.

        Idempotent: the HTTP app's shutdown and the CLI both call it.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        self.trainer.stop()
        if final_checkpoint:
            self.checkpoint()
        self.ingest.stop()

    @property
    def published(self) -> PublishedModel | None:
        return self.trainer.published

    # ------------------------------------------------------------------ checkpoints
    def restore(self) -> LoadedCheckpoint | None:
        """Load the newest valid checkpoint (corrupt ones are skipped, logged and counted).

        In DP mode the admission record then decides where the DP clock and every
        partition's admissions continue (privacy/service.py), checkpoint or not.
        """
        loaded = self._load_checkpoint()
        resume = getattr(self.trainer, "resume_from_record", None)
        if resume is not None:
            resume()
        return loaded

    def _load_checkpoint(self) -> LoadedCheckpoint | None:
        loaded = self.store.load_latest()
        if loaded is None:
            log.info("no checkpoint in %s: starting fresh", self.settings.checkpoint_dir)
            return None
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

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now; None (counted, logged, retried later) when it fails."""
        with self._checkpoint_lock:
            with self.ingest.apply_lock, self.trainer.lock:  # both states cover the same offsets
                try:
                    trainer_state = self.trainer.state_dict()  # DP: syncs the admission record first
                except OSError as err:
                    return self._checkpoint_failed(f"DP admission record not durable: {err}")
                window_state = self.window.state_dict()
                step = int(trainer_state["step"])
            offsets = {int(p): int(o) for p, o in window_state["next_offsets"].items()}
            if not self.ingest.flush_dead_letters():
                return self._checkpoint_failed("dead letters not acknowledged by Kafka")
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

    def _checkpoint_failed(self, why: str) -> None:
        self.metrics.checkpoint_failures.inc()
        self.checkpoint_error = why
        log.error("checkpoint failed (training and serving go on; retrying): %s", why)
        return None

    def _checkpoint_loop(self) -> None:
        interval = self.settings.checkpoint_interval_s
        while not self._stop.wait(interval if self.checkpoint_error is None else min(interval, _CHECKPOINT_RETRY_S)):
            try:
                self.checkpoint()
            except Exception as err:  # noqa: BLE001 - never let the checkpointer die
                self._checkpoint_failed(f"{type(err).__name__}: {err}")

    def _on_corrupt(self, path: Path, reason: str) -> None:
        self.metrics.checkpoints_corrupt.inc()  # the store logs the file and the reason

    # ------------------------------------------------------------------ health
    def readiness(self) -> tuple[bool, list[str]]:
        """(ready, reasons): ready needs a connected consumer and a published model."""
        blocking: list[str] = []
        if not self.ingest.connected:
            blocking.append("kafka_not_connected" + (f": {self.ingest.last_error}" if self.ingest.last_error else ""))
        if self.published is None:
            if self.settings.dp == "on":  # window counts are data-dependent: operator plane only
                blocking.append("no_model_published: the first DP model is published on the public clock")
            else:
                blocking.append(f"no_model_published: window has {len(self.window)} of {self.settings.min_window_items} items needed")
        notes = []
        if self.checkpoint_error is not None:
            notes.append(f"checkpoint_failing: {self.checkpoint_error}")
        if not self.trainer.running and not self._stop.is_set():
            notes.append("trainer_not_running" + (f": {self.trainer.last_error}" if self.trainer.last_error else ""))
        if getattr(self.trainer, "record_error", None):
            notes.append(f"dp_admission_record_failing: {self.trainer.record_error}")
        return not blocking, blocking + notes
