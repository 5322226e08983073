"""The trainer's loop when the service runs as one of ``WORLD_SIZE`` ranks: lockstep ticks.

Every rank runs the same ticks. A tick takes this rank's next batch if one is ready
(never waiting on an empty window: a rank without data still takes part, with a zero
gradient), tells the others what it wants (stop, checkpoint, publish) and runs one
data-parallel step (:class:`~streamtrain.distributed.data_parallel.DataParallelStep`). Everything that
follows is decided from the step's agreement, which is identical on every rank: the
optimizer step, the trainer's counters, publishing a version, cutting a checkpoint, and
stopping. So all ranks publish the same version at the same step, cut every checkpoint
at the same step, and stop together after one final checkpoint.

The loop never recovers from an error: a failed collective (a peer died or hung past
``DIST_TIMEOUT_S``) or any other exception ends the process with a non-zero status, so
the supervisor restarts the whole group from the last complete checkpoint. Resuming
alone would leave this rank out of step with the others.

Rollbacks are agreed the same way. An admin's request (``POST /v1/admin/rollback`` on any
rank) or this rank's automatic rollback rule (its own prequential figures) is carried in
the next agreement; one request wins per tick (an admin's before an automatic one, then
the lowest rank's) and every rank applies it at that tick, so the registries of the
ranks never differ. A tick that rolls back publishes nothing; the next publication waits
a full interval. A drift reaction that clears AdamW's moments is agreed too.

The publish gate (``HOLDOUT_SHARE`` > 0) judges the union of the ranks' holdouts: at a
publication every rank scores its own holdout and the ranks add the sums
(:meth:`~streamtrain.distributed.collectives.Collectives.sum_rows`), so the verdict is the same on
every rank.

On a GPU the loop stages batches as the single-process trainer does: the prefetch thread
pins each batch, and the next batch's copy is queued on a side stream while this tick's
step runs (:class:`DeviceStager`); the step's forward runs under ``AMP``'s autocast; the
normalization moments are merged on the host in float64.

Trainer state splits in two for a checkpoint: what every rank holds alike (model,
optimizer, scheduler, normalization, step and token counters, version, the kept
versions), saved once by rank 0, and what is this rank's own (its data stream's resume
point, its torch generator, its quality monitor: prequential figures and holdout), saved
in its shard and restored only when the ownership is unchanged.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import numpy as np
import torch

from streamtrain.config import Settings
from streamtrain.data.collate import Batch
from streamtrain.data.prefetch import Prefetcher, StagedBatch, Staging, pin_batch, stage_batch
from streamtrain.device import is_cuda, side_stream
from streamtrain.distributed.collectives import (
    EXIT_COLLECTIVE_FAILURE,
    CollectiveFailure,
    Collectives,
    exit_after_collective_failure,
)
from streamtrain.distributed.data_parallel import DataParallelStep, ParallelStepReport
from streamtrain.distributed.wire import AgreedRollback, AskedRollback, StepAgreement, StepSignals
from streamtrain.training.protocol import ContinuousTrainer
from streamtrain.training.registry import UnknownVersion
from streamtrain.training.trainer import RANK_LOCAL_TRAINER_KEYS as RANK_LOCAL_TRAINER_KEYS
from streamtrain.training.trainer import Trainer
from streamtrain.training.trainer import join_trainer_state as join_trainer_state
from streamtrain.training.trainer import split_trainer_state as split_trainer_state

log = logging.getLogger(__name__)

TrainerT = TypeVar("TrainerT", bound=ContinuousTrainer)

#: Settings every rank of a group must share: the model and how it learns, the window the
#: shares add up to, the publish gate's rule and the kept versions (the registries of the
#: ranks must stay identical). Checked at start-up (:func:`check_settings_agree`). Others
#: may differ per rank (HTTP port, threads, timers, the scoring budget, DEVICE's index).
AGREED_SETTINGS: Final = (
    "topic",
    "channels",
    "n_classes",
    "max_len",
    "d_model",
    "n_heads",
    "n_layers",
    "learning_rate",
    "weight_decay",
    "warmup_steps",
    "grad_clip_norm",
    "amp",
    "dp",
    "window_capacity",
    "half_life_s",
    "max_age_s",
    "holdout_share",
    "holdout_min_events",
    "publish_gate_tolerance",
    "model_versions_keep",
    # DP: the ranks' engines are one mechanism, accounted once, with one schedule
    "dp_noise_multiplier",
    "dp_clip_norm",
    "dp_q0",
    "dp_half_life_steps",
    "dp_eligible_steps",
    "dp_admit_per_step",
    "dp_step_rate_hz",
    "dp_delta",
    "dp_target_epsilon",
    "dp_expected_batch_size",
    "dp_unit",
    "dp_sensor_events",
    "dp_expected_units",
    "dp_norm_mean",
    "dp_norm_std",
)
EXIT_LOOP_FAILURE: Final = 1  # a rank's own error (not a collective's): it leaves, the group restarts

_IDLE_WAIT_S = 0.1  # between ticks while no rank has data
_BATCH_WAIT_S = 0.05  # a rank that is training waits this long for its next batch
_ROLLBACKS_KEPT = 100  # LockstepLoop.rollbacks: the most recent agreed rollbacks


def settings_fingerprint(settings: Settings) -> dict[str, Any]:
    """The values of :data:`AGREED_SETTINGS` as ``settings`` holds them (JSON values)."""
    public = settings.public_dict()
    return {name: public[name] for name in AGREED_SETTINGS}


def check_settings_agree(collectives: Collectives, settings: Settings) -> None:
    """Refuse (:class:`~streamtrain.distributed.wire.SettingsMismatch`, one line, on every rank) a group
    whose ranks were started with different :data:`AGREED_SETTINGS`."""
    collectives.agree_settings(settings_fingerprint(settings))


# ----------------------------------------------------------------------------------------
# batches on the training device


class DeviceStager:
    """This rank's next batch, on the training device, without ever blocking a tick.

    Takes host batches from ``source`` (the prefetch thread, which pins them on a GPU)
    and hands out :class:`~streamtrain.data.prefetch.StagedBatch` es. With ``ahead`` (the
    default on CUDA) it queues the copy of the next ready batch on a side stream right
    after handing one out, so the copy runs during this tick's step; a batch that is not
    ready then is not waited for (the tick must go on) and is copied when it is taken.
    Off CUDA the "copy" is the host tensor itself: the same code path, nothing moved.
    """

    def __init__(self, source: Prefetcher[Batch], device: torch.device, *, ahead: bool | None = None) -> None:
        self.source = source
        self.device = device
        self.ahead = is_cuda(device) if ahead is None else ahead
        self.staged_ahead = 0  # batches whose copy was queued one tick early
        self._stream = side_stream(device)
        self._next: Staging | None = None  # the staging of the batch copied ahead
        self._ended: BaseException | None = None  # the source ended (or failed) while looking ahead

    def poll(self, timeout_s: float) -> StagedBatch | None:
        """The next batch if one is ready within ``timeout_s`` (0: only if ready now).

        The source's end (StopIteration) or error comes out of the ``poll`` after the
        batch in hand was delivered, as from the source itself.
        """
        if self._next is not None:
            current, self._next = self._next, None
        else:
            if self._ended is not None:
                ended, self._ended = self._ended, None
                raise ended
            host = self.source.poll(timeout_s)
            if host is None:
                return None
            current = stage_batch(host, self.device, self._stream)
        if self.ahead and self._ended is None:
            try:
                upcoming = self.source.poll(0.0)
            except Exception as error:  # noqa: BLE001 - StopIteration included: after the batch in hand
                self._ended = error
                upcoming = None
            if upcoming is not None:
                self._next = stage_batch(upcoming, self.device, self._stream)
                self.staged_ahead += 1
        return current.ready()

    def close(self, timeout: float = 0.5) -> None:
        """Close the source; a batch staged ahead is dropped (planned, never trained)."""
        self._next = None
        self.source.close(timeout=timeout)


# ----------------------------------------------------------------------------------------
# agreed rollbacks


@dataclass(frozen=True)
class AppliedRollback:
    """One agreed rollback as this rank took it (the same on every rank)."""

    tick: int
    rank: int  # who asked
    trigger: str
    version: int
    from_version: int | None  # the version that served before
    applied: bool
    why_not: str | None = None
    unknown_version: bool = False  # not taken: the version is not kept


class RollbackTicket:
    """A rollback this rank asked for; resolved once every rank took it (or it lapsed)."""

    def __init__(self, request: AskedRollback, reason: str) -> None:
        self.request = request
        self.reason = reason
        self.outcome: AppliedRollback | None = None
        self._done = threading.Event()

    def resolve(self, outcome: AppliedRollback) -> None:
        self.outcome = outcome
        self._done.set()

    def wait(self, timeout_s: float) -> AppliedRollback | None:
        """The outcome, or None when the ranks did not take the request within ``timeout_s``."""
        self._done.wait(timeout_s)
        return self.outcome


class LockstepControl(Generic[TrainerT]):
    """What every lockstep loop shares: the agreed rollback, publication, checkpoint and stop.

    Requests come from other threads (:attr:`stop_requested`, :attr:`checkpoint_due`,
    :meth:`request_rollback`, :meth:`request_automatic_rollback`); each tick a subclass
    carries them in one agreement (:meth:`_signals`, then
    :meth:`~streamtrain.distributed.collectives.Collectives.agree`) and hands the agreement
    to :meth:`_follow`, which takes the agreed actions in one order on every rank. Any error
    ends the process (:meth:`__call__`). Subclasses implement :meth:`_run` and :meth:`_publish`.
    """

    def __init__(
        self,
        trainer: TrainerT,
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
        self.tick = 0  # lockstep ticks since start, the same on every rank
        self.stop_requested = threading.Event()
        self.checkpoint_due = threading.Event()
        self.finished = threading.Event()  # the loop ended after the agreed stop
        self.rollbacks: list[AppliedRollback] = []  # every agreed rollback, as applied (the same on every rank)
        self._rollback_lock = threading.Lock()
        self._rollback_queue: deque[RollbackTicket] = deque()
        self._last_publish = -math.inf  # never: the first tick may publish, however young the machine's clock

    # ------------------------------------------------------------------ requests from other threads
    def request_rollback(
        self, version: int, trigger: str = "admin", reason: str = "asked by an admin"
    ) -> RollbackTicket:
        """Ask every rank to make kept ``version`` serve again; wait on the ticket for the outcome."""
        ticket = RollbackTicket(AskedRollback(int(version), trigger), reason)
        with self._rollback_lock:
            self._rollback_queue.append(ticket)
        return ticket

    def sum_rows(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` summed over the ranks (the quality monitor's holdout sums)."""
        return self.collectives.sum_rows(rows)

    def request_automatic_rollback(self, version: int, reason: str) -> bool:
        """The quality monitor's rule fired on this rank (ingest thread): ask every rank."""
        serving = self.trainer.published
        if serving is None:
            return False
        ticket = RollbackTicket(AskedRollback(int(version), "automatic", serving.version), reason)
        with self._rollback_lock:
            self._rollback_queue.append(ticket)
        log.info(
            "rank %d asks every rank to roll back from version %d to %d: %s",
            self.collectives.rank,
            serving.version,
            version,
            reason,
        )
        return True

    def _pending_rollback(self) -> RollbackTicket | None:
        """What this rank asks for at this tick: its oldest admin request, else its oldest automatic one."""
        with self._rollback_lock:
            for ticket in self._rollback_queue:
                if ticket.request.trigger == "admin":
                    return ticket
            return self._rollback_queue[0] if self._rollback_queue else None

    # ------------------------------------------------------------------ the loop
    def __call__(self) -> None:
        """Run until the ranks agree to stop; never returns on an error (the process exits)."""
        try:
            self._run()
        except CollectiveFailure as err:
            exit_after_collective_failure(err, EXIT_COLLECTIVE_FAILURE)
        except BaseException as err:  # noqa: BLE001 - one rank cannot go on alone
            log.exception("rank %d: the lockstep loop failed", self.collectives.rank)
            exit_after_collective_failure(err, EXIT_LOOP_FAILURE)
        self._abandon_rollbacks("the ranks stopped before taking it")
        self.finished.set()
        if self.on_stopped is not None:
            self.on_stopped()

    def _run(self) -> None:
        """The ticks, until the ranks agree to stop (:meth:`_follow` returns True)."""
        raise NotImplementedError

    def _publish(self) -> None:
        """Publish the model, as agreed at this tick (every rank)."""
        raise NotImplementedError

    def _signals(self, asked: RollbackTicket | None, **wants: bool) -> StepSignals:
        """This rank's row of the tick's agreement: stop, checkpoint, its rollback request, and ``wants``."""
        return StepSignals(
            stop=self.stop_requested.is_set(),
            checkpoint_due=self.checkpoint_due.is_set(),
            rollback=None if asked is None else asked.request,
            **wants,
        )

    def _follow(self, tick: int, agreement: StepAgreement, asked: RollbackTicket | None, *, publish: bool) -> bool:
        """Take what the ranks agreed at ``tick``, in one order on every rank; True when they stop.

        A rollback first (a tick that rolls back publishes nothing), then the publication
        (``publish``: the agreement's, as the subclass's step allows), then the checkpoint
        (at the stop: the final one).
        """
        rolled_back = agreement.rollback is not None and self._roll_back(tick, agreement.rollback, asked)
        if publish and not rolled_back:
            self._publish()
            self._last_publish = time.monotonic()
        if agreement.checkpoint or agreement.stop:
            self.checkpoint_due.clear()  # asked again meanwhile: the next tick cuts another
            self.checkpoint(agreement.stop)
        if agreement.stop:
            log.info(
                "rank %d: the ranks agreed to stop at tick %d (step %d)",
                self.collectives.rank,
                self.tick,
                self.trainer.step,
            )
        return agreement.stop

    def _roll_back(self, tick: int, agreed: AgreedRollback, asked: RollbackTicket | None) -> bool:
        """Apply the agreed rollback (every rank, this tick); True when a version was rolled back to.

        Whether it applies depends only on the registry, which is the same on every rank:
        an automatic request lapses once the version it judged no longer serves, and a
        version no longer kept cannot serve.
        """
        trainer = self.trainer
        request = agreed.request
        mine = asked if asked is not None and agreed.rank == self.collectives.rank else None
        if mine is not None:
            assert mine.request == request, "the agreement carries this rank's own request"
            with self._rollback_lock:
                self._rollback_queue.remove(mine)
        serving = trainer.published
        before = None if serving is None else serving.version
        why_not: str | None = None
        unknown = False
        if request.trigger == "automatic" and before != request.from_version:
            why_not = f"version {request.from_version} no longer serves (version {before} does)"
        else:
            detail = f"agreed at tick {tick}, asked by rank {agreed.rank}"
            reason = f"{mine.reason} ({detail})" if mine is not None else detail
            try:
                trainer.rollback(request.version, trigger=request.trigger, reason=reason)
            except UnknownVersion:
                unknown = True
                why_not = f"version {request.version} is not kept; kept versions: {trainer.registry.versions()}"
        if why_not is None:
            self._last_publish = time.monotonic()  # the next publication waits a full interval
        else:
            log.warning(
                "%s rollback to version %d asked by rank %d not taken: %s",
                request.trigger,
                request.version,
                agreed.rank,
                why_not,
            )
        outcome = AppliedRollback(
            tick=tick,
            rank=agreed.rank,
            trigger=request.trigger,
            version=request.version,
            from_version=before,
            applied=why_not is None,
            why_not=why_not,
            unknown_version=unknown,
        )
        self.rollbacks.append(outcome)
        del self.rollbacks[:-_ROLLBACKS_KEPT]
        if mine is not None:
            mine.resolve(outcome)
        return outcome.applied

    def _abandon_rollbacks(self, why: str) -> None:
        with self._rollback_lock:
            left, self._rollback_queue = list(self._rollback_queue), deque()
        for ticket in left:
            r = ticket.request
            ticket.resolve(AppliedRollback(self.tick, self.collectives.rank, r.trigger, r.version, None, False, why))


class LockstepLoop(LockstepControl[Trainer]):
    """The trainer thread's work on every rank of a scaled-out service (module docstring).

    ``checkpoint(final)`` cuts a checkpoint together with the other ranks; the loop calls
    it on the trainer thread whenever the agreement says so (``final`` at the agreed
    stop). ``on_stopped`` runs once the loop has ended after an agreed stop. The trainer
    is built with the loop (``Trainer(loop=...)``): it asks automatic rollbacks of every rank
    through :meth:`request_automatic_rollback`, its publish gate judges the union of the
    ranks' holdouts through :meth:`sum_rows`, and it counts each agreed step in
    :meth:`~streamtrain.training.trainer.Trainer.apply_step`.
    """

    def __init__(
        self,
        trainer: Trainer,
        collectives: Collectives,
        *,
        checkpoint: Callable[[bool], None],
        on_stopped: Callable[[], None] | None = None,
        stage_ahead: bool | None = None,
    ) -> None:
        super().__init__(trainer, collectives, checkpoint=checkpoint, on_stopped=on_stopped)
        self.stage_ahead = stage_ahead  # None: one batch ahead on CUDA only (tests force it on the CPU)
        self.step = DataParallelStep(
            collectives,
            trainer.model,
            trainer.norm,
            trainer.optimizer,
            grad_clip_norm=trainer.settings.grad_clip_norm,
            scheduler=trainer.scheduler,
            amp=trainer.settings.precision,
            forward=trainer.forward,
        )
        self.last_report: ParallelStepReport | None = None
        self.stager: DeviceStager | None = None
        self._training = False  # the last tick had a batch here: wait a little for the next

    def _run(self) -> None:
        trainer = self.trainer
        device = trainer.device
        prefetcher: Prefetcher[Batch] = Prefetcher(
            trainer.dataset,
            depth=self.settings.prefetch_depth,
            name="trainer-prefetch",
            transform=pin_batch if is_cuda(device) else None,  # pinned in the producer thread
        )
        self.stager = stager = DeviceStager(prefetcher, device, ahead=self.stage_ahead)
        try:
            while True:
                waited_before = prefetcher.data_wait_seconds
                batch = stager.poll(_BATCH_WAIT_S if self._training else 0.0)
                wait = prefetcher.data_wait_seconds - waited_before if self._training else 0.0
                self._training = batch is not None
                asked = self._pending_rollback()
                signals = self._signals(
                    asked, publish_due=self._publish_due(), reset_optimizer=trainer.take_optimizer_reset()
                )
                with trainer.lock:
                    self.step.fault_injector = trainer.fault_injector
                    report = self.step.step(batch, step=self.tick, signals=signals)
                    tick = self.tick
                    self.tick += 1
                    self._account(batch, report, wait)
                agreement = report.agreement
                if batch is not None and report.skipped_reason != "stop":
                    trainer.dataset.mark_trained(batch)  # applied or refused, the stream moves past it
                # the gate, if on, judges the union of the ranks' holdouts
                if self._follow(tick, agreement, asked, publish=agreement.publish and report.applied):
                    return
                if not agreement.has_data:
                    self.stop_requested.wait(_IDLE_WAIT_S)
        finally:
            stager.close(timeout=0.5)

    def _publish(self) -> None:
        self.trainer.publish()

    def _publish_due(self) -> bool:
        return (
            self.trainer.published is None or time.monotonic() - self._last_publish >= self.settings.publish_interval_s
        )

    def _account(self, batch: Batch | None, report: ParallelStepReport, wait: float) -> None:
        """The trainer counts the global step; its metrics come from this rank's own batch."""
        self.last_report = report
        self.trainer.data_wait_seconds += wait
        self.trainer.metrics.train_data_wait_seconds.inc(wait)
        self.trainer.apply_step(report.outcome(), batch)
