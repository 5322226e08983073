"""Poisson sampling with a public recency schedule: each eligible record independently.

An eligible record of age j is included with probability q_j (``DPConfig.sampling_schedule``),
independently of every other record, with bits from the OS CSPRNG. A record is one event,
or (sensor unit) one sensor's group, whose events are included or left out together.
Independent inclusion is what the Poisson-subsampled Gaussian accountant assumes; the batch
size is random and is never used to scale anything.
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
            raise ValueError(
                f"PoissonSampler: ages must be in [0, {self.schedule.size}), got {ages.min()}..{ages.max()}"
            )
        return np.flatnonzero(self.randomness.bernoulli(self.schedule[ages]))

    def sample_records(self, ages: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Indices of the included events when whole records are sampled: ``records[i]`` is
        event i's record id; every event of a record has the record's age."""
        records = np.asarray(records, dtype=np.int64)
        if records.size == 0:
            return np.zeros(0, dtype=np.int64)
        ids, first = np.unique(records, return_index=True)
        chosen = ids[self.sample(np.asarray(ages, dtype=np.int64)[first])]
        return np.flatnonzero(np.isin(records, chosen))
