"""The losses: the one-step forecast MSE and the cross-entropy by hand, in both reductions."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import small_model

from streamtrain.model.losses import classification_loss, forecast_loss, naive_last_value_loss, total_loss

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
