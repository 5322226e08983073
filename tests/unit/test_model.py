"""Model, norm, losses and no-shuffle predict.

Every model-level invariant is a small ``assert_*`` check run on a model whose random body
and random head both reach the forecast (an untrained SensorModel's zero head would make
its forecast the last reading whatever the body does), and run again on a copy broken
against it (:mod:`broken_models`), which must fail it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from broken_models import computing_model, head_dropped, mixes_batch, non_causal, pools_over_padding, reads_padding

from device_params import CUDA, DEVICES
from streamtrain.data.collate import collate
from streamtrain.model.network import (
    Prediction,
    RunningNorm,
    SensorModel,
    classification_loss,
    forecast_loss,
    naive_last_value_loss,
    predict,
    total_loss,
)

torch.set_num_threads(1)


def pad_batch(items: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate(items)
    return batch.values, batch.mask


def small_model(channels: int = 2, n_classes: int = 3, seed: int = 0) -> SensorModel:
    """A model that computes something: random body, random non-zero forecast head."""
    return computing_model(channels, n_classes=n_classes, seed=seed, d_model=32, n_heads=4, n_layers=2, max_len=64)


def untrained_model(channels: int = 2, n_classes: int = 3, seed: int = 0) -> SensorModel:
    """A model as SensorModel builds it: the zero head makes its forecast the last reading."""
    torch.manual_seed(seed)
    return SensorModel(channels, n_classes=n_classes, d_model=32, n_heads=4, n_layers=2, max_len=64).eval()


def ragged(rng: np.random.Generator, n: int, channels: int, max_len: int = 40) -> list[np.ndarray]:
    return [rng.normal(size=(int(rng.integers(1, max_len)), channels)).astype(np.float32) for _ in range(n)]


def test_shapes_and_logits() -> None:
    model = small_model()
    x = torch.randn(5, 12, 2)
    mask = torch.ones(5, 12, dtype=torch.bool)
    out = model(x, mask)
    assert out.forecast.shape == (5, 12, 2)
    assert out.logits is not None and out.logits.shape == (5, 3)
    assert small_model(n_classes=0)(x, mask).logits is None


def test_rejects_wrong_channels_and_too_long() -> None:
    model = small_model()
    with pytest.raises(ValueError, match="expected x_norm"):
        model(torch.randn(2, 5, 3), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.randn(1, 65, 2), torch.ones(1, 65, dtype=torch.bool))


def assert_padding_values_ignored(model: SensorModel) -> None:
    """Garbage (huge, NaN) in the padding changes no output, and pad forecasts are zero."""
    x = torch.randn(3, 10, model.channels, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, 4:] = False
    mask[1, 1:] = False
    garbage = x.clone()
    garbage[~mask] = torch.tensor([1e30, float("nan")])
    with torch.no_grad():
        a, b = model(x, mask), model(garbage, mask)
    assert torch.isfinite(b.forecast).all() and torch.isfinite(b.logits).all()
    torch.testing.assert_close(a.forecast, b.forecast)
    torch.testing.assert_close(a.logits, b.logits)
    assert (b.forecast[~mask] == 0).all()


def test_padding_values_do_not_matter_and_pad_outputs_are_zero() -> None:
    assert_padding_values_ignored(small_model())


def test_fully_masked_row_gives_no_nan() -> None:
    model = small_model()
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, :3] = True
    out = model(torch.randn(2, 6, 2), mask)
    assert torch.isfinite(out.forecast).all() and torch.isfinite(out.logits).all()


def assert_causal(model: SensorModel) -> None:
    """Changing the readings from position ``cut`` on changes no forecast before ``cut``."""
    x = torch.randn(3, 10, model.channels, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 10, dtype=torch.bool)
    with torch.no_grad():
        reference = model(x, mask).forecast
        for cut in (1, 6, 9):
            changed = x.clone()
            changed[:, cut:] += 5.0
            torch.testing.assert_close(model(changed, mask).forecast[:, :cut], reference[:, :cut])


def test_causal_future_does_not_change_past() -> None:
    assert_causal(small_model())


def assert_alone_equals_padded_in_company(model: SensorModel) -> None:
    """Each instance's forecasts and logits are the same alone as padded in a batch of others."""
    rng = np.random.default_rng(1)
    items = ragged(rng, 7, model.channels)
    values, mask = pad_batch(items)
    with torch.no_grad():
        together = model(values, mask)
        for i, item in enumerate(items):
            alone = model(torch.from_numpy(item)[None], torch.ones(1, len(item), dtype=torch.bool))
            torch.testing.assert_close(together.forecast[i, : len(item)], alone.forecast[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(together.logits[i], alone.logits[0], atol=1e-5, rtol=0)


def test_alone_equals_padded_in_company() -> None:
    assert_alone_equals_padded_in_company(small_model())


def test_forecast_loss_reductions_by_hand() -> None:
    x = torch.tensor([[[1.0], [2.0], [4.0]], [[0.0], [3.0], [9.0]]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    forecast = torch.zeros_like(x)
    out = type("O", (), {"forecast": forecast, "logits": None})()
    # targets: row0 -> 2, 4 ; row1 -> 3 (t=1 -> 9 is padding)
    assert forecast_loss(out, x, mask).item() == pytest.approx((4 + 16 + 9) / 3)
    torch.testing.assert_close(forecast_loss(out, x, mask, "per_sample"), torch.tensor([10.0, 9.0]))
    assert naive_last_value_loss(x, mask).item() == pytest.approx((1 + 4 + 9) / 3)
    out_single = type("O", (), {"forecast": forecast[:1, :1], "logits": None})()
    single = forecast_loss(out_single, x[:1, :1], mask[:1, :1], "per_sample")
    assert single.tolist() == [0.0]


def test_classification_loss_ignores_unlabelled() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 5.0], [1.0, 1.0]])
    labels = torch.tensor([0, -1, 1])
    expected = torch.nn.functional.cross_entropy(logits[[0, 2]], labels[[0, 2]])
    assert classification_loss(logits, labels).item() == pytest.approx(expected.item())
    per = classification_loss(logits, labels, "per_sample")
    assert per[1].item() == 0.0
    assert classification_loss(logits, torch.full((3,), -1)).item() == 0.0
    model = small_model()
    x, mask = torch.randn(3, 4, 2), torch.ones(3, 4, dtype=torch.bool)
    out = model(x, mask)
    both = total_loss(out, x, mask, labels, class_weight=0.5)
    assert both.item() == pytest.approx(
        (forecast_loss(out, x, mask) + 0.5 * classification_loss(out.logits, labels)).item(), rel=1e-6
    )


def test_running_norm_matches_numpy_across_batches() -> None:
    rng = np.random.default_rng(2)
    norm = RunningNorm(3)
    seen = []
    for _ in range(5):
        items = [
            (rng.normal(size=(int(rng.integers(1, 30)), 3)) * [1, 10, 0.1] + [5, -3, 0]).astype(np.float32)
            for _ in range(4)
        ]
        values, mask = pad_batch(items)
        values[~mask] = 1234.0  # padding must not count
        norm.update(values, mask)
        seen.extend(items)
    data = np.concatenate(seen).astype(np.float64)
    assert norm.count == len(data)
    np.testing.assert_allclose(norm.mean.numpy(), data.mean(0), rtol=1e-6)
    np.testing.assert_allclose(norm.std.numpy(), data.std(0), rtol=1e-5)
    x = torch.from_numpy(data[:10]).float()
    torch.testing.assert_close(norm.denormalize(norm.normalize(x)), x, atol=1e-4, rtol=1e-5)


def test_running_norm_floor_identity_and_state_dict() -> None:
    norm = RunningNorm(2)
    torch.testing.assert_close(norm.std, torch.ones(2, dtype=torch.float64))
    constant = torch.full((1, 5, 2), 3.0)
    norm.update(constant, torch.ones(1, 5, dtype=torch.bool))
    assert (norm.std > 0).all()
    assert torch.isfinite(norm.normalize(constant)).all()
    norm.update(torch.randn(2, 7, 2), torch.ones(2, 7, dtype=torch.bool))
    clone = RunningNorm(2)
    clone.load_state_dict(norm.state_dict())
    assert clone.count == norm.count
    torch.testing.assert_close(clone.mean, norm.mean)
    torch.testing.assert_close(clone.std, norm.std)
    with pytest.raises(ValueError, match="channels"):
        RunningNorm(3).load_state_dict(norm.state_dict())


@pytest.mark.parametrize("outlier_batch", [0, 6], ids=["during warm-up", "after warm-up"])
def test_one_extreme_event_does_not_drag_the_running_norm(outlier_batch: int) -> None:
    rng = np.random.default_rng(5)
    norm, reference = RunningNorm(1), RunningNorm(1, clip_std=None)
    clean = []
    for b in range(10):
        items = [rng.normal(2.0, 3.0, size=(40, 1)).astype(np.float32) for _ in range(8)]
        clean.extend(items)
        if b == outlier_batch:
            items.append(np.full((40, 1), 3e38, dtype=np.float32))  # valid (finite) but absurd
        values, mask = pad_batch(items)
        norm.update(values, mask)
        reference.update(values, mask)
    data = np.concatenate(clean).astype(np.float64)
    assert reference.std.item() > 1e30  # what the plain statistics would do
    assert norm.clipped == 40
    assert norm.mean.item() == pytest.approx(data.mean(), abs=0.5)
    assert norm.std.item() == pytest.approx(data.std(), rel=0.5)


def test_running_norm_keeps_sparse_channels_whole_during_warm_up() -> None:
    values = torch.zeros(1, 200, 1)
    values[0, ::50] = 1.0  # 2% ones: the MAD is 0, the spread cannot be judged
    norm = RunningNorm(1)
    norm.update(values, torch.ones(1, 200, dtype=torch.bool))
    assert norm.clipped == 0
    assert norm.mean.item() == pytest.approx(0.02)
    clone = RunningNorm(1, clip_std=3.0)
    clone.load_state_dict(norm.state_dict())
    assert (clone.clip_std, clone.warmup_count, clone.clipped) == (8.0, 1024, 0)


def test_public_norm_is_frozen() -> None:
    norm = RunningNorm.from_public([1.0, 2.0], [2.0, 4.0])
    torch.testing.assert_close(norm.normalize(torch.tensor([3.0, 6.0])), torch.tensor([1.0, 1.0]))
    with pytest.raises(RuntimeError, match="frozen"):
        norm.update(torch.zeros(1, 1, 2), torch.ones(1, 1, dtype=torch.bool))


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


# ------------------------------------------------------------------ the checks catch what they guard


def test_the_models_under_test_compute_something() -> None:
    """The invariants mean nothing on a model whose forecast is the last reading: the one they run
    on forecasts something else, while the zero head hides a broken body completely."""
    x, mask = pad_batch(ragged(np.random.default_rng(8), 5, 2))
    with torch.no_grad():
        assert (small_model()(x, mask).forecast - x * mask[..., None]).abs().max() > 0.5
        untrained = untrained_model()
        torch.testing.assert_close(non_causal(untrained)(x, mask).forecast, untrained(x, mask).forecast, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("check", "breaks"),
    [
        pytest.param(assert_causal, non_causal, id="causality-non-causal mask"),
        pytest.param(assert_padding_values_ignored, reads_padding, id="padding values-mask ignored"),
        pytest.param(assert_alone_equals_padded_in_company, pools_over_padding, id="padding-pooled over padding"),
        pytest.param(assert_alone_equals_padded_in_company, mixes_batch, id="company-mixes the batch"),
        pytest.param(assert_predict_order_and_company_invariant, mixes_batch, id="predict company-mixes the batch"),
        pytest.param(assert_predict_order_and_company_invariant, pools_over_padding, id="predict-pooled over padding"),
    ],
)
def test_each_invariant_check_fails_on_the_model_broken_against_it(
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


def ar1_batch(rng: np.random.Generator, batch: int, phi: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    items = []
    for _ in range(batch):
        length = int(rng.integers(8, 33))
        x = np.empty(length)
        x[0] = rng.normal()
        noise = rng.normal(size=length) * np.sqrt(1 - phi**2)
        for t in range(1, length):
            x[t] = phi * x[t - 1] + noise[t]
        items.append(x[:, None].astype(np.float32))
    return pad_batch(items)


def test_tiny_training_beats_last_value_baseline() -> None:
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    model = SensorModel(1, d_model=32, n_heads=4, n_layers=1, max_len=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        x, mask = ar1_batch(rng, 32)
        loss = forecast_loss(model(x, mask), x, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    x, mask = ar1_batch(np.random.default_rng(99), 256)
    with torch.no_grad():
        trained = forecast_loss(model(x, mask), x, mask).item()
    naive = naive_last_value_loss(x, mask).item()
    # AR(1) with phi = 0.6: naive ≈ 2(1 - phi) = 0.8, best possible ≈ 1 - phi² = 0.64.
    assert trained < 0.9 * naive, (trained, naive)


def test_predict_groups_cover_every_instance_once_within_budget_and_length_share() -> None:
    from streamtrain.model.network import PREDICT_MIN_LENGTH_SHARE, plan_predict_batches

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


# ------------------------------------------------------------------ level shifts


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(shift=st.floats(-1e3, 1e3), seed=st.integers(0, 2**16))
def test_a_level_shift_moves_every_forecast_by_the_same_amount(shift: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    model = small_model(seed=seed % 7)  # a random head, not the zero start
    items = ragged(rng, 4, 2, max_len=20)
    values, mask = pad_batch(items)
    offset = torch.tensor([shift, -0.5 * shift], dtype=torch.float64)
    shifted = (values.double() + offset).float() * mask[..., None]
    a, b = model(values, mask), model(shifted, mask)
    expected = (a.forecast.double() + offset) * mask[..., None]
    tolerance = 1e-4 * (1.0 + abs(shift))  # float32 rounding of the shifted readings
    torch.testing.assert_close(b.forecast.double(), expected, atol=tolerance, rtol=0)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-3, rtol=0)


def test_an_untrained_model_forecasts_the_last_value() -> None:
    model = untrained_model()
    x, mask = pad_batch(ragged(np.random.default_rng(8), 5, 2))
    torch.testing.assert_close(model(x, mask).forecast, x * mask[..., None])


def level_shift_series(rng: np.random.Generator, steps: int, levels: list[float]) -> np.ndarray:
    """A noisy oscillation (period 12) around a level that jumps to each of ``levels`` in turn."""
    level = np.repeat(levels, -(-steps // len(levels)))[:steps]
    t = np.arange(steps)
    return level + np.sin(2 * np.pi * t / 12 + rng.uniform(0, 2 * np.pi)) + 0.2 * rng.normal(size=steps)


def fit_on_windows(model: SensorModel, windows: list[np.ndarray], steps: int, seed: int) -> RunningNorm:
    """The trainer's recipe in a loop: running norm, AdamW, clipped token-mean loss."""
    rng = np.random.default_rng(seed)
    norm = RunningNorm(windows[0].shape[1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model.train()
    for _ in range(steps):
        batch = collate([windows[i] for i in rng.choice(len(windows), size=min(64, len(windows)), replace=False)])
        norm.update(batch.values, batch.mask)
        x = norm.normalize(batch.values).float() * batch.mask[..., None]
        loss = forecast_loss(model(x, batch.mask), x, batch.mask)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return norm


def one_step_ratios(model: SensorModel, norm: RunningNorm, series: np.ndarray, start: int, length: int) -> np.ndarray:
    """Per channel: served forecast MSE / last-value MSE over ``series[start:]``."""
    instances = [series[t - length : t] for t in range(start, len(series))]
    forecast = np.array([p.next for p in predict(model, norm, instances, token_budget=4096)])
    target, last = series[start:], series[start - 1 : -1]
    return ((forecast - target) ** 2).mean(0) / ((last - target) ** 2).mean(0)


def test_forecasts_beat_the_last_value_on_levels_never_seen_in_training() -> None:
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    train = level_shift_series(rng, 3000, [0.0, 3.0, -2.0])[:, None].astype(np.float32)
    windows = [train[i : i + 24] for i in range(len(train) - 24)]
    model = SensorModel(1, d_model=32, n_heads=4, n_layers=2, max_len=64)
    norm = fit_on_windows(model, windows, steps=300, seed=11)
    for level in (25.0, -40.0, 500.0):  # far outside what the running norm has seen
        future = level_shift_series(rng, 400, [level])[:, None].astype(np.float32)
        ratio = one_step_ratios(model, norm, np.concatenate([train, future]), start=len(train) + 24, length=24)
        # Last value: MSE ~ 2(1 - cos(30 deg)) * 0.5 + 2 * 0.04 = 0.21; the best forecast's ~0.04.
        assert ratio[0] <= 0.7, (level, ratio)
