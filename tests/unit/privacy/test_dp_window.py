"""DP window, public clock and Poisson sampling: caps, eligibility, rates within binomial bounds."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from streamtrain.data.randomness import CryptoRandomness, SeededRandomness
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.privacy.config import DPConfig
from streamtrain.privacy.sampling import PoissonSampler
from streamtrain.privacy.window import DPClock, DPWindow

Z = 5.0  # two-sided binomial bound; with fixed seeds the outcome is deterministic anyway


def events(n: int, start: int = 0) -> list[SensorEvent]:
    """Event i carries the value i (so admission can be traced) and label i % 3."""
    return [SensorEvent("s", 0.0, np.full((1 + i % 4, 1), float(i), np.float32), (i) % 3) for i in range(start, start + n)]


def ids(values: list[np.ndarray]) -> list[int]:
    return [int(v[0, 0]) for v in values]


def within_binomial(successes: int, trials: int, p: float) -> bool:
    sd = np.sqrt(trials * p * (1 - p))
    return abs(successes - trials * p) <= Z * sd


def test_clock_numbers_steps_by_time_only() -> None:
    clock = DPClock(step_rate_hz=2.0)
    assert clock.due_steps(100.0) == 0  # anchored at the first reading
    assert clock.arrival_step(100.2) == 1
    assert clock.due_steps(100.49) == 0 and clock.due_steps(100.5) == 1 and clock.due_steps(101.6) == 3
    clock.steps_done = 3
    assert clock.arrival_step(101.6) == 4  # step 3 is done: arrivals go to the next one
    assert clock.next_due_at(101.6) == pytest.approx(102.0)
    restored = DPClock(2.0)
    restored.load_state_dict(clock.state_dict())
    assert restored.due_steps(5000.0) == 0  # re-anchored: no catch-up burst after downtime
    assert restored.due_steps(5000.5) == 1 and restored.steps_done == 3


def test_admission_caps_at_r_and_admits_all_below() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=5, randomness=SeededRandomness(0))
    window.admit(events(3), step=1)
    window.close_step(1)
    assert sorted(ids(window.eligible().values)) == [0, 1, 2]
    window.admit(events(4, 100), step=2)
    window.admit(events(40, 200), step=2)  # two poll batches for the same step
    window.close_step(2)
    eligible = window.eligible()
    assert len(eligible) == 3 + 5
    assert window.arrived_total == 47 and window.admitted_total == 8
    # values and labels stay paired through the reservoir
    for value, label in zip(ids(eligible.values), eligible.labels.tolist(), strict=True):
        assert label == value % 3


def test_admission_is_uniform_over_arrivals_within_binomial_bounds() -> None:
    trials, arrivals, cap = 2000, 12, 4
    counts = np.zeros(arrivals, dtype=np.int64)
    randomness = SeededRandomness(1)
    for _ in range(trials):
        window = DPWindow(eligible_steps=1, admit_per_step=cap, randomness=randomness)
        window.admit(events(5), step=1)  # arrivals split over two admit calls
        window.admit(events(7, 5), step=1)
        window.close_step(1)
        admitted = ids(window.eligible().values)
        assert len(admitted) == cap
        counts[admitted] += 1
    for count in counts:  # every arrival, early or late, is admitted with probability R / n
        assert within_binomial(int(count), trials, cap / arrivals), counts


def test_event_is_eligible_for_exactly_k_steps_then_removed() -> None:
    k = 4
    window = DPWindow(eligible_steps=k, admit_per_step=10, randomness=SeededRandomness(2))
    window.admit(events(2), step=1)
    seen = {}
    for step in range(1, 9):
        if step == 3:
            window.admit(events(1, 50), step=3)
        window.close_step(step)
        eligible = window.eligible()
        for value, age in zip(ids(eligible.values), eligible.ages.tolist(), strict=True):
            seen.setdefault(value, []).append((step, age))
        assert len(window) <= 10 * k
    assert seen[0] == [(s, s - 1) for s in range(1, 5)]
    assert seen[50] == [(s, s - 3) for s in range(3, 7)]
    assert window.expired_total == 3 and len(window) == 0
    assert window.steps_eligible_so_far() == k
    with pytest.raises(ValueError, match="in order"):
        window.close_step(20)


def test_late_arrival_goes_to_the_next_open_step() -> None:
    window = DPWindow(eligible_steps=2, admit_per_step=10, randomness=SeededRandomness(3))
    window.close_step(1)
    assert window.admit(events(1), step=1) == 2


def test_window_state_dict_round_trip() -> None:
    window = DPWindow(eligible_steps=3, admit_per_step=4, randomness=SeededRandomness(4))
    window.admit(EventBatch.from_events(events(6)), step=1, next_offsets={0: 6})
    window.close_step(1)
    window.admit(events(2, 10), step=2)
    window.admit(events(3, 20), step=3)  # pending beyond the next step
    window.close_step(2)
    clone = DPWindow(eligible_steps=3, admit_per_step=4, randomness=SeededRandomness(5))
    clone.load_state_dict(window.state_dict())
    before, after = window.eligible(), clone.eligible()
    assert ids(before.values) == ids(after.values)
    assert before.labels.tolist() == after.labels.tolist() and before.ages.tolist() == after.ages.tolist()
    assert clone.next_offsets == {0: 6} and clone.arrived_total == 11
    window.close_step(3)
    clone.close_step(3)
    assert sorted(ids(window.eligible().values)) == sorted(ids(clone.eligible().values))
    with pytest.raises(ValueError, match="K="):
        DPWindow(eligible_steps=5, admit_per_step=4, randomness=SeededRandomness(0)).load_state_dict(window.state_dict())


def test_poisson_inclusion_rates_per_age_within_binomial_bounds() -> None:
    config = DPConfig(q0=0.3, half_life_steps=2.0, eligible_steps=6)
    schedule = config.sampling_schedule()
    sampler = PoissonSampler(schedule, SeededRandomness(6))
    per_age, rounds = 500, 40
    ages = np.repeat(np.arange(6), per_age)
    included = np.zeros(6, dtype=np.int64)
    sizes = []
    for _ in range(rounds):
        chosen = sampler.sample(ages)
        sizes.append(chosen.size)
        included += np.bincount(ages[chosen], minlength=6)
    for age in range(6):
        assert within_binomial(int(included[age]), per_age * rounds, float(schedule[age]))
    # Independent inclusion: the batch size is a sum of Bernoullis, its variance sum p(1-p).
    expected_var = per_age * float((schedule * (1 - schedule)).sum())
    chi2 = (rounds - 1) * np.var(sizes, ddof=1) / expected_var
    assert stats.chi2.ppf(1e-6, rounds - 1) <= chi2 <= stats.chi2.ppf(1 - 1e-6, rounds - 1)


def test_poisson_sampler_uses_the_os_csprng_by_default_and_checks_ages() -> None:
    sampler = PoissonSampler(np.array([1.0, 0.0]))
    assert isinstance(sampler.randomness, CryptoRandomness)
    assert sampler.sample(np.array([0, 1, 0, 1])).tolist() == [0, 2]
    with pytest.raises(ValueError, match="ages"):
        sampler.sample(np.array([2]))
