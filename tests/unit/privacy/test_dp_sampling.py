"""Poisson sampling: inclusion rates per age within binomial bounds, records taken whole."""

from __future__ import annotations

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
