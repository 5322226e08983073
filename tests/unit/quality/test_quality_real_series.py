"""Forecasts on real sensor series that River ships inside its wheel (nothing downloaded).

The setting of the issue that found the problem: train on sliding windows of 24 readings
over the first 70% of a series, then forecast the rest one step ahead and compare with
the last value, channel by channel. The occupancy room's humidity and CO2 leave the
training range in the last 30%.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_TESTS_UNIT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS_UNIT.parents[1] / "bench"))  # the real-series loaders
sys.path.insert(0, str(_TESTS_UNIT))  # broken_models, which the network tests import
sys.path.insert(0, str(_TESTS_UNIT / "model"))  # the network tests' training recipe

from _series import SERIES, sliding_windows  # noqa: E402
from test_model_network import fit_on_windows, one_step_ratios  # noqa: E402

from streamtrain.model.network import SensorModel  # noqa: E402


def ratios(name: str, seed: int, steps: int = 200) -> np.ndarray:
    series = SERIES[name]()
    values = series.values
    cut = int(0.7 * len(values))
    torch.manual_seed(seed)
    model = SensorModel(values.shape[1], d_model=64, n_heads=4, n_layers=2, max_len=64)
    norm = fit_on_windows(model, sliding_windows(values, 24, cut), steps=steps, seed=seed)
    return one_step_ratios(model, norm, values, start=cut, length=24)


def test_occupancy_levels_outside_the_training_range() -> None:
    series = SERIES["occupancy"]()
    cut = int(0.7 * len(series.values))
    train, future = series.values[:cut], series.values[cut:]
    assert (future[:, 1].max() > train[:, 1].max()) and (future[:, 3].max() > train[:, 3].max())  # humidity, CO2
    ratio = ratios("occupancy", seed=0)
    # temperature, humidity, CO2: below the last value's error. Light switches on and off
    # between readings 16 minutes apart (a step no forecaster sees coming): the model stays
    # within 10% of the last value there, short of the 1.0x target (see docs/quality.md).
    assert (ratio[[0, 1, 3]] <= 1.0).all(), ratio
    assert ratio[2] <= 1.1, ratio


@pytest.mark.parametrize("seed", [0, 1])
def test_water_flow_beats_the_last_value_by_a_wide_margin(seed: int) -> None:
    assert ratios("water_flow", seed)[0] <= 0.7
