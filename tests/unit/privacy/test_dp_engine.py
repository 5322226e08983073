"""The DP-SGD engine: public clock, noise-only steps, public divisor, ε, aggregates, checkpoints."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch
from scipy import stats

from streamtrain.data.collate import collate
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.model.network import SensorModel
from streamtrain.privacy import DPConfig, DPConfigError, DPEngine, DPStepReport, PerSampleGradients
from streamtrain.privacy.noise import GRID

BASE = dict(noise_multiplier=1.0, clip_norm=0.5, q0=0.2, eligible_steps=6, admit_per_step=8,
            step_rate_hz=10.0, delta=1e-6, target_epsilon=30.0, expected_units=1e3)  # fmt: skip


def make_engine(report_every_steps: int = 4, **overrides: float) -> DPEngine:
    torch.manual_seed(0)
    model = SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return DPEngine(model, optimizer, DPConfig(**{**BASE, **overrides}), 256, report_every_steps=report_every_steps)


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
def test_a_record_whose_computation_raises_counts_as_zero_and_the_others_still_count(unit: str) -> None:
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
    totals = engine.noisy_step(values, labels, groups)
    engine.record_fault = None
    kept = [i for i in range(6) if i != poison and not (unit == "sensor" and i == 3)]
    reference = engine.noisy_step([values[i] for i in kept], labels[kept], None if groups is None else groups[kept])
    assert totals.failed_records == 1 and totals.sampled_sequences == len(kept) == reference.sampled_sequences
    assert sum(int(total.abs().sum()) for total in captured.sums[0].values()) > 0
    for name, total in captured.sums[0].items():
        # computed alone instead of in one padded micro-batch: each vector may round one grid unit apart
        assert (total - captured.sums[1][name]).abs().max() <= len(kept), name
