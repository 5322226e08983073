"""A small trainer over a window of random walks, for tests of the training step's machinery."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from streamtrain.config import load_settings
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.metrics import Metrics
from streamtrain.training.protocol import LoopFactory
from streamtrain.training.trainer import Trainer
from streamtrain.window.reservoir import RecencyWindow


def make_small_trainer(
    events: int = 96, seed: int = 0, *, loop: LoopFactory | None = None, **overrides: Any
) -> Trainer:
    """A one-layer model (d_model 16) over ``events`` walks of 4-31 readings from 4 sensors
    (``loop``: built with a lockstep loop, as a scaled-out rank is)."""
    settings = load_settings(
        **{"d_model": 16, "n_heads": 2, "n_layers": 1, "max_len": 32, "token_budget": 512, "min_window_items": 8,
           "warmup_steps": 1, "learning_rate": 0.01, "publish_interval_s": 0.05, "seed": seed,
           "checkpoint_dir": "unused", **overrides},
    )  # fmt: skip
    window = RecencyWindow(1000, math.inf, channels=1, rng=np.random.default_rng(seed))
    window.insert_batch(random_walks(events, seed, time.time()))
    return Trainer(settings, window, Metrics(), loop=loop)


def random_walks(count: int, seed: int, newest_ts: float) -> EventBatch:
    """``count`` random walks of 4-31 readings from 4 sensors, one a second back from ``newest_ts``."""
    rng = np.random.default_rng(seed)
    return EventBatch.from_events(
        [
            SensorEvent(
                f"s{i % 4}", newest_ts - i, np.cumsum(rng.standard_normal((int(n), 1)), axis=0).astype(np.float32)
            )
            for i, n in enumerate(rng.integers(4, 32, count))
        ]
    )
