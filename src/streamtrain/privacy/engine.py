"""The DP-SGD engine: public clock → DP window → Poisson sample → clipped sums → noise → step.

One call of :meth:`DPEngine.step` runs one step of the public clock when it is due:

1. close the step's admissions (≤ R arrivals, CSPRNG choice) and expire events that have
   been eligible K steps (:class:`DPWindow`);
2. Poisson-sample the eligible events, age j with probability q_j (:class:`PoissonSampler`);
3. cut the sample into token-budget micro-batches (the pipeline's length bucketing),
   sum per-sample gradients clipped to C over the whole gradient (:class:`PerSampleGradients`);
4. add N(0, σ²C²) once (:class:`SecureGaussianNoise`), divide by the public expected batch
   size — never by the actual one — and take one optimizer step.

The step runs even when nothing is sampled (a noise-only step), so whether and when a step
happens never depends on the data. Per-step sample sizes are never reported: only totals
over whole reporting periods (:class:`DPAggregates`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from streamtrain.data.bucketing import TokenBudget, plan_batches
from streamtrain.data.collate import collate
from streamtrain.data.randomness import CryptoRandomness, Randomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.model import RunningNorm
from streamtrain.privacy.accounting import PerEventAccountant
from streamtrain.privacy.config import DPConfig, DPConfigError
from streamtrain.privacy.noise import SecureGaussianNoise
from streamtrain.privacy.per_sample import PerSampleGradients, PerSampleLoss, sensor_per_sample_loss
from streamtrain.privacy.sampling import PoissonSampler
from streamtrain.privacy.validators import check_dp_safety
from streamtrain.privacy.window import DPClock, DPWindow

ACCOUNTANT_NAME = "pld_replace_one"


@dataclass(frozen=True)
class DPAggregates:
    """Totals over completed reporting periods only; nothing here is per step."""

    steps: int = 0
    sampled_sequences: int = 0
    sampled_tokens: int = 0
    padded_tokens: int = 0
    micro_batches: int = 0
    nonfinite_examples: int = 0  # examples whose gradient was not finite (they count as zero)
    step_seconds: float = 0.0
    periods: int = 0

    @property
    def mean_batch_size(self) -> float:
        return self.sampled_sequences / self.steps if self.steps else 0.0

    @property
    def mean_step_seconds(self) -> float:
        return self.step_seconds / self.steps if self.steps else 0.0

    def __add__(self, other: DPAggregates) -> DPAggregates:
        return DPAggregates(**{k: v + getattr(other, k) for k, v in asdict(self).items()})


@dataclass(frozen=True)
class DPStepReport:
    """What one step may tell the outside: its number, ε so far, and period aggregates."""

    step: int
    epsilon: float
    aggregates: DPAggregates  # as of the last completed reporting period
    aggregates_updated: bool  # this step completed a period (new totals to export)
    behind_steps: int  # steps already due after this one (the clock outruns the trainer)


def public_norm(config: DPConfig, channels: int) -> RunningNorm:
    """The frozen input normalization of the DP path (public constants; identity by default)."""
    mean = config.norm_mean if config.norm_mean is not None else (0.0,) * channels
    std = config.norm_std if config.norm_std is not None else (1.0,) * channels
    return RunningNorm.from_public(mean, std)


class DPEngine:
    """DP-SGD on a stream, one public-clock step at a time.

    ``model`` is trained in place by ``optimizer``; ``admit`` is called by the ingest side
    (thread-safe), ``step`` by the trainer loop. The model and optimizer states belong to
    the trainer's checkpoint; :meth:`state_dict` holds the DP state (clock, window,
    accountant table, aggregates).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: DPConfig,
        token_budget: int | TokenBudget,
        *,
        randomness: Randomness | None = None,
        norm: RunningNorm | None = None,
        loss_fn: PerSampleLoss = sensor_per_sample_loss,
        max_micro_batch_sequences: int = 128,
        report_every_steps: int = 50,
    ) -> None:
        self.randomness = randomness if randomness is not None else CryptoRandomness()
        self.norm = norm if norm is not None else public_norm(config, int(getattr(model, "channels", 1)))
        # Refuses seeded randomness, unsafe settings, unsafe models and a missed target ε.
        self.accountant: PerEventAccountant = check_dp_safety(
            config, self.randomness.mode, model, input_norm=self.norm
        )
        if report_every_steps < 1:
            raise ValueError(f"report_every_steps must be >= 1, got {report_every_steps}")
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.budget = (
            token_budget
            if isinstance(token_budget, TokenBudget)
            else TokenBudget(max_tokens=int(token_budget), max_sequences=max_micro_batch_sequences)
        )
        self.report_every_steps = int(report_every_steps)
        self.clock = DPClock(config.step_rate_hz)
        self.window = DPWindow(config.eligible_steps, config.admit_per_step, self.randomness)
        self.sampler = PoissonSampler(config.sampling_schedule(), self.randomness)
        self.noise = SecureGaussianNoise(config.noise_source, self.randomness)  # type: ignore[arg-type]
        self.gradients = PerSampleGradients(model, config.clip_norm, loss_fn)
        self.divisor = config.divisor
        self._params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self._device = next(iter(self._params.values())).device
        self._clock_lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._running = DPAggregates()  # the current, unpublished period
        self._published = DPAggregates()

    # -- ingest --------------------------------------------------------------------------------

    def admit(
        self, events: EventBatch | Sequence[SensorEvent], now: float, next_offsets: Mapping[int, int] | None = None
    ) -> int:
        """Offer arrivals at wall time ``now``; returns the clock step they were assigned to."""
        with self._clock_lock:
            step = self.clock.arrival_step(now)
        return self.window.admit(events, step, next_offsets)

    # -- training ------------------------------------------------------------------------------

    def seconds_until_next_step(self, now: float) -> float:
        with self._clock_lock:
            return max(0.0, self.clock.next_due_at(now) - now)

    def step(self, now: float) -> DPStepReport | None:
        """Run the next clock step if it is due at ``now``; None if not yet due."""
        with self._step_lock:
            with self._clock_lock:
                if self.clock.due_steps(now) == 0:
                    return None
                step = self.clock.steps_done + 1
            started = time.perf_counter()
            self.window.close_step(step)
            period = self._train_one_step()
            with self._clock_lock:
                self.clock.steps_done = step
                behind = self.clock.due_steps(now)
            period = replace(period, step_seconds=time.perf_counter() - started)
            self._running = self._running + period
            updated = step % self.report_every_steps == 0
            if updated:
                self._published = self._published + replace(self._running, periods=1)
                self._running = DPAggregates()
            return DPStepReport(step, self.epsilon_spent(), self._published, updated, behind)

    def _train_one_step(self) -> DPAggregates:
        eligible = self.window.eligible()
        chosen = self.sampler.sample(eligible.ages)
        return self.noisy_step([eligible.values[i] for i in chosen], eligible.labels[chosen])

    def noisy_step(self, values: Sequence[np.ndarray], labels: np.ndarray) -> DPAggregates:
        """One DP-SGD update on an already sampled logical batch (may be empty).

        Token-budget micro-batches, clipped per-sample sums, noise once, public divisor,
        optimizer step. :meth:`step` feeds it the Poisson sample; benchmarks feed it fixed
        batches to compare with other implementations on the same data.
        """
        sums = {name: torch.zeros_like(p) for name, p in self._params.items()}
        sequences = tokens = padded = micro_batches = nonfinite = 0
        if len(values):
            lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
            plan = plan_batches(lengths, self.budget, self.randomness, pool_size=len(values))
            for group in plan.batches:
                batch = collate([values[i] for i in group], labels=np.asarray(labels)[group],
                                pad_to_multiple_of=self.budget.pad_to_multiple_of).to(self._device)  # fmt: skip
                x_norm = self.norm.normalize(batch.values).float() * batch.mask[..., None]
                part, norms = self.gradients.clipped_sum(x_norm, batch.mask, batch.labels)
                for name, value in part.items():
                    sums[name].add_(value)
                sequences += batch.batch_size
                tokens += batch.real_tokens
                padded += batch.padded_tokens
                micro_batches += 1
                nonfinite += int((~torch.isfinite(norms)).sum())
        self.noise.add_noise_(list(sums.values()), self.config.noise_std)
        for name, param in self._params.items():
            param.grad = sums[name].div_(self.divisor)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return DPAggregates(steps=1, sampled_sequences=sequences, sampled_tokens=tokens, padded_tokens=padded,
                            micro_batches=micro_batches, nonfinite_examples=nonfinite)  # fmt: skip

    # -- reporting -----------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return self.clock.steps_done

    def epsilon_spent(self) -> float:
        """The largest ε any single event has spent so far (capped at the K-step value)."""
        return self.accountant.epsilon_after(self.window.steps_eligible_so_far())

    def report(self) -> DPAggregates:
        """Totals over completed reporting periods (never the current, partial one)."""
        return self._published

    def model_info(self) -> dict[str, Any]:
        """The ``dp`` object of ``GET /v1/model`` (JSON-safe: an infinite half-life is null)."""
        config = self.config
        return {
            "epsilon": self.epsilon_spent(),
            "delta": config.delta,
            "target_epsilon": config.target_epsilon,
            "epsilon_cap": self.accountant.epsilon_cap,
            "sigma": config.noise_multiplier,
            "clip_norm": config.clip_norm,
            "q0": config.q0,
            "half_life_steps": None if math.isinf(config.half_life_steps) else config.half_life_steps,
            "K": config.eligible_steps,
            "R": config.admit_per_step,
            "steps": self.steps,
            "step_rate_hz": config.step_rate_hz,
            "expected_batch_size": self.divisor,
            "accountant": ACCOUNTANT_NAME,
            "mean_batch_size": self._published.mean_batch_size,
        }

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        with self._step_lock:
            return {
                "schedule": np.asarray(self.config.schedule_key()[:3], dtype=np.float64),
                "eligible_steps": self.config.eligible_steps,
                "clock": self.clock.state_dict(),
                "window": self.window.state_dict(),
                "accountant": self.accountant.state_dict(),
                "published": asdict(self._published),
                "running": asdict(self._running),
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = np.asarray(state["schedule"], dtype=np.float64)
        if not (np.array_equal(saved, np.asarray(self.config.schedule_key()[:3], dtype=np.float64))
                and int(state["eligible_steps"]) == self.config.eligible_steps):  # fmt: skip
            raise DPConfigError(
                "the checkpoint was written with another DP schedule (σ, q0, half-life, K); events in its window were "
                "accounted under that schedule: restore those STREAMTRAIN_DP_* settings or use an empty checkpoint directory"
            )
        with self._step_lock:
            try:
                self.accountant.load_state_dict(state["accountant"])
            except ValueError as error:
                raise DPConfigError(str(error)) from error
            self.window.load_state_dict(state["window"])
            with self._clock_lock:
                self.clock.load_state_dict(state["clock"])
            if self.window.closed_step != self.clock.steps_done:
                raise DPConfigError(
                    f"DP checkpoint is inconsistent: window closed step {self.window.closed_step} != clock step "
                    f"{self.clock.steps_done}; use an earlier checkpoint"
                )
            self._published = DPAggregates(**dict(state["published"]))
            self._running = DPAggregates(**dict(state["running"]))
