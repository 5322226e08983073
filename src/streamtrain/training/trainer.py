"""The continuous trainer: its own thread, fed by the pipeline, publishing frozen models.

The model surface is two verbs, River-style: :meth:`Trainer.train_step` on a
:class:`~streamtrain.data.collate.Batch` and :func:`streamtrain.model.network.predict` on the
published copy. The loop waits for a minimum window, trains on token-budget batches
(loss normalized by real tokens, so variable batch sizes keep a steady gradient scale),
refuses non-finite steps and publishes a frozen inference copy at a set interval.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch

from streamtrain.config import Settings
from streamtrain.data.bucketing import PassDiagnostics, TokenBudget
from streamtrain.data.collate import Batch
from streamtrain.data.dataset import WindowBatchDataset
from streamtrain.data.passes import pass_sampler_from_settings
from streamtrain.data.prefetch import DevicePrefetcher, Prefetcher, pin_batch, stage_batch
from streamtrain.data.randomness import derive_seed, make_randomness
from streamtrain.device import autocast, describe, is_cuda, settle
from streamtrain.metrics import Metrics
from streamtrain.model.forecasters import FORECASTER_KINDS, NETWORK, Forecaster, ServedModel
from streamtrain.model.network import (
    ModelOutput,
    RunningNorm,
    SensorModel,
    build_model,
    forecast_loss,
    naive_last_value_loss,
    total_loss,
)
from streamtrain.quality.monitor import Drift, GateDecision, QualityConfig, QualityMonitor, Selection
from streamtrain.training.registry import ModelRegistry, UnknownVersion
from streamtrain.window import RecencyWindow

log = logging.getLogger(__name__)

_LOSS_SMOOTHING = 0.05


def _smooth(average: float | None, value: float) -> float | None:
    if not math.isfinite(value):
        return average
    return value if average is None else (1 - _LOSS_SMOOTHING) * average + _LOSS_SMOOTHING * value


@dataclass(frozen=True)
class PublishedModel:
    """A frozen inference copy: readers take the reference, nobody mutates it.

    ``model`` is the network (what training resumes from after a rollback); ``served``
    is what answers: the network, or the forecaster chosen on held-out data beside it.
    """

    model: SensorModel
    norm: RunningNorm
    version: int
    step: int
    tokens_trained: int
    loss: float | None
    published_at: float
    forecaster: Forecaster = NETWORK

    @cached_property
    def served(self) -> torch.nn.Module:
        """The module predict, OIP v2, scoring and export run (built once, on first use)."""
        return self.model if self.forecaster.kind == "network" else ServedModel(self.model, self.forecaster).eval()


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


def _float32(output: ModelOutput) -> ModelOutput:
    """``output`` in float32 (the same tensors when they already are: AMP off)."""
    logits = output.logits
    return ModelOutput(forecast=output.forecast.float(), logits=None if logits is None else logits.float())


def build_budget(settings: Settings) -> TokenBudget:
    return TokenBudget(
        max_tokens=settings.token_budget,
        max_sequences=settings.max_batch_sequences,
        pad_to_multiple_of=settings.pad_to_multiple_of,
    )


class ModelTrainer:
    """What both trainers share: a worker thread, a lock, and atomic model publishing.

    Subclasses set ``model``, ``norm`` and ``settings`` and implement :meth:`_work`, one
    unit of training that the thread repeats until stopped; an exception is logged,
    counted in ``last_error`` and the work resumes a second later.
    """

    thread_name = "trainer"

    def __init__(self, settings: Settings, metrics: Metrics, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.metrics = metrics
        self._clock = clock
        self.device = torch.device(settings.device)  # resolved by Settings: never "auto" here
        self.lock = threading.RLock()  # held for a step; checkpoints take it for a consistent state
        self.registry: ModelRegistry[PublishedModel] = ModelRegistry(settings.model_versions_keep)
        self.last_error: str | None = None
        self.last_gate: GateDecision | None = None
        self.last_selection: Selection | None = None
        self.reference: PublishedModel | None = None  # the best network that passed the gate (Trainer._select)
        self.publish_held = 0
        self.publish_seconds = 0.0  # the last due publication's duration (gate and forecaster choice included)
        # Tests corrupt a candidate here (after freezing, before the gate).
        self.candidate_hook: Callable[[SensorModel], None] | None = None
        self._version = 0
        self._last_publish = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    model: SensorModel
    norm: RunningNorm
    optimizer: torch.optim.Optimizer
    step: int
    tokens_trained: int
    loss_ema: float | None

    @property
    def published(self) -> PublishedModel | None:
        """The version that serves."""
        return self.registry.serving

    def publish(self) -> PublishedModel:
        """Freeze a copy of the model (version + 1) and make it serve, unless the gate holds it back.

        Serving switches by a single reference swap: readers see old or new. A held-back
        candidate is kept (not served) and counted; the serving version answers on.
        """
        with self.lock:
            frozen = copy.deepcopy(self.model).eval()  # on the training device
            for parameter in frozen.parameters():
                parameter.requires_grad_(False)
            settle(self.device)  # predict streams read these weights: the copy must be done
            norm = RunningNorm(self.settings.channels)
            norm.load_state_dict(self.norm.state_dict())
            self._version += 1
            published = PublishedModel(
                model=frozen,
                norm=norm,
                version=self._version,
                step=self.step,
                tokens_trained=self.tokens_trained,
                loss=self.loss_ema,
                published_at=self._clock(),
            )
        if self.candidate_hook is not None:
            self.candidate_hook(published.model)
        selection = self._select(published)
        decision = selection.decision
        self.last_gate = decision
        self.last_selection = selection
        if decision.publish and selection.forecaster.kind != "network":
            published = replace(published, forecaster=selection.forecaster)
        self.registry.add(published, serve=decision.publish)
        self._last_publish = time.monotonic()
        if decision.publish:
            self._show_serving(published)
        else:
            self.publish_held += 1
            self.metrics.publish_held.inc()
            serving = self.published
            log.warning(
                "candidate version %d held back (%s); version %s keeps serving",
                published.version, decision.reason, None if serving is None else serving.version,
            )  # fmt: skip
        return published

    def _show_serving(self, published: PublishedModel) -> None:
        self.metrics.model_version.set(published.version)
        for kind in FORECASTER_KINDS:
            self.metrics.model_forecaster.labels(kind).set(1.0 if kind == published.forecaster.kind else 0.0)

    def _select(self, candidate: PublishedModel) -> Selection:
        """Whether ``candidate`` may serve, and with which forecaster; subclasses with a gate override it."""
        return Selection(GateDecision(True, "no gate", 0), NETWORK, candidate, "no gate")

    def rollback(self, version: int, trigger: str = "admin", reason: str = "asked by an admin") -> PublishedModel:
        """Make kept ``version`` serve again and continue training from its weights.

        Training goes on from the version that serves (else the next publication would
        bring the rolled-back weights straight back); the optimizer's moments, which
        belong to the abandoned trajectory, are cleared. :class:`UnknownVersion` when the
        version is not kept.
        """
        with self.lock:
            before = self.published
            target = self.registry.get(version)
            self.model.load_state_dict(target.model.state_dict())
            self.optimizer.state.clear()
            self.registry.rollback(version)
            self.reference = None  # candidates are judged against the version that serves now
            self._last_publish = time.monotonic()  # the next publication waits a full interval
        self._show_serving(target)
        self.metrics.model_rollbacks.labels(trigger).inc()
        from_version = None if before is None else before.version
        log.warning("rolled back (%s) from version %s to version %d: %s", trigger, from_version, version, reason)
        self._note_rollback(version, trigger, reason, from_version)
        return target

    def _note_rollback(self, version: int, trigger: str, reason: str, from_version: int | None) -> None:
        """Subclasses that track quality record the rollback there."""

    def registry_state(self) -> dict[str, Any]:
        """The kept versions (weights, norm, identity) and which one serves, for a checkpoint."""
        serving = self.published
        return {
            "serving": None if serving is None else serving.version,
            "versions": [
                {
                    "version": p.version,
                    "step": p.step,
                    "tokens_trained": p.tokens_trained,
                    "loss": p.loss,
                    "published_at": p.published_at,
                    "model": p.model.state_dict(),
                    "norm": p.norm.state_dict(),
                    "forecaster": p.forecaster.state_dict(),
                }
                for p in (self.registry.get(v) for v in self.registry.versions())
            ],
        }

    def load_registry_state(self, state: dict[str, Any]) -> bool:
        """Bring the kept versions back (the one that served, serving); True when one serves."""
        serving = state.get("serving")
        for entry in state.get("versions", []):
            model = build_model(self.settings)
            model.load_state_dict(entry["model"])
            model.to(self.device).eval()
            for parameter in model.parameters():
                parameter.requires_grad_(False)
            norm = RunningNorm(self.settings.channels)
            norm.load_state_dict(entry["norm"])
            loss = entry.get("loss")
            published = PublishedModel(
                model=model,
                norm=norm,
                version=int(entry["version"]),
                step=int(entry["step"]),
                tokens_trained=int(entry["tokens_trained"]),
                loss=None if loss is None else float(loss),
                published_at=float(entry["published_at"]),
                forecaster=Forecaster.from_state(entry.get("forecaster")),
            )
            self.registry.add(published, serve=published.version == serving)
        if self.published is None:
            return False
        settle(self.device)
        self._last_publish = time.monotonic()
        self._show_serving(self.published)
        return True

    def _publish_if_due(self) -> None:
        """Publish every PUBLISH_INTERVAL_S, but give publishing (the gate's scoring, the linear
        fit) at most PUBLISH_MAX_SHARE of the trainer's time: a slower publication waits longer."""
        interval = max(self.settings.publish_interval_s, self.publish_seconds / self.settings.publish_max_share)
        if self.published is None or time.monotonic() - self._last_publish >= interval:
            started = time.perf_counter()
            self.publish()
            self.publish_seconds = time.perf_counter() - started

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        torch.set_num_threads(self.settings.torch_threads)
        lower_thread_priority(self.settings.train_nice)
        while not self._stop.is_set():
            try:
                self._work()
            except Exception as err:  # noqa: BLE001 - log, count, and keep the service up
                self.last_error = f"{type(err).__name__}: {err}"
                log.exception("%s failed; resuming in 1s", self.thread_name)
                self._stop.wait(1.0)

    def _work(self) -> None:
        raise NotImplementedError


def lower_thread_priority(niceness: int) -> bool:
    """Make the calling thread (and the threads it starts later) yield the CPU to the rest.

    Training is background work: it can use every idle cycle, but a predict request or a
    poll batch should not wait behind a training step. Linux keeps a nice value per
    thread, so this lowers the trainer and its prefetch thread only; elsewhere (or where
    refused) it does nothing and says so.
    """
    if niceness <= 0:
        return False
    if not sys.platform.startswith("linux"):
        log.info("train_nice=%d ignored: per-thread priorities need Linux", niceness)
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except OSError as err:
        log.warning("could not lower the training threads' priority: %s", err)
        return False
    return True


class ReplayBudget:
    """How many times, on average, the trainer may train each event: a trainer faster than
    its stream idles instead of memorizing its window.

    Every accepted event adds ``per_event_limit`` item-trainings to an allowance that each
    trained item spends; the allowance never exceeds ``per_event_limit`` passes over the
    window as it is now, so a fast phase leaves no credit for replaying a slow one. 0 turns
    the budget off.
    """

    def __init__(self, per_event_limit: float) -> None:
        self.limit = float(per_event_limit)
        self.allowance = 0.0
        self.accepted_seen = 0  # window.accepted_total already credited
        self.trained_items = 0
        self.accepted = 0

    def allows(self, items: int, accepted_total: int, window_size: int) -> bool:
        new = max(0, accepted_total - self.accepted_seen)
        self.accepted_seen = max(self.accepted_seen, accepted_total)
        self.accepted += new
        if self.limit <= 0:
            return True
        self.allowance = min(self.allowance + self.limit * new, self.limit * max(window_size, 1))
        return self.allowance >= min(items, self.limit * max(window_size, 1))

    def spend(self, items: int) -> None:
        self.trained_items += items
        if self.limit > 0:
            self.allowance -= items

    @property
    def per_event(self) -> float:
        """Mean item-trainings per accepted event so far."""
        return self.trained_items / self.accepted if self.accepted else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "allowance": self.allowance, "accepted_seen": self.accepted_seen,
            "trained_items": self.trained_items, "accepted": self.accepted,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.allowance = float(state["allowance"])
        self.accepted_seen = int(state["accepted_seen"])
        self.trained_items = int(state["trained_items"])
        self.accepted = int(state["accepted"])


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
    ) -> None:
        """``data_seed`` and ``min_items`` (default: ``SEED``, ``MIN_WINDOW_ITEMS``) are a
        scaled-out rank's own: its passes are drawn from its own window share."""
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
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=settings.learning_rate,
            weight_decay=settings.weight_decay,
            **({"fused": True} if is_cuda(self.device) else {}),  # one kernel for the whole update
        )
        warmup = max(1, settings.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self._prefetcher: Prefetcher | None = None
        data_seed = settings.seed if data_seed is None else data_seed
        # SAMPLING: which items each pass trains
        self.sampler = pass_sampler_from_settings(settings.model_copy(update={"seed": data_seed}))
        self.dataset = WindowBatchDataset(
            window.snapshot,
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
        self.step = 0
        self.tokens_trained = 0
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
        # A scaled-out service sets this: the thread's work is then the lockstep loop of
        # streamtrain.distributed.lockstep, which trains with every rank and returns at the agreed stop.
        self.loop: Callable[[], None] | None = None
        # Scaled out, an automatic rollback is asked of every rank (version, reason) instead
        # of applied here: the lockstep loop applies it on all ranks at one step.
        self.request_rollback: Callable[[int, str], bool] | None = None

    # ------------------------------------------------------------------ the verbs
    def train_step(self, batch: Batch) -> StepReport:
        """One optimizer step on ``batch``; non-finite loss or gradients skip it unchanged.

        ``batch`` is a host batch, a batch already on the training device, or a
        :class:`~streamtrain.data.prefetch.StagedBatch` (both: the trainer's own pipeline).
        """
        started = time.perf_counter()
        batch, on_device = self._placed(batch)
        with self.lock:
            if self._reset_optimizer_due:
                self._reset_optimizer_due = False
                self.optimizer.state.clear()
            norm_before = self.norm.state_dict()  # a refused step must not move the normalization
            self.norm.update(batch.values, batch.mask)  # float64, on the host
            x_norm = self.norm.normalize(on_device.values).float() * on_device.mask[..., None]
            with autocast(self.device, self.settings.amp):
                output = self.model(x_norm, on_device.mask)
            output = _float32(output)  # the loss, its gradient seed and the EMAs in float32
            loss = total_loss(output, x_norm, on_device.mask, on_device.labels)
            if self.fault_injector is not None:
                loss = self.fault_injector(loss)
            skipped = None
            if not torch.isfinite(loss):
                skipped = "non_finite_loss"
            else:
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip_norm)
                if not torch.isfinite(grad_norm):
                    skipped = "non_finite_grad"
                else:
                    self.optimizer.step()
                    self.scheduler.step()
                    self.step += 1
                    self.tokens_trained += batch.real_tokens
            self.optimizer.zero_grad(set_to_none=True)
            if skipped is not None:
                self.norm.load_state_dict(norm_before)
            self.dataset.mark_trained(batch)  # applied or refused, the stream moves past it
            value = float(loss.detach())
            if skipped is None:
                self.loss_ema = _smooth(self.loss_ema, float(forecast_loss(output, x_norm, on_device.mask).detach()))
                self.naive_loss_ema = _smooth(self.naive_loss_ema, float(naive_last_value_loss(x_norm, on_device.mask)))
        seconds = time.perf_counter() - started
        self._record(batch, skipped, seconds)
        return StepReport(
            step=self.step,
            applied=skipped is None,
            loss=value,
            skipped_reason=skipped,
            real_tokens=batch.real_tokens,
            padded_tokens=batch.padded_tokens,
            sequences=batch.batch_size,
            seconds=seconds,
        )

    def evaluate(self, batch: Batch) -> float:
        """Forecast loss of the live model on ``batch`` (no update)."""
        _, on_device = self._placed(batch)
        with self.lock, torch.no_grad():
            x_norm = self.norm.normalize(on_device.values).float() * on_device.mask[..., None]
            with autocast(self.device, self.settings.amp):
                output = self.model(x_norm, on_device.mask)
            return float(forecast_loss(_float32(output), x_norm, on_device.mask))

    def _placed(self, batch: Batch) -> tuple[Batch, Batch]:
        """(host batch, its values/mask/labels on the training device) for any batch given."""
        on_device = getattr(batch, "on_device", None)
        if on_device is None and batch.values.device == self.device:
            on_device = batch
        if batch.values.device.type != "cpu":  # a hand-made batch on the device: statistics need a host copy
            batch = batch.to("cpu")
        if on_device is None:
            on_device = stage_batch(batch, self.device).ready().on_device
        return batch, on_device

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
        return True

    def _record(self, batch: Batch, skipped: str | None, seconds: float) -> None:
        m = self.metrics
        self.step_seconds += seconds
        m.train_step_seconds.observe(seconds)
        if skipped is not None:
            m.train_skipped_steps.labels(skipped).inc()
            log.warning("step skipped: %s", skipped)
            return
        m.train_steps.inc()
        self.replays.spend(batch.batch_size)
        m.train_replays_per_event.set(self.replays.per_event)
        m.train_tokens.inc(batch.real_tokens)
        m.train_padding_tokens.inc(batch.padded_tokens - batch.real_tokens)
        m.train_batch_sequences.observe(batch.batch_size)
        if self.loss_ema is not None:
            m.train_loss.set(self.loss_ema)
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
        selection = self.quality.select(candidate, reference, self._linear_training_values)
        if selection.new_reference:
            self.reference = candidate
        for kind, name in (("last_value", "last_value"), ("linear", "linear"), ("network", "candidate")):
            value = selection.mse.get(name)
            if value is not None:
                self.metrics.model_holdout_mse.labels(kind).set(value)
        return selection

    def _linear_training_values(self) -> list[np.ndarray]:
        """Readings the linear forecaster is fitted on: a seeded sample of the window."""
        snapshot = self.window.snapshot()
        n = len(snapshot)
        limit = self.settings.linear_fit_items
        if n > limit:
            rng = make_randomness(self.settings.shuffle, self.settings.seed, self._version, purpose="linear")
            snapshot = snapshot.subset(np.sort(rng.permutation(n)[:limit]))
        return snapshot.values

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
        if self.request_rollback is not None:
            return self.request_rollback(version, reason)
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
                "dataset": self.dataset.state_dict(),  # with the sampler's counters; every data stream derives from them
                "rng": {"torch": torch.get_rng_state()},  # the only generator the trainer draws from itself
            }

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
            self.step = int(state["step"])
            self.tokens_trained = int(state["tokens_trained"])
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
