"""Window snapshots and event batches for the data-pipeline tests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from streamtrain.events import NO_LABEL, EventBatch
from streamtrain.window.snapshot import WindowSnapshot


def lognormal_lengths(n: int, seed: int = 0, median: float = 48.0, sigma: float = 0.8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 4, 512).astype(np.int64)


def _columns(lengths: np.ndarray, channels: int, seed: int, first_id: int) -> dict[str, np.ndarray]:
    """Item columns; ``ts`` is unique per item (first_id + i), so it identifies the item in a Batch."""
    rng = np.random.default_rng(seed)
    n = lengths.size
    labels = rng.integers(-1, 3, n).astype(np.int64)
    labels[labels < 0] = NO_LABEL
    return {
        "values": rng.standard_normal((int(lengths.sum()), channels)).astype(np.float32),
        "ts": 1.7e9 + first_id + np.arange(n, dtype=np.float64),
        "labels": labels,
        "sensor_ids": np.array([f"s{i % 7}" for i in range(n)], dtype=object),
        "partitions": np.zeros(n, np.int32),
        "offsets": first_id + np.arange(n, dtype=np.int64),
    }


@pytest.fixture
def make_snapshot() -> Callable[..., WindowSnapshot]:
    def make(
        lengths: np.ndarray, channels: int = 1, seed: int = 0, version: int = 1, first_id: int = 0
    ) -> WindowSnapshot:
        lengths = np.asarray(lengths, dtype=np.int64)
        columns = _columns(lengths, channels, seed, first_id)
        starts = np.zeros(lengths.size, np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        return WindowSnapshot(
            flat_values=columns.pop("values"),
            starts=starts,
            lengths=lengths,
            keys=np.random.default_rng(seed + 1).random(lengths.size),
            version=version,
            taken_at=0.0,
            **columns,
        )

    return make


@pytest.fixture
def make_event_batch() -> Callable[..., EventBatch]:
    def make(lengths: np.ndarray, channels: int = 1, seed: int = 0, first_id: int = 0) -> EventBatch:
        lengths = np.asarray(lengths, dtype=np.int64)
        return EventBatch(lengths=lengths, **_columns(lengths, channels, seed, first_id))

    return make


@pytest.fixture
def lognormal() -> Callable[..., np.ndarray]:
    """Lengths of the benchmark mix: lognormal, median 48, sigma 0.8, clipped to 4..512."""
    return lognormal_lengths
