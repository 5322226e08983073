"""The sums behind the prequential averages: weighted adds, fading, and ratios with nothing under them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from streamtrain.quality.averages import Averages
from streamtrain.quality.scoring import EventScores

NAN = math.nan


def scores(steps: list[int], sse: list[float], naive: list[float], log_loss: list[float], correct: list[float]):
    return EventScores(
        steps=np.array(steps, dtype=np.int64), sse=np.array(sse), naive_sse=np.array(naive),
        log_loss=np.array(log_loss), correct=np.array(correct),
    )  # fmt: skip


def test_nothing_added_is_no_ratio_at_all() -> None:
    assert Averages().report() == {
        "prequential_mse": None, "naive_mse": None, "skill": None, "log_loss": None, "accuracy": None,
    }  # fmt: skip


def test_totals_add_every_event_once_and_labels_only_where_there_is_one() -> None:
    totals = Averages()
    totals.add(scores([2, 3, 0], [1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [0.5, NAN, 1.5], [1.0, NAN, 0.0]))
    totals.add(scores([1], [0.5], [0.5], [0.25], [1.0]))
    assert (totals.steps, totals.sse, totals.naive_sse) == (6.0, 3.5, 6.5)
    assert (totals.labelled, totals.log_loss, totals.correct) == (3.0, 2.25, 2.0)
    assert totals.report() == {
        "prequential_mse": 3.5 / 6, "naive_mse": 6.5 / 6, "skill": pytest.approx(1 - 3.5 / 6.5),
        "log_loss": 0.75, "accuracy": 2 / 3,
    }  # fmt: skip


def test_weights_scale_each_event_and_its_label() -> None:
    faded = Averages()
    faded.add(scores([2, 2], [1.0, 3.0], [2.0, 2.0], [0.4, 0.8], [1.0, 0.0]), decay=np.array([0.5, 0.25]))
    assert (faded.steps, faded.sse, faded.naive_sse) == (1.5, 1.25, 1.5)
    assert (faded.labelled, faded.log_loss, faded.correct) == (0.75, 0.4, 0.5)
    report = faded.report()
    assert report["log_loss"] == pytest.approx(0.4 / 0.75) and report["accuracy"] == pytest.approx(0.5 / 0.75)
    faded.scale(0.5)
    assert (faded.steps, faded.labelled, faded.log_loss, faded.correct) == (0.75, 0.375, 0.2, 0.25)
    assert faded.report()["log_loss"] == pytest.approx(0.4 / 0.75)  # fading leaves the ratios


def test_a_fraction_of_a_label_is_still_a_label() -> None:
    little = Averages()
    little.add(scores([1], [1.0], [1.0], [0.3], [1.0]), decay=0.1)
    assert little.report()["log_loss"] == pytest.approx(0.3) and little.report()["accuracy"] == pytest.approx(1.0)


def test_no_naive_error_is_no_skill() -> None:
    flat = Averages()
    flat.add(scores([3], [0.0], [0.0], [NAN], [NAN]))
    assert flat.report()["skill"] is None and flat.report()["prequential_mse"] == 0.0
