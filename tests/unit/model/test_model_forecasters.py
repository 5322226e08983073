"""The linear forecaster and the served module: the ridge fit against numpy's least squares,
the module against the regression it was fitted as, the (order, penalty) choice following
the held-out error, and the no-shuffle invariants of every served kind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamtrain.data.collate import collate
from streamtrain.model.forecasters import (
    LAST_VALUE,
    NETWORK,
    ORDERS,
    RELATIVE_PENALTIES,
    Forecaster,
    LagSums,
    LinearForecast,
    ServedModel,
    best_blend,
    choose_linear,
    gcv_sse,
    held_out_sse,
    ridge_solve,
)
from streamtrain.model.network import SensorModel


def lag_matrix(instances: list[np.ndarray], order: int, channel: int) -> tuple[np.ndarray, np.ndarray]:
    """The regression written out row by row: [1, x[t], ..., x[t-order+1]] -> x[t+1] - x[t]."""
    rows, targets = [], []
    for x in instances:
        for t in range(len(x) - 1):
            lags = [x[max(t - k, 0), channel] for k in range(order)]
            rows.append([1.0, *lags])
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


@pytest.mark.parametrize("order", [1, 3, 8])
def test_the_ridge_fit_without_penalty_is_numpys_least_squares(order: int) -> None:
    rng = np.random.default_rng(0)
    instances = ar2_instances(rng, 20, 30, channels=2) + [rng.normal(size=(1, 2)).astype(np.float32)]
    sums = LagSums.of(instances, max_order=8, channels=2)
    for channel in range(2):
        design, target = lag_matrix(instances, order, channel)
        expected = np.linalg.lstsq(design, target, rcond=None)[0]
        np.testing.assert_allclose(ridge_solve(sums, channel, order, penalty=0.0), expected, rtol=1e-6, atol=1e-9)
        assert sums.rows == len(target)


def test_the_held_out_error_in_closed_form_is_the_summed_squared_residual() -> None:
    rng = np.random.default_rng(1)
    train, holdout = ar2_instances(rng, 10, 40), ar2_instances(rng, 5, 25)
    sums, held = LagSums.of(train, 4, 1), LagSums.of(holdout, 4, 1)
    coefficients = ridge_solve(sums, 0, 4, penalty=0.5)
    design, target = lag_matrix(holdout, 4, 0)
    assert held_out_sse(held, 0, coefficients) == pytest.approx(float(np.sum((target - design @ coefficients) ** 2)))


def test_sums_add_over_chunks_as_ranks_add_them() -> None:
    rng = np.random.default_rng(2)
    instances = ar2_instances(rng, 12, 20, channels=3)
    whole = LagSums.of(instances, 6, 3)
    parts = [LagSums.of(instances[:5], 6, 3), LagSums.of(instances[5:], 6, 3)]
    added = LagSums.from_array(parts[0].as_array() + parts[1].as_array(), 3, 6)
    np.testing.assert_allclose(added.as_array(), whole.as_array(), rtol=1e-12)


def test_the_module_forecasts_what_the_regression_was_fitted_as() -> None:
    rng = np.random.default_rng(3)
    coefficients = rng.normal(size=(2, 1 + 5))
    module = LinearForecast(coefficients)
    instances = [rng.normal(size=(n, 2)).astype(np.float32) for n in (1, 3, 9)]
    batch = collate(instances)
    forecast = module(batch.values * batch.mask[..., None]).double().numpy()
    for b, x in enumerate(instances):
        for channel in range(2):
            design, _ = lag_matrix([np.vstack([x, x[-1:]])], 5, channel)  # one more row: every t has a target
            expected = x[:, channel] + design @ coefficients[channel]
            np.testing.assert_allclose(forecast[b, : len(x), channel], expected, rtol=1e-5, atol=1e-5)


def test_the_choice_follows_the_held_out_error() -> None:
    rng = np.random.default_rng(4)
    train, held_out = LagSums.of(ar2_instances(rng, 40, 32), 24, 1), LagSums.of(ar2_instances(rng, 20, 32), 24, 1)
    choice = choose_linear(train, held_out, 24)
    assert choice is not None and choice.orders[0] >= 2  # an AR(2) needs two lags
    scale = lambda order: float(np.diagonal(train.xtx[0])[1 : order + 1].mean())  # noqa: E731
    tried = [
        held_out_sse(held_out, 0, ridge_solve(train, 0, order, relative * scale(order)))
        for order in ORDERS if order <= 24 for relative in RELATIVE_PENALTIES
    ]  # fmt: skip
    assert choice.held_out_sse[0] == pytest.approx(min(tried))
    # On a random walk the best forecast of the change is none: the penalty chosen is large
    # and the coefficients end close to the last value's (all zero).
    walks = [np.cumsum(rng.normal(size=(32, 1)), axis=0).astype(np.float32) for _ in range(80)]
    held = [np.cumsum(rng.normal(size=(32, 1)), axis=0).astype(np.float32) for _ in range(40)]
    walk = choose_linear(LagSums.of(walks, 24, 1), LagSums.of(held, 24, 1), 24)
    assert walk is not None and np.abs(walk.coefficients[0, 1:]).sum() < 0.3


def test_without_held_out_data_generalized_cross_validation_chooses() -> None:
    rng = np.random.default_rng(5)
    choice = choose_linear(LagSums.of(ar2_instances(rng, 30, 32), 24, 1), None, 24)
    assert choice is not None and choice.criterion == "gcv" and choice.orders[0] >= 2
    walks = [np.cumsum(rng.normal(size=(32, 1)), axis=0).astype(np.float32) for _ in range(60)]
    walk = choose_linear(LagSums.of(walks, 24, 1), None, 24)
    assert walk is not None and np.abs(walk.coefficients[0, 1:]).sum() < 0.3
    assert choose_linear(LagSums.zeros(1, 24), None, 24) is None


def test_gcv_from_the_sums_is_the_one_computed_from_the_explicit_hat_matrix() -> None:
    rng = np.random.default_rng(6)
    instances = ar2_instances(rng, 25, 30)
    sums = LagSums.of(instances, 2, 1)
    coefficients = ridge_solve(sums, 0, 2, 0.0)
    design, target = lag_matrix(instances, 2, 0)
    hat = design @ np.linalg.solve(design.T @ design, design.T)
    residual = target - hat @ target
    gcv = float(residual @ residual) / (1 - np.trace(hat) / len(target)) ** 2
    assert gcv_sse(sums, 0, coefficients, 0.0) == pytest.approx(gcv, rel=1e-6)


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
    with pytest.raises(ValueError, match="network weight"):
        Forecaster("blend", coefficients)
