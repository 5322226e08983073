"""Poisson sampling with a public recency schedule: each eligible event independently.

An eligible event of age j is included with probability q_j (``DPConfig.sampling_schedule``),
independently of every other event, with bits from the OS CSPRNG. Independent inclusion
is what the Poisson-subsampled Gaussian accountant assumes; the batch size is random and
is never used to scale anything.
"""

from __future__ import annotations

import numpy as np

from streamtrain.data.randomness import CryptoRandomness, Randomness


class PoissonSampler:
    """Include each eligible event with probability ``schedule[age]``."""

    def __init__(self, schedule: np.ndarray, randomness: Randomness | None = None) -> None:
        schedule = np.asarray(schedule, dtype=np.float64).reshape(-1)
        if schedule.size == 0 or not np.all((schedule >= 0) & (schedule <= 1)):
            raise ValueError("PoissonSampler: the schedule needs K >= 1 probabilities in [0, 1]")
        self.schedule = schedule
        self.randomness = randomness if randomness is not None else CryptoRandomness()

    def sample(self, ages: np.ndarray) -> np.ndarray:
        """Indices of the included events (int64, ascending) for events of the given ages."""
        ages = np.asarray(ages, dtype=np.int64)
        if ages.size and (ages.min() < 0 or ages.max() >= self.schedule.size):
            raise ValueError(f"PoissonSampler: ages must be in [0, {self.schedule.size}), got {ages.min()}..{ages.max()}")
        return np.flatnonzero(self.randomness.bernoulli(self.schedule[ages]))
