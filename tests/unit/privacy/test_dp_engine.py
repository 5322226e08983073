"""The DP-SGD engine: public clock, noise-only steps, public divisor, ε, aggregates, checkpoints."""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from dataclasses import asdict, fields, replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from streamtrain.data.bucketing import TokenBudget
from streamtrain.data.collate import collate
from streamtrain.data.randomness import SeededRandomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.model.network import SensorModel
from streamtrain.privacy import DPConfig, DPConfigError, DPEngine, DPStepReport, PerSampleGradients
from streamtrain.privacy.engine import DPAggregates
from streamtrain.privacy.noise import GRID

BASE = dict(noise_multiplier=1.0, clip_norm=0.5, q0=0.2, eligible_steps=6, admit_per_step=8,
            step_rate_hz=10.0, delta=1e-6, target_epsilon=30.0, expected_units=1e3)  # fmt: skip


def dp_engine(
    config: DPConfig | None = None,
    budget: int | TokenBudget = 256,
    *,
    model: SensorModel | None = None,
    optimizer: type[torch.optim.SGD] = torch.optim.SGD,
    **kwargs: object,
) -> DPEngine:
    """An engine on ``model`` (default: a small model seeded 0) trained by ``optimizer`` at lr 1."""
    torch.manual_seed(0)
    model = model if model is not None else SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=32)
    return DPEngine(model, optimizer(model.parameters(), lr=1.0), config or DPConfig(**BASE), budget, **kwargs)


def make_engine(report_every_steps: int = 4, **overrides: float) -> DPEngine:
    return dp_engine(DPConfig(**{**BASE, **overrides}), report_every_steps=report_every_steps)


def arrivals(n: int, seed: int) -> list[SensorEvent]:
    rng = np.random.default_rng(seed)
    return [SensorEvent("s", 0.0, rng.normal(size=(int(rng.integers(2, 20)), 1)).astype(np.float32)) for _ in range(n)]


def flat_parameters(engine: DPEngine) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in engine.model.parameters()])


def tick(k: int) -> float:
    """Just after step k is due on a 10 Hz clock started at 0 (clear of float rounding)."""
    return k / 10 + 1e-3


class NoNoise:
    """Test double: lets the deterministic part of a step be checked exactly."""

    def sample(self, sigma_squared: object, n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.int64)


def test_steps_follow_the_public_clock() -> None:
    engine = make_engine()
    assert engine.step(100.0) is None  # anchors the clock; step 1 is due at 100.1
    assert engine.seconds_until_next_step(100.0) == pytest.approx(0.1)
    assert engine.admit(arrivals(3, 0), now=100.05) == 1
    report = engine.step(100.101)
    assert isinstance(report, DPStepReport) and report.step == 1
    assert engine.step(100.15) is None
    reports = [engine.step(100.35) for _ in range(3)]  # behind: run due steps back to back
    assert [r.step for r in reports if r] == [2, 3] and reports[0].behind_steps == 1 and reports[2] is None


def test_noise_only_step_adds_gaussian_noise_of_std_sigma_c_over_divisor() -> None:
    engine = make_engine()
    before = flat_parameters(engine)
    assert engine.step(0.0) is None
    assert engine.step(tick(1)).step == 1  # empty window: the step runs anyway
    delta = (flat_parameters(engine) - before).double().numpy()
    expected_std = BASE["noise_multiplier"] * BASE["clip_norm"] / engine.divisor
    n = delta.size
    ratio = delta.var(ddof=1) / expected_std**2
    assert stats.chi2.ppf(1e-6, n - 1) / (n - 1) <= ratio <= stats.chi2.ppf(1 - 1e-6, n - 1) / (n - 1)
    assert engine.divisor == pytest.approx(BASE["admit_per_step"] * BASE["q0"] * BASE["eligible_steps"])


def test_update_is_the_clipped_sum_over_the_public_divisor() -> None:
    engine = make_engine(q0=1.0, target_epsilon=1e6)  # q = 1: every eligible event is sampled
    engine.noise = NoNoise()
    items = arrivals(5, 1)
    engine.step(0.0)
    engine.admit(items, now=0.01)
    reference = PerSampleGradients(engine.model, BASE["clip_norm"])
    batch = collate([e.values for e in items])
    expected, _ = reference.clipped_sum(batch.values, batch.mask, batch.labels)
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    engine.step(tick(1))
    for name, p in engine.model.named_parameters():
        # SGD with lr 1: the update is -(sum of clipped gradients) / public divisor, up to the
        # grid: each of the 5 vectors loses less than one grid unit (C / 2^16) per coordinate.
        grid_error = 5 * BASE["clip_norm"] / GRID / engine.divisor
        torch.testing.assert_close(
            before[name] - p.detach(), expected[name] / engine.divisor, atol=grid_error + 1e-7, rtol=1e-4
        )
    assert engine.divisor == pytest.approx(8 * 6)  # R * sum q_j, not the 5 actually sampled


def test_epsilon_grows_then_caps_while_steps_continue() -> None:
    engine = make_engine()
    assert engine.step(0.0) is None and engine.epsilon_spent() == 0.0
    spent = []
    for k in range(1, 16):
        engine.admit(arrivals(4, k), now=tick(k - 1))
        spent.append(engine.step(tick(k)).epsilon)
    cap = engine.accountant.epsilon_cap
    assert 0 < spent[0] < cap
    assert all(b >= a for a, b in zip(spent, spent[1:], strict=False))
    assert spent[5] == spent[-1] == cap <= BASE["target_epsilon"]  # K = 6 steps, then flat forever
    info = engine.model_info()
    assert info["epsilon"] == cap and info["steps"] == 15 and info["K"] == 6 and info["R"] == 8
    assert info["half_life_steps"] is None and info["delta"] == 1e-6


def test_only_period_aggregates_are_reported() -> None:
    engine = make_engine(report_every_steps=4)
    engine.step(0.0)
    seen = []
    for k in range(1, 10):
        engine.admit(arrivals(8, k + 7), now=tick(k - 1))
        report = engine.step(tick(k))
        seen.append((report.aggregates_updated, report.aggregates))
    assert [updated for updated, _ in seen] == [False, False, False, True, False, False, False, True, False]
    assert seen[0][1].steps == 0 and seen[2][1].steps == 0  # nothing before the first period ends
    assert seen[3][1].steps == 4 and seen[6][1] == seen[3][1] and seen[7][1].steps == 8
    assert engine.report() == seen[8][1]
    assert seen[7][1].sampled_sequences > 0 and seen[7][1].padded_tokens >= seen[7][1].sampled_tokens
    names = {f.name for f in fields(DPStepReport)}
    assert names == {
        "step",
        "epsilon",
        "aggregates",
        "aggregates_updated",
        "behind_steps",
        "failed",
    }  # no per-step counts


def test_state_dict_round_trip_and_schedule_mismatch() -> None:
    engine = make_engine()
    engine.step(0.0)
    for k in range(1, 4):
        engine.admit(arrivals(5, k), now=tick(k - 1))
        engine.step(tick(k))
    engine.admit(arrivals(2, 99), now=0.35)  # pending for step 4
    state = engine.state_dict()
    restored = make_engine()
    restored.load_state_dict(state)
    assert restored.steps == 3 and restored.epsilon_spent() == engine.epsilon_spent()
    assert len(restored.window) == len(engine.window)
    assert restored.step(500.0) is None  # the clock re-anchors after a restart
    assert restored.step(500.101).step == 4
    assert len(restored.window) == len(engine.window) + 2  # the pending arrivals were admitted
    with pytest.raises(DPConfigError, match="another DP schedule"):
        make_engine(noise_multiplier=2.0).load_state_dict(state)


def test_a_step_that_raises_is_a_noise_only_step_and_training_goes_on(tmp_path) -> None:
    from streamtrain.privacy import AdmissionRecord

    engine = make_engine(report_every_steps=2)
    engine.record = AdmissionRecord(tmp_path / "adm", tmp_path / "clock.jsonl")
    engine.step(0.0)
    engine.admit(arrivals(4, 1), now=0.01)

    def boom() -> None:
        raise RuntimeError("the sampler ran out of memory")

    engine.fault_injector = boom
    before = flat_parameters(engine)
    report = engine.step(tick(1))
    assert report.step == 1 and report.failed
    assert not torch.equal(flat_parameters(engine), before)  # noise was released, as on any step
    assert engine.window.closed_step == engine.clock.steps_done == 1  # consistent, not wedged
    engine.fault_injector = None
    for k in range(2, 5):  # the next steps run and train
        engine.admit(arrivals(3, k), now=tick(k - 1))
        report = engine.step(tick(k))
        assert report.step == k and not report.failed
    assert engine.report().failed_steps == 1 and "out of memory" in engine.operator_info()["last_failure"]
    restored = make_engine()
    restored.load_state_dict(engine.state_dict())  # and the checkpoint is consistent
    assert restored.steps == 4
    engine.record.sync()
    assert engine.record.synced_step == 4


def test_even_a_failing_noise_only_step_consumes_its_step() -> None:
    engine = make_engine()
    engine.step(0.0)
    engine.fault_injector = lambda: (_ for _ in ()).throw(RuntimeError("bad step"))

    class Broken:
        def sample(self, sigma_squared: object, n: int) -> np.ndarray:
            raise OSError("entropy source unavailable")

    engine.noise = Broken()
    with pytest.raises(OSError):
        engine.step(tick(1))
    assert engine.window.closed_step == engine.clock.steps_done == 1
    engine.noise, engine.fault_injector = make_engine().noise, None
    assert engine.step(tick(2)).step == 2


def test_sensor_unit_engine_reports_lifetime_epsilon() -> None:
    engine = make_engine(unit="sensor", sensor_events=2, noise_multiplier=3.0, target_epsilon=3.0)
    assert engine.lifetime is not None and engine.lifetime.max_groups >= 1
    engine.step(0.0)
    assert engine.epsilon_spent() == 0.0
    batch = EventBatch.from_events(
        [SensorEvent(s, 0.0, np.ones((4, 1), np.float32)) for s in ["a", "a", "a", "b"]],
        partitions=[0] * 4,
        offsets=[0, 1, 2, 3],
    )
    engine.admit(batch, now=0.01)
    report = engine.step(tick(1))
    assert len(engine.window) == 3  # a: 2 of 3, b: 1
    assert report.epsilon == pytest.approx(engine.accountant.epsilon_cap, rel=1e-6)  # one group, counted whole
    info = engine.model_info()
    assert info["unit"] == "sensor" and info["horizon"] == "lifetime" and info["max_groups_per_sensor"] >= 1
    assert info["epsilon_cap"] <= 3.0 and "mean_batch_size" not in info


def test_a_dp_checkpoint_of_the_older_format_is_refused_in_one_line() -> None:
    engine = make_engine()
    state = engine.state_dict()
    del state["window"]["watermarks"], state["window"]["pending"]["offsets"]
    with pytest.raises(DPConfigError, match="older streamtrain"):
        make_engine().load_state_dict(state)


class CapturedSums:
    """Test double for the noise-and-step stage: keeps the exact integer sum a step would noise."""

    def __init__(self) -> None:
        self.sums: list[dict[str, torch.Tensor]] = []

    def __call__(self, sums: dict[str, torch.Tensor]) -> None:
        self.sums.append({name: total.clone() for name, total in sums.items()})


@pytest.mark.parametrize("unit", ["event", "sensor"])
def test_a_record_whose_computation_raises_counts_as_zero_and_the_others_still_count(unit: str, caplog) -> None:
    """Not a noise-only step (which would drop every record for one record's sake): the record alone is zero."""
    engine = make_engine(q0=1.0, target_epsilon=1e6)
    with torch.no_grad():  # a network that does something: the zero head would hide every body gradient
        for parameter in engine.model.parameters():
            parameter.normal_(0.0, 0.3)
    captured = CapturedSums()
    engine._add_noise_and_step = captured  # type: ignore[method-assign]
    items = arrivals(6, 3)
    values = [e.values for e in items]
    labels = EventBatch.from_events(items).labels
    groups = np.asarray([0, 0, 1, 1, 2, 2]) if unit == "sensor" else None
    poison = 2  # its unit: the event alone, or the sensor group of events 2 and 3
    engine.record_fault = lambda rows: (_ for _ in ()).throw(MemoryError("one record")) if poison in rows else None
    with caplog.at_level(logging.WARNING, logger="streamtrain.privacy.engine"):
        totals = engine.noisy_step(values, labels, groups)
    assert [r.getMessage() for r in caplog.records] == [
        "DP micro-batch of 6 events failed; computing its records one by one"
    ]
    assert engine.last_failure == "a record's gradient: MemoryError: one record"
    engine.record_fault = None
    kept = [i for i in range(6) if i != poison and not (unit == "sensor" and i == 3)]
    reference = engine.noisy_step([values[i] for i in kept], labels[kept], None if groups is None else groups[kept])
    assert totals.failed_records == 1 and totals.sampled_sequences == len(kept) == reference.sampled_sequences
    assert sum(int(total.abs().sum()) for total in captured.sums[0].values()) > 0
    for name, total in captured.sums[0].items():
        # computed alone instead of in one padded micro-batch: each vector may round one grid unit apart
        assert (total - captured.sums[1][name]).abs().max() <= len(kept), name


# --- what the engine promises beyond a step's arithmetic (its mutation run) ---


class ReplayedCrypto(SeededRandomness):
    """Test double: seeded bits under the crypto label, so two engines can be fed the same draws."""

    mode = "crypto"


def replayed_engine(seed: int) -> DPEngine:
    return dp_engine(DPConfig(**{**BASE, "q0": 0.5}), randomness=ReplayedCrypto(seed))


def run_steps(engine: DPEngine, steps: int) -> torch.Tensor:
    engine.step(0.0)
    for k in range(1, steps + 1):
        engine.admit(arrivals(6, k), now=tick(k - 1))
        torch.manual_seed(k)
        engine.step(tick(k))
    return flat_parameters(engine)


def test_every_draw_of_a_step_comes_from_the_engines_randomness() -> None:
    """Admission, sampling, the micro-batch plan and the noise: the same draws give the same model,
    other draws another (no decision falls back to a source of its own)."""
    assert torch.equal(run_steps(replayed_engine(1), 3), run_steps(replayed_engine(1), 3))
    assert not torch.equal(run_steps(replayed_engine(1), 3), run_steps(replayed_engine(2), 3))


def test_noise_bits_given_to_the_engine_feed_the_noise_alone() -> None:
    noise_only = [dp_engine(noise_bits=SeededRandomness(seed)) for seed in (5, 5, 6)]
    moved = [run_steps(engine, 0) + 0 for engine in noise_only]
    for engine in noise_only:
        engine.step(tick(1))  # empty window: the update is the noise alone
    after = [flat_parameters(engine) - start for engine, start in zip(noise_only, moved, strict=True)]
    assert torch.equal(after[0], after[1]) and not torch.equal(after[0], after[2])


def test_the_constructor_refuses_what_would_void_the_guarantee() -> None:
    from streamtrain.model.normalization import RunningNorm

    model = SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(DPConfigError, match="SHUFFLE=crypto"):
        DPEngine(model, optimizer, DPConfig(**BASE), 256, randomness=SeededRandomness(0))
    with pytest.raises(DPConfigError, match="input normalization from running statistics"):
        DPEngine(model, optimizer, DPConfig(**BASE), 256, norm=RunningNorm(1))
    unsafe = SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=32)
    unsafe.extra = torch.nn.BatchNorm1d(4)
    with pytest.raises(DPConfigError, match="module 'extra' \\(BatchNorm1d\\)"):
        DPEngine(unsafe, torch.optim.SGD(unsafe.parameters(), lr=1.0), DPConfig(**BASE), 256)
    frozen = SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=32).requires_grad_(False)
    with pytest.raises(DPConfigError) as raised:
        DPEngine(frozen, optimizer, DPConfig(**BASE), 256)
    assert str(raised.value) == "model SensorModel has no trainable parameter: DP-SGD has nothing to train"
    with pytest.raises(ValueError) as bad_period:
        make_engine(report_every_steps=0)
    assert str(bad_period.value) == "report_every_steps must be >= 1, got 0"
    assert make_engine(report_every_steps=1).report_every_steps == 1


def test_the_constructor_keeps_what_it_is_given_and_documents_its_defaults() -> None:
    from streamtrain.model.normalization import RunningNorm
    from streamtrain.privacy.engine import public_norm

    model = SensorModel(2, d_model=16, n_heads=2, n_layers=1, max_len=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine = DPEngine(model, optimizer, DPConfig(**BASE), 256)
    assert engine.randomness.mode == "crypto" and engine.report_every_steps == 50
    assert engine.budget == TokenBudget(max_tokens=256, max_sequences=128)
    assert engine.norm.mean.tolist() == [0.0, 0.0] and engine.norm.std.tolist() == [1.0, 1.0]  # one per channel
    norm = RunningNorm.from_public([1.0, 2.0], [3.0, 4.0])
    budget = TokenBudget(max_tokens=300, max_sequences=4, pad_to_multiple_of=8)
    given = DPEngine(model, optimizer, DPConfig(**BASE), budget, norm=norm, max_micro_batch_sequences=7)
    assert given.norm is norm and given.budget is budget
    assert DPEngine(model, optimizer, DPConfig(**BASE), 99, max_micro_batch_sequences=7).budget.max_sequences == 7
    undeclared = torch.nn.Linear(1, 1)  # no `channels`: one, the probe skipped (it needs the input shape)
    assert DPEngine(
        undeclared, torch.optim.SGD(undeclared.parameters(), lr=1.0), DPConfig(**BASE), 99
    ).norm.mean.tolist() == [0.0]
    configured = public_norm(DPConfig(**BASE, norm_mean=(1.0, 2.0), norm_std=(3.0, 4.0)), 2)
    assert configured.mean.tolist() == [1.0, 2.0] and configured.std.tolist() == [3.0, 4.0]


def test_a_custom_per_sample_loss_is_the_one_trained() -> None:
    zero_loss = lambda output, x, mask, labels: (output.forecast * 0.0).sum(dim=(1, 2))  # noqa: E731
    engine = dp_engine(DPConfig(**{**BASE, "q0": 1.0, "target_epsilon": 1e6}), loss_fn=zero_loss)
    captured = CapturedSums()
    engine._add_noise_and_step = captured  # type: ignore[method-assign]
    items = arrivals(4, 2)
    engine.noisy_step([e.values for e in items], EventBatch.from_events(items).labels)
    assert all(int(total.abs().sum()) == 0 for total in captured.sums[0].values())


def test_arrivals_pass_their_partitions_next_offsets_to_the_window() -> None:
    engine = make_engine()
    batch = EventBatch.from_events(arrivals(2, 0), partitions=[0, 0], offsets=[3, 4])
    engine.admit(batch, now=0.0, next_offsets={0: 9})
    assert engine.window.next_offsets == {0: 9}


def test_the_wait_for_the_next_step_anchors_a_fresh_clock() -> None:
    engine = make_engine()
    assert engine.seconds_until_next_step(100.0) == pytest.approx(0.1)
    assert engine.due_at(3, 123.0) == pytest.approx(100.3)


def test_a_step_reports_its_failure_flag_its_time_and_whole_periods(caplog) -> None:
    engine = make_engine(report_every_steps=2)
    engine.step(0.0)
    started = time.perf_counter()
    report = engine.step(tick(1))
    assert report.failed is False and engine.last_failure is None
    engine.step(tick(2))
    assert 0.0 < engine.report().step_seconds <= time.perf_counter() - started  # the two steps of the period
    for k in (3, 4):
        engine.step(tick(k))
    assert engine.report().periods == 2 and engine.report().steps == 4

    def boom() -> None:
        raise RuntimeError("the sampler ran out of memory")

    engine.fault_injector = boom
    with caplog.at_level(logging.ERROR, logger="streamtrain.privacy.engine"):
        assert engine.step(tick(5)).failed is True
    assert engine.last_failure == "step 5: RuntimeError: the sampler ran out of memory"
    assert [r.getMessage() for r in caplog.records] == ["DP step 5 failed; releasing it as a noise-only step"]


def test_a_step_leaves_no_gradient_behind_and_releases_the_noisy_sum_in_double_precision() -> None:
    """The update is the noisy integer sum times C / (grid · divisor), computed in float64 and rounded once."""

    class SeenGradients(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def,override]
            self.seen = [p.grad.clone() for group in self.param_groups for p in group["params"]]
            return super().step(closure)

    engine = dp_engine(optimizer=SeenGradients)
    released: list[torch.Tensor] = []
    engine.on_update = lambda flat: released.append(flat.clone())
    engine.step(0.0)
    engine.step(tick(1))
    scale = BASE["clip_norm"] / GRID / engine.divisor
    expected = (released[0].to(torch.float64) * scale).to(torch.float32)
    assert released[0].dtype == torch.int64 and int(released[0].abs().sum()) > 0
    assert torch.equal(torch.cat([g.reshape(-1) for g in engine.optimizer.seen]), expected)
    assert all(p.grad is None for p in engine.model.parameters())


def test_a_healthy_sample_is_one_micro_batch_when_it_fits_with_exact_totals(caplog) -> None:
    """Not record by record (the fallback for a micro-batch that raises): one padded batch, its totals exact."""
    engine = dp_engine(budget=TokenBudget(max_tokens=256, max_sequences=16, pad_to_multiple_of=8))
    lengths = [2, 30, 3, 29]
    values = [np.ones((n, 1), np.float32) for n in lengths]
    with caplog.at_level(logging.WARNING, logger="streamtrain.privacy.engine"):
        totals = engine.noisy_step(values, np.full(4, -1))
    assert caplog.records == []
    assert totals == DPAggregates(steps=1, sampled_sequences=4, sampled_tokens=64, padded_tokens=4 * 32,
                                  micro_batches=1)  # fmt: skip
    values[1] = np.full((30, 1), np.nan, np.float32)
    assert engine.noisy_step(values, np.full(4, -1)).nonfinite_examples == 1


def test_a_classifier_trains_on_the_labels_of_its_records() -> None:
    torch.manual_seed(0)
    model = SensorModel(1, n_classes=3, d_model=16, n_heads=2, n_layers=1, max_len=32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3)
    engine = dp_engine(model=model)
    captured = CapturedSums()
    engine._add_noise_and_step = captured  # type: ignore[method-assign]
    values = [np.ones((5, 1), np.float32) * k for k in (1, 2)]
    for labels in ([0, 0], [2, 1]):
        engine.noisy_step(values, np.asarray(labels))
    assert any(not torch.equal(captured.sums[0][n], captured.sums[1][n]) for n in captured.sums[0])


def test_the_sensor_unit_clips_each_group_once_across_micro_batches() -> None:
    """A group's events are summed before the clip and never straddle two micro-batches, whatever the budget."""
    engine = make_engine(unit="sensor", sensor_events=3, noise_multiplier=3.0, q0=1.0, target_epsilon=20.0)
    with torch.no_grad():
        for parameter in engine.model.parameters():
            parameter.normal_(0.0, 0.3)
    captured = CapturedSums()
    engine._add_noise_and_step = captured  # type: ignore[method-assign]
    calls: list[np.ndarray] = []
    add = engine._add_micro_batch
    engine._add_micro_batch = lambda sums, values, labels, groups, rows: (  # type: ignore[method-assign]
        calls.append(np.asarray(rows)) or add(sums, values, labels, groups, rows)
    )
    engine.budget = replace(engine.budget, max_tokens=40)  # two groups of <= 3 x 12 readings no longer fit together
    rng = np.random.default_rng(7)
    values = [rng.normal(size=(12, 1)).astype(np.float32) for _ in range(9)]
    groups = np.asarray([0, 1, 2, 0, 1, 2, 0, 1, 2])
    labels = np.full(9, -1)
    engine.noisy_step(values, labels, groups)
    assert len(calls) == 3 and sorted(tuple(sorted(groups[rows])) for rows in calls) == [(0,) * 3, (1,) * 3, (2,) * 3]
    batch = collate(values)
    grouped, _ = engine.gradients.grid_sum(batch.values, batch.mask, batch.labels, groups=torch.as_tensor(groups))
    alone, _ = engine.gradients.grid_sum(batch.values, batch.mask, batch.labels)
    for name, total in captured.sums[0].items():
        assert (total - grouped[name]).abs().max() <= 3, name  # per micro-batch: one grid unit per group
    assert max(int((captured.sums[0][n] - alone[n]).abs().max()) for n in alone) > 100  # per event: another sum


def test_the_sensor_units_step_trains_groups_and_spends_one_group_every_k_steps() -> None:
    engine = make_engine(unit="sensor", sensor_events=2, noise_multiplier=3.0, target_epsilon=20.0, q0=1.0)
    lifetime = engine.lifetime
    assert lifetime is not None and lifetime.max_groups >= 2 and engine.window.max_groups == lifetime.max_groups
    seen: list[np.ndarray | None] = []
    noisy_step = engine.noisy_step
    engine.noisy_step = lambda values, labels, groups=None: (  # type: ignore[method-assign]
        seen.append(groups) or noisy_step(values, labels, groups)
    )
    engine.step(0.0)
    batch = EventBatch.from_events([SensorEvent(s, 0.0, np.ones((4, 1), np.float32)) for s in "aab"],
                                   partitions=[0] * 3, offsets=[0, 1, 2])  # fmt: skip
    engine.admit(batch, now=0.01)
    engine.step(tick(1))
    assert seen[0] is not None and sorted(np.unique(seen[0], return_counts=True)[1].tolist()) == [1, 2]
    for k in range(2, 8):  # K = 6: step 7 is the first a sensor could be a candidate again
        engine.step(tick(k))
    assert engine.epsilon_spent() == lifetime.epsilon_after(2) > lifetime.epsilon_after(1)
    assert engine.operator_info()["epsilon_spent_by_data"] == lifetime.epsilon_after(1)  # a and b: one group each


SENSOR = {**BASE, "unit": "sensor", "sensor_events": 2, "noise_multiplier": 3.0, "target_epsilon": 3.0}


def test_the_sensor_unit_decides_candidacies_on_the_records_ledger_and_merges_a_checkpoints(tmp_path) -> None:
    from streamtrain.privacy import AdmissionRecord

    def record(name: str) -> AdmissionRecord:
        return AdmissionRecord(tmp_path / name / "adm", tmp_path / name / "clock.jsonl")

    engine = dp_engine(DPConfig(**SENSOR), record=record("first"))
    assert engine.window.ledger is engine.record.ledger.entries and engine.window.claim == engine.record.ledger.claim
    engine.step(0.0)
    batch = EventBatch.from_events([SensorEvent(s, 0.0, np.ones((4, 1), np.float32)) for s in "ab"],
                                   partitions=[0, 0], offsets=[0, 1])  # fmt: skip
    engine.admit(batch, now=0.01)
    engine.step(tick(1))
    restored = dp_engine(DPConfig(**SENSOR), record=record("second"))
    restored.load_state_dict(engine.state_dict())
    assert restored.window.ledger is restored.record.ledger.entries
    assert (
        sorted(restored.record.ledger.entries) == sorted(engine.record.ledger.entries)
        and len(engine.window.ledger) == 2
    )
    events = dp_engine(DPConfig(**BASE), record=record("events"))
    assert events.window.ledger is not events.record.ledger.entries  # the event unit keeps no ledger


def test_model_info_is_the_public_dp_object_in_full() -> None:
    engine = make_engine()
    assert engine.model_info() == {
        "epsilon": 0.0, "delta": 1e-6, "target_epsilon": 30.0, "epsilon_cap": engine.accountant.epsilon_cap,
        "unit": "event", "horizon": "event", "sigma": 1.0, "clip_norm": 0.5, "q0": 0.2, "half_life_steps": None,
        "K": 6, "R": 8, "steps": 0, "step_rate_hz": 10.0, "expected_batch_size": pytest.approx(9.6),
        "expected_units": 1e3, "accountant": "pld_replace_one_discrete_gaussian_coupled",
        "noise": "discrete Gaussian, grid 2^-16 C",
    }  # fmt: skip
    sensor = dp_engine(DPConfig(**{**SENSOR, "half_life_steps": 50.0}))
    info = sensor.model_info()
    assert sensor.lifetime is not None and info["epsilon_cap"] == sensor.lifetime.epsilon_cap
    assert info["unit"] == "sensor" and info["horizon"] == "lifetime" and info["half_life_steps"] == 50.0
    assert info["sensor_events"] == 2 and info["max_groups_per_sensor"] == sensor.lifetime.max_groups


def test_operator_info_in_full() -> None:
    engine = make_engine(report_every_steps=1)
    engine.step(0.0)
    batch = EventBatch.from_events(arrivals(3, 0), partitions=[0, 0, 1], offsets=[4, 5, 9])
    engine.admit(batch, now=0.01)
    engine.step(tick(1))
    totals = engine.report()
    assert engine.operator_info() == {
        **asdict(totals), "mean_batch_size": totals.mean_batch_size, "mean_step_seconds": totals.mean_step_seconds,
        "window_records": 3, "arrived_total": 3, "admitted_total": 3, "expired_total": 0,
        "turned_away": {"not_owned": 0, "decided_before": 0, "sensor_ruled_out": 0, "group_refused": 0},
        "pending_steps": 0, "sensors_in_ledger": 0, "watermarks": {"0": 6, "1": 10}, "last_failure": None,
        "epsilon_spent_by_data": engine.accountant.epsilon_after(1),
    }  # fmt: skip


def test_the_checkpoint_names_its_schedule_and_unit_and_its_refusals_are_whole() -> None:
    engine = make_engine()
    state = engine.state_dict()
    assert state["schedule"].tolist() == [1.0, 0.2, math.inf] and state["eligible_steps"] == 6
    assert state["unit"] == "event" and state["record_synced_step"] == 0
    older = {key: value for key, value in state.items() if key != "unit"}  # written before the sensor unit
    make_engine().load_state_dict(older)
    other = (
        "the checkpoint was written with another DP schedule or unit (σ, q0, half-life, K, DP_UNIT); units in its "
        "window were accounted under that schedule: restore those STREAMTRAIN_DP_* settings or use an empty "
        "checkpoint directory"
    )
    for engine_elsewhere in (dp_engine(DPConfig(**SENSOR)), make_engine(eligible_steps=7), make_engine(q0=0.3)):
        for written in (state, older):
            with pytest.raises(DPConfigError) as raised:
                engine_elsewhere.load_state_dict(written)
            assert str(raised.value) == other
    lacking = copy.deepcopy(state)
    del lacking["window"]["pending"]["offsets"]
    with pytest.raises(DPConfigError) as raised:
        make_engine().load_state_dict(lacking)
    assert str(raised.value) == (
        "the checkpoint's DP state lacks 'offsets' (written by an older streamtrain, before the admission "
        "record): its events cannot be proven admitted once; start DP from an empty CHECKPOINT_DIR"
    )
    with pytest.raises(DPConfigError) as raised:
        make_engine(delta=1e-7).load_state_dict(state)  # δ: the accountant's own check, in the engine's error
    assert str(raised.value) == (
        "PerEventAccountant.load_state_dict: the checkpoint's DP schedule (σ, q_j, K, δ) differs from this run's; "
        "restore the checkpoint's DP settings or start from an empty checkpoint directory"
    )
    ahead = {**state, "clock": {**state["clock"], "steps_done": 5}}
    with pytest.raises(DPConfigError) as raised:
        make_engine().load_state_dict(ahead)
    assert str(raised.value) == (
        "DP checkpoint is inconsistent: window closed step 0 != clock step 5; use an earlier checkpoint"
    )


@functools.cache
def planning_engine() -> DPEngine:
    return make_engine(unit="sensor", sensor_events=8, noise_multiplier=3.0, target_epsilon=30.0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.integers(0, 7), min_size=1, max_size=24),
    data=st.data(),
    max_tokens=st.integers(1, 120),
    max_sequences=st.one_of(st.none(), st.integers(1, 6)),
    pad_to_multiple_of=st.sampled_from([1, 4]),
)
def test_sensor_micro_batches_keep_each_group_whole_and_fill_the_budget_greedily(
    groups: list[int], data: st.DataObject, max_tokens: int, max_sequences: int | None, pad_to_multiple_of: int
) -> None:
    lengths = data.draw(st.lists(st.integers(1, 30), min_size=len(groups), max_size=len(groups)))
    engine = planning_engine()
    budget = TokenBudget(max_tokens=max_tokens, max_sequences=max_sequences, pad_to_multiple_of=pad_to_multiple_of)
    engine.budget = budget
    group_of = np.asarray(groups)
    batches = engine._micro_batches([np.zeros((n, 1), np.float32) for n in lengths], group_of)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(len(groups)))  # every event once
    units = [list(dict.fromkeys(group_of[batch].tolist())) for batch in batches]
    assert sorted(g for unit in units for g in unit) == sorted(set(groups))  # each group in one batch

    def size(unit: list[int]) -> tuple[int, int]:
        members = [i for i, g in enumerate(groups) if g in unit]
        return len(members), max(lengths[i] for i in members)

    longest_first = [size([g])[1] for unit in units for g in unit]
    assert longest_first == sorted(longest_first)  # groups in order of their longest event
    for unit in units:
        assert len(unit) == 1 or budget.fits(*size(unit))  # a batch of several groups fits the budget
    for unit, after in zip(units, units[1:], strict=False):
        assert not budget.fits(*size([*unit, after[0]]))  # a batch closes only when the next group does not fit
