"""bench/real_series.py without Kafka: the series loaders, the AR(p) baseline and the score arithmetic."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import real_series as rs  # noqa: E402
from _series import FRESH, LATE, SERIES, UNSEEN  # noqa: E402


@pytest.mark.parametrize("name", sorted(SERIES) + sorted(UNSEEN) + sorted(FRESH) + sorted(LATE))
def test_every_loader_returns_a_finite_float32_series_in_time_order(name: str) -> None:
    series = {**SERIES, **UNSEEN, **FRESH, **LATE}[name]()
    values = series.values
    assert values.dtype == np.float32 and values.ndim == 2
    assert values.shape[0] >= 100 and 1 <= values.shape[1] <= 4
    assert np.isfinite(values).all()
    assert len(series.channel_names) == values.shape[1]
    assert series.ts.shape == (values.shape[0],) and np.isfinite(series.ts).all()
    assert (np.diff(series.ts) > 0).all()
    assert series.period and series.source
    assert (values[: int(rs.TRAIN_SHARE * len(values))].std(axis=0) > 0).all()  # z-scoring needs spread


def test_no_unseen_fresh_or_late_series_is_a_series_of_an_earlier_set() -> None:
    assert not set(SERIES) & set(UNSEEN) and not (set(SERIES) | set(UNSEEN)) & set(FRESH)
    assert not (set(SERIES) | set(UNSEEN) | set(FRESH)) & set(LATE)
    earlier = [f().values for f in SERIES.values()]
    for f in [*UNSEEN.values(), *FRESH.values(), *LATE.values()]:
        values = f().values
        assert not any(t.shape == values.shape and np.array_equal(t, values) for t in earlier)
        earlier.append(values)


def test_the_bench_has_eight_series_daily_to_yearly_with_one_to_four_channels() -> None:
    loaded = [f() for f in SERIES.values()]
    assert len(loaded) >= 8
    assert {"daily", "weekly", "monthly", "quarterly", "yearly"} <= {s.period.split(" ")[0] for s in loaded}
    assert {s.values.shape[1] for s in loaded} >= {1, 2, 3, 4}


FIXED = np.array([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0, 5.0, 8.0, 9.0, 7.0, 9.0, 3.0, 2.0, 3.0, 8.0, 4.0])


@pytest.mark.parametrize("p", [1, 2, 3])
def test_the_ar_fit_is_numpy_lstsq_on_lags_with_an_intercept(p: int) -> None:
    rows = [[1.0, *(FIXED[t - k] for k in range(1, p + 1))] for t in range(p, len(FIXED))]
    expected = np.linalg.lstsq(np.array(rows), FIXED[p:], rcond=None)[0]
    np.testing.assert_allclose(rs.fit_ar(FIXED, p), expected, rtol=1e-10, atol=1e-12)
    # the forecast from a context uses the newest reading as lag 1
    context = FIXED[None, -5:]
    assert rs.ar_forecast(expected, context)[0] == pytest.approx(expected[0] + expected[1:] @ FIXED[-1 : -p - 1 : -1])


@pytest.mark.parametrize("p", [1, 3])
def test_the_hybrid_base_is_ar_where_its_lags_are_in_the_window_and_the_last_value_before(p: int) -> None:
    import replay_budget  # noqa: PLC0415 (torch: imported only by the test that needs it)

    windows = np.stack([FIXED[i : i + 8] for i in range(6)])[:, :, None].repeat(2, axis=2)  # [6, 8, 2]
    windows[:, :, 1] *= -2.0
    coefficients = [rs.fit_ar(FIXED, p), rs.fit_ar(-2.0 * FIXED, 2)]
    bases = replay_budget.ar_bases(windows, coefficients)
    for c, coef in enumerate(coefficients):
        order = len(coef) - 1
        for t in range(8):
            expected = rs.ar_forecast(coef, windows[:, : t + 1, c])[:] if t >= order - 1 else windows[:, t, c]
            np.testing.assert_allclose(bases[:, t, c], expected, rtol=1e-5)


def test_the_order_is_picked_on_the_last_fifth_and_refitted_on_everything() -> None:
    rng = np.random.default_rng(0)
    x = np.zeros(100)
    for t in range(2, len(x)):  # an AR(2) process; on 80 readings high orders overfit and lose on the last 20
        x[t] = 1.2 * x[t - 1] - 0.6 * x[t - 2] + rng.normal()
    assert rs.max_order(100) == 20 and rs.max_order(400) == 24
    split = int(0.8 * len(x))
    targets = np.arange(split, len(x))
    val = [np.mean((rs.ar_design(x, q, targets) @ rs.fit_ar(x[:split], q) - x[targets]) ** 2) for q in range(1, 21)]
    p, coef = rs.choose_order(x)
    assert p == int(np.argmin(val)) + 1 == 2
    np.testing.assert_allclose(coef, rs.fit_ar(x, 2))  # refitted on all of it


def test_scores_are_standardized_per_channel_then_averaged() -> None:
    target = np.array([[0.0, 100.0], [2.0, 100.0]])
    forecast = np.array([[1.0, 110.0], [2.0, 90.0]])
    mean, std = np.array([5.0, 0.0]), np.array([2.0, 10.0])
    # channel 0: errors (1, 0) / 2 -> mse 0.125; channel 1: errors (10, -10) / 10 -> mse 1.0
    assert rs.standardized_mse(forecast, target, mean, std) == pytest.approx((0.125 + 1.0) / 2)
    assert rs.standardized_mse(target, target, mean, std) == 0.0


def test_ratios_and_geometric_means() -> None:
    r = rs.ratios(mse_served=0.5, mse_last=2.0, mse_ar=1.0)
    assert r == pytest.approx({"served_last": 0.25, "ar_last": 0.5, "served_ar": 0.5, "served_best": 0.5})
    assert rs.ratios(3.0, 2.0, 4.0)["served_best"] == pytest.approx(1.5)  # best of the two is the last value
    assert rs.geomean([0.5, 2.0]) == pytest.approx(1.0)
    assert rs.geomean([0.25, 1.0, 4.0, 8.0]) == pytest.approx(8.0**0.25)
    assert math.isnan(rs.geomean([]))


def _result(name: str, served_last: float, served_ar: float, served_best: float, error: str | None = None) -> rs.Result:
    return rs.Result(name, "burst", 1, "daily", "river", 100, served_last, 1.0, served_ar, served_best, None, None,
                     None, [1], 1.0, 1.0, 1.0, error=error)  # fmt: skip


def test_targets_name_the_series_that_miss_them() -> None:
    good = [_result("a", 0.5, 0.5, 1.0), _result("b", 0.9, 0.8, 1.04)]
    assert all(met for met, _ in rs.targets_met(good).values())
    bad = [_result("a", 1.2, 0.5, 1.2), _result("b", 0.9, 2.0, 1.06)]
    (last, last_detail), (best, best_detail), (geo, geo_detail) = rs.targets_met(bad).values()
    assert not last and last_detail == "over: a"
    assert not best and best_detail == "over: a, b"
    assert not geo and geo_detail == "1.000x"  # sqrt(0.5 * 2.0)
    # the last value served through float32 normalization: 1 + 1e-7, not a miss; 1 + 1e-5 is
    rounded = [_result("a", 1.0 + 1e-7, 0.9, 1.0 + 1e-7), _result("b", 1.0 + 1e-5, 0.9, 1.0)]
    assert rs.targets_met(rounded)["every series served <= 1x last"] == (False, "over: b")
    failed = [*good, _result("c", math.nan, math.nan, math.nan, error="TimeoutError")]
    assert not any(met for met, _ in rs.targets_met(failed).values())


def test_window_capacity_is_five_to_ten_thousand_and_holds_every_event() -> None:
    assert rs.window_capacity(333) == 5000
    assert rs.window_capacity(7000) == 7000
    assert rs.window_capacity(12_000) == 12_000


def test_the_network_holdout_ratio_is_the_reference_over_the_linear_forecaster() -> None:
    publication = {"holdout_events": 96, "holdout_mse": {"candidate": 9.0, "reference": 3.0, "linear": 2.0}}
    assert rs.holdout_network_linear({"forecaster": {"last_publication": publication}}) == (1.5, 96)
    publication["holdout_mse"] = {"candidate": 3.0, "reference": None, "linear": 2.0}  # no reference yet
    assert rs.holdout_network_linear({"forecaster": {"last_publication": publication}}) == (1.5, 96)
    assert rs.holdout_network_linear({"forecaster": {"last_publication": None}}) == (None, None)
    assert rs.holdout_network_linear({}) == (None, None)


def test_the_held_out_block_chooses_the_family_at_each_replay_count_and_across_them() -> None:
    import replay_budget  # noqa: PLC0415 (torch: imported only by the test that needs it)

    held = {"network": {4: 1.0, 8: 0.5, 16: 0.7}, "level": {4: 0.9, 8: 0.6, 16: 0.4}}
    test = {"network": {4: 10.0, 8: 20.0, 16: 30.0}, "level": {4: 11.0, 8: 21.0, 16: 31.0}}
    at_each, early = replay_budget.held_out_choice(held, test)
    assert at_each == {4: 11.0, 8: 20.0, 16: 31.0}  # the lower held-out error's test score, not the lower test score
    assert early == 31.0  # level at 16: the lowest held-out error of all six
    tie = {"network": {4: 0.5}, "level": {4: 0.5}}
    assert replay_budget.held_out_choice(tie, test) == ({4: 10.0}, 10.0)  # a tie keeps the service's network


def test_the_range_seen_is_that_of_the_readings_before_an_instance_and_clips_the_level() -> None:
    import replay_budget  # noqa: PLC0415 (torch: imported only by the tests that need it)
    import torch  # noqa: PLC0415

    series = np.array([[0.0, 5.0], [2.0, 4.0], [1.0, 6.0], [3.0, 3.0], [-1.0, 7.0]])
    z = np.stack([series[i : i + 3] for i in range(3)])
    ranged = replay_budget.with_range_seen(z, np.arange(3), series)
    assert ranged.shape == (3, 3, 6) and np.array_equal(ranged[..., :2], z)
    assert np.array_equal(ranged[0, :, 2:], np.tile([0.0, 5.0, 0.0, 5.0], (3, 1)))  # the first reading's own
    # the instance starting at 2 comes after rows 0-1: low, high per channel, along the instance
    assert np.array_equal(ranged[2, :, 2:4], np.tile([0.0, 4.0], (3, 1)))
    assert np.array_equal(ranged[2, :, 4:], np.tile([2.0, 5.0], (3, 1)))

    torch.manual_seed(0)
    model = replay_budget.RangeAwareModel(2, d_model=16, n_heads=2, n_layers=1)
    x = torch.tensor(ranged[2:])
    mask = torch.ones(x.shape[:2], dtype=torch.bool)
    inputs: list[torch.Tensor] = []
    model.input.register_forward_hook(lambda _m, args, _out: inputs.append(args[0]))
    forecast = model(x, mask).forecast
    assert torch.equal(forecast, x[..., :2])  # untrained: the last value, as the service's network
    clipped, outside = inputs[0].view(1, 3, 10)[..., 4:6], inputs[0].view(1, 3, 10)[..., 8:]
    # readings (1, 6), (3, 3), (-1, 7) against the range 0..2 and 4..5: each clipped to it and flagged
    assert np.array_equal(clipped[0].numpy(), [[1.0, 5.0], [2.0, 4.0], [0.0, 5.0]])
    assert np.array_equal(outside[0].numpy(), [[0.0, 1.0], [1.0, -1.0], [-1.0, 1.0]])
    inputs.clear()
    model(torch.tensor([[[0.0, 5.0, 0.0, 4.0, 2.0, 5.0]]]), torch.ones(1, 1, dtype=torch.bool))  # on the edges
    assert not inputs[0].view(1, 1, 10)[..., 8:].any()  # inside: an edge is part of the range
