"""A real Service for the quality tests (ingest not started, no Kafka), fed and trained by hand."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from streamtrain.config import load_settings
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.runtime.service import Service

ADMIN_TOKEN = "quality-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def oscillations(rng: np.random.Generator, n: int, now: float) -> EventBatch:
    """Learnable events: noisy sinusoids of period 8 at random levels."""
    items = []
    for i in range(n):
        t = np.arange(int(rng.integers(12, 32)))
        x = rng.normal(0, 3) + np.sin(2 * np.pi * t / 8 + rng.uniform(0, 6.3)) + 0.05 * rng.normal(size=t.size)
        items.append(SensorEvent(f"s{i % 5}", now - n + i, x[:, None].astype(np.float32)))
    return EventBatch.from_events(items)


def build_service(tmp: Path, **overrides: Any) -> Service:
    values = {
        "kafka_bootstrap": "127.0.0.1:9",  # never contacted: ingest is not started
        "checkpoint_dir": tmp,
        "d_model": 16, "n_heads": 2, "n_layers": 1, "token_budget": 512, "max_len": 64,
        "admin_token": ADMIN_TOKEN, "min_window_items": 8, "warmup_steps": 1, "learning_rate": 3e-3,
        "quality_max_events_per_s": 1e6, "publish_interval_s": 3600.0,
        **overrides,
    }  # fmt: skip
    return Service(load_settings(**values))


def trained_service(tmp: Path, **overrides: Any) -> Service:
    """A service whose holdout judges (a quarter held out, 16 events enough), trained 30 steps on
    400 oscillations and published once."""
    svc = build_service(tmp, holdout_share=0.25, holdout_min_events=16, **overrides)
    feed(svc, oscillations(np.random.default_rng(0), 400, time.time()))
    train(svc, 30)
    svc.trainer.publish()
    return svc


def feed(service: Service, batch: EventBatch) -> None:
    """What ingest does with a poll batch: the quality hook first, then the window."""
    to_window = service.ingest.before_insert(batch) if service.ingest.before_insert else batch
    if len(to_window):
        service.window.insert_batch(to_window)


def train(service: Service, steps: int) -> None:
    trainer = service.trainer
    for _, batch in zip(range(steps), iter(trainer.dataset)):
        trainer.train_step(batch)
