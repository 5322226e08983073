"""The DP-SGD engine: public clock → DP window → Poisson sample → clipped integer sums → noise → step.

One call of :meth:`DPEngine.step` runs one step of the public clock when it is due:

1. close the step's admissions (≤ R records, CSPRNG choice) and expire records that have
   been eligible K steps (:class:`DPWindow`); the decisions go to the admission record;
2. Poisson-sample the eligible records, age j with probability q_j (:class:`PoissonSampler`);
3. cut the sample into token-budget micro-batches, put each record's clipped gradient on
   the integer grid (:meth:`PerSampleGradients.grid_sum`) and add the integer vectors;
4. add exact discrete Gaussian noise N_Z(0, (σ·grid)²) to the integer sum once
   (:mod:`noise`), scale back, divide by the public expected batch size — never by the
   actual one — and take one optimizer step.

The step runs even when nothing is sampled (a noise-only step), so whether and when a step
happens never depends on the data. A micro-batch whose computation raises is recomputed one
record at a time, and a record whose own computation raises contributes zero — a decision
about that record alone, like a non-finite gradient — so no record's content can make the
step fail or drop another record. Anything else that raises (the window, the sampler, the
noise, the optimizer: none of them depends on a record's content, and their sizes are
bounded by public settings) releases the step as a noise-only step, and the clock goes on.
Per-step sample sizes are never reported: only totals over whole reporting periods
(:class:`DPAggregates`), and those only on the operator plane.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch import nn

from streamtrain.data.bucketing import TokenBudget, plan_batches
from streamtrain.data.collate import collate
from streamtrain.data.randomness import CryptoRandomness, Randomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.model.normalization import RunningNorm
from streamtrain.privacy.accounting import PerEventAccountant, SensorLifetimeAccountant
from streamtrain.privacy.admissions import AdmissionRecord, RecordState
from streamtrain.privacy.clock import DPClock
from streamtrain.privacy.config import DPConfig, DPConfigError
from streamtrain.privacy.group import DPGroup
from streamtrain.privacy.noise import GRID, BitSource, DiscreteGaussianNoise
from streamtrain.privacy.per_sample import PerSampleGradients, PerSampleLoss, sensor_per_sample_loss
from streamtrain.privacy.sampling import PoissonSampler
from streamtrain.privacy.validators import check_dp_safety
from streamtrain.privacy.window import DPWindow

log = logging.getLogger(__name__)

ACCOUNTANT_NAME = "pld_replace_one_discrete_gaussian_coupled"


@dataclass(frozen=True)
class DPAggregates:
    """Totals over completed reporting periods only; nothing here is per step (operator plane)."""

    steps: int = 0
    sampled_sequences: int = 0
    sampled_tokens: int = 0
    padded_tokens: int = 0
    micro_batches: int = 0
    nonfinite_examples: int = 0  # records whose gradient was not finite (they count as zero)
    failed_records: int = 0  # records whose own computation raised (they count as zero)
    failed_steps: int = 0  # steps that raised and were released as noise-only steps
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
    """What one step may tell the outside: its number and ε so far (aggregates: operator plane)."""

    step: int
    epsilon: float
    aggregates: DPAggregates  # as of the last completed reporting period
    aggregates_updated: bool  # this step completed a period (new totals to export)
    behind_steps: int  # steps already due after this one (the clock outruns the trainer)
    failed: bool = False  # the step raised and was released as a noise-only step


def public_norm(config: DPConfig, channels: int) -> RunningNorm:
    """The frozen input normalization of the DP path (public constants; identity by default)."""
    mean = config.norm_mean if config.norm_mean is not None else (0.0,) * channels
    std = config.norm_std if config.norm_std is not None else (1.0,) * channels
    return RunningNorm.from_public(mean, std)


class DPEngine:
    """DP-SGD on a stream, one public-clock step at a time.

    ``model`` is trained in place by ``optimizer``; ``admit`` is called by the ingest side
    (thread-safe), ``step`` by the trainer loop. The model and optimizer states belong to
    the trainer's checkpoint; :meth:`state_dict` holds the DP state (clock, window, ledger,
    accountant table, aggregates). With a ``record``, every closed step's decisions are
    appended to it; the caller syncs it (:meth:`sync_record`) before publishing.

    With a ``group`` (``WORLD_SIZE > 1``), the engines of all ranks are one mechanism
    (:mod:`streamtrain.privacy.group`): :meth:`step`, :meth:`resume` and :meth:`sync_record`
    are then collectives, called by every rank in the same order from one thread.
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
        record: AdmissionRecord | None = None,
        noise_bits: BitSource | None = None,
        group: DPGroup | None = None,
    ) -> None:
        self.randomness = randomness if randomness is not None else CryptoRandomness()
        self.norm = norm if norm is not None else public_norm(config, int(getattr(model, "channels", 1)))
        # Refuses seeded randomness, unsafe settings, unsafe models and a missed target ε.
        self.accountant: PerEventAccountant = check_dp_safety(config, self.randomness.mode, model, input_norm=self.norm)
        self.lifetime: SensorLifetimeAccountant | None = (
            SensorLifetimeAccountant(self.accountant, config.target_epsilon) if config.unit == "sensor" else None
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
        self.group = group
        admit_per_step = config.admit_per_step if group is None else group.admit_share(config.admit_per_step)
        self.window = DPWindow(
            config.eligible_steps, admit_per_step, self.randomness, unit=config.unit,
            sensor_events=config.sensor_events, max_groups=None if self.lifetime is None else self.lifetime.max_groups,
        )  # fmt: skip
        self.sampler = PoissonSampler(config.sampling_schedule(), self.randomness)
        self.noise = DiscreteGaussianNoise(noise_bits if noise_bits is not None else self.randomness)
        self.noise_variance = (Fraction(config.noise_multiplier) * GRID) ** 2  # in grid units, exact
        self.gradients = PerSampleGradients(model, config.clip_norm, loss_fn)
        self.divisor = config.divisor
        self.record = record
        self._group_writer_taken = group is None  # one writer for the group: take_group_writer()
        self._share_ledger()
        self.fault_injector: Any = None  # tests: called at the start of a step's training; may raise
        self.record_fault: Any = None  # tests: called with each micro-batch's rows before its gradients; may raise
        self.on_update: Any = None  # tests: called with each step's noisy integer sum (the group's, after the reduce)
        self._reduced_step = False  # this step's sum has crossed the group: no second, noise-only reduce
        self.last_failure: str | None = None
        self._params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self._params:
            raise DPConfigError(f"model {type(model).__name__} has no trainable parameter: DP-SGD has nothing to train")
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

    def due_at(self, step: int, now: float) -> float:
        """The public time step ``step`` is due."""
        with self._clock_lock:
            return self.clock.due_at(step, now)

    def step(self, now: float) -> DPStepReport | None:
        """Run the next clock step if it is due at ``now``; None if not yet due.

        A step whose training raises is released as a noise-only step (counted on the
        operator plane); if even that fails, the step is still consumed and the error
        raised, so the clock, the window and the record stay consistent.
        """
        with self._step_lock:
            with self._clock_lock:
                due = self.clock.due_steps(now) > 0
                step = self.clock.steps_done + 1
                origin = self.clock.due_at(0, now)
            if self.group is not None:  # rank 0's clock is the group's: same steps, same anchor
                due, origin = self.group.agree_due(due, origin, step)
                with self._clock_lock:
                    self.clock.origin = origin
            if not due:
                return None
            started = time.perf_counter()
            decision = self.window.close_step(step)
            if self.record is not None:
                self.record.append(decision, self.window.eligible_ranges(), clock=self._writes_clock)
            failed = False
            self._reduced_step = False
            try:
                try:
                    period = self._train_one_step()
                except Exception as error:  # noqa: BLE001 - any failure: noise only, and go on
                    if self._reduced_step:  # the group already summed this step: a second reduce would hang
                        raise
                    failed = True
                    self.last_failure = f"step {step}: {type(error).__name__}: {error}"
                    log.exception("DP step %d failed; releasing it as a noise-only step", step)
                    period = replace(self._noise_only_step(), failed_steps=1)
            finally:
                with self._clock_lock:
                    self.clock.steps_done = step
            with self._clock_lock:
                behind = self.clock.due_steps(now)
            period = replace(period, step_seconds=time.perf_counter() - started)
            self._running = self._running + period
            updated = step % self.report_every_steps == 0
            if updated:
                self._published = self._published + replace(self._running, periods=1)
                self._running = DPAggregates()
            return DPStepReport(step, self.epsilon_spent(), self._published, updated, behind, failed)

    def _train_one_step(self) -> DPAggregates:
        eligible = self.window.eligible()
        chosen = self.sampler.sample_records(eligible.ages, eligible.groups)
        if self.fault_injector is not None:
            self.fault_injector()
        groups = eligible.groups[chosen] if self.config.unit == "sensor" else None
        return self.noisy_step([eligible.values[i] for i in chosen], eligible.labels[chosen], groups)

    def _noise_only_step(self) -> DPAggregates:
        for param in self._params.values():
            param.grad = None
        self.optimizer.zero_grad(set_to_none=True)
        return self.noisy_step([], np.zeros(0, np.int64))

    def _micro_batches(self, values: Sequence[np.ndarray], groups: np.ndarray | None) -> list[np.ndarray]:
        """Index groups of token-budget micro-batches; a sensor group never straddles two.

        Sensor unit: groups in order of their longest event, each added to the current batch
        while the batch still fits the budget (a group too large for it is a batch alone).
        """
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        if groups is None:
            return list(plan_batches(lengths, self.budget, self.randomness, pool_size=len(values)).batches)
        records = [np.flatnonzero(groups == g) for g in np.unique(groups)]
        records.sort(key=lambda rows: int(lengths[rows].max()))
        batches: list[np.ndarray] = []
        current: list[np.ndarray] = []
        longest = count = 0
        for rows in records:
            new_longest, new_count = max(longest, int(lengths[rows].max())), count + rows.size
            if current and not self.budget.fits(new_count, new_longest):
                batches.append(np.concatenate(current))
                current, new_longest, new_count = [], int(lengths[rows].max()), rows.size
            current.append(rows)
            longest, count = new_longest, new_count
        if current:
            batches.append(np.concatenate(current))
        return batches

    def noisy_step(
        self, values: Sequence[np.ndarray], labels: np.ndarray, groups: np.ndarray | None = None
    ) -> DPAggregates:
        """One DP-SGD update on an already sampled logical batch (may be empty).

        Token-budget micro-batches, clipped per-record vectors on the integer grid summed
        exactly, discrete Gaussian noise once, public divisor, optimizer step. ``groups``
        (sensor unit) gives each event's record. :meth:`step` feeds it the Poisson sample;
        benchmarks and the audit feed it fixed batches. A micro-batch that raises is redone
        record by record; a record that raises alone contributes zero (``failed_records``).
        """
        sums = {name: torch.zeros(p.shape, dtype=torch.int64, device=p.device) for name, p in self._params.items()}
        totals = DPAggregates(steps=1)
        if len(values):
            label_array = np.asarray(labels)
            for batch_rows in self._micro_batches(values, groups):
                try:
                    totals = totals + self._add_micro_batch(sums, values, label_array, groups, batch_rows)
                except Exception:  # noqa: BLE001 - isolate the record(s) that cannot be computed
                    log.warning("DP micro-batch of %d events failed; computing its records one by one", len(batch_rows))
                    totals = totals + self._add_records_one_by_one(sums, values, label_array, groups, batch_rows)
        self._add_noise_and_step(sums)
        return totals

    def _add_micro_batch(
        self,
        sums: dict[str, torch.Tensor],
        values: Sequence[np.ndarray],
        labels: np.ndarray,
        groups: np.ndarray | None,
        batch_rows: np.ndarray,
    ) -> DPAggregates:
        """Add one micro-batch's clipped integer vectors to ``sums`` (all or nothing)."""
        batch = collate([values[i] for i in batch_rows], labels=labels[batch_rows],
                        pad_to_multiple_of=self.budget.pad_to_multiple_of).to(self._device)  # fmt: skip
        x_norm = self.norm.normalize(batch.values).float() * batch.mask[..., None]
        local = None
        if groups is not None:
            _, inverse = np.unique(np.asarray(groups)[batch_rows], return_inverse=True)
            local = torch.as_tensor(inverse, dtype=torch.int64, device=self._device)
        if self.record_fault is not None:
            self.record_fault(batch_rows)
        part, norms = self.gradients.grid_sum(x_norm, batch.mask, batch.labels, groups=local)
        for name, value in part.items():
            sums[name].add_(value)
        return DPAggregates(sampled_sequences=batch.batch_size, sampled_tokens=batch.real_tokens,
                            padded_tokens=batch.padded_tokens, micro_batches=1,
                            nonfinite_examples=int((~torch.isfinite(norms)).sum()))  # fmt: skip

    def _add_records_one_by_one(
        self,
        sums: dict[str, torch.Tensor],
        values: Sequence[np.ndarray],
        labels: np.ndarray,
        groups: np.ndarray | None,
        batch_rows: np.ndarray,
    ) -> DPAggregates:
        """A failed micro-batch again, one privacy unit at a time; a unit that raises counts as zero."""
        rows = np.asarray(batch_rows)
        units = (
            [rows[np.asarray(groups)[rows] == g] for g in np.unique(np.asarray(groups)[rows])]
            if groups is not None
            else [rows[i : i + 1] for i in range(rows.size)]
        )
        totals = DPAggregates()
        for unit_rows in units:
            try:
                totals = totals + self._add_micro_batch(sums, values, labels, groups, unit_rows)
            except Exception as error:  # noqa: BLE001 - this unit alone: its contribution is zero
                self.last_failure = f"a record's gradient: {type(error).__name__}: {error}"
                totals = totals + DPAggregates(failed_records=1)
        return totals

    def _add_noise_and_step(self, sums: dict[str, torch.Tensor]) -> None:
        """Integer sum + N_Z(0, (σ·grid)²) per coordinate, exactly; then scale and step (post-processing).

        In a group, rank 0 alone adds its draw to its own sum and the int64 sums are then
        all-reduced: every rank holds the union's sum plus one draw, exactly.
        """
        sizes = [t.numel() for t in sums.values()]
        flat = torch.cat([t.reshape(-1).cpu() for t in sums.values()])  # the constructor refuses a model without any
        if self.group is None or self.group.draws_noise:
            flat += torch.from_numpy(self.noise.sample(self.noise_variance, sum(sizes)))  # exact: int64
        if self.group is not None:
            self._reduced_step = True
            self.group.sum_exactly(flat)
        if self.on_update is not None:
            self.on_update(flat)
        scale = self.config.clip_norm / GRID / self.divisor
        for (name, total), noisy in zip(sums.items(), torch.split(flat, sizes), strict=True):
            param = self._params[name]
            grad = noisy.reshape(total.shape).to(torch.float64) * scale
            param.grad = grad.to(dtype=param.dtype, device=param.device)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def _writes_clock(self) -> bool:
        return self.group is None or self.group.writes_clock

    def sync_record(self) -> int:
        """Make the admission record durable; returns the last durable step. Raises OSError.

        In a group (a collective): every rank makes its partition logs and ledger lines
        durable, the ranks agree that all did, and only then does rank 0 write the group's
        clock log — so the clock never shows a step whose decisions on some rank are lost,
        and a rank that failed makes every rank raise (no rank publishes what another could
        not record).
        """
        if self.record is None:
            return self.steps
        if self.group is None:
            return self.record.sync()
        error: OSError | None = None
        try:
            self.record.sync(clock=False)
        except OSError as err:
            error = err
        if not self.group.all_ok(error is None):
            raise error if error is not None else OSError("another rank of the DP group could not sync its record")
        return self.record.sync() if self.group.writes_clock else self.record.synced_step

    # -- reporting -----------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        return self.clock.steps_done

    def epsilon_spent(self) -> float:
        """The most ε any privacy unit can have spent by the current public clock step (public).

        A function of the settings and the clock alone — never of which events arrived — so
        it can be released: an event admitted at step 1 has been eligible at min(t, K) of the
        t steps so far; a sensor can have become a candidate at most once every K steps,
        ceil(t / K) times by step t, and at most G times ever (docs/privacy.md, public plane).
        """
        steps = self.steps
        if self.lifetime is not None:
            most_groups = -(-steps // self.config.eligible_steps)
            return self.lifetime.epsilon_after(min(most_groups, self.lifetime.max_groups))
        return self.accountant.epsilon_after(min(steps, self.config.eligible_steps))

    def epsilon_spent_by_data(self) -> float:
        """The ε of the most exposed unit that actually arrived: data-dependent, operator plane only."""
        if self.lifetime is not None:
            return self.lifetime.epsilon_after(self.window.most_groups())
        return self.accountant.epsilon_after(self.window.steps_eligible_so_far())

    @property
    def epsilon_cap(self) -> float:
        return self.lifetime.epsilon_cap if self.lifetime is not None else self.accountant.epsilon_cap

    def report(self) -> DPAggregates:
        """Totals over completed reporting periods (never the current, partial one): operator plane."""
        return self._published

    def model_info(self) -> dict[str, Any]:
        """The ``dp`` object of ``GET /v1/model``: public settings and ε only (JSON-safe)."""
        config = self.config
        info = {
            "epsilon": self.epsilon_spent(),
            "delta": config.delta,
            "target_epsilon": config.target_epsilon,
            "epsilon_cap": self.epsilon_cap,
            "unit": config.unit,
            "horizon": "lifetime" if config.unit == "sensor" else "event",
            "sigma": config.noise_multiplier,
            "clip_norm": config.clip_norm,
            "q0": config.q0,
            "half_life_steps": None if math.isinf(config.half_life_steps) else config.half_life_steps,
            "K": config.eligible_steps,
            "R": config.admit_per_step,
            "steps": self.steps,
            "step_rate_hz": config.step_rate_hz,
            "expected_batch_size": self.divisor,
            "expected_units": config.expected_units,
            "accountant": ACCOUNTANT_NAME,
            "noise": f"discrete Gaussian, grid 2^-{int(math.log2(GRID))} C",
        }
        if self.lifetime is not None:
            info["sensor_events"] = config.sensor_events
            info["max_groups_per_sensor"] = self.lifetime.max_groups
        return info

    def operator_info(self) -> dict[str, Any]:
        """Data-dependent diagnostics, outside the guarantee: for the admin-only operator plane."""
        totals = self._published
        return {
            **asdict(totals),
            "mean_batch_size": totals.mean_batch_size,
            "mean_step_seconds": totals.mean_step_seconds,
            "window_records": len(self.window),
            "arrived_total": self.window.arrived_total,
            "admitted_total": self.window.admitted_total,
            "expired_total": self.window.expired_total,
            "turned_away": dict(self.window.turned_away),
            "pending_steps": self.window.pending_steps,
            "sensors_in_ledger": len(self.window.ledger),
            "watermarks": {str(p): o for p, o in sorted(self.window.watermarks.items())},
            "last_failure": self.last_failure,
            "epsilon_spent_by_data": self.epsilon_spent_by_data(),
        }

    # -- checkpoints and restarts ---------------------------------------------------------------

    def _schedule_key(self) -> np.ndarray:
        return np.asarray(self.config.schedule_key()[:3], dtype=np.float64)

    def state_dict(self) -> dict[str, Any]:
        with self._step_lock:
            return {
                "schedule": self._schedule_key(),
                "eligible_steps": self.config.eligible_steps,
                "unit": self.config.unit,
                "clock": self.clock.state_dict(),
                "window": self.window.state_dict(),
                "accountant": self.accountant.state_dict(),
                "published": asdict(self._published),
                "running": asdict(self._running),
                "record_synced_step": 0 if self.record is None else self.record.synced_step,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not (np.array_equal(np.asarray(state["schedule"], dtype=np.float64), self._schedule_key())
                and int(state["eligible_steps"]) == self.config.eligible_steps
                and str(state.get("unit", "event")) == self.config.unit):  # fmt: skip
            raise DPConfigError(
                "the checkpoint was written with another DP schedule or unit (σ, q0, half-life, K, DP_UNIT); "
                "units in its window were accounted under that schedule: restore those STREAMTRAIN_DP_* settings or "
                "use an empty checkpoint directory"
            )
        with self._step_lock:
            try:
                self.accountant.load_state_dict(state["accountant"])
                self.window.load_state_dict(state["window"])
            except ValueError as error:
                raise DPConfigError(str(error)) from error
            except KeyError as error:
                raise DPConfigError(
                    f"the checkpoint's DP state lacks {error} (written by an older streamtrain, before the admission "
                    "record): its events cannot be proven admitted once; start DP from an empty CHECKPOINT_DIR"
                ) from None
            with self._clock_lock:
                self.clock.load_state_dict(state["clock"])
            if self.window.closed_step != self.clock.steps_done:
                raise DPConfigError(
                    f"DP checkpoint is inconsistent: window closed step {self.window.closed_step} != clock step "
                    f"{self.clock.steps_done}; use an earlier checkpoint"
                )
            self._published = DPAggregates(**dict(state["published"]))
            self._running = DPAggregates(**dict(state["running"]))
            self._share_ledger()

    def _share_ledger(self) -> None:
        """Sensor unit with a record: the window decides candidacies on the shared ledger."""
        if self.record is None or self.config.unit != "sensor":
            return
        self.record.ledger.merge(self.window.ledger)  # a restored checkpoint's (the log has it unless lost)
        self.window.ledger = self.record.ledger.entries
        self.window.claim = self.record.ledger.claim

    def take_group_writer(self) -> None:
        """In a group (a collective, once): write the record under rank 0's writer name.

        One writer for the group: one ledger spacing (one candidacy per K steps of the
        group's clock) and one clock log. Not in the constructor: the service builds the
        engine before the ranks have met. Call before the record is read (the ledger tells
        its own lines apart by the name); :meth:`resume` calls it if nobody did.
        """
        if self._group_writer_taken:
            return
        assert self.group is not None
        if self.record is not None:
            self.record.writer = self.record.ledger.writer = self.group.writer(self.record.writer)
        self._group_writer_taken = True

    def resume(self, recorded: RecordState) -> int:
        """Continue after the last step the admission record shows (see :meth:`DPWindow.resume`).

        Call after :meth:`load_state_dict` (or on a fresh start with a record). Returns the
        step the clock continues after.
        """
        self.take_group_writer()
        with self._step_lock:
            step = max(self.clock.steps_done, recorded.last_step)
            if self.group is not None:  # one clock log (rank 0's), one checkpoint step: every rank the same
                step = self.group.last_step(step)
            self._share_ledger()  # after load_state_dict, which replaced the window's ledger
            self.window.resume(step, recorded.watermarks, recorded.candidates)
            with self._clock_lock:
                self.clock.steps_done = step
                self.clock.origin = None
            return step
