"""Scoring events with a frozen model, by hand (no Kafka)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from streamtrain.events import NO_LABEL
from streamtrain.model.network import ModelOutput
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


class HalfwayWithLogits(torch.nn.Module):
    """Forecasts half the normalized reading (data units: halfway from the mean to the reading),
    logits peaking at the class nearest the event's first normalized reading; records its inputs."""

    def __init__(self, n_classes: int = 4) -> None:
        super().__init__()
        self.n_classes = n_classes
        self.inputs: list[torch.Tensor] = []

    def forward(self, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        self.inputs.append(x_norm.clone())
        classes = torch.arange(self.n_classes, dtype=x_norm.dtype)
        logits = -((classes[None, :] - x_norm[:, :1, 0]) ** 2)
        return ModelOutput(forecast=0.5 * x_norm, logits=logits)


def expected_scores(
    values: list[np.ndarray], labels: list[int], mean: np.ndarray, std: np.ndarray, n_classes: int = 4
) -> tuple[list[int], list[float], list[float], list[float], list[float]]:
    """The same scores event by event, by hand: no batch, no padding."""
    steps, sse, naive, log_loss, correct = [], [], [], [], []
    for event, label in zip(values, labels, strict=True):
        forecast = mean + 0.5 * (event - mean)
        steps.append(len(event) - 1)
        sse.append(float((((forecast[:-1] - event[1:]) / std) ** 2).mean(-1).sum()))
        naive.append(float((((event[:-1] - event[1:]) / std) ** 2).mean(-1).sum()))
        first = (event[0, 0] - mean[0]) / std[0]
        logits = -((np.arange(n_classes) - first) ** 2)
        log_probs = logits - np.log(np.exp(logits).sum())
        log_loss.append(math.nan if label == NO_LABEL else float(-log_probs[label]))
        correct.append(math.nan if label == NO_LABEL else float(np.argmax(logits) == label))
    return steps, sse, naive, log_loss, correct


def test_events_scored_together_score_as_each_alone_across_channels_and_padding() -> None:
    """Mixed lengths in one batch, two channels of different scale, labels 0 and unlabelled:
    each event's scores are its own, the padding scores nothing and the model never sees it."""
    rng = np.random.default_rng(3)
    mean, std = np.array([1.0, -2.0]), np.array([2.0, 0.5])
    values = [rng.normal(mean, std, size=(length, 2)) for length in (8, 7, 6, 8)]
    values[1][0, 0] = mean[0]  # first reading at the mean: class 0 on top
    labels = [2, 0, NO_LABEL, 3]
    model = HalfwayWithLogits()
    scores = score_events(model, RunningNorm.from_public(mean.tolist(), std.tolist()), values, labels)
    assert len(model.inputs) == 1 and model.inputs[0].shape[0] == 4  # one padded batch
    for row, length in zip(model.inputs[0], (8, 8, 7, 6), strict=True):  # longest first
        assert torch.all(row[length:] == 0)  # the padding reaches the model as zeros
    steps, sse, naive, log_loss, correct = expected_scores(values, labels, mean, std)
    assert scores.steps.dtype == np.int64 and scores.steps.tolist() == steps
    np.testing.assert_allclose(scores.sse, sse, rtol=1e-6)
    np.testing.assert_allclose(scores.naive_sse, naive, rtol=1e-6)  # float32 unit std
    np.testing.assert_allclose(scores.log_loss, log_loss, rtol=1e-6)
    np.testing.assert_array_equal(scores.correct, correct)
    assert scores.correct[1] == 1.0 and math.isnan(scores.correct[2])


def test_without_labels_a_classifier_scores_no_log_loss() -> None:
    values = [np.array([[1.0], [2.0], [3.0]]), np.array([[0.0], [1.0], [0.5]])]
    scores = score_events(HalfwayWithLogits(), RunningNorm.from_public([0.0], [1.0]), values)
    assert scores.steps.tolist() == [2, 2]
    assert np.isnan(scores.log_loss).all() and np.isnan(scores.correct).all()


def test_scores_in_another_models_units() -> None:
    """``units`` sets the scale of the errors, not the model's own normalization."""
    values = [np.array([[1.0], [3.0], [2.0]])]
    own = RunningNorm.from_public([0.0], [1.0])
    scores = score_events(HalfwayWithLogits(), own, values, units=RunningNorm.from_public([5.0], [4.0]))
    # forecasts 0.5 and 1.5 for targets 3 and 2, in units of std 4: (2.5² + 0.5²) / 16
    assert scores.sse[0] == pytest.approx((2.5**2 + 0.5**2) / 16)
    assert scores.naive_sse[0] == pytest.approx((2.0**2 + 1.0**2) / 16)


def test_no_events_score_nothing_and_leave_the_model_alone() -> None:
    model = HalfwayWithLogits()
    scores = score_events(model, RunningNorm.from_public([0.0], [1.0]), [])
    assert scores.steps.shape == (0,) and scores.sse.shape == (0,) and model.inputs == []


def test_labels_of_any_integer_type_score_alike() -> None:
    """An int32 or uint8 label column (a caller's own) is read as the class indices it holds."""
    values = [np.array([[1.0], [2.0], [3.0]]), np.array([[0.0], [1.0], [0.5]])]
    norm = RunningNorm.from_public([0.0], [1.0])
    reference = score_events(HalfwayWithLogits(), norm, values, [1, 0])
    for dtype in (np.int32, np.uint8):
        scores = score_events(HalfwayWithLogits(), norm, values, np.array([1, 0], dtype=dtype))
        np.testing.assert_array_equal(scores.log_loss, reference.log_loss)
        np.testing.assert_array_equal(scores.correct, reference.correct)
