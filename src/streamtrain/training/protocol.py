"""What the service and the HTTP layer use of a trainer, whichever kind it is.

:class:`~streamtrain.training.trainer.Trainer` (plain training, quality-scored) and
:class:`~streamtrain.privacy.trainer.DPTrainer` (DP-SGD on the public clock) both
implement :class:`ContinuousTrainer` explicitly. A capability one of them lacks is said
by the return value (``quality`` is None in DP mode: private events are not scored;
``dp_report()`` is None without DP), never by a missing attribute, so the wiring never
probes a trainer by name.

:class:`StepLoop` is the other side of scale-out: a loop that trains in step with other
processes (:class:`~streamtrain.distributed.lockstep.LockstepLoop`). The trainer is given
one at construction, runs it on its thread, and hands automatic rollbacks and the
quality monitor's sums to it; the loop reports each agreed step back through
:meth:`~streamtrain.training.trainer.Trainer.apply_step`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from streamtrain.config import Settings
from streamtrain.events import EventBatch
from streamtrain.metrics import Metrics
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.training.registry import ModelRegistry

if TYPE_CHECKING:  # the trainer module imports this one
    from streamtrain.quality.monitor import QualityMonitor
    from streamtrain.training.publishing import PublishedModel
    from streamtrain.training.trainer import Trainer


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did, as the trainer counts it.

    ``real_tokens`` is the step's total (scaled out: over every rank); the per-process
    metrics come from this process's own batch.
    """

    applied: bool
    skipped_reason: str | None  # None, "stop", "no_data", "non_finite_loss", "non_finite_grad"
    seconds: float
    real_tokens: int
    forecast_loss: float  # normalized units; nan when no step ran
    naive_loss: float  # the last-value forecast's loss on the same readings


@dataclass(frozen=True)
class TrainerReport:
    """The trainer's part of ``GET /v1/model`` (serve/app.py adds versions and placement).

    ``public_progress`` False (DP): the step is the public clock's, and nothing
    data-dependent (loss, tokens, quality) may be released.
    """

    training: dict[str, Any]
    public_progress: bool = True
    quality: dict[str, Any] | None = None
    forecaster: dict[str, Any] | None = None
    replays_per_event: float | None = None
    dp: dict[str, Any] | None = None


@dataclass(frozen=True)
class CheckpointParts:
    """A trainer state cut for a sharded checkpoint (``docs/scale-out.md``).

    ``shared``: the same on every rank, saved once (rank 0). ``rank_local``: this rank's
    own (its data stream, its quality monitor), restored only under the same ownership.
    ``by_partition``: this rank's state that follows its partitions (the DP window's
    records); after a rescale every old rank's is read, and each rank takes what belongs
    to the partitions it now owns. None: the trainer keeps nothing per partition.
    """

    shared: dict[str, Any]
    rank_local: dict[str, Any]
    by_partition: dict[str, Any] | None = None


@dataclass(frozen=True)
class RestoredParts:
    """The parts of a trainer state one rank takes back from a checkpoint (:class:`CheckpointParts`).

    ``rank_local`` is None under another ownership; ``by_partition`` holds this rank's own
    part when ``unchanged``, else every old rank's (empty for a one-file checkpoint, whose
    ``shared`` is the whole state); ``owns`` says whether this rank owns a partition now.
    """

    shared: dict[str, Any]
    rank_local: dict[str, Any] | None
    by_partition: list[dict[str, Any]]
    owns: Callable[[int], bool]
    unchanged: bool


class StepLoop(Protocol):
    """A training loop run in step with other processes, on the trainer's thread."""

    def __call__(self) -> None:
        """Train until the processes agree to stop."""

    def request_automatic_rollback(self, version: int, reason: str) -> bool:
        """Ask every process to roll back (the quality monitor's rule fired here)."""

    def sum_rows(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` summed over the processes (the quality monitor's holdout sums)."""


class ContinuousTrainer(Protocol):
    """A trainer the service runs: ingest hooks, checkpoints, publishing, rollback, reports."""

    settings: Settings
    metrics: Metrics
    device: torch.device
    lock: threading.RLock
    registry: ModelRegistry[PublishedModel]
    model: SensorModel
    norm: RunningNorm
    last_error: str | None

    @property
    def step(self) -> int: ...

    @property
    def tokens_trained(self) -> int: ...

    @property
    def published(self) -> PublishedModel | None: ...

    @property
    def running(self) -> bool: ...

    @property
    def quality(self) -> QualityMonitor | None:
        """The monitor that scores incoming events; None when events are private (DP)."""

    @property
    def min_window_items(self) -> int:
        """How many window items the first step waits for."""

    def start(self) -> None: ...

    def stop(self, timeout: float = 30.0) -> None: ...

    # ingest hooks (called on the ingest thread)
    def admit(self, batch: EventBatch, next_offsets: dict[int, int]) -> None:
        """Every poll batch of valid events, before it is applied to the window."""

    def on_partitions_assigned(self, partitions: list[int]) -> None: ...

    def on_partitions_revoked(self, partitions: list[int]) -> None: ...

    # checkpoints
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def checkpoint_parts(self, state: dict[str, Any]) -> CheckpointParts:
        """``state`` (:meth:`state_dict`) cut for a sharded checkpoint."""

    def state_from_parts(self, parts: RestoredParts) -> dict[str, Any]:
        """A state for :meth:`load_state_dict` from what this rank took back of a checkpoint."""

    def resume_after_restore(self) -> None:
        """Called once at start, after a checkpoint was loaded or none was found."""

    # models
    def publish(self) -> PublishedModel | None: ...

    def rollback(self, version: int, trigger: str = "admin", reason: str = "asked by an admin") -> PublishedModel: ...

    # reports
    def readiness_notes(self) -> list[str]:
        """Conditions that do not block readiness but an operator should see."""

    def report(self) -> TrainerReport: ...

    def dp_report(self) -> dict[str, Any] | None:
        """The public privacy report; None without DP."""

    def operator_report(self) -> dict[str, Any] | None:
        """Data-dependent diagnostics for the admin plane; None when there are none (DP off)."""


LoopFactory = Callable[["Trainer"], StepLoop]
"""Builds a trainer's :class:`StepLoop` from the trainer (its model, optimizer, dataset)."""
