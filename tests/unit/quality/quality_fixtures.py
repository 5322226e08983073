"""The frozen models and event batches the quality tests share."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from streamtrain.events import NO_LABEL, EventBatch, SensorEvent
from streamtrain.metrics import Metrics
from streamtrain.model.network import ModelOutput
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.config import QualityConfig
from streamtrain.quality.monitor import QualityMonitor


class ForecastsZero(nn.Module):
    """A frozen model whose forecast is 0 in normalized units (the norm's mean) and whose
    logits always favour class 1."""

    def __init__(self, n_classes: int = 0) -> None:
        super().__init__()
        self.n_classes = n_classes

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        logits = None
        if self.n_classes:
            logits = torch.zeros(x_norm.shape[0], self.n_classes)
            logits[:, 1] = math.log(3.0)  # p = 3/(3 + n - 1)
        return ModelOutput(forecast=torch.zeros_like(x_norm), logits=logits)


@dataclass
class Frozen:
    model: nn.Module
    norm: RunningNorm
    version: int = 1

    @property
    def served(self) -> nn.Module:
        return self.model


def events(*series: list[float], labels: list[int] | None = None) -> EventBatch:
    items = [
        SensorEvent(
            f"s{i}", 1000.0 + i, np.asarray(v, dtype=np.float32)[:, None], NO_LABEL if labels is None else labels[i]
        )
        for i, v in enumerate(series)
    ]
    return EventBatch.from_events(items, channels=1)


def monitor(serving: Frozen | None, **overrides: object) -> QualityMonitor:
    config = QualityConfig(**{"max_events_per_s": 1e9, "drift_detector": "off", **overrides})  # type: ignore[arg-type]
    return QualityMonitor(config, Metrics(), lambda: serving)
