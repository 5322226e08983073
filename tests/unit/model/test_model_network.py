"""The network: shapes, causality, padding and company invariance, level-shift equivariance, learning.

Every model-level invariant is a small ``assert_*`` check run on a model whose random body
and random head both reach the forecast (an untrained SensorModel's zero head would make
its forecast the last reading whatever the body does), and run again on a copy broken
against it (:mod:`broken_models`), which must fail it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from broken_models import mixes_batch, non_causal, pools_over_padding, randomize_head, reads_padding
from hypothesis import given, settings
from hypothesis import strategies as st
from model_fixtures import pad_batch, ragged, small_model, untrained_model

import streamtrain.model.network as network_module
from streamtrain.data.collate import collate
from streamtrain.model.inference import predict
from streamtrain.model.losses import forecast_loss, naive_last_value_loss
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm

torch.set_num_threads(1)


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


def test_under_cpu_bf16_autocast_the_linears_run_in_bf16_and_attention_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, torch.dtype] = {}
    attention = torch.nn.functional.scaled_dot_product_attention

    def recording_attention(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        mixed = attention(q, *args, **kwargs)  # type: ignore[arg-type]
        seen["attention"] = q.dtype
        seen["attention output"] = mixed.dtype  # computed in float32 too, not cast down inside
        return mixed

    monkeypatch.setattr(network_module.F, "scaled_dot_product_attention", recording_attention)
    model = small_model()
    x, mask = torch.randn(3, 9, 2), torch.ones(3, 9, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen["linear"] = model.blocks[0].ff_in(torch.randn(2, model.blocks[0].ff_in.in_features)).dtype
        output = model(x, mask)
    assert seen == {"linear": torch.bfloat16, "attention": torch.float32, "attention output": torch.float32}
    torch.testing.assert_close(output.forecast.float(), model(x, mask).forecast, atol=0.05, rtol=0.05)


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


@pytest.mark.parametrize("row_multiple", [7, 64, 1000])
def test_token_rows_padded_to_a_multiple_change_no_forecast_logit_or_gradient(row_multiple: int) -> None:
    """The body's pad rows mix with no position: outputs and every parameter's gradient are those of
    the unpadded forward (a model whose random body and head both reach the outputs)."""
    x, mask = pad_batch(ragged(np.random.default_rng(3), 9, 2))
    assert x.shape[0] * x.shape[1] % row_multiple, "no pad row: nothing checked"
    outputs, gradients = [], []
    for multiple in (1, row_multiple):
        model = small_model().train()
        output = model(x, mask, row_multiple=multiple)
        (output.forecast.square().sum() + output.logits.square().sum()).backward()
        outputs.append(output)
        gradients.append([p.grad for p in model.parameters()])
    # float32 tolerances: on some CPUs (AVX2 without AVX-512) a matmul's kernel, and so its last bits,
    # depend on the row count (differences of up to 5e-6 seen there); a pad row that mixed in would not
    torch.testing.assert_close(outputs[1].forecast, outputs[0].forecast, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, atol=2e-5, rtol=1e-4)
    for padded, plain in zip(*gradients, strict=True):
        torch.testing.assert_close(padded, plain, atol=2e-5, rtol=1e-4)


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
    ],
)
def test_each_invariant_check_fails_on_the_model_broken_against_it(
    check: Callable[[SensorModel], None], breaks: Callable[[SensorModel], SensorModel]
) -> None:
    model = small_model()
    check(model)
    with pytest.raises(AssertionError):
        check(breaks(model))


# ------------------------------------------------------------------ learning


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


# ------------------------------------------------------------------ level shifts


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


# ------------------------------------------------------------------ the network written out by hand


def textbook_positions(max_len: int, d_model: int) -> torch.Tensor:
    """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)) (Vaswani et al.)."""
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    for p in range(max_len):
        for i in range(0, d_model, 2):
            angle = p / 10000.0 ** (i / d_model)
            table[p, i] = math.sin(angle)
            if i + 1 < d_model:
                table[p, i + 1] = math.cos(angle)
    return table.float()


def by_hand(model: SensorModel, x_norm: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the model documents it computes, one instance and one position at a time."""
    batch, length, channels = x_norm.shape
    forecast = torch.zeros(batch, length, channels)
    logits = []
    positions = textbook_positions(model.max_len, model.input.out_features)
    for b in range(batch):
        n = int(mask[b].sum())
        xb = x_norm[b, :n]
        features, scales = [], []
        for t in range(n):
            step = xb[t] - xb[t - 1] if t else torch.zeros(channels)
            mean_abs_step = sum((xb[s] - xb[s - 1]).abs() for s in range(1, t + 1)) / max(t, 1)
            scale = 1.25 * mean_abs_step + 0.05
            features.append(torch.cat([(xb[t] - xb[: t + 1].mean(dim=0)) / scale, step / scale]))
            scales.append(scale * torch.ones(channels))
        h = model.input(torch.stack(features)) + positions[:n]
        for block in model.blocks:
            attn = block.attn
            normed = block.attn_norm(h)
            q, k, v = (
                layer(normed).view(n, attn.n_heads, attn.head_dim) for layer in (attn.query, attn.key, attn.value)
            )
            scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(attn.head_dim)
            scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))  # a position sees its past
            mixed = torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v).reshape(n, -1)
            h = h + attn.out(mixed)
            h = h + block.ff_out(torch.nn.functional.gelu(block.ff_in(block.ff_norm(h))))
        h = model.final_norm(h)
        forecast[b, :n] = xb + torch.stack(scales) * model.forecast_head(h)
        if model.class_head is not None:
            logits.append(model.class_head(h[n - 1]))
    return forecast, torch.stack(logits) if logits else None


def test_the_forward_is_the_documented_computation() -> None:
    model = small_model(channels=2, n_classes=3)
    x, mask = pad_batch([torch.randn(7, 2) * 3 + 5, torch.randn(1, 2), torch.randn(12, 2)])
    with torch.no_grad():
        output = model(x, mask)
        forecast, logits = by_hand(model, x, mask)
    torch.testing.assert_close(output.forecast, forecast, rtol=1e-4, atol=1e-5)
    assert output.logits is not None and logits is not None
    torch.testing.assert_close(output.logits, logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.positions, textbook_positions(64, 32), rtol=0, atol=1e-6)


def test_dropout_acts_in_training_only() -> None:
    torch.manual_seed(0)
    model = SensorModel(2, d_model=16, n_heads=2, n_layers=1, max_len=16, dropout=0.5)
    randomize_head(model)
    x, mask = pad_batch([torch.randn(9, 2)])
    model.train()
    assert not torch.equal(model(x, mask).forecast, model(x, mask).forecast)
    model.eval()
    assert torch.equal(model(x, mask).forecast, model(x, mask).forecast)


def test_a_config_builds_the_same_network_and_its_defaults_are_the_documented_ones() -> None:
    default = SensorModel(3)
    assert default.config == {
        "channels": 3, "n_classes": 0, "d_model": 64, "n_heads": 4, "n_layers": 2, "ff_mult": 4, "max_len": 512,
        "dropout": 0.0, "form": "level_free_residual/v2",
    }  # fmt: skip
    model = small_model(channels=2, n_classes=3)
    rebuilt = SensorModel.from_config(model.config)
    rebuilt.load_state_dict(model.state_dict())
    x, mask = pad_batch([torch.randn(5, 2)])
    torch.testing.assert_close(rebuilt.eval()(x, mask).forecast, model(x, mask).forecast)
    with pytest.raises(ValueError) as refused:
        SensorModel.from_config({**model.config, "form": "level_free_residual/v1"})
    assert str(refused.value) == (
        "this model was saved in form 'level_free_residual/v1'; this streamtrain builds 'level_free_residual/v2', "
        "whose inputs and outputs differ: export or serve it with the streamtrain version that trained it"
    )
    settings = SimpleNamespace(channels=2, n_classes=1, d_model=24, n_heads=3, n_layers=3, max_len=40)
    built = network_module.build_model(settings)
    assert {k: built.config[k] for k in vars(settings)} == vars(settings)


@pytest.mark.parametrize(
    ("kw", "got"),
    [
        ({"channels": 0}, "got 0, 0, 2, 512"),
        ({"channels": 1, "n_classes": -1}, "got 1, -1, 2, 512"),
        ({"channels": 1, "n_layers": 0}, "got 1, 0, 0, 512"),
        ({"channels": 1, "max_len": 0}, "got 1, 0, 2, 0"),
    ],
)
def test_each_bad_size_is_refused_in_full(kw: dict[str, int], got: str) -> None:
    with pytest.raises(ValueError) as refused:
        SensorModel(**kw)  # type: ignore[arg-type]
    assert str(refused.value) == f"SensorModel: need channels >= 1, n_classes >= 0, n_layers >= 1, max_len >= 1; {got}"


def test_the_smallest_model_and_the_longest_input_are_allowed() -> None:
    assert SensorModel(1, d_model=8, n_heads=2, n_layers=1, max_len=1)(
        torch.ones(1, 1, 1), torch.ones(1, 1)
    ).forecast.shape == (1, 1, 1)
    model = SensorModel(1, d_model=8, n_heads=2, n_layers=1, max_len=4)
    assert model(torch.ones(2, 4, 1), torch.ones(2, 4)).forecast.shape == (2, 4, 1)
    with pytest.raises(ValueError, match=r"^d_model \(10\) must be a multiple of n_heads \(4\)$"):
        SensorModel(1, d_model=10, n_heads=4)


def test_pad_rows_adds_zero_rows_and_leaves_a_full_set_alone() -> None:
    rows = torch.ones(3, 2)
    assert network_module.pad_rows(rows, 3) is rows
    padded = network_module.pad_rows(rows, 5)
    assert padded.shape == (5, 2) and padded[3:].abs().sum() == 0 and padded[:3].tolist() == rows.tolist()
    assert network_module.pad_rows(rows, 4).shape == (4, 2)


def test_the_position_table_is_computed_in_float64() -> None:
    # float32 angles drift by ~1e-5 at position 500: the table must match the float64 formula to an ulp
    torch.testing.assert_close(
        network_module.sinusoidal_positions(512, 64), textbook_positions(512, 64), rtol=0, atol=2e-7
    )


def test_the_position_table_is_not_saved_with_the_weights() -> None:
    model = small_model()
    assert "positions" not in model.state_dict()  # rebuilt from max_len: a checkpoint carries no copy
    with pytest.raises(ValueError, match="saved in form None"):
        SensorModel.from_config({k: v for k, v in model.config.items() if k != "form"})


@pytest.mark.parametrize("autocast", [False, True])
def test_attention_dropout_acts_in_training_only(autocast: bool) -> None:
    torch.manual_seed(0)
    attention = network_module.CausalSelfAttention(16, 2, dropout=0.5)
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        attention.train()
        assert not torch.equal(attention(x, 2, 4), attention(x, 2, 4))
        attention.eval()
        assert torch.equal(attention(x, 2, 4), attention(x, 2, 4))
