"""What both trainers share: a worker thread, a lock, and atomic model publishing.

A published model is a frozen copy: readers take the reference and nobody mutates it,
so serving switches versions by a single reference swap. The registry keeps the last
``MODEL_VERSIONS_KEEP`` of them as rollback targets; a rollback makes one serve again and
training continues from its weights.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch

from streamtrain.config import Settings
from streamtrain.device import settle
from streamtrain.metrics import Metrics
from streamtrain.model.forecasters import FORECASTER_KINDS, NETWORK, Forecaster, served_module
from streamtrain.model.network import SensorModel, build_model
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.selection import GateDecision, Selection
from streamtrain.runtime.cpus import pin_training_thread, release_training_cpus
from streamtrain.training.registry import ModelRegistry

log = logging.getLogger(__name__)


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
        return served_module(self.model, self.forecaster)


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
        self._step = 0
        self._tokens_trained = 0
        self._last_publish = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    model: SensorModel
    norm: RunningNorm
    optimizer: torch.optim.Optimizer
    loss_ema: float | None

    @property
    def step(self) -> int:
        """Optimizer steps applied."""
        return self._step

    @property
    def tokens_trained(self) -> int:
        """Readings trained on, over every step applied."""
        return self._tokens_trained

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
            self._last_publish = time.monotonic()  # publications are spaced start to start
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
        if decision.publish:
            self._show_serving(published)
            return published
        self.publish_held += 1
        self.metrics.publish_held.inc()
        serving = self.published
        if selection.refreshed and (network := self._refreshed_network()) is not None:
            # the network that passed serves on, the choice beside it made afresh (a new version)
            with self.lock:
                self._version += 1
                refreshed = replace(
                    network, version=self._version, published_at=self._clock(), forecaster=selection.forecaster
                )
            self.registry.add(refreshed, serve=True)
            self._show_serving(refreshed)
            log.warning(
                "candidate version %d held back (%s); version %d serves network of version %d with %s",
                published.version, decision.reason, refreshed.version, network.version, selection.forecaster.kind,
            )  # fmt: skip
            return published
        log.warning(
            "candidate version %d held back (%s); version %s keeps serving",
            published.version, decision.reason, None if serving is None else serving.version,
        )  # fmt: skip
        return published

    def _refreshed_network(self) -> PublishedModel | None:
        """The network a held-back candidate was judged against, which serves on; subclasses with a gate say."""
        return None

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
        fit) at most PUBLISH_MAX_SHARE of the trainer's time: a slower publication waits longer
        (start to start: a publication of ``d`` seconds is followed by ``d / PUBLISH_MAX_SHARE - d`` of training)."""
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
        pinned = pin_training_thread(self.settings.train_cpus, self.settings.torch_threads)
        try:
            while not self._stop.is_set():
                try:
                    self._work()
                except Exception as err:  # noqa: BLE001 - log, count, and keep the service up
                    self.last_error = f"{type(err).__name__}: {err}"
                    log.exception("%s failed; resuming in 1s", self.thread_name)
                    self._stop.wait(1.0)
        finally:
            if pinned is not None:
                release_training_cpus()

    def _work(self) -> None:
        raise NotImplementedError


def build_optimizer(model: torch.nn.Module, settings: Settings) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters, fused: one kernel for the whole update, on the CPU too
    (a quarter of the for-loop update's time for the default model: docs/performance.md)."""
    return torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay, fused=True
    )


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
