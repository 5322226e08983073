"""Scoring events with a frozen model, by hand (no Kafka)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from streamtrain.events import NO_LABEL
from streamtrain.model.normalization import RunningNorm
from streamtrain.quality.scoring import score_events

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/unit/quality: the shared quality fixtures
from quality_fixtures import ForecastsZero  # noqa: E402


def test_scores_of_a_frozen_model_by_hand() -> None:
    norm = RunningNorm.from_public([0.0], [2.0])
    scores = score_events(ForecastsZero(2), norm, [np.array([[1.0], [2.0], [4.0]]), np.array([[3.0]])], [1, NO_LABEL])
    # Event 0: targets 2 and 4, forecast 0 (data units): ((0-2)/2)^2 + ((0-4)/2)^2 = 1 + 4.
    # Last value: ((1-2)/2)^2 + ((2-4)/2)^2 = 0.25 + 1. Event 1 has no step to forecast.
    assert scores.steps.tolist() == [2, 0]
    assert scores.sse.tolist() == pytest.approx([5.0, 0.0])
    assert scores.naive_sse.tolist() == pytest.approx([1.25, 0.0])
    assert scores.log_loss[0] == pytest.approx(-math.log(3 / 4))  # labelled class 1 with p = 3/4
    assert scores.correct[0] == 1.0 and math.isnan(scores.log_loss[1]) and math.isnan(scores.correct[1])
