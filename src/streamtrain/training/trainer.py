"""The continuous trainer: its own thread, fed by the pipeline, publishing frozen models.

The model surface is two verbs, River-style: :meth:`Trainer.train_step` on a
:class:`~streamtrain.data.collate.Batch` and :func:`streamtrain.model.inference.predict` on the
published copy. The loop waits for a minimum window, trains on token-budget batches
(loss normalized by real tokens, so variable batch sizes keep a steady gradient scale),
refuses non-finite steps and publishes a frozen inference copy at a set interval.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from streamtrain.config import Settings
from streamtrain.data.bucketing import PassDiagnostics, TokenBudget
from streamtrain.data.collate import Batch
from streamtrain.data.dataset import WindowBatchDataset
from streamtrain.data.passes import pass_sampler_from_settings
from streamtrain.data.prefetch import DevicePrefetcher, Prefetcher, pin_batch, place_batch
from streamtrain.data.randomness import derive_seed, make_randomness
from streamtrain.device import autocast, describe, is_cuda
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.data_parallel import DataParallelStep
from streamtrain.distributed.launch import DistContext
from streamtrain.distributed.wire import StepSignals
from streamtrain.events import EventBatch
from streamtrain.metrics import Metrics
from streamtrain.model.compiled import ModelForward, training_row_multiple
from streamtrain.model.losses import forecast_loss
from streamtrain.model.network import ModelOutput, build_model
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.config import QualityConfig
from streamtrain.quality.drift import Drift
from streamtrain.quality.monitor import QualityMonitor
from streamtrain.quality.selection import Selection
from streamtrain.training.protocol import (
    CheckpointParts,
    LoopFactory,
    RestoredParts,
    StepLoop,
    StepOutcome,
    TrainerReport,
)
from streamtrain.training.publishing import ModelTrainer, PublishedModel, build_optimizer
from streamtrain.training.registry import UnknownVersion
from streamtrain.training.replays import ReplayBudget
from streamtrain.window.reservoir import RecencyWindow

log = logging.getLogger(__name__)

_LOSS_SMOOTHING = 0.05

#: Trainer-state keys that belong to one rank (scaled out: its data stream and quality monitor); the rest is shared.
RANK_LOCAL_TRAINER_KEYS: Final = ("dataset", "rng", "quality")
_STREAM_KEYS: Final = ("dataset", "rng")  # this rank's data stream: restored together or not at all


def _smooth(average: float | None, value: float) -> float | None:
    if not math.isfinite(value):
        return average
    return value if average is None else (1 - _LOSS_SMOOTHING) * average + _LOSS_SMOOTHING * value


@dataclass(frozen=True)
class StepReport:
    step: int
    applied: bool
    loss: float
    skipped_reason: str | None
    real_tokens: int
    padded_tokens: int
    sequences: int
    seconds: float


def build_budget(settings: Settings) -> TokenBudget:
    return TokenBudget(
        max_tokens=settings.token_budget,
        max_sequences=settings.max_batch_sequences,
        pad_to_multiple_of=settings.pad_to_multiple_of,
    )


def split_trainer_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, rank-local) parts of :meth:`Trainer.state_dict`."""
    shared = {key: value for key, value in state.items() if key not in RANK_LOCAL_TRAINER_KEYS}
    local = {key: state[key] for key in RANK_LOCAL_TRAINER_KEYS if key in state}
    return shared, local


def join_trainer_state(trainer: Trainer, shared: Mapping[str, Any], local: Mapping[str, Any] | None) -> dict[str, Any]:
    """A state for :meth:`Trainer.load_state_dict`: the shared part with this rank's own, or,
    when there is none (another ownership, or a checkpoint of one process), a fresh data
    stream and generator for this rank, and a fresh quality monitor (no quality key)."""
    joined = {key: value for key, value in shared.items() if key not in RANK_LOCAL_TRAINER_KEYS}
    if local and all(key in local for key in _STREAM_KEYS):
        joined.update({key: local[key] for key in _STREAM_KEYS})
    else:
        joined.update({"dataset": trainer.dataset.state_dict(), "rng": {"torch": torch.get_rng_state()}})
    if local and "quality" in local:
        joined["quality"] = local["quality"]
    return joined


class Trainer(ModelTrainer):
    """Owns the model, optimizer and normalization; trains from the window on a thread."""

    def __init__(
        self,
        settings: Settings,
        window: RecencyWindow,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
        data_seed: int | None = None,
        min_items: int | None = None,
        loop: LoopFactory | None = None,
    ) -> None:
        """``data_seed`` and ``min_items`` (default: ``SEED``, ``MIN_WINDOW_ITEMS``) are a
        scaled-out rank's own: its passes are drawn from its own window share. ``loop``
        builds the lockstep loop of a scaled-out rank: the thread then runs it instead of
        training alone, automatic rollbacks are asked of every rank through it, and the
        quality monitor's holdout sums are summed over the ranks."""
        super().__init__(settings, metrics, clock)
        self.window = window
        torch.manual_seed(settings.seed)
        # Built on the CPU from the seed, then moved: the same initial weights on every device.
        self.model = build_model(settings).to(self.device)
        self.model.train()
        log.info(
            "training on %s, amp=%s%s", describe(self.device), settings.amp,
            f"; GPU profile: {', '.join(settings.gpu_profile_applied)}" if settings.gpu_profile_applied else "",
        )  # fmt: skip
        self.norm = RunningNorm(settings.channels)  # float64 statistics, on the host
        self.optimizer = build_optimizer(self.model, settings)
        # The step's forward, compiled on a background thread (eager until then): COMPILE.
        self.forward = ModelForward(
            self.model,
            settings.precision,
            enabled=settings.compile == "on",
            niceness=settings.train_nice,
            row_multiple=training_row_multiple(self.device, settings.token_budget),
        )
        warmup = max(1, settings.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        # One process is a world of one rank: its step is the data-parallel step, whose
        # collectives are then local (the skip, clip and update rules exist once).
        self._one_rank = DataParallelStep(
            Collectives(DistContext()),
            self.model,
            self.norm,
            self.optimizer,
            grad_clip_norm=settings.grad_clip_norm,
            scheduler=self.scheduler,
            amp=settings.precision,
            forward=self.forward,
        )
        self._prefetcher: Prefetcher[Batch] | None = None
        data_seed = settings.seed if data_seed is None else data_seed
        # SAMPLING: which items each pass trains
        self.sampler = pass_sampler_from_settings(settings.model_copy(update={"seed": data_seed}))
        self.dataset = WindowBatchDataset(
            window.pass_source,  # a pass gathers its own items' columns, not the window's
            build_budget(settings),
            pool_size=settings.pool_size,
            shuffle=settings.shuffle,
            seed=data_seed,
            rank=0,  # every pass is this process's own window: never a share of a torch.distributed plan
            world_size=1,
            min_items=settings.min_window_items if min_items is None else min_items,
            idle_wait_s=0.2,
            on_pass_end=self._on_pass_end,
            sampler=self.sampler,
            track_trained=True,  # train_step marks each batch, so a checkpoint resumes after the last trained one
            min_batches_per_pass=settings.min_batches_per_pass,
        )
        self.loss_ema: float | None = None
        self.naive_loss_ema: float | None = None  # the last-value forecast on the same batches
        self.last_pass: PassDiagnostics | None = None
        self.data_wait_seconds = 0.0
        self.step_seconds = 0.0
        self.fault_injector: Callable[[torch.Tensor], torch.Tensor] | None = None  # tests inject NaN here
        self.quality = QualityMonitor(
            QualityConfig.from_settings(settings),
            metrics,
            lambda: self.registry.serving,
            on_drift=self._on_drift,
            on_rollback=self._auto_rollback,
        )
        self._reset_optimizer_due = False
        self.drift_reactions = 0
        self.replays = ReplayBudget(settings.max_replays_per_event)
        self.budget_wait_seconds = 0.0
        self._published_inputs: tuple[int, ...] | None = None  # what the last publication saw (_inputs)
        self.loop: StepLoop | None = None if loop is None else loop(self)
        if self.loop is not None:
            self.quality.combine = self.loop.sum_rows  # every rank judges the union of the holdouts

    # ------------------------------------------------------------------ the service's hooks
    @property
    def min_window_items(self) -> int:
        return self.dataset.min_items

    def admit(self, batch: EventBatch, next_offsets: dict[int, int]) -> None:
        """Nothing to do: the window is the trainer's only input (DP has its own admission)."""

    def on_partitions_assigned(self, partitions: list[int]) -> None:
        """Nothing to do: the window follows the consumer's assignment itself."""

    def on_partitions_revoked(self, partitions: list[int]) -> None:
        """Nothing to do: the window follows the consumer's assignment itself."""

    def resume_after_restore(self) -> None:
        """Nothing to do: the checkpoint holds everything training resumes from."""

    def readiness_notes(self) -> list[str]:
        return []

    def dp_report(self) -> dict[str, Any] | None:
        return None

    def operator_report(self) -> dict[str, Any] | None:
        return None

    def report(self) -> TrainerReport:
        published = self.published
        busy = self.step_seconds + self.data_wait_seconds
        selection = self.last_selection
        return TrainerReport(
            training={
                "live_step": self.step,
                "forecast_loss": self.loss_ema,
                "naive_last_value_loss": self.naive_loss_ema,
                "last_pass": {} if self.last_pass is None else self.last_pass.as_metrics(),
                "data_wait_share": (self.data_wait_seconds / busy) if busy > 0 else None,
                "publish_held": self.publish_held,
                "last_gate": None if self.last_gate is None else dataclasses.asdict(self.last_gate),
                "budget_wait_seconds": self.budget_wait_seconds,
            },
            quality=self.quality.report(None if published is None else published.version),
            forecaster={
                **(published.forecaster.report() if published is not None else {"kind": None}),
                "last_publication": None if selection is None else selection.report(),
            },
            replays_per_event=self.replays.per_event,
        )

    # ------------------------------------------------------------------ the verbs
    def train_step(self, batch: Batch) -> StepReport:
        """One optimizer step on ``batch``; non-finite loss or gradients skip it unchanged
        (the normalization statistics too).

        ``batch`` is a host batch, a batch already on the training device, or a
        :class:`~streamtrain.data.prefetch.StagedBatch` (both: the trainer's own pipeline).
        """
        with self.lock:
            reset, self._reset_optimizer_due = self._reset_optimizer_due, False
            self._one_rank.fault_injector = self.fault_injector
            report = self._one_rank.step(batch, step=self.step, signals=StepSignals(reset_optimizer=reset))
            host = batch.to("cpu") if batch.values.device.type != "cpu" else batch
            self.dataset.mark_trained(host)  # applied or refused, the stream moves past it
            self.apply_step(report.outcome(), host)
        return StepReport(
            step=self.step,
            applied=report.applied,
            loss=report.loss,
            skipped_reason=report.skipped_reason,
            real_tokens=host.real_tokens,
            padded_tokens=host.padded_tokens,
            sequences=host.batch_size,
            seconds=report.seconds,
        )

    def evaluate(self, batch: Batch) -> float:
        """Forecast loss of the live model on ``batch`` (no update)."""
        _, on_device = self._placed(batch)
        with self.lock, torch.no_grad():
            x_norm = self.norm.normalize(on_device.values).float() * on_device.mask[..., None]
            with autocast(self.device, self.settings.precision):
                output = self.model(x_norm, on_device.mask)
            # the loss reads the forecast alone, in float32 (the same tensor when AMP is off)
            return float(forecast_loss(ModelOutput(output.forecast.float(), None), x_norm, on_device.mask))

    def _placed(self, batch: Batch) -> tuple[Batch, Batch]:
        """(host batch, its values/mask/labels on the training device) for any batch given."""
        return place_batch(batch, self.device)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop at once, also while waiting for the window to fill (the prefetcher is closed)."""
        self._stop.set()
        prefetcher = self._prefetcher
        if prefetcher is not None:
            prefetcher.close(timeout=0.5)
        super().stop(timeout)

    def _work(self) -> None:
        """Train on prefetched batches until stopped (a fresh prefetcher after an error)."""
        if self.loop is not None:
            self.loop()
            self._stop.set()  # the ranks agreed to stop: the thread ends
            return
        prefetcher = Prefetcher(
            self.dataset,
            depth=self.settings.prefetch_depth,
            name="trainer-prefetch",
            transform=pin_batch if is_cuda(self.device) else None,  # pinned in the producer thread
        )
        self._prefetcher = prefetcher
        staged = DevicePrefetcher(prefetcher, self.device)  # on a GPU: copied one batch ahead on a side stream
        try:
            while not self._stop.is_set():
                waited_before = staged.data_wait_seconds
                batch = next(staged, None)
                if batch is None:  # closed by stop()
                    break
                # The first batch waits for the window to fill: that is warm-up, not data wait.
                wait = staged.data_wait_seconds - waited_before if staged.items_delivered > 1 else 0.0
                if self._stop.is_set() or not self._wait_for_replay_budget(batch.batch_size):
                    break
                self.train_step(batch)
                self.data_wait_seconds += wait
                self.metrics.train_data_wait_seconds.inc(wait)
                self._publish_if_due()
        finally:
            prefetcher.close(timeout=0.5)  # a producer still waiting for the window exits on its next put

    def _wait_for_replay_budget(self, items: int) -> bool:
        """Idle until ``items`` more trained items fit the replay budget; False when stopped meanwhile."""
        while not self.replays.allows(items, self.window.accepted_total, len(self.window)):
            started = time.monotonic()
            stopped = self._stop.wait(0.2)
            waited = time.monotonic() - started  # counted as it passes: an idle trainer shows it
            self.budget_wait_seconds += waited
            self.metrics.train_budget_wait_seconds.inc(waited)
            if stopped:
                return False
            if self._inputs() != self._published_inputs:
                self._publish_if_due()
        return True

    def _inputs(self) -> tuple[int, ...]:
        """What a publication is made of: the steps trained, the window's events, the held-out and
        guard events. An idle trainer publishes when these moved since the last publication: the
        steps trained after it, and events that went to the holdout rather than the window (they
        give no replay budget, so nothing else wakes the trainer; the linear forecaster is fitted
        on them while the holdout is too small to judge)."""
        holdout, guards = self.quality.holdout, self.quality.guards
        return (self.step, self.window.accepted_total, holdout.version, guards.version)

    def apply_step(self, outcome: StepOutcome, batch: Batch | None) -> None:
        """Count one step: the trainer's counters from ``outcome``, this process's metrics from
        its own ``batch`` (None: a scaled-out rank that had no data this step). Called with
        :attr:`lock` held, by :meth:`train_step` and by the lockstep loop for each agreed step."""
        m = self.metrics
        if outcome.skipped_reason in ("stop", "no_data"):  # no step ran anywhere
            return
        self.step_seconds += outcome.seconds
        m.train_step_seconds.observe(outcome.seconds)
        if not outcome.applied:
            assert outcome.skipped_reason is not None
            m.train_skipped_steps.labels(outcome.skipped_reason).inc()
            log.warning("step skipped: %s", outcome.skipped_reason)
            return
        self._step += 1
        self._tokens_trained += outcome.real_tokens
        self.loss_ema = _smooth(self.loss_ema, outcome.forecast_loss)
        self.naive_loss_ema = _smooth(self.naive_loss_ema, outcome.naive_loss)
        m.train_steps.inc()
        if self.loss_ema is not None:
            m.train_loss.set(self.loss_ema)
        if batch is None:
            return
        self.replays.spend(batch.batch_size)
        m.train_replays_per_event.set(self.replays.per_event)
        m.train_tokens.inc(batch.real_tokens)
        m.train_padding_tokens.inc(batch.padded_tokens - batch.real_tokens)
        m.train_batch_sequences.observe(batch.batch_size)
        ages = self._clock() - batch.ts.numpy()
        ages = ages[np.isfinite(ages)]
        if ages.size:
            m.train_sample_age_seconds.observe(float(np.median(ages)))

    def _on_pass_end(self, diagnostics: PassDiagnostics) -> None:
        self.last_pass = diagnostics
        self.metrics.train_passes.inc()
        for field, value in diagnostics.as_metrics().items():
            if field not in ("pass_index", "snapshot_version"):
                self.metrics.train_last_pass.labels(field).set(value)

    # ------------------------------------------------------------------ quality
    def _select(self, candidate: PublishedModel) -> Selection:
        """The gate against the reference network, then the forecaster with the least held-out error."""
        reference = self.reference if self.reference is not None else self.published
        self._published_inputs = self._inputs()
        selection = self.quality.select(candidate, reference, self._linear_training_values)
        if selection.new_reference:
            self.reference = candidate
        for kind, name in (("last_value", "last_value"), ("linear", "linear"), ("network", "candidate")):
            value = selection.mse.get(name)
            if value is not None:
                self.metrics.model_holdout_mse.labels(kind).set(value)
        return selection

    def _refreshed_network(self) -> PublishedModel | None:
        return self.reference if self.reference is not None else self.published

    def _linear_training_values(self) -> tuple[list[np.ndarray], float]:
        """Readings the linear forecaster is fitted on (a seeded sample of the window), and
        the share of the window's items the sample holds."""
        source = self.window.pass_source()
        n = len(source)
        limit = self.settings.linear_fit_items
        if n <= limit:
            return source.whole.values, 1.0
        rng = make_randomness(self.settings.shuffle, self.settings.seed, self._version, purpose="linear")
        return source.subset(np.sort(rng.sample(n, limit))).values, limit / n

    def _on_drift(self, drift: Drift) -> None:
        """The configured reaction (called on the ingest thread; the step applies it)."""
        if self.settings.drift_reaction == "reset_optimizer":
            self._reset_optimizer_due = True
            self.drift_reactions += 1
            log.info("drift reaction: AdamW moments are cleared before the next step")

    def take_optimizer_reset(self) -> bool:
        """True once after a drift reaction asked to clear AdamW's moments (the lockstep loop
        asks every rank to, at one step, instead of this rank's next ``train_step``)."""
        if not self._reset_optimizer_due:
            return False
        self._reset_optimizer_due = False
        return True

    def _auto_rollback(self, version: int, reason: str) -> bool:
        if self.loop is not None:  # every rank rolls back at one agreed step
            return self.loop.request_automatic_rollback(version, reason)
        try:
            self.rollback(version, trigger="automatic", reason=reason)
        except UnknownVersion:
            log.warning("automatic rollback to version %d skipped: it is no longer kept (%s)", version, reason)
            return False
        return True

    def _note_rollback(self, version: int, trigger: str, reason: str, from_version: int | None) -> None:
        self.quality.note_rollback(version, trigger, reason, from_version)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "quality": self.quality.state_dict(),
                "registry": self.registry_state(),
                "model": self.model.state_dict(),
                "model_config": dict(self.model.config),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "norm": self.norm.state_dict(),
                "step": self.step,
                "tokens_trained": self.tokens_trained,
                "loss_ema": self.loss_ema,
                "version": self._version,
                "replays": self.replays.state_dict(),
                # with the sampler's counters; every data stream derives from them
                "dataset": self.dataset.state_dict(),
                "rng": {"torch": torch.get_rng_state()},  # the only generator the trainer draws from itself
            }

    def checkpoint_parts(self, state: dict[str, Any]) -> CheckpointParts:
        shared, local = split_trainer_state(state)
        return CheckpointParts(shared=shared, rank_local=local)

    def state_from_parts(self, parts: RestoredParts) -> dict[str, Any]:
        return join_trainer_state(self, parts.shared, parts.rank_local)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            if dict(state["model_config"]) != dict(self.model.config):
                raise ValueError(
                    f"checkpoint model {dict(state['model_config'])} does not match the configured "
                    f"model {self.model.config}; use a fresh CHECKPOINT_DIR or the old settings"
                )
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.norm.load_state_dict(state["norm"])
            self._step = int(state["step"])
            self._tokens_trained = int(state["tokens_trained"])
            loss = state.get("loss_ema")
            self.loss_ema = None if loss is None or not math.isfinite(loss) else float(loss)
            self._version = int(state.get("version", 0))
            if "replays" in state:
                self.replays.load_state_dict(state["replays"])
            saved_seed = self.dataset.load_state_dict(state["dataset"], sampler_state=state.get("sampler"))
            if saved_seed == self.dataset.seed:
                torch.set_rng_state(state["rng"]["torch"])
            else:  # the configured SEED wins (the dataset logged it): torch follows it too
                torch.manual_seed(derive_seed(self.settings.seed, self.step, purpose="torch"))
            if "quality" in state:
                self.quality.load_state_dict(state["quality"], self.settings.channels)
        # The kept versions come back as rollback targets; the restored live model (whose
        # step the checkpoint covers) is published as the next version, through the gate.
        self.load_registry_state(state.get("registry", {}))
        self.publish()
