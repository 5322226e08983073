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
from streamtrain.model.inference import (
    PREDICT_MIN_LENGTH_SHARE,
    InferenceModel,
    Prediction,
    PredictionArrays,
    forward_on_model_device,
    model_device,
    plan_predict_batches,
    predict,
    predict_arrays,
)
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


def test_output_names_follow_the_head() -> None:
    norm = RunningNorm(2)
    assert InferenceModel(small_model(n_classes=3), norm).output_names == ("next", "anomaly_score", "probs")
    assert InferenceModel(small_model(n_classes=0), norm).output_names == ("next", "anomaly_score")


def test_predictions_are_float32_in_request_order_even_for_one_class_and_for_none() -> None:
    rng = np.random.default_rng(3)
    values = ragged(rng, 5, 2) + [rng.normal(size=(3, 2))]  # a float64 instance too
    one_class = small_model(n_classes=1)
    arrays = predict_arrays(one_class, RunningNorm(2), values, 64)
    assert arrays.next.dtype == arrays.anomaly_score.dtype == np.float32
    assert arrays.probs is not None and arrays.probs.dtype == np.float32 and arrays.probs.tolist() == [[1.0]] * 6
    empty = predict_arrays(small_model(n_classes=3), RunningNorm(2), [], 64)
    assert empty.next.shape == (0, 2) and empty.anomaly_score.shape == (0,)
    assert empty.probs is not None and empty.probs.shape == (0, 3) and len(empty) == 0
    assert predict_arrays(small_model(n_classes=0), RunningNorm(2), [], 64).probs is None
    with pytest.raises(ValueError) as refused:
        predict_arrays(one_class, RunningNorm(2), [np.zeros((0, 2), np.float32)], 64)
    assert str(refused.value) == "predict: every instance needs at least one reading"


def test_prediction_arrays_slice_in_order_and_flag_rows_that_are_not_finite() -> None:
    arrays = PredictionArrays(
        next=np.array([[1.0, 2.0], [np.inf, 0.0], [3.0, 4.0], [5.0, 6.0]], np.float32),
        anomaly_score=np.array([0.1, 0.2, np.nan, 0.4], np.float32),
        probs=np.array([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [np.nan, 1.0]], np.float32),
    )
    assert len(arrays) == 4 and arrays.finite_rows().tolist() == [True, False, False, False]
    middle = arrays[1:3]
    assert len(middle) == 2 and middle.next.tolist() == [[np.inf, 0.0], [3.0, 4.0]]
    assert middle.probs is not None and middle.probs.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    without = PredictionArrays(arrays.next, arrays.anomaly_score, None)
    assert without.finite_rows().tolist() == [True, False, False, True] and without[2:].probs is None
    assert [p.next for p in without[2:].to_predictions()] == [[3.0, 4.0], [5.0, 6.0]]
    with pytest.raises(TypeError, match="^PredictionArrays: index with a slice$"):
        arrays[0]  # type: ignore[index]


def test_the_planner_keeps_equal_lengths_in_request_order_and_cuts_at_the_budget_and_share() -> None:
    groups = plan_predict_batches(np.full(100, 3), 30)
    assert [len(g) for g in groups] == [10] * 10 and np.concatenate(groups).tolist() == list(range(100))
    assert [g.tolist() for g in plan_predict_batches(np.ones(6, dtype=np.int64), 4)] == [[0, 1, 2, 3], [4, 5]]
    # an item exactly at the share of the longest (6 of 8 at 0.75) joins its group
    assert [g.tolist() for g in plan_predict_batches(np.array([8, 6, 5]), 100)] == [[0, 1], [2]]


def test_the_model_device_is_its_parameters_then_its_buffers_then_the_host() -> None:
    buffers_only = torch.nn.Module()
    buffers_only.register_buffer("b", torch.zeros(1, device="meta"))
    assert model_device(buffers_only) == torch.device("meta")
    both = torch.nn.Linear(1, 1, device="meta")
    both.register_buffer("b", torch.zeros(1))
    assert model_device(both) == torch.device("meta")
    assert model_device(torch.nn.Module()) == torch.device("cpu")


def test_a_forward_for_host_tensors_is_the_model_s_own_forward() -> None:
    model = small_model(n_classes=3)
    x, mask = pad_batch([torch.randn(4, 2), torch.randn(2, 2)])
    got, want = forward_on_model_device(model, x, mask), model(x, mask)
    torch.testing.assert_close(got.forecast, want.forecast)
    assert got.logits is not None and want.logits is not None
    torch.testing.assert_close(got.logits, want.logits)
    assert forward_on_model_device(small_model(n_classes=0), x, mask).logits is None
