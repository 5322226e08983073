"""DP mode inside the service: the DP engine on its public clock, with the Trainer's surface.

Ingest hands every valid event straight to :meth:`DPTrainer.admit` (the DP window's
admission rule); the recency window is never a training source in DP mode, since its
evictions would carry an event's influence on for an unbounded time (docs/privacy.md).
Steps run on the public clock whether or not anything was sampled.

Exactly-once participation: every closed step's decisions go to the admission record,
which is made durable (fsync) before any model is published; on start the record says the
last step that ran and each partition's watermark, and the engine continues after them
(:meth:`DPTrainer.resume_after_restore`). A model whose record cannot be made durable is not
published. Publication follows the public clock: the model after step t is published at
the time step t + 1 is due, every ``PUBLISH_INTERVAL_S`` worth of steps, stamped with that
public time.

Scaled out (``WORLD_SIZE > 1``), the ranks' engines are one DP mechanism
(:mod:`streamtrain.privacy.group`) and the trainer thread runs :class:`DPLockstepLoop`: every
tick the ranks agree on stop, checkpoint, rollback and publication (rank 0's public clock
decides when a model is due), then run the clock's step together. The record is synced by
every rank together (:meth:`DPEngine.sync_record`) before a publication and a checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from streamtrain.config import Settings
from streamtrain.data.randomness import make_randomness
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.lockstep import LockstepControl
from streamtrain.events import EventBatch
from streamtrain.metrics import Metrics
from streamtrain.model.network import build_model
from streamtrain.model.normalization import RunningNorm
from streamtrain.privacy.admissions import ADMISSION_DIR, CLOCK_LOG, AdmissionRecord, AdmissionRecordError
from streamtrain.privacy.config import DPConfig, DPConfigError
from streamtrain.privacy.engine import DPAggregates, DPEngine, DPStepReport
from streamtrain.privacy.group import DPGroup
from streamtrain.runtime.exits import leave_now
from streamtrain.training.protocol import CheckpointParts, RestoredParts, StepLoop, TrainerReport
from streamtrain.training.publishing import ModelTrainer, PublishedModel, build_optimizer
from streamtrain.window.reservoir import RecencyWindow

log = logging.getLogger(__name__)

#: The exit status of a process that fenced itself (EX_TEMPFAIL: restart it, it resumes from its record).
EXIT_DP_FENCED = 75
#: A revocation's sync is retried this often (with doubling waits from the first) before the process fences itself.
REVOKE_SYNC_ATTEMPTS = 3
REVOKE_SYNC_FIRST_WAIT_S = 0.5
#: Scaled out: the longest a tick waits for the next step (a stop or checkpoint asked meanwhile waits no longer).
_GROUP_TICK_WAIT_S = 0.1


class AdmissionsFenced(OSError):
    """This process may neither publish nor checkpoint again: another may admit what it did not record."""


def end_process_fenced(why: str) -> None:
    """Leave at once (exit 75), from whichever thread fenced: nothing after the fence may reach a release."""
    leave_now(EXIT_DP_FENCED, f"DP: leaving the process (exit {EXIT_DP_FENCED}): {why}")


def dp_config(settings: Settings) -> DPConfig:
    """The DP schedule from the settings; a bad value is one line naming the setting."""
    try:
        return DPConfig.from_settings(settings)
    except ValidationError as err:
        first = err.errors()[0]
        raise DPConfigError(f"invalid DP setting {first.get('loc')}: {first.get('msg')}") from None


def admission_record(settings: Settings) -> AdmissionRecord:
    """The record's place: DP_ADMISSION_DIR (shareable by replicas) and this process's clock log."""
    directory = settings.dp_admission_dir or Path(settings.checkpoint_dir) / ADMISSION_DIR
    return AdmissionRecord(directory, Path(settings.checkpoint_dir) / CLOCK_LOG)


class DPTrainer(ModelTrainer):
    """Trains with DP-SGD on the public clock; publishes frozen copies like :class:`Trainer`."""

    thread_name = "dp-trainer"

    def __init__(
        self,
        settings: Settings,
        window: RecencyWindow,
        metrics: Metrics,
        *,
        collectives: Collectives | None = None,
        loop: Callable[[DPTrainer], StepLoop] | None = None,
    ) -> None:
        """``collectives`` (scaled out): the ranks whose engines are one DP mechanism; ``loop``
        builds the lockstep loop the thread then runs (:class:`DPLockstepLoop`)."""
        super().__init__(settings, metrics, clock=self._public_time)
        torch.manual_seed(settings.seed)  # initial weights are public
        self.model = build_model(settings)
        self.model.train()
        self.optimizer = build_optimizer(self.model, settings)
        self.config = dp_config(settings)
        self.record = admission_record(settings)
        self.group = None if collectives is None else DPGroup(collectives)
        # SHUFFLE=seeded is refused inside (check_dp_safety), naming SHUFFLE and crypto.
        self.engine = DPEngine(
            self.model,
            self.optimizer,
            self.config,
            settings.dp_token_budget,
            randomness=make_randomness(settings.shuffle, settings.seed),
            record=self.record,
            group=self.group,
        )
        self.norm: RunningNorm = self.engine.norm
        self.publish_every_steps = max(1, round(settings.publish_interval_s * self.config.step_rate_hz))
        self.last_pass = None
        self.loss_ema = None  # not released in DP mode
        self.naive_loss_ema = None
        self.step_seconds = 0.0  # operator plane only
        self.data_wait_seconds = 0.0
        self.record_error: str | None = None
        self.assign_error: str | None = None  # partitions given to us whose watermarks could not be read
        #: Set when this life may no longer release anything (docs/privacy.md, Revocation fenced).
        self.fenced: str | None = None
        #: Called with the reason once fenced; the default ends the process (a restart resumes from the record).
        self.on_fenced: Callable[[str], None] = end_process_fenced
        self._publish_after: int | None = None  # a step whose model is published when the next one is due
        self._publish_at_step = 0
        self._exported = DPAggregates()
        self._checkpoint_synced_step = 0  # the record's synced step when the restored checkpoint was taken
        self.metrics.dp_epsilon.set(self.engine.epsilon_spent())
        self.loop: StepLoop | None = None if loop is None else loop(self)

    # ------------------------------------------------------------------ the Trainer surface
    @property
    def step(self) -> int:
        return self.engine.steps

    @property
    def tokens_trained(self) -> int:
        return 0  # data-dependent: on the operator plane (operator_report), never in a published model

    def admit(self, batch: EventBatch, next_offsets: dict[int, int]) -> None:
        """Called by ingest for every poll batch of valid events."""
        self.engine.admit(batch, time.time(), next_offsets)

    @property
    def quality(self) -> None:
        """None: private events are not scored (a score would be a data-dependent release)."""
        return None

    @property
    def min_window_items(self) -> int:
        return self.settings.min_window_items

    def dp_report(self) -> dict[str, Any]:
        return self.engine.model_info()

    def readiness_notes(self) -> list[str]:
        notes = [] if self.record_error is None else [f"dp_admission_record_failing: {self.record_error}"]
        if self.assign_error is not None:
            notes.append(f"dp_partitions_not_admitted: {self.assign_error}")
        if self.fenced is not None:
            notes.append(f"dp_fenced: {self.fenced}")
        return notes

    def report(self) -> TrainerReport:
        """Only the public clock and ε: nothing data-dependent."""
        return TrainerReport(training={"live_step": self.step}, public_progress=False, dp=self.dp_report())

    def operator_report(self) -> dict[str, Any]:
        """Data-dependent DP diagnostics (outside the guarantee): admin token only."""
        return {
            **self.engine.operator_info(),
            "record_synced_step": self.record.synced_step,
            "record_error": self.record_error,
            "record_directory": str(self.record.directory),
        }

    def _public_time(self) -> float:
        """``published_at`` of a model: when the step after it was due (a public time)."""
        return self.engine.due_at(self._publish_at_step + 1, time.time())

    # ------------------------------------------------------------------ partitions
    def on_partitions_assigned(self, partitions: list[int]) -> None:
        """A partition arrives (maybe from another replica): admit only above its recorded watermark.

        If the record cannot be read, the partitions are not admitted from at all (until the
        next assignment): admitting without their watermarks could decide an event twice.
        """
        try:
            marks = self.record.watermarks(partitions)
        except (OSError, AdmissionRecordError) as err:
            self.assign_error = f"partitions {sorted(partitions)}: admission record unreadable ({err})"
            log.error("DP: %s; their events are not admitted", self.assign_error)
            self.engine.window.own([], {})  # from here on only owned partitions are admitted
            self.engine.window.drop_partitions(partitions)
            return
        self.assign_error = None
        self.engine.window.own(partitions, marks)

    def on_partitions_revoked(self, partitions: list[int]) -> None:
        """A partition leaves: stop admitting it, and make its decisions durable for the next owner.

        Runs before the rebalance can complete. If the record still cannot be made durable
        after a few tries, the next owner would read an older watermark and could admit what
        this process trained on: so this process fences itself — it never publishes or
        checkpoints again — and ends (:attr:`on_fenced`); its restart resumes from the
        durable record and checkpoint, in which those admissions never happened.

        Scaled out, a partition has no next owner while the group runs (ownership is a fixed
        rule; a consumer closed by ingest's watchdog gets the same partitions back), and the
        record is synced by every rank together, on the trainer thread: nothing to sync here.
        """
        self.engine.window.drop_partitions(partitions)
        if self.group is not None:
            return
        wait = REVOKE_SYNC_FIRST_WAIT_S
        for attempt in range(1, REVOKE_SYNC_ATTEMPTS + 1):
            try:
                self.record.sync()
                return
            except OSError as err:
                self._record_failed(err)
                if attempt == REVOKE_SYNC_ATTEMPTS:
                    self._fence(
                        f"partitions {sorted(partitions)} were revoked but the admission record could not be made "
                        f"durable ({err})"
                    )
                    return
                time.sleep(wait)
                wait *= 2

    def _fence(self, why: str) -> None:
        with self.lock:  # a step or a checkpoint in progress finishes first; none starts after
            self.fenced = why
        log.critical("DP fenced: %s; nothing is published or checkpointed from here on", why)
        self.on_fenced(why)

    # ------------------------------------------------------------------ training and publishing
    def publish(self) -> PublishedModel | None:  # type: ignore[override]
        """Publish only once the admission record covers every step the model used (never once fenced)."""
        with self.lock:  # the fence is set under this lock: checked and published as one
            if self.fenced is not None:
                return None
            try:
                self.engine.sync_record()  # scaled out: every rank's part, then the group's clock
            except OSError as err:
                self._record_failed(err)
                return None
            self.record_error = None
            return super().publish()

    def _record_failed(self, err: OSError) -> None:
        self.record_error = f"admission record not durable ({err}); models are held back"
        self.metrics.dp_record_failures.inc()
        log.error("DP %s", self.record_error)

    def _work(self) -> None:
        """Publish the last step's model once the next step is due, then run that step."""
        if self.loop is not None:
            self.loop()
            self._stop.set()  # the ranks agreed to stop: the thread ends
            return
        now = time.time()
        if self.publication_due(now):
            self.publish_due_model()
        if self.run_step(now) is None:
            self._stop.wait(self.idle_wait_s())

    def publication_due(self, now: float) -> bool:
        """A model waits to be published and the public time of the step after it has come."""
        return self._publish_after is not None and now >= self.engine.due_at(self._publish_after + 1, now)

    def publish_due_model(self) -> None:
        """Publish the model that waits (:meth:`publication_due`), stamped with that public time;
        it waits on if the record cannot be made durable."""
        if self._publish_after is None:
            return
        self._publish_at_step = self._publish_after
        if self.publish() is not None:
            self._publish_after = None

    def run_step(self, now: float) -> DPStepReport | None:
        """The clock's next step if it is due at ``now`` (scaled out: with every rank); None if not."""
        with self.lock:
            report = self.engine.step(now)
        if report is None:
            return None
        self.metrics.dp_epsilon.set(report.epsilon)
        self.metrics.train_steps.inc()
        if report.aggregates_updated:
            self._export_period(report.aggregates)
        if report.behind_steps:
            log.debug("DP clock is %d steps ahead of training", report.behind_steps)
        if report.step % self.publish_every_steps == 0 or self.published is None:
            self._publish_after = report.step
        return report

    def idle_wait_s(self) -> float:
        """How long to wait after a tick without a step: until the next is due, shorter while a model waits."""
        wait = self.engine.seconds_until_next_step(time.time())
        return min(0.5, wait) if self._publish_after is None else min(0.05, wait)

    def _export_period(self, totals: DPAggregates) -> None:
        """Operator-plane counters move by whole reporting periods: no per-step batch size anywhere."""
        new = DPAggregates(**{k: getattr(totals, k) - getattr(self._exported, k) for k in totals.__dataclass_fields__})
        self._exported = totals
        self.metrics.train_tokens.inc(new.sampled_tokens)
        self.metrics.train_padding_tokens.inc(max(0, new.padded_tokens - new.sampled_tokens))
        self.step_seconds += new.step_seconds

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's trainer state; the admission record is synced first (OSError: no
        checkpoint), so the record always covers whatever a checkpoint holds."""
        with self.lock:
            if self.fenced is not None:
                raise AdmissionsFenced(self.fenced)
            self.engine.sync_record()  # scaled out: a collective (every rank cuts the checkpoint)
            return {
                "model": self.model.state_dict(),
                "model_config": dict(self.model.config),
                "optimizer": self.optimizer.state_dict(),
                "dp": self.engine.state_dict(),
                "step": self.engine.steps,
                "version": self._version,
                "tokens_trained": 0,
            }

    def checkpoint_parts(self, state: dict[str, Any]) -> CheckpointParts:
        """Shared: the model, optimizer and the group's DP state (clock, accountant, record step);
        this rank's own: its operator-plane totals; by partition: its DP window's records."""
        dp = dict(state["dp"])
        window, published, running = dp.pop("window"), dp.pop("published"), dp.pop("running")
        return CheckpointParts(
            shared={**state, "dp": dp},
            rank_local={"dp_totals": {"published": published, "running": running}},
            by_partition={"dp_window": window},
        )

    def state_from_parts(self, parts: RestoredParts) -> dict[str, Any]:
        """The group's DP state with this rank's share of the DP windows (:meth:`DPWindow.share_state`).

        A one-file checkpoint (another world size) holds its one window in the shared state.
        Operator-plane totals come back only under the same ownership.
        """
        dp = dict(parts.shared["dp"])
        if parts.unchanged and parts.by_partition:
            window = parts.by_partition[0]["dp_window"]
        else:
            sources = [part["dp_window"] for part in parts.by_partition] or [dp["window"]]
            window = self.engine.window.share_state(sources, parts.owns)
        totals = (parts.rank_local or {}).get("dp_totals")
        fresh = asdict(DPAggregates())
        dp.update(
            window=window,
            published=fresh if totals is None else totals["published"],
            running=fresh if totals is None else totals["running"],
        )
        return {**parts.shared, "dp": dp}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            if "dp" not in state:
                raise DPConfigError(
                    "the newest checkpoint was written without DP: its model saw data outside the DP window; "
                    "use an empty CHECKPOINT_DIR for DP mode"
                )
            if dict(state["model_config"]) != dict(self.model.config):
                raise ValueError("checkpoint model does not match the configured model; use a fresh CHECKPOINT_DIR")
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.engine.load_state_dict(state["dp"])
            self._version = int(state.get("version", 0))
            self._exported = self.engine.report()
            self._checkpoint_synced_step = int(state["dp"].get("record_synced_step", 0))

    def resume_after_restore(self) -> None:
        """On start, after any checkpoint is loaded: continue after what the admission record shows.

        Refuses (AdmissionRecordError) a record that is damaged, or older than the checkpoint
        it must complement (deleted or rolled back): restoring from it could admit events twice.
        """
        self.engine.take_group_writer()  # scaled out: before the record is read (the ledger knows its own lines)
        recorded = self.record.load()
        synced = self._checkpoint_synced_step
        if recorded.last_step < synced:
            raise AdmissionRecordError(
                f"the DP admission record in {self.record.directory} ends at step {recorded.last_step}, but the "
                f"checkpoint was taken when it reached step {synced}: it was deleted or rolled back, and restoring "
                "would admit events again; restore the record, or start a new DP deployment with empty "
                "CHECKPOINT_DIR and DP_ADMISSION_DIR"
            )
        restored_step = self.engine.steps
        step = self.engine.resume(recorded)
        # What the checkpoint knows goes into the record before anything is published, so a
        # later fallback to an older checkpoint still sees these watermarks.
        watermarks = dict(self.engine.window.watermarks)
        self.record.note_watermarks(step, watermarks)
        log.info(
            "DP admission record: life %d, checkpoint at step %d, record at step %d: continuing after step %d "
            "(%d partitions with watermarks)",
            self.record.life, restored_step, recorded.last_step, step, len(watermarks),
        )  # fmt: skip
        self.metrics.dp_epsilon.set(self.engine.epsilon_spent())
        if restored_step:
            self._publish_at_step = step
            self.publish()  # the restored model (it used only steps the record and checkpoint cover)


class DPLockstepLoop(LockstepControl[DPTrainer]):
    """The DP trainer's thread on every rank of a scaled-out service: lockstep ticks on the public clock.

    A tick: the ranks agree (one small all-gather, :class:`~streamtrain.distributed.lockstep.LockstepControl`)
    on stop, checkpoint and rollback, as asked on any rank, and on publication, which rank 0
    asks for once the public time of the step after the waiting model has come (rank 0's
    clock is the group's); they take those actions together, then run the clock's next step
    together if rank 0's clock says it is due (:meth:`DPEngine.step`: one exact integer sum
    and one noise draw for the group). A publication and a checkpoint sync the admission
    record with every rank first; one that cannot be synced on some rank is held back on all.
    """

    def _run(self) -> None:
        trainer = self.trainer
        while True:
            # one reading of the clock a tick: read again for the step, a step that came due
            # after the publication check ran before the model waiting for it was published,
            # which then held that step too and carried the earlier step's public time
            now = time.time()
            asked = self._pending_rollback()
            rank_zero_due = self.collectives.rank == 0 and trainer.publication_due(now)
            signals = self._signals(asked, publish_due=rank_zero_due)
            agreement = self.collectives.agree(self.tick, signals)
            tick = self.tick
            self.tick += 1
            if self._follow(tick, agreement, asked, publish=agreement.publish):
                return
            if trainer.run_step(now) is None:
                self.stop_requested.wait(min(trainer.idle_wait_s(), _GROUP_TICK_WAIT_S))

    def _publish(self) -> None:
        self.trainer.publish_due_model()
