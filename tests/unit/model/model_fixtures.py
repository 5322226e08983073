"""Small models and ragged batches shared by the model tests.

``small_model`` computes something: its random body and random head both reach the forecast
(an untrained SensorModel's zero head would make its forecast the last reading whatever the
body does), so the invariant checks run on it mean something.
"""

from __future__ import annotations

import numpy as np
import torch
from broken_models import computing_model

from streamtrain.data.collate import collate
from streamtrain.model.network import SensorModel


def pad_batch(items: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate(items)
    return batch.values, batch.mask


def small_model(channels: int = 2, n_classes: int = 3, seed: int = 0) -> SensorModel:
    """A model that computes something: random body, random non-zero forecast head."""
    return computing_model(channels, n_classes=n_classes, seed=seed, d_model=32, n_heads=4, n_layers=2, max_len=64)


def untrained_model(channels: int = 2, n_classes: int = 3, seed: int = 0) -> SensorModel:
    """A model as SensorModel builds it: the zero head makes its forecast the last reading."""
    torch.manual_seed(seed)
    return SensorModel(channels, n_classes=n_classes, d_model=32, n_heads=4, n_layers=2, max_len=64).eval()


def ragged(rng: np.random.Generator, n: int, channels: int, max_len: int = 40) -> list[np.ndarray]:
    return [rng.normal(size=(int(rng.integers(1, max_len)), channels)).astype(np.float32) for _ in range(n)]
