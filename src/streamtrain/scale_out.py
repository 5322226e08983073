"""The trainer's loop when the service runs as one of ``WORLD_SIZE`` ranks: lockstep ticks.

Every rank runs the same ticks. A tick takes this rank's next batch if one is ready
(never waiting on an empty window: a rank without data still takes part, with a zero
gradient), tells the others what it wants (stop, checkpoint, publish) and runs one
data-parallel step (:class:`~streamtrain.parallel.DataParallelStep`). Everything that
follows is decided from the step's agreement, which is identical on every rank: the
optimizer step, the trainer's counters, publishing a version, cutting a checkpoint, and
stopping. So all ranks publish the same version at the same step, cut every checkpoint
at the same step, and stop together after one final checkpoint.

The loop never recovers from an error: a failed collective (a peer died or hung past
``DIST_TIMEOUT_S``) or any other exception ends the process with a non-zero status, so
the supervisor restarts the whole group from the last complete checkpoint. Resuming
alone would leave this rank out of step with the others.

Trainer state splits in two for a checkpoint: what every rank holds alike (model,
optimizer, scheduler, normalization, step and token counters, version), saved once by
rank 0, and what is this rank's own (its data stream's resume point, its torch
generator), saved in its shard and restored only when the ownership is unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np
import torch

from streamtrain.data.collate import Batch
from streamtrain.data.prefetch import Prefetcher
from streamtrain.distributed import (
    EXIT_COLLECTIVE_FAILURE,
    Collectives,
    CollectiveFailure,
    StepSignals,
    exit_after_collective_failure,
)
from streamtrain.parallel import DataParallelStep, ParallelStepReport
from streamtrain.train import Trainer, _smooth

log = logging.getLogger(__name__)

#: Trainer-state keys that belong to one rank (see the module docstring); the rest is shared.
RANK_LOCAL_TRAINER_KEYS: Final = ("dataset", "rng")
EXIT_LOOP_FAILURE: Final = 1  # a rank's own error (not a collective's): it leaves, the group restarts

_IDLE_WAIT_S = 0.1  # between ticks while no rank has data
_BATCH_WAIT_S = 0.05  # a rank that is training waits this long for its next batch


def split_trainer_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, rank-local) parts of :meth:`Trainer.state_dict`."""
    shared = {key: value for key, value in state.items() if key not in RANK_LOCAL_TRAINER_KEYS}
    local = {key: state[key] for key in RANK_LOCAL_TRAINER_KEYS if key in state}
    return shared, local


def join_trainer_state(trainer: Trainer, shared: Mapping[str, Any], local: Mapping[str, Any] | None) -> dict[str, Any]:
    """A state for :meth:`Trainer.load_state_dict`: the shared part with this rank's own, or,
    when there is none (another ownership, or a checkpoint of one process), a fresh data
    stream and generator for this rank."""
    shared = {key: value for key, value in shared.items() if key not in RANK_LOCAL_TRAINER_KEYS}
    if local and all(key in local for key in RANK_LOCAL_TRAINER_KEYS):
        return {**shared, **{key: local[key] for key in RANK_LOCAL_TRAINER_KEYS}}
    return {**shared, "dataset": trainer.dataset.state_dict(), "rng": {"torch": torch.get_rng_state()}}


class LockstepLoop:
    """The trainer thread's work on every rank of a scaled-out service (module docstring).

    ``checkpoint(final)`` cuts a checkpoint together with the other ranks; the loop calls
    it on the trainer thread whenever the agreement says so (``final`` at the agreed
    stop). ``on_stopped`` runs once the loop has ended after an agreed stop.
    """

    def __init__(
        self,
        trainer: Trainer,
        collectives: Collectives,
        *,
        checkpoint: Callable[[bool], None],
        on_stopped: Callable[[], None] | None = None,
    ) -> None:
        self.trainer = trainer
        self.collectives = collectives
        self.settings = trainer.settings
        self.checkpoint = checkpoint
        self.on_stopped = on_stopped
        self.step = DataParallelStep(
            collectives,
            trainer.model,
            trainer.norm,
            trainer.optimizer,
            grad_clip_norm=trainer.settings.grad_clip_norm,
            scheduler=trainer.scheduler,
        )
        self.tick = 0  # lockstep ticks since start, the same on every rank
        self.stop_requested = threading.Event()
        self.checkpoint_due = threading.Event()
        self.finished = threading.Event()  # the loop ended after the agreed stop
        self.last_report: ParallelStepReport | None = None
        self._last_publish = 0.0
        self._training = False  # the last tick had a batch here: wait a little for the next

    def __call__(self) -> None:
        """Run until the ranks agree to stop; never returns on an error (the process exits)."""
        try:
            self._run()
        except CollectiveFailure as err:
            exit_after_collective_failure(err, EXIT_COLLECTIVE_FAILURE)
        except BaseException as err:  # noqa: BLE001 - one rank cannot go on alone
            log.exception("rank %d: the lockstep loop failed", self.collectives.rank)
            exit_after_collective_failure(err, EXIT_LOOP_FAILURE)
        self.finished.set()
        if self.on_stopped is not None:
            self.on_stopped()

    def _run(self) -> None:
        trainer = self.trainer
        prefetcher = Prefetcher(trainer.dataset, depth=self.settings.prefetch_depth, name="trainer-prefetch")
        try:
            while True:
                waited_before = prefetcher.data_wait_seconds
                batch = prefetcher.poll(_BATCH_WAIT_S if self._training else 0.0)
                wait = prefetcher.data_wait_seconds - waited_before if self._training else 0.0
                self._training = batch is not None
                signals = StepSignals(
                    stop=self.stop_requested.is_set(),
                    checkpoint_due=self.checkpoint_due.is_set(),
                    publish_due=self._publish_due(),
                )
                with trainer.lock:
                    self.step.fault_injector = trainer.fault_injector
                    report = self.step.step(batch, step=self.tick, signals=signals)
                    self.tick += 1
                    self._account(batch, report, wait)
                agreement = report.agreement
                if batch is not None and report.skipped_reason != "stop":
                    trainer.dataset.mark_trained(batch)  # applied or refused, the stream moves past it
                if agreement.publish and report.applied:
                    trainer.publish()
                    self._last_publish = time.monotonic()
                if agreement.checkpoint or agreement.stop:
                    self.checkpoint_due.clear()  # asked again meanwhile: the next tick cuts another
                    self.checkpoint(agreement.stop)
                if agreement.stop:
                    log.info("rank %d: the ranks agreed to stop at tick %d (step %d)", self.collectives.rank, self.tick, trainer.step)
                    return
                if not agreement.has_data:
                    self.stop_requested.wait(_IDLE_WAIT_S)
        finally:
            prefetcher.close(timeout=0.5)

    def _publish_due(self) -> bool:
        return self.trainer.published is None or time.monotonic() - self._last_publish >= self.settings.publish_interval_s

    def _account(self, batch: Batch | None, report: ParallelStepReport, wait: float) -> None:
        """The trainer's counters from the global report; this process's metrics from its own batch."""
        trainer, m = self.trainer, self.trainer.metrics
        self.last_report = report
        trainer.data_wait_seconds += wait
        m.train_data_wait_seconds.inc(wait)
        if report.skipped_reason in ("stop", "no_data"):
            return
        trainer.step_seconds += report.seconds
        m.train_step_seconds.observe(report.seconds)
        if not report.applied:
            m.train_skipped_steps.labels(report.skipped_reason).inc()
            log.warning("step skipped on every rank: %s", report.skipped_reason)
            return
        trainer.step += 1
        trainer.tokens_trained += report.real_tokens  # global: every rank counts the same
        trainer.loss_ema = _smooth(trainer.loss_ema, report.forecast_loss)
        trainer.naive_loss_ema = _smooth(trainer.naive_loss_ema, report.naive_loss)
        m.train_steps.inc()
        if trainer.loss_ema is not None:
            m.train_loss.set(trainer.loss_ema)
        if batch is None:
            return
        m.train_tokens.inc(report.local_real_tokens)  # this process's share: summed over ranks, the total
        m.train_padding_tokens.inc(batch.padded_tokens - batch.real_tokens)
        m.train_batch_sequences.observe(batch.batch_size)
        ages = trainer._clock() - batch.ts.numpy()
        ages = ages[np.isfinite(ages)]
        if ages.size:
            m.train_sample_age_seconds.observe(float(np.median(ages)))
