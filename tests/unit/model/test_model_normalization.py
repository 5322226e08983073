"""RunningNorm: exact statistics whatever the batching, padding ignored, a variance floor, outliers
clamped before they are merged, a frozen public norm, and the one moment merge everyone uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_fixtures import pad_batch

from streamtrain.model.normalization import RunningNorm, merge_moments

torch.set_num_threads(1)


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


def moments_of(data: np.ndarray) -> tuple[int, torch.Tensor, torch.Tensor]:
    rows = torch.from_numpy(data.astype(np.float64))
    mean = rows.mean(dim=0) if len(data) else torch.zeros(data.shape[1], dtype=torch.float64)
    return len(data), mean, (rows - mean).square().sum(dim=0)


def test_merged_moments_are_those_of_the_union() -> None:
    rng = np.random.default_rng(7)
    parts = [rng.normal(3.0, 2.0, size=(n, 2)) * [1.0, 1e3] for n in (5, 1, 40, 0, 13)]
    count, mean, m2 = moments_of(parts[0])
    for part in parts[1:]:
        count, mean, m2 = merge_moments(count, mean, m2, *moments_of(part))
    union = np.concatenate(parts)
    assert count == len(union)
    np.testing.assert_allclose(mean.numpy(), union.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(m2.numpy(), ((union - union.mean(axis=0)) ** 2).sum(axis=0), rtol=1e-10)


def test_merging_an_empty_sample_gives_copies_of_the_other() -> None:
    empty = moments_of(np.zeros((0, 2)))
    full = moments_of(np.random.default_rng(8).normal(size=(9, 2)))
    for merged in (merge_moments(*empty, *full), merge_moments(*full, *empty)):
        assert merged[0] == 9
        assert torch.equal(merged[1], full[1]) and torch.equal(merged[2], full[2])
        assert merged[1] is not full[1] and merged[2] is not full[2]


def test_merging_the_moments_of_a_batch_is_updating_with_it() -> None:
    rng = np.random.default_rng(9)
    updated, merged = RunningNorm(2, clip_std=None), RunningNorm(2, clip_std=None)
    for _ in range(4):
        items = [rng.normal(size=(int(rng.integers(1, 20)), 2)).astype(np.float32) for _ in range(3)]
        values, mask = pad_batch(items)
        updated.update(values, mask)
        merged.merge(*moments_of(np.concatenate(items).astype(np.float64)))
    assert merged.count == updated.count
    assert torch.equal(merged.mean, updated.mean) and torch.equal(merged.std, updated.std)
    merged.merge(0, torch.zeros(2), torch.zeros(2), clipped=3)
    assert merged.clipped == 3 and merged.count == updated.count
    with pytest.raises(RuntimeError, match="frozen"):
        RunningNorm.from_public([0.0], [1.0]).merge(1, torch.zeros(1), torch.zeros(1))
