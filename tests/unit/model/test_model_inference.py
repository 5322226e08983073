"""No-shuffle predict: order, company and micro-batching change no answer; the anomaly score is the
standardized one-step error; the device path answers as the CPU path; the batch plan covers every
instance within the token budget.

Each check runs on a model that computes something and again on a copy broken against it
(:mod:`broken_models`), which must fail it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from broken_models import head_dropped, mixes_batch, pools_over_padding
from model_fixtures import pad_batch, ragged, small_model

from device_params import CUDA, DEVICES
from streamtrain.model.inference import PREDICT_MIN_LENGTH_SHARE, Prediction, plan_predict_batches, predict
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm

torch.set_num_threads(1)


def assert_predict_order_and_company_invariant(model: SensorModel) -> None:
    """Each instance gets the same prediction in any request order, any micro-batching and alone."""
    rng = np.random.default_rng(3)
    norm = RunningNorm(2)
    values, mask = pad_batch(ragged(rng, 20, 2))
    norm.update(values * 3 + 1, mask)
    items = ragged(rng, 30, 2)
    reference = predict(model, norm, items, token_budget=256)
    assert len(reference) == 30
    alone = [predict(model, norm, [item], token_budget=256)[0] for item in items]
    by_length = np.argsort([len(v) for v in items])
    for order in (by_length, by_length[::-1], rng.permutation(30)):
        shuffled = predict(model, norm, [items[i] for i in order], token_budget=97)
        for position, index in enumerate(order):
            for other in (shuffled[position], alone[index]):
                np.testing.assert_allclose(other.next, reference[index].next, atol=1e-5)
                assert other.anomaly_score == pytest.approx(reference[index].anomaly_score, abs=1e-5)
                np.testing.assert_allclose(other.probs, reference[index].probs, atol=1e-5)
    assert all(p.anomaly_score == 0.0 for p, item in zip(reference, items) if len(item) == 1)
    assert all(abs(sum(p.probs) - 1) < 1e-6 for p in reference)  # float32 softmax, as exported
    assert model.training is False


@pytest.mark.parametrize("device", DEVICES)
def test_predict_is_order_and_company_invariant(device: str) -> None:
    assert_predict_order_and_company_invariant(small_model().to(device))


def assert_same_predictions(expected: Sequence[Prediction], got: Sequence[Prediction]) -> None:
    """Equal to a float32 tolerance (kernels and reduction orders differ between devices)."""
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g.next, e.next, rtol=1e-4, atol=1e-5)
        assert g.anomaly_score == pytest.approx(e.anomaly_score, rel=1e-4, abs=1e-5)
        np.testing.assert_allclose(g.probs, e.probs, rtol=1e-4, atol=1e-5)


def device_items() -> tuple[RunningNorm, list[np.ndarray]]:
    rng = np.random.default_rng(11)
    norm = RunningNorm(2)
    values, mask = pad_batch(ragged(rng, 20, 2))
    norm.update(values * 3 + 1, mask)
    return norm, ragged(rng, 64, 2, max_len=60)


@pytest.mark.parametrize("device", [CUDA])
def test_predictions_on_the_device_equal_the_cpu_path(device: str) -> None:
    """The same weights answer the same on the GPU as on the CPU, in float32 (kernels and
    reduction orders differ, so to a float32 tolerance, not bit for bit)."""
    norm, items = device_items()
    on_cpu = predict(small_model(), norm, items, token_budget=512)
    on_device = predict(small_model().to(device), norm, items, token_budget=512)
    assert_same_predictions(on_cpu, on_device)


PredictFn = Callable[[SensorModel, RunningNorm, Sequence[np.ndarray], int], list[Prediction]]


def assert_anomaly_score_is_the_one_step_error(model: SensorModel, serve: PredictFn = predict) -> None:
    """Computed here from first principles, not with the functions predict uses:
    z = (x − mean) / std of the training data per channel (population variance), and the
    score is the mean over t of the channel-mean of (forecast_t − z_{t+1})², the forecast
    being ``model``'s own. ``serve`` is the serving path under test."""
    rng = np.random.default_rng(4)
    scale, shift = np.array([100.0, 0.5]), np.array([3.0, -7.0])
    train = (rng.normal(size=(50, 2)) * scale + shift).astype(np.float32)
    norm = RunningNorm(2)
    norm.update(*pad_batch([train]))
    mean, std = train.astype(np.float64).mean(axis=0), train.astype(np.float64).std(axis=0)
    item = np.stack([np.linspace(-100, 100, 20), np.linspace(-8, -6, 20)], axis=1).astype(np.float32)
    z = (item.astype(np.float64) - mean) / std

    # a zero forecast head forecasts the last reading: the score is the mean of (z_{t+1} − z_t)²
    silent = head_dropped(model)
    (quiet,) = serve(silent, norm, [item], 64)
    assert quiet.anomaly_score == pytest.approx(((z[1:] - z[:-1]) ** 2).mean(), rel=1e-4)
    np.testing.assert_allclose(quiet.next, item[-1], rtol=1e-5)

    # the real forecaster: its own forecasts, the same arithmetic
    with torch.no_grad():
        forecast = (
            model(torch.from_numpy(z).float()[None], torch.ones(1, 20, dtype=torch.bool)).forecast[0].double().numpy()
        )
    (prediction,) = serve(model, norm, [item], 64)
    assert prediction.anomaly_score == pytest.approx(((forecast[:-1] - z[1:]) ** 2).mean(), rel=1e-4)
    np.testing.assert_allclose(prediction.next, forecast[-1] * std + mean, rtol=1e-4)
    assert prediction.probs is None and len(prediction.next) == 2


def test_predict_anomaly_score_is_the_standardized_one_step_error() -> None:
    assert_anomaly_score_is_the_one_step_error(small_model(channels=2, n_classes=0))


def test_predict_groups_cover_every_instance_once_within_budget_and_length_share() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(1, 300, rng.integers(1, 64))
        budget = int(rng.integers(1, 4096))
        groups = plan_predict_batches(lengths, budget)
        assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
        for group in groups:
            longest = lengths[group].max()
            assert len(group) == 1 or len(group) * longest <= budget
            assert len(group) == 1 or lengths[group].min() >= PREDICT_MIN_LENGTH_SHARE * longest


# ------------------------------------------------------------------ the checks catch what they guard


@pytest.mark.parametrize(
    ("check", "breaks"),
    [
        pytest.param(assert_predict_order_and_company_invariant, mixes_batch, id="predict company-mixes the batch"),
        pytest.param(assert_predict_order_and_company_invariant, pools_over_padding, id="predict-pooled over padding"),
    ],
)
def test_each_predict_check_fails_on_the_model_broken_against_it(
    check: Callable[[SensorModel], None], breaks: Callable[[SensorModel], SensorModel]
) -> None:
    model = small_model()
    check(model)
    with pytest.raises(AssertionError):
        check(breaks(model))


def test_the_anomaly_score_check_fails_on_a_serving_path_that_drops_the_head() -> None:
    def without_head(
        model: SensorModel, norm: RunningNorm, values: Sequence[np.ndarray], budget: int
    ) -> list[Prediction]:
        return predict(head_dropped(model), norm, values, budget)

    model = small_model(channels=2, n_classes=0)
    with pytest.raises(AssertionError):
        assert_anomaly_score_is_the_one_step_error(model, without_head)


def test_the_device_comparison_is_tighter_than_what_the_head_adds() -> None:
    """The CPU-vs-device check would see a device path that lost the head (run here on the CPU)."""
    norm, items = device_items()
    model = small_model()
    assert_same_predictions(predict(model, norm, items, 512), predict(small_model(), norm, items, 512))
    with pytest.raises(AssertionError):
        assert_same_predictions(predict(model, norm, items, 512), predict(head_dropped(model), norm, items, 512))
