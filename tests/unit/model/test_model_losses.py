"""The losses: the one-step forecast MSE and the cross-entropy by hand, in both reductions."""

from __future__ import annotations

import math

import pytest
import torch
from model_fixtures import small_model

from streamtrain.model.losses import classification_loss, forecast_loss, naive_last_value_loss, total_loss
from streamtrain.model.network import ModelOutput

torch.set_num_threads(1)


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


def _output(forecast: torch.Tensor, logits: torch.Tensor | None = None) -> ModelOutput:
    return ModelOutput(forecast=forecast, logits=logits)


def test_one_real_target_is_the_whole_mean() -> None:
    x = torch.tensor([[[1.0], [3.0], [0.0]]])
    mask = torch.tensor([[True, True, False]])
    out = _output(torch.zeros_like(x))
    assert forecast_loss(out, x, mask).item() == 9.0 and forecast_loss(out, x, mask, "per_sample").tolist() == [9.0]
    logits, labels = torch.tensor([[0.0, 0.0], [3.0, 1.0]]), torch.tensor([1, -1])
    assert classification_loss(logits, labels).item() == pytest.approx(math.log(2.0))


def test_padding_that_holds_garbage_counts_for_nothing() -> None:
    x = torch.tensor([[[1.0], [2.0], [float("nan")]]])
    mask = torch.tensor([[True, True, False]])
    forecast = torch.tensor([[[2.0], [float("inf")], [float("nan")]]])
    assert forecast_loss(_output(forecast), x, mask).item() == 0.0
    logits, labels = torch.tensor([[float("nan"), 0.0], [0.0, 0.0]]), torch.tensor([-1, 0])
    assert classification_loss(logits, labels, "per_sample").tolist() == [0.0, pytest.approx(math.log(2.0))]


@pytest.mark.parametrize("loss", ["forecast", "classification"])
def test_an_unknown_reduction_is_refused_in_full(loss: str) -> None:
    x, mask = torch.zeros(1, 2, 1), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"^reduction must be 'tokens' or 'per_sample', got 'mean'$"):
        if loss == "forecast":
            forecast_loss(_output(x), x, mask, "mean")  # type: ignore[arg-type]
        else:
            classification_loss(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), "mean")  # type: ignore[arg-type]


def test_the_total_is_the_forecast_loss_plus_the_classification_loss_in_either_reduction() -> None:
    x = torch.tensor([[[1.0], [3.0]], [[2.0], [2.0]]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    logits, labels = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, -1])
    out = _output(torch.zeros_like(x), logits)
    for reduction in ("tokens", "per_sample"):
        expected = forecast_loss(out, x, mask, reduction) + classification_loss(logits, labels, reduction)
        torch.testing.assert_close(total_loss(out, x, mask, labels, reduction), expected)  # class weight 1
    assert total_loss(out, x, mask, labels, "per_sample").shape == (2,)
    # a head without labels, or labels without a head: the forecast loss alone
    torch.testing.assert_close(total_loss(out, x, mask, None), forecast_loss(out, x, mask))
    torch.testing.assert_close(total_loss(_output(out.forecast), x, mask, labels), forecast_loss(out, x, mask))
