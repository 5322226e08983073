"""Poisson sampling: inclusion rates per age within binomial bounds, records taken whole."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from streamtrain.data.randomness import CryptoRandomness, SeededRandomness
from streamtrain.privacy.config import DPConfig
from streamtrain.privacy.sampling import PoissonSampler

Z = 5.0  # two-sided binomial bound; with fixed seeds the outcome is deterministic anyway


def within_binomial(successes: int, trials: int, p: float) -> bool:
    sd = np.sqrt(trials * p * (1 - p))
    return abs(successes - trials * p) <= Z * sd


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


def test_record_sampling_takes_a_group_whole() -> None:
    sampler = PoissonSampler(np.array([0.5]), SeededRandomness(16))
    records = np.array([0, 0, 1, 1, 1, 2])
    seen = set()
    for _ in range(50):
        chosen = sampler.sample_records(np.zeros(6, np.int64), records)
        groups = set(records[chosen].tolist())
        assert chosen.tolist() == np.flatnonzero(np.isin(records, list(groups))).tolist()
        seen |= {frozenset(groups)}
    assert len(seen) > 4


def test_the_schedule_halves_every_half_life_and_is_flat_without_one() -> None:
    decaying = DPConfig(q0=0.4, half_life_steps=2.0, eligible_steps=5).sampling_schedule()
    np.testing.assert_allclose(decaying, [0.4, 0.4 / np.sqrt(2), 0.2, 0.2 / np.sqrt(2), 0.1], rtol=1e-15)
    assert DPConfig(q0=0.4, half_life_steps=math.inf, eligible_steps=3).sampling_schedule().tolist() == [0.4] * 3


def test_dp_settings_are_read_from_the_services_settings() -> None:
    from streamtrain.config import Settings

    settings = Settings(dp_noise_multiplier=2.5, dp_q0=0.1, dp_half_life_steps=math.inf, dp_unit="sensor",
                        dp_norm_mean=(1.0,), dp_norm_std=(2.0,))  # fmt: skip
    config = DPConfig.from_settings(settings)
    assert (config.noise_multiplier, config.q0, config.half_life_steps, config.unit) == (2.5, 0.1, math.inf, "sensor")
    assert config.norm_mean == (1.0,) and config.norm_std == (2.0,) and config.expected_batch_size is None
    assert config.eligible_steps == Settings().dp_eligible_steps  # the rest: the service's defaults


@pytest.mark.parametrize("schedule", [[], [0.5, 1.5], [-0.1, 0.5], [math.nan]])
def test_a_schedule_outside_the_probabilities_is_refused(schedule: list[float]) -> None:
    with pytest.raises(ValueError) as raised:
        PoissonSampler(np.asarray(schedule, dtype=np.float64))
    assert str(raised.value) == "PoissonSampler: the schedule needs K >= 1 probabilities in [0, 1]"


def test_a_schedule_of_any_shape_is_read_as_its_k_probabilities() -> None:
    assert PoissonSampler(np.array([[1.0, 0.0]])).sample(np.array([0, 1, 0])).tolist() == [0, 2]


def test_the_sampler_draws_from_the_randomness_it_is_given() -> None:
    draws = [
        PoissonSampler(np.array([0.5]), SeededRandomness(seed)).sample(np.zeros(64, np.int64)) for seed in (3, 3, 4)
    ]
    assert draws[0].tolist() == draws[1].tolist() != draws[2].tolist()


def test_record_sampling_of_one_record_and_of_none() -> None:
    sampler = PoissonSampler(np.array([1.0]))
    assert sampler.sample_records(np.zeros(1, np.int64), np.array([7])).tolist() == [0]
    nothing = sampler.sample_records(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert nothing.dtype == np.int64 and nothing.size == 0  # it indexes the labels of an empty window
