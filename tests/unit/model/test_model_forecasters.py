"""The linear forecaster and the served module: each fit against numpy's least squares on the
regression written out row by row, GCV against the explicit hat matrix, the unit-root
statistic against statsmodels' ADF, the choice on processes whose best forecast is known,
the module against the regression it was fitted as, and the no-shuffle invariants of every
served kind."""

from __future__ import annotations

import math
import re

import numpy as np
import orjson
import pytest
import torch

from streamtrain.data.collate import collate
from streamtrain.model import forecasters
from streamtrain.model.forecasters import (
    ADF_CRITICAL_T,
    LAST_VALUE,
    LINEAR_SHRINK_DF,
    NETWORK,
    SMOOTHING_WEIGHTS,
    Forecaster,
    LagSums,
    LinearForecast,
    ServedModel,
    best_blend,
    choose_linear,
    family_basis,
    family_fit,
    fit_model,
    served_module,
    shrink_factor,
    unit_root_t,
)
from streamtrain.model.network import SensorModel
from streamtrain.tools.sensor_fleet import SensorFleet
from streamtrain.tools.simulation_config import SimulationConfig


def lag_matrix(
    instances: list[np.ndarray], readings: int, channel: int, first: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The regression written out row by row: [1, x[t], ..., x[t-readings+1]] -> x[t+1] - x[t],
    over origins t at position ``first`` or later (positions before 0 repeat the first reading)."""
    rows, targets = [], []
    for x in instances:
        for t in range(first, len(x) - 1):
            lags = [x[max(t - k, 0), channel] for k in range(readings)]
            rows.append([1.0, *lags])
            targets.append(x[t + 1, channel] - x[t, channel])
    return np.array(rows), np.array(targets)


def changes_matrix(instances: list[np.ndarray], order: int, channel: int, drift: bool) -> tuple[np.ndarray, np.ndarray]:
    """[1, x[t] - x[t-1], ..., x[t-order+1] - x[t-order]] -> x[t+1] - x[t], every lag real."""
    rows, targets = [], []
    for x in instances:
        for t in range(order, len(x) - 1):
            changes = [x[t - k, channel] - x[t - k - 1, channel] for k in range(order)]
            rows.append([1.0, *changes] if drift else changes)
            targets.append(x[t + 1, channel] - x[t, channel])
    return np.array(rows), np.array(targets)


def ar2_instances(rng: np.random.Generator, n: int, length: int, channels: int = 1) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        x = np.zeros((length, channels))
        x[:2] = rng.normal(size=(2, channels))
        for t in range(2, length):
            x[t] = 1.6 * x[t - 1] - 0.8 * x[t - 2] + 0.1 * rng.normal(size=channels)
        out.append(x.astype(np.float32))
    return out


def walks(rng: np.random.Generator, n: int, length: int) -> list[np.ndarray]:
    return [np.cumsum(rng.normal(size=(length, 1)), axis=0).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("readings", [1, 3, 8])
def test_a_levels_fit_without_penalty_is_numpys_least_squares_on_rows_whose_lags_are_real(readings: int) -> None:
    rng = np.random.default_rng(0)
    instances = ar2_instances(rng, 20, 30, channels=2) + [rng.normal(size=(1, 2)).astype(np.float32)]
    sums = LagSums.of(instances, max_order=8, channels=2)
    for channel in range(2):
        design, target = lag_matrix(instances, readings, channel, first=readings - 1)
        expected = np.linalg.lstsq(design, target, rcond=None)[0]
        model = fit_model(sums, channel, "levels", readings, 0.0)
        assert model is not None
        np.testing.assert_allclose(model.coefficients, expected, rtol=1e-6, atol=1e-9)
    assert sums.total_rows == sum(len(x) - 1 for x in instances)
    assert sums.tail(0, readings - 1)[3] == len(target)


@pytest.mark.parametrize(("order", "drift"), [(1, True), (4, True), (4, False)])
def test_a_changes_fit_is_least_squares_on_the_changes_and_serves_as_levels(order: int, drift: bool) -> None:
    rng = np.random.default_rng(1)
    instances = walks(rng, 15, 30)
    sums = LagSums.of(instances, max_order=8, channels=1)
    model = fit_model(sums, 0, "changes" if drift else "changes_no_drift", order, 0.0)
    assert model is not None
    design, target = changes_matrix(instances, order, 0, drift)
    phi = np.linalg.lstsq(design, target, rcond=None)[0]
    # the levels coefficients forecast exactly what the changes regression does
    levels, _ = lag_matrix(instances, order + 1, 0, first=order)
    np.testing.assert_allclose(levels @ model.coefficients, design @ phi, rtol=1e-6, atol=1e-8)
    assert model.coefficients[1:].sum() == pytest.approx(0.0, abs=1e-9)  # no mean to revert to
    basis, readings = family_basis("changes", order)
    assert readings == order + 1 and basis.shape == (order + 2, order + 1)


def smoothed_matrix(instances: list[np.ndarray], readings: int, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """The exponentially weighted mean of the ``readings`` up to t (the newest weighted ``weight``) less
    ``x[t]`` -> x[t+1] - x[t], every lag real, written out row by row."""
    rows, targets = [], []
    for x in (i.astype(np.float64) for i in instances):
        for t in range(readings - 1, len(x) - 1):
            weights = [weight * (1 - weight) ** k for k in range(readings)]
            smoothed = sum(w * x[t - k, 0] for k, w in enumerate(weights)) / sum(weights)
            rows.append([smoothed - x[t, 0]])
            targets.append(x[t + 1, 0] - x[t, 0])
    return np.array(rows), np.array(targets)


@pytest.mark.parametrize(("order", "weight"), [(1, 0.5), (8, 0.2), (16, 0.05)])
def test_a_smoothed_fit_is_least_squares_on_the_smoothed_change_and_serves_as_levels(order: int, weight: float) -> None:
    rng = np.random.default_rng(4)
    instances = walks(rng, 15, 30)
    sums = LagSums.of(instances, max_order=24, channels=1)
    model = fit_model(sums, 0, "smoothed", order, 0.0, smoothing=weight)
    assert model is not None and model.report()["smoothing"] == weight
    design, target = smoothed_matrix(instances, order + 1, weight)
    beta = np.linalg.lstsq(design, target, rcond=None)[0]
    levels, _ = lag_matrix(instances, order + 1, 0, first=order)
    np.testing.assert_allclose(levels @ model.coefficients, design @ beta, rtol=1e-6, atol=1e-8)
    # a coefficient of one is simple exponential smoothing of the context
    basis, readings = family_basis("smoothed", order, weight)
    ses = weight * (1 - weight) ** np.arange(readings)
    np.testing.assert_allclose(basis[1:, 0] + np.eye(readings)[0], ses / ses.sum())
    assert basis[0, 0] == 0.0  # no drift


def local_level(rng: np.random.Generator, length: int, ratio: float) -> np.ndarray:
    """A level that wanders (steps of variance ``ratio``) under noise of variance 1: its best
    one-step forecast is simple exponential smoothing, with the steady-state Kalman gain."""
    level = np.cumsum(math.sqrt(ratio) * rng.normal(size=length))
    return (level + rng.normal(size=length))[:, None]


def test_a_short_noisy_level_is_forecast_by_the_smoothed_family_closer_to_the_best_forecast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A level under noise (signal-to-noise 0.1), 70 readings as sliding windows of 24, as a short
    yearly series arrives: the best forecast weights the past exponentially (gain 0.27), which 47
    events cannot teach a ridge autoregression on 23 changes. With the smoothed family the choice
    forecasts the next 200 readings closer to the best forecast, seed after seed."""
    ratio = 0.1
    variance = (ratio + math.sqrt(ratio**2 + 4 * ratio)) / 2
    best_mse = variance + 1  # the Kalman filter's one-step error
    with_smoothed, without = [], []
    led = 0
    for seed in range(20):
        x = local_level(np.random.default_rng(seed), 70 + 200, ratio)
        train = [x[i : i + 24].astype(np.float32) for i in range(70 - 23)]
        test = collate([x[i : i + 25].astype(np.float32) for i in range(70 - 24, 270 - 24)])
        errors = []
        for weights in (SMOOTHING_WEIGHTS, ()):
            monkeypatch.setattr(forecasters, "SMOOTHING_WEIGHTS", weights)
            choice = choose_linear(LagSums.of(train, 24, 1), 24, redundancy=24.0)
            assert choice is not None
            forecast = LinearForecast(choice.coefficients)(test.values).double().numpy()[:, -2, 0]
            errors.append(float(np.mean((forecast - test.values.double().numpy()[:, -1, 0]) ** 2)) / best_mse)
            if weights:
                led += any(f.best.family == "smoothed" for f in choice.channels[0].fits)
        with_smoothed.append(errors[0])
        without.append(errors[1])
    assert led >= 15, led  # a smoothed model has the least GCV error (18 of these 20 seeds)
    assert sum(a < b for a, b in zip(with_smoothed, without)) >= 15  # 19 of 20
    assert np.mean(with_smoothed) < np.mean(without) - 0.03, (np.mean(with_smoothed), np.mean(without))
    assert np.mean(with_smoothed) < 1.1  # 1.08x the best forecast's error (the last value: 1.53x)


def test_a_one_parameter_family_is_shrunk_as_one_parameter_and_forecasts_a_noisy_level_better_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short noisy level (100 readings as sliding windows, signal-to-noise 0.05) is mostly led
    by the smoothed family, one coefficient: shrunk by its own fitted df (one) rather than by two
    parameters' worth, its forecasts of the next 200 readings are closer, seed after seed (by
    ~0.3% on average)."""
    shrink_as_fitted = forecasters.shrink_factor

    def shrink_as_two(edge: float, distinct_targets: float, df: float) -> float:
        return shrink_as_fitted(edge, distinct_targets, LINEAR_SHRINK_DF)

    own, two = [], []
    for seed in range(40):
        x = local_level(np.random.default_rng(seed), 100 + 200, 0.05)
        train = [x[i : i + 24].astype(np.float32) for i in range(100 - 23)]
        test = collate([x[i : i + 25].astype(np.float32) for i in range(100 - 24, 300 - 24)])
        for errors, shrink in ((own, shrink_as_fitted), (two, shrink_as_two)):
            monkeypatch.setattr(forecasters, "shrink_factor", shrink)
            choice = choose_linear(LagSums.of(train, 24, 1), 24, redundancy=24.0)
            assert choice is not None
            forecast = LinearForecast(choice.coefficients)(test.values).double().numpy()[:, -2, 0]
            errors.append(float(np.mean((forecast - test.values.double().numpy()[:, -1, 0]) ** 2)))
    better = sum(a < b - 1e-12 for a, b in zip(own, two))
    worse = sum(a > b + 1e-12 for a, b in zip(own, two))
    assert better >= 24 and better > 2 * worse, (better, worse)  # 28 and 9 of these 40 seeds
    assert np.mean(own) < np.mean(two), (np.mean(own), np.mean(two))


def test_sums_add_over_chunks_as_ranks_add_them() -> None:
    rng = np.random.default_rng(2)
    instances = ar2_instances(rng, 12, 20, channels=3)
    whole = LagSums.of(instances, 6, 3)
    parts = [LagSums.of(instances[:5], 6, 3), LagSums.of(instances[5:], 6, 3)]
    added = LagSums.from_array(parts[0].as_array() + parts[1].as_array(), 3, 6)
    np.testing.assert_allclose(added.as_array(), whole.as_array(), rtol=1e-12)
    assert added.instances == 12 and added.mean_length == pytest.approx(20.0)


@pytest.mark.parametrize("positions", [None, 3])
def test_the_module_forecasts_what_the_regression_was_fitted_as(positions: int | None) -> None:
    """One row of coefficients serves every origin; with [C, K, 1 + order], row k serves the
    origin at position k, the last row every later one."""
    rng = np.random.default_rng(3)
    shape = (2, 1 + 5) if positions is None else (2, positions, 1 + 5)
    coefficients = rng.normal(size=shape)
    module = LinearForecast(coefficients)
    instances = [rng.normal(size=(n, 2)).astype(np.float32) for n in (1, 3, 9)]
    batch = collate(instances)
    forecast = module(batch.values * batch.mask[..., None]).double().numpy()
    for b, x in enumerate(instances):
        for channel in range(2):
            design, _ = lag_matrix([np.vstack([x, x[-1:]])], 5, channel)  # one more row: every t has a target
            rows = (
                coefficients[channel]
                if positions is None
                else coefficients[channel, np.minimum(np.arange(len(x)), positions - 1)]
            )
            expected = x[:, channel] + (design * rows).sum(axis=1)
            np.testing.assert_allclose(forecast[b, : len(x), channel], expected, rtol=1e-5, atol=1e-5)


def test_gcv_from_the_sums_is_the_one_computed_from_the_explicit_hat_matrix() -> None:
    rng = np.random.default_rng(6)
    instances = ar2_instances(rng, 25, 30)
    sums = LagSums.of(instances, 4, 1)
    for relative in (0.0, 0.1):
        model = fit_model(sums, 0, "levels", 2, relative)
        assert model is not None
        design, target = lag_matrix(instances, 2, 0, first=1)
        penalty = np.diag([0.0, 1.0, 1.0]) * relative * np.diagonal(design.T @ design)[1:].mean()
        hat = design @ np.linalg.solve(design.T @ design + penalty, design.T)
        residual = target - hat @ target
        n = len(target)
        gcv = float(residual @ residual) / n / (1 - np.trace(hat) / n) ** 2
        assert model.gcv_mse == pytest.approx(gcv, rel=1e-6)
        assert model.df == pytest.approx(float(np.trace(hat)), rel=1e-9)


def test_the_unit_root_statistic_is_statsmodels_adf() -> None:
    adfuller = pytest.importorskip("statsmodels.tsa.stattools").adfuller
    rng = np.random.default_rng(7)
    for x in (np.cumsum(rng.normal(size=400)), ar2_instances(rng, 1, 400)[0][:, 0].astype(np.float64)):
        expected = adfuller(x, maxlag=4, autolag=None, regression="c", result_object=False)[0]
        t = unit_root_t(LagSums.of([x[:, None]], 8, 1), 0, redundancy=1.0, lags=4)
        assert t == pytest.approx(expected, rel=1e-6)
        # sums of fewer lags than asked for: as many lagged changes as they hold (max_order - 1)
        expected = adfuller(x, maxlag=2, autolag=None, regression="c", result_object=False)[0]
        t = unit_root_t(LagSums.of([x[:, None]], 3, 1), 0, redundancy=1.0, lags=4)
        assert t == pytest.approx(expected, rel=1e-6)


def test_an_unknown_family_is_refused_not_fitted_as_another() -> None:
    for family in ("level", "CHANGES", ""):
        with pytest.raises(ValueError, match=f"^unknown family {family!r}"):
            family_basis(family, 3)  # type: ignore[arg-type]


def test_a_single_training_row_is_a_choice_of_the_last_value() -> None:
    choice = choose_linear(LagSums.of([np.array([[0.0], [1.0]], np.float32)], 24, 1), 24)
    assert choice is not None and choice.is_last_value and choice.channels[0].fits == ()


def test_sliding_windows_count_each_reading_once_in_the_unit_root_statistic() -> None:
    """A series sent as sliding windows repeats each target in many events: the statistic must be
    the series' own, not inflated by the repeats (without the correction it is ~4x larger here)."""
    rng = np.random.default_rng(8)
    x = ar2_instances(rng, 1, 600)[0]
    whole = unit_root_t(LagSums.of([x], 24, 1), 0, redundancy=1.0)
    windows = [x[i : i + 24] for i in range(len(x) - 23)]
    sliding = unit_root_t(LagSums.of(windows, 24, 1), 0, redundancy=24.0)
    assert whole is not None and sliding is not None and whole < ADF_CRITICAL_T
    assert sliding == pytest.approx(whole, rel=0.1)


def ar1_instances(rng: np.random.Generator, n: int, length: int, phi: float) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        x = np.zeros((length, 1))
        x[0] = 5.0 * rng.normal()
        for t in range(1, length):
            x[t] = phi * x[t - 1] + rng.normal()
        out.append(x.astype(np.float32))
    return out


def test_random_walks_keep_their_root_and_mostly_serve_exactly_the_last_value() -> None:
    exactly_last = 0
    for seed in range(10):
        choice = choose_linear(LagSums.of(walks(np.random.default_rng(seed), 60, 32), 24, 1), 24)
        assert choice is not None
        t = choice.channels[0].unit_root_t
        assert t is not None and t > ADF_CRITICAL_T
        assert all(f.best.family != "levels" for f in choice.channels[0].fits)
        batch = collate(walks(np.random.default_rng(100 + seed), 20, 32))
        change = LinearForecast(choice.coefficients)(batch.values) - batch.values
        assert float(change.pow(2).mean()) < 0.05  # steps have variance 1: the forecast stays near the last value
        exactly_last += choice.is_last_value  # GCV finds nothing that beats it
    assert exactly_last >= 7, exactly_last  # 8 of these 10 seeds
    assert choose_linear(LagSums.zeros(1, 24), 24) is None


def momentum_walks(rng: np.random.Generator, n: int, length: int, phi: float) -> list[np.ndarray]:
    """Random walks whose steps follow an AR(1) with coefficient ``phi``: a changes model of
    order 1 has an error ``1 - phi**2`` times the last value's."""
    out = []
    for _ in range(n):
        steps = np.zeros(length)
        for t in range(1, length):
            steps[t] = phi * steps[t - 1] + rng.normal()
        out.append(np.cumsum(steps)[:, None].astype(np.float32))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_an_edge_over_the_last_value_below_the_minimum_gain_serves_the_last_value(seed: int) -> None:
    """A 1% edge in the window (steps with a little momentum, 6,000 targets: far beyond noise
    for GCV) is less than a change of regime takes away: the last value serves. A 9% edge serves."""
    rng = np.random.default_rng(seed)
    small = choose_linear(LagSums.of(momentum_walks(rng, 200, 32, phi=0.1), 24, 1), 24)
    assert small is not None and small.is_last_value
    large = choose_linear(LagSums.of(momentum_walks(rng, 200, 32, phi=0.3), 24, 1), 24)
    assert large is not None and not large.is_last_value
    assert any(f.best.order >= 1 for f in large.channels[0].fits)


def test_the_shrink_factor_trusts_an_edge_in_proportion_to_its_evidence() -> None:
    assert shrink_factor(0.05, 40.0, 2.0) == 0.0  # n * edge = 2: no more than two parameters' worth
    assert shrink_factor(0.05, 400.0, 2.0) == pytest.approx(0.9)
    assert shrink_factor(0.5, 40_000.0, 2.0) == pytest.approx(1 - 1e-4)
    assert shrink_factor(0.05, 400.0, 0.0) == 1.0
    assert shrink_factor(float("nan"), 400.0, 2.0) == shrink_factor(0.05, 0.0, 2.0) == 0.0
    assert shrink_factor(0.0, 400.0, 2.0) == 0.0  # no edge: nothing to trust, and no division by it
    assert shrink_factor(0.5, 1.0, 0.1) == pytest.approx(0.8)  # one target is evidence too, if little


def later_error_over_last_value(train: list[np.ndarray], test: list[np.ndarray]) -> float | None:
    """The choice fitted on ``train`` forecasting ``test`` where every lag is real: its MSE over the
    last value's; None where it serves the last value."""
    choice = choose_linear(LagSums.of(train, 24, 1), 24)
    assert choice is not None
    if choice.is_last_value:
        return None
    batch = collate(test)
    first = choice.order - 1
    forecast = LinearForecast(choice.coefficients)(batch.values).double().numpy()[:, first:-1, 0]
    x = batch.values.double().numpy()[..., 0]
    return float(np.mean((forecast - x[:, first + 1 :]) ** 2) / np.mean((x[:, first:-1] - x[:, first + 1 :]) ** 2))


def test_a_thin_edge_is_shrunk_toward_the_last_value_and_forecasts_better_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random walks with a faint momentum (steps AR(1), phi 0.1: 1% better than the last value at
    best), a few short events each: where the window shows an edge past the minimum gain it is
    mostly luck, and the shrunk forecast loses less to the last value later than the unshrunk one.
    Thousands of targets of a real 9% edge keep their forecast (the factor near 1)."""
    shrunk, unshrunk = [], []
    for seed in range(80):
        rng = np.random.default_rng(seed)
        train, test = momentum_walks(rng, 6, 32, phi=0.1), momentum_walks(rng, 200, 32, phi=0.1)
        monkeypatch.setattr(forecasters, "LINEAR_SHRINK_DF", 0.0)
        plain = later_error_over_last_value(train, test)
        monkeypatch.setattr(forecasters, "LINEAR_SHRINK_DF", LINEAR_SHRINK_DF)
        if plain is not None:
            unshrunk.append(plain)
            later = later_error_over_last_value(train, test)
            shrunk.append(1.0 if later is None else later)
    assert len(shrunk) >= 15, len(shrunk)  # luck shows an edge this often (22 of these 80 seeds)
    assert np.mean(unshrunk) > 1.0  # what luck shows does not last
    assert np.mean(shrunk) < np.mean(unshrunk) - 0.01, (np.mean(shrunk), np.mean(unshrunk))
    large = choose_linear(LagSums.of(momentum_walks(np.random.default_rng(0), 200, 32, phi=0.3), 24, 1), 24)
    assert large is not None and all(f.shrink > 0.97 for f in large.channels[0].fits)


def test_a_perfect_fit_to_a_couple_of_targets_is_no_evidence_and_the_family_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One event of 12 readings: a changes model of high order fits its last two targets exactly,
    and GCV, on so few, calls that a 97% edge. Shrunk by its evidence to nothing, the family is
    dropped as one below the minimum gain is, not averaged in as zeros."""
    sums = LagSums.of(momentum_walks(np.random.default_rng(0), 1, 12, phi=0.6), 24, 1)
    monkeypatch.setattr(forecasters, "LINEAR_SHRINK_DF", 0.0)
    unshrunk = family_fit(sums, 0, ("changes", "changes_no_drift"), 24, 1.0)
    assert unshrunk is not None and unshrunk.best.distinct_targets <= 2
    monkeypatch.setattr(forecasters, "LINEAR_SHRINK_DF", LINEAR_SHRINK_DF)
    assert family_fit(sums, 0, ("changes", "changes_no_drift"), 24, 1.0) is None


def test_where_the_unit_root_stands_no_levels_model_serves_even_one_that_fits() -> None:
    """Near a unit root a levels model fits the training range (mean reversion) and fails
    once the level leaves it; where the test keeps the root, only changes models serve."""
    kept_out = 0
    for seed in range(4):
        # 10 short instances: their levels show mean reversion of a few percent, the test keeps the root
        sums = LagSums.of(ar1_instances(np.random.default_rng(seed), 10, 32, phi=0.98), 24, 1)
        choice = choose_linear(sums, 24)
        assert choice is not None
        t = choice.channels[0].unit_root_t
        if t is not None and t >= ADF_CRITICAL_T:
            assert all(f.best.family != "levels" for f in choice.channels[0].fits)
            kept_out += family_fit(sums, 0, ("levels",), 24, 1.0) is not None
    assert kept_out >= 1  # the gate did keep a levels model that GCV would have taken


def fleet_events(seed: int, count: int) -> list[np.ndarray]:
    """The seasonal sensor fleet of the integration tests' learnable stream: 8 sensors, events
    of ~32 readings, each a noisy sinusoid of period 16 at its sensor's level and scale."""
    config = SimulationConfig(
        bootstrap="127.0.0.1:9", topic="unused", rate=0, count=count, sensors=8, length_median=32,
        length_sigma=0.3, max_len=128, process="seasonal", seed=seed,
    )  # fmt: skip
    batch = SensorFleet(config).generate_batch(count, now=1e9)
    return [np.asarray(orjson.loads(v)["values"], np.float32).reshape(-1, 1) for v in batch.values]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_choice_from_a_few_dozen_short_events_beats_the_last_value_at_every_position(seed: int) -> None:
    """A service's first publication serves the linear choice before its holdout can judge it.
    Fitted on 24 events of ~32 readings, the seasonal lag (order 16 and beyond) fits best where
    every lag is real; served with those coefficients from an event's first readings on, it
    forecast from copies of the first reading, 2.5-3.5x the last value's error on whole events.
    Each position now serves only models whose lags are real there."""
    events = fleet_events(seed, 24 + 300)
    train, test = events[:24], events[24:]
    flat = np.concatenate(train).astype(np.float64)
    mean, std = flat.mean(axis=0), flat.std(axis=0)
    choice = choose_linear(LagSums.of(train, 24, 1, mean, std), 24)
    assert choice is not None and choice.order >= 16  # the seasonal lag is what fits best
    batch = collate([(e - mean) / std for e in test])
    forecast = LinearForecast(choice.coefficients)(batch.values).double().numpy()[:, :-1, 0]
    x, valid = batch.values.double().numpy()[..., 0], (batch.mask[:, :-1] & batch.mask[:, 1:]).numpy()
    model_mse = float(((forecast - x[:, 1:]) ** 2)[valid].mean())
    last_mse = float(((x[:, :-1] - x[:, 1:]) ** 2)[valid].mean())
    assert model_mse < 0.3 * last_mse, (model_mse, last_mse)


def test_an_origin_serves_no_lag_before_its_events_first_reading() -> None:
    rng = np.random.default_rng(12)
    choice = choose_linear(LagSums.of(ar2_instances(rng, 40, 32, channels=2), 24, 2), 24)
    assert choice is not None and choice.coefficients.shape[1] == choice.order >= 3
    for k in range(choice.coefficients.shape[1]):
        assert not np.any(choice.coefficients[:, k, k + 2 :])  # intercept and k + 1 real readings
        assert np.any(choice.coefficients[:, k, 1:])  # something better than the last value from the first


def test_a_stationary_ar2_averages_a_levels_and_a_changes_model_and_forecasts_close_to_the_truth() -> None:
    rng = np.random.default_rng(10)
    train, test = ar2_instances(rng, 40, 32), ar2_instances(rng, 40, 32)
    choice = choose_linear(LagSums.of(train, 24, 1), 24)
    assert choice is not None
    families = {f.best.family for f in choice.channels[0].fits}
    assert "levels" in families and families & {"changes", "changes_no_drift"}, families
    assert all(f.best.order >= 2 for f in choice.channels[0].fits)  # an AR(2) needs two lags
    batch = collate(test)  # scored at origins whose lags are all real, as the models were fitted
    first = choice.order - 1
    forecast = LinearForecast(choice.coefficients)(batch.values).double().numpy()[:, first:-1, 0]
    x = batch.values.double().numpy()[..., 0]
    truth = 1.6 * x[:, first:-1] - 0.8 * x[:, first - 1 : -2]
    model_mse = float(np.mean((forecast - x[:, first + 1 :]) ** 2))
    best_mse = float(np.mean((truth - x[:, first + 1 :]) ** 2))
    last_mse = float(np.mean((x[:, first:-1] - x[:, first + 1 :]) ** 2))
    assert model_mse <= 1.1 * best_mse < 0.5 * last_mse, (model_mse, best_mse, last_mse)


def test_a_season_plus_one_lag_is_an_order_tried() -> None:
    """x[t+1] = 0.9 x[t-12]: the levels model of order 13 is exact; a grid of 12 and 16 (as the
    forecaster once tried) lacks it, and a monthly series' season-plus-one lag with it."""
    rng = np.random.default_rng(5)
    instances = []
    for _ in range(200):
        x = np.zeros((40, 1))
        x[:13] = rng.normal(size=(13, 1))
        for t in range(13, 40):
            x[t] = 0.9 * x[t - 13] + 0.1 * rng.normal()
        instances.append(x[16:].astype(np.float32))
    sums = LagSums.of(instances, 24, 1)
    levels = family_fit(sums, 0, ("levels",), 24, 1.0)
    assert levels is not None and levels.best.order == 13
    assert levels.coefficients[13] == pytest.approx(0.9, abs=0.05)  # x[t-12] (index 0 is the intercept)


def test_each_family_averages_its_models_with_akaike_weights_led_by_the_least_gcv_error() -> None:
    rng = np.random.default_rng(11)
    sums = LagSums.of(ar2_instances(rng, 30, 32), 24, 1)
    choice = choose_linear(sums, 24)
    assert choice is not None and len(choice.channels[0].fits) == 2
    for fit in choice.channels[0].fits:
        families = ("levels",) if fit.best.family == "levels" else ("changes", "changes_no_drift")
        tried = [
            m
            for family in families for order in range(1, 25)
            for relative in (1e-6, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
            if (m := fit_model(sums, 0, family, order, relative)) is not None
        ]  # fmt: skip
        if fit.best.family != "levels":  # the smoothed models compete with the changes models
            tried += [
                m
                for weight in SMOOTHING_WEIGHTS for order in (1, 2, 4, 8, 12, 16, 23)
                if (m := fit_model(sums, 0, "smoothed", order, 0.0, smoothing=weight)) is not None
            ]  # fmt: skip
        gcv = np.array([m.gcv_mse for m in tried])
        assert fit.best.gcv_mse == pytest.approx(gcv.min())
        akaike = np.exp(-0.5 * fit.best.distinct_targets * (np.log(gcv) - np.log(gcv.min())))
        akaike /= akaike.sum()
        assert len(fit.models) == int((akaike >= 1e-3).sum()) > 1  # GCV cannot tell several apart here
        expected = sorted(akaike[akaike >= 1e-3], reverse=True)
        np.testing.assert_allclose(sorted(fit.weights, reverse=True), np.array(expected) / sum(expected), rtol=1e-9)
        width = fit.coefficients.size
        averaged = sum(
            w * np.pad(m.coefficients, (0, width - m.coefficients.size)) for w, m in zip(fit.weights, fit.models)
        )
        _, _, yty, rows = sums.tail(0, fit.best.coefficients.size - 2)
        edge = 1 - fit.best.gcv_mse / (yty / rows)  # over the last value's error on the same targets
        df = min(LINEAR_SHRINK_DF, fit.best.df)  # the best model's fitted parameters, capped
        assert fit.shrink == pytest.approx(1 - df / (fit.best.distinct_targets * edge)) and fit.shrink < 1
        np.testing.assert_allclose(fit.coefficients, fit.shrink * averaged)
    width = choice.coefficients.shape[-1]
    both = [np.pad(f.coefficients, (0, width - f.coefficients.size)) for f in choice.channels[0].fits]
    np.testing.assert_allclose(choice.coefficients[0, -1], np.mean(both, axis=0))  # where every lag is real
    assert math.isfinite(choice.channels[0].unit_root_t or math.nan)


def computing_network(channels: int = 2, n_classes: int = 0) -> SensorModel:
    torch.manual_seed(0)
    model = SensorModel(channels, n_classes=n_classes, d_model=16, n_heads=2, n_layers=1, max_len=32)
    with torch.no_grad():
        model.forecast_head.weight.normal_(0, 0.5)  # a forecast that is not the last value
    return model.eval()


@pytest.mark.parametrize("kind", ["last_value", "linear", "network"])
def test_every_served_kind_answers_an_instance_alike_whatever_its_company_and_padding(kind: str) -> None:
    rng = np.random.default_rng(6)
    forecaster = {"last_value": LAST_VALUE, "network": NETWORK}.get(kind) or Forecaster(
        "linear", rng.normal(size=(2, 4))
    )
    served = ServedModel(computing_network(n_classes=3), forecaster)
    instances = [rng.normal(size=(n, 2)).astype(np.float32) for n in (4, 11, 7)]
    alone = served(collate(instances[:1]).values, collate(instances[:1]).mask)
    batch = collate(instances[::-1])
    together = served(batch.values + 5.0 * (~batch.mask[..., None]), batch.mask)  # pads hold garbage
    torch.testing.assert_close(together.forecast[2, :4], alone.forecast[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together.logits[2], alone.logits[0], atol=1e-5, rtol=1e-5)
    if kind != "network":  # the forecasters' own pads are zero, not the pads' garbage or a division by them
        assert torch.equal(together.forecast[~batch.mask], torch.zeros_like(together.forecast[~batch.mask]))


@pytest.mark.parametrize("max_order", [24, 2])
def test_the_smoothed_family_is_fitted_at_its_weights_and_orders_only(max_order: int) -> None:
    sums = LagSums.of(ar2_instances(np.random.default_rng(13), 20, 30), 24, 1)
    members = forecasters.family_members(sums, 0, ("smoothed",), max_order, 1.0)
    widest = max_order - 1  # orders of at most max_order - 1 readings of changes, and the widest itself
    orders = sorted({o for o in forecasters.SMOOTHED_ORDERS if o < widest} | {widest})
    assert sorted((m.smoothing, m.order) for m in members) == sorted((w, o) for w in SMOOTHING_WEIGHTS for o in orders)
    assert {m.family for m in members} == {"smoothed"} and {m.relative_penalty for m in members} == {0.0}
    levels = forecasters.family_members(sums, 0, ("levels",), max_order, 1.0)
    assert levels and {m.smoothing for m in levels} == {0.0}  # only the smoothed family has a weight
    single = forecasters.averaged(levels[:1], sums, 0)  # a family of one model: all its weight
    assert single is not None and single.weights == (1.0,) and single.models == (levels[0],)


def test_the_choice_reports_each_channels_families_as_v1_model_shows_them() -> None:
    sums = LagSums.of(ar2_instances(np.random.default_rng(14), 30, 40, channels=2), 24, 2)
    choice = choose_linear(sums, 24)
    assert choice is not None
    report = orjson.loads(orjson.dumps(choice.report()))  # what the route serializes
    assert report["chosen_by"] == "gcv" and len(report["channels"]) == 2
    for channel, (shown, chosen) in enumerate(zip(report["channels"], choice.channels, strict=True)):
        t = unit_root_t(sums, channel, 1.0)
        assert t is not None and shown["unit_root_t"] == round(t, 3) != round(t, 4)
        assert len(shown["families"]) == len(chosen.fits) >= 1
        for family, fit in zip(shown["families"], chosen.fits, strict=True):
            expected = {
                "family": fit.best.family, "order": fit.best.order, "relative_penalty": fit.best.relative_penalty,
                "weight": round(fit.weights[0], 4), "models_averaged": len(fit.models), "shrink": round(fit.shrink, 4),
            }  # fmt: skip
            if fit.best.family == "smoothed":
                expected["smoothing"] = fit.best.smoothing
            assert family == expected
            assert family["relative_penalty"] in (0.0, *forecasters.RELATIVE_PENALTIES)
    widest = max(f.coefficients.size - 1 for c in choice.channels for f in c.fits)
    assert choice.order == widest and choice.coefficients.shape == (2, widest, widest + 1)
    fits = [f for c in choice.channels for f in c.fits]
    assert any(len(f.models) > 1 and round(f.weights[0], 4) != round(f.weights[0], 5) for f in fits)


def test_a_forecaster_reports_its_kind_order_and_blend_weight() -> None:
    rows = np.zeros((2, 3, 5))  # order 4, a row per position for three positions
    assert NETWORK.report() == {"kind": "network"} and LAST_VALUE.report() == {"kind": "last_value"}
    assert Forecaster("linear", rows).report() == {"kind": "linear", "order": 4}
    assert Forecaster("blend", rows[:, 0], 0.25).report() == {"kind": "blend", "order": 4, "network_weight": 0.25}


def test_the_network_serves_as_itself_and_every_other_kind_through_an_eval_mode_wrapper() -> None:
    network = computing_network()
    assert served_module(network, NETWORK) is network  # its compiled forward and state keys, unwrapped
    for forecaster in (LAST_VALUE, Forecaster("linear", np.ones((2, 3))), Forecaster("blend", np.ones((2, 3)), 0.5)):
        served = served_module(network.train(), forecaster)
        assert isinstance(served, ServedModel) and not served.training and not network.training


@pytest.mark.parametrize("shape", [(2,), (2, 0, 3), (2, 3, 1), (2, 1), (1, 2, 3, 4)])
def test_coefficients_without_a_position_row_or_a_lag_are_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=rf"^LinearForecast: coefficients must be .* got {re.escape(str(shape))}$"):
        LinearForecast(np.zeros(shape))


def test_the_last_value_kind_is_the_last_value_and_the_linear_kind_is_not() -> None:
    rng = np.random.default_rng(7)
    batch = collate([rng.normal(size=(6, 2)).astype(np.float32)])
    network = computing_network()
    last = ServedModel(network, LAST_VALUE)(batch.values, batch.mask).forecast
    torch.testing.assert_close(last, batch.values)
    linear = ServedModel(network, Forecaster("linear", np.ones((2, 3))))(batch.values, batch.mask).forecast
    assert not torch.allclose(linear, batch.values)
    assert not torch.allclose(ServedModel(network, NETWORK)(batch.values, batch.mask).forecast, batch.values)


def test_a_forecaster_round_trips_through_its_state() -> None:
    coefficients = np.arange(6, dtype=np.float64).reshape(2, 3)
    back = Forecaster.from_state(Forecaster("linear", coefficients).state_dict())
    assert back.kind == "linear" and np.array_equal(back.coefficients, coefficients)
    rows = np.arange(12, dtype=np.float64).reshape(2, 2, 3) / 7.0  # a coefficient row per position
    blend = Forecaster.from_state(Forecaster("blend", rows, 0.3).state_dict())
    assert blend.kind == "blend" and blend.network_weight == 0.3 and np.array_equal(blend.coefficients, rows)
    assert Forecaster.from_state(NETWORK.state_dict()) == NETWORK
    assert Forecaster.from_state(None) is NETWORK and Forecaster.from_state(LAST_VALUE.state_dict()) == LAST_VALUE
    with pytest.raises(ValueError, match="coefficients"):
        Forecaster("linear")
    with pytest.raises(ValueError, match="kind"):
        Forecaster("mean")  # type: ignore[arg-type]


def test_the_blend_weight_is_the_least_squares_one() -> None:
    rng = np.random.default_rng(8)
    network_errors, linear_errors = rng.normal(size=500), 0.6 * rng.normal(size=500) + 0.3 * rng.normal(size=500)
    gram = (network_errors @ network_errors, linear_errors @ linear_errors, network_errors @ linear_errors)
    weight, sse = best_blend(*gram)
    grid = np.linspace(0.0, 1.0, 10_001)
    brute = [float(np.sum((w * network_errors + (1 - w) * linear_errors) ** 2)) for w in grid]
    assert weight == pytest.approx(grid[int(np.argmin(brute))], abs=2e-4) and sse == pytest.approx(min(brute), rel=1e-6)
    assert best_blend(1.0, 4.0, 2.0)[0] == 1.0  # the linear errors only add: all network
    assert best_blend(4.0, 1.0, 2.0)[0] == 0.0
    assert best_blend(2.0, 2.0, 2.0) == (0.0, 2.0)  # the same errors: nothing to blend, the linear serves


def test_a_blend_serves_the_weighted_forecast_of_the_network_and_the_linear() -> None:
    rng = np.random.default_rng(9)
    batch = collate([rng.normal(size=(6, 2)).astype(np.float32), rng.normal(size=(3, 2)).astype(np.float32)])
    network, coefficients = computing_network(), rng.normal(size=(2, 3))
    with torch.no_grad():
        parts = [
            ServedModel(network, f)(batch.values, batch.mask).forecast
            for f in (NETWORK, Forecaster("linear", coefficients), Forecaster("blend", coefficients, 0.3))
        ]
    torch.testing.assert_close(parts[2], 0.3 * parts[0] + 0.7 * parts[1])
    with pytest.raises(ValueError, match="^a blend needs its network weight, and only a blend has one$"):
        Forecaster("blend", coefficients)
    with pytest.raises(
        ValueError, match="^a linear or blended forecaster needs its coefficients, and only they have them$"
    ):
        Forecaster("network", coefficients)
    assert Forecaster("blend", coefficients, 0.0).network_weight == 0.0  # either end may serve
    assert Forecaster("blend", coefficients, 1.0).network_weight == 1.0
    for outside in (-0.01, 1.01):
        with pytest.raises(ValueError, match=rf"^a blend's network weight must be within \[0, 1\], got {outside}$"):
            Forecaster("blend", coefficients, outside)


@pytest.mark.parametrize("shape", [(2, 4), (2, 3, 4)])  # one row for every position, or a row per position
def test_a_forecaster_in_other_units_forecasts_the_same_readings(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(12)
    readings = torch.from_numpy(np.cumsum(rng.normal(size=(3, 20, 2)), axis=1).astype(np.float32) * 5 + 40)
    mask = torch.ones(3, 20, dtype=torch.bool)
    network = computing_network()
    (mean, std), (to_mean, to_std) = (
        (np.array([40.0, 35.0]), np.array([5.0, 2.0])),
        (np.array([1.0, 3.0]), np.array([9.0, 0.5])),
    )
    for kind in ("linear", "blend"):
        forecaster = Forecaster(kind, rng.normal(size=shape), 0.4 if kind == "blend" else None)
        moved = forecaster.in_units(mean, std, to_mean, to_std)
        assert np.array_equal(moved.coefficients[..., 1:], forecaster.coefficients[..., 1:])
        assert moved.network_weight == forecaster.network_weight
        served = []
        for f, (m, s) in ((forecaster, (mean, std)), (moved, (to_mean, to_std))):
            m_t, s_t = torch.tensor(m, dtype=torch.float32), torch.tensor(s, dtype=torch.float32)
            linear_only = ServedModel(network, Forecaster("linear", f.coefficients))
            served.append(linear_only((readings - m_t) / s_t, mask).forecast * s_t + m_t)
        torch.testing.assert_close(served[0], served[1], atol=1e-3, rtol=1e-5)
    assert LAST_VALUE.in_units(mean, std, to_mean, to_std) is LAST_VALUE


def test_sums_of_readings_with_a_mean_and_scale_are_the_sums_of_the_standardized_readings() -> None:
    rng = np.random.default_rng(15)
    instances = ar2_instances(rng, 6, 20, channels=2)
    mean, std = np.array([3.0, -1.0]), np.array([2.0, 0.5])
    scaled = LagSums.of(instances, 8, 2, mean=mean, std=std)
    by_hand = LagSums.of([(x.astype(np.float64) - mean) / std for x in instances], 8, 2)
    np.testing.assert_allclose(scaled.as_array(), by_hand.as_array(), rtol=1e-6, atol=1e-9)
    assert not np.allclose(scaled.as_array(), LagSums.of(instances, 8, 2).as_array())


def test_a_mean_without_a_scale_or_a_scale_without_a_mean_is_refused_not_ignored() -> None:
    instances = ar2_instances(np.random.default_rng(16), 2, 10)
    for units in ({"mean": np.zeros(1)}, {"std": np.ones(1)}):
        with pytest.raises(ValueError, match=r"^LagSums\.of: give the mean and the std together, or neither$"):
            LagSums.of(instances, 4, 1, **units)


def test_sums_over_more_targets_than_one_chunk_add_every_chunk() -> None:
    """Past ``_CHUNK_ROWS`` targets the sums are built chunk by chunk; each must add to the last."""
    rng = np.random.default_rng(17)
    instances = ar2_instances(rng, 700, 100, channels=2)  # 69,300 targets: two chunks
    assert sum(len(x) - 1 for x in instances) > forecasters._CHUNK_ROWS
    whole = LagSums.of(instances, 6, 2)
    halves = LagSums.of(instances[:350], 6, 2).as_array() + LagSums.of(instances[350:], 6, 2).as_array()
    np.testing.assert_allclose(whole.as_array(), halves, rtol=1e-9)
    assert whole.total_rows == 69_300 and whole.instances == 700


def test_the_tail_from_past_the_last_bucket_is_the_last_bucket() -> None:
    """The last bucket holds every origin at position ``P - 1`` or later."""
    sums = LagSums.of(ar2_instances(np.random.default_rng(18), 4, 30), 5, 1)
    last = sums.tail(0, 4)
    for position in (5, 6, 100):
        for got, expected in zip(sums.tail(0, position), last, strict=True):
            np.testing.assert_array_equal(got, expected)
    assert last[3] == 4 * (30 - 5)


def test_no_data_has_no_unit_root_statistic() -> None:
    assert unit_root_t(LagSums.zeros(1, 8), 0, redundancy=1.0) is None
    assert unit_root_t(LagSums.of([np.zeros((1, 1), np.float32)], 8, 1), 0, redundancy=1.0) is None


def test_the_unit_root_statistic_needs_one_degree_of_freedom_and_no_more() -> None:
    """Intercept, level and one lagged change: three parameters; four targets leave one."""
    x = np.array([[0.0], [1.0], [3.0], [2.0], [5.0], [4.5], [7.0]])  # origins 1..5 have a lagged change
    short = LagSums.of([x[:5]], 2, 1)  # three targets with a lagged change: no degree of freedom
    assert short.tail(0, 1)[3] == 3 and unit_root_t(short, 0, redundancy=1.0, lags=1) is None
    four = LagSums.of([x[:6]], 2, 1)
    assert four.tail(0, 1)[3] == 4
    t = unit_root_t(four, 0, redundancy=1.0, lags=1)
    assert t is not None and math.isfinite(t)


def test_the_unit_root_statistic_and_the_fits_do_not_depend_on_the_readings_scale() -> None:
    """A t-statistic and a relative penalty are scale-free: readings in thousandths (sums far below
    one) give the same statistic and, in level space, the same coefficients up to the scale."""
    instances = ar2_instances(np.random.default_rng(19), 10, 30)
    small = [x / 1000.0 for x in instances]
    sums, sums_small = LagSums.of(instances, 8, 1), LagSums.of(small, 8, 1)
    t, t_small = unit_root_t(sums, 0, 1.0), unit_root_t(sums_small, 0, 1.0)
    assert t is not None and t_small == pytest.approx(t, rel=1e-6)
    for family in ("levels", "changes", "changes_no_drift"):
        model, model_small = fit_model(sums, 0, family, 3, 0.1), fit_model(sums_small, 0, family, 3, 0.1)
        assert model is not None and model_small is not None
        scaled = model_small.coefficients.copy()
        scaled[0] *= 1000.0  # the intercept is in readings; the lag weights are ratios
        np.testing.assert_allclose(scaled, model.coefficients, rtol=1e-5, atol=1e-9)  # float32 readings


def test_one_target_is_evidence_for_a_penalized_fit_and_none_for_an_unpenalized_one() -> None:
    sums = LagSums.of([np.array([[0.0], [1.0], [3.0]], np.float32)], 4, 1)  # one target with a lagged change
    assert sums.tail(0, 1)[3] == 1
    model = fit_model(sums, 0, "changes_no_drift", 1, 1.0)
    assert model is not None and model.df == pytest.approx(0.5)  # the ridge halves the one change's weight
    # the change 1 -> 3 after a change of 1: weight 2 unpenalized, 1 with the penalty, as levels [0, 1, -1]
    np.testing.assert_allclose(model.coefficients, [0.0, 1.0, -1.0])
    assert fit_model(sums, 0, "changes_no_drift", 1, 0.0) is None  # as many parameters as targets


def test_as_many_parameters_as_targets_is_no_fit() -> None:
    x = np.array([[0.0], [1.0], [3.0], [2.0]], np.float32)  # two targets with a lagged change
    sums = LagSums.of([x], 4, 1)
    assert sums.tail(0, 1)[3] == 2
    assert fit_model(sums, 0, "changes", 1, 0.0) is None  # intercept and one change: two parameters
    assert fit_model(sums, 0, "changes_no_drift", 1, 0.0) is not None


def test_a_constant_series_fits_the_last_value_under_a_penalty() -> None:
    """No change at all: the penalized block's scale is zero and the penalty falls back to an
    absolute one, so the fit exists and is the last value (every coefficient zero)."""
    sums = LagSums.of([np.full((20, 1), 3.0, np.float32)], 4, 1)
    model = fit_model(sums, 0, "changes_no_drift", 2, 0.1)
    assert model is not None
    np.testing.assert_array_equal(model.coefficients, np.zeros(4))
    assert model.gcv_mse == 0.0


def test_a_penalty_shrinks_the_smoothed_familys_one_coefficient() -> None:
    rng = np.random.default_rng(20)
    sums = LagSums.of([local_level(rng, 400, 1.0)[:, None].astype(np.float32)], 8, 1)
    free = fit_model(sums, 0, "smoothed", 4, 0.0, smoothing=0.5)
    penalized = fit_model(sums, 0, "smoothed", 4, 1.0, smoothing=0.5)
    assert free is not None and penalized is not None
    assert 0.0 < np.abs(penalized.coefficients).sum() < 0.75 * np.abs(free.coefficients).sum()
    assert penalized.df == pytest.approx(0.5, rel=1e-6)  # a penalty equal to the feature's scale halves it


def test_the_widest_order_asked_for_is_among_a_familys_members() -> None:
    sums = LagSums.of(ar2_instances(np.random.default_rng(21), 20, 40), 12, 1)
    for max_order in (3, 8, 11):
        members = forecasters.family_members(sums, 0, ("levels", "changes"), max_order, 1.0)
        for family in ("levels", "changes"):
            assert max(m.order for m in members if m.family == family) == max_order


def test_the_linear_forecast_keeps_its_coefficients_in_float32_and_answers_in_the_inputs_dtype() -> None:
    module = LinearForecast(np.random.default_rng(22).normal(size=(2, 3, 4)))
    assert {b.dtype for b in module.buffers()} == {torch.float32}
    for dtype in (torch.bfloat16, torch.float64):
        assert module(torch.ones(2, 5, 2, dtype=dtype)).dtype == dtype


class _CountingNetwork(SensorModel):
    calls = 0

    def forward(self, x: torch.Tensor, mask: torch.Tensor):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        return super().forward(x, mask)


@pytest.mark.parametrize("n_classes", [0, 1, 3])
def test_a_linear_forecaster_runs_the_network_only_for_its_class_head(n_classes: int) -> None:
    torch.manual_seed(0)
    network = _CountingNetwork(2, n_classes=n_classes, d_model=16, n_heads=2, n_layers=1, max_len=32).eval()
    coefficients = np.random.default_rng(23).normal(size=(2, 1 + 3))
    served = ServedModel(network, Forecaster("linear", coefficients))
    _CountingNetwork.calls = 0
    output = served(torch.ones(3, 6, 2), torch.ones(3, 6))
    assert _CountingNetwork.calls == (1 if n_classes else 0)
    assert (output.logits is None) == (n_classes == 0)
    if n_classes:
        assert output.logits is not None and output.logits.shape == (3, n_classes)
