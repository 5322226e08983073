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


def _batch(*values: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of ``values`` (one channel), every position real."""
    return torch.tensor(values, dtype=torch.float32).reshape(1, -1, 1), torch.ones(1, len(values), dtype=torch.bool)


@pytest.mark.parametrize(
    ("kw", "refusal"),
    [
        ({"channels": 0}, "RunningNorm: channels must be >= 1, got 0"),
        ({"channels": 1, "var_floor": 0.0}, "RunningNorm: var_floor must be > 0, got 0.0"),
        ({"channels": 1, "clip_std": 0.0}, "RunningNorm: clip_std must be > 0 or None, got 0.0"),
    ],
)
def test_each_construction_refusal_in_full(kw: dict[str, float], refusal: str) -> None:
    with pytest.raises(ValueError) as refused:
        RunningNorm(**kw)  # type: ignore[arg-type]
    assert str(refused.value) == refusal


def test_a_band_under_one_standard_deviation_is_allowed() -> None:
    assert RunningNorm(1, clip_std=0.5).clip_std == 0.5


def test_a_sample_of_one_merges_as_any_other() -> None:
    count, mean, m2 = merge_moments(
        1, torch.tensor([2.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
        1, torch.tensor([4.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
    )  # fmt: skip
    assert count == 2 and mean.tolist() == [3.0] and m2.tolist() == [2.0]


def test_the_statistics_are_float64_from_the_start_and_after_any_merge() -> None:
    norm = RunningNorm(2)
    assert norm.mean.dtype == torch.float64 and norm.state_dict()["m2"].dtype == torch.float64
    norm.merge(3, torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.25]))  # float32 moments
    assert norm.mean.dtype == torch.float64 and norm.state_dict()["m2"].dtype == torch.float64


def test_public_constants_are_taken_in_float64_and_checked_in_full() -> None:
    norm = RunningNorm.from_public([100_000_001.0, 0.0], [3.0, 0.1])  # neither is a float32
    assert norm.mean.tolist() == [100_000_001.0, 0.0] and norm.std.tolist() == pytest.approx([3.0, 0.1], rel=1e-12)
    assert norm.var_floor == pytest.approx(1e-8)  # a millionth of the smallest variance
    assert RunningNorm.from_public([0.0], [3.0]).var_floor == pytest.approx(9e-6)
    for mean, std in (([0.0, 1.0], [1.0]), ([0.0], [0.0])):
        with pytest.raises(ValueError) as refused:
            RunningNorm.from_public(mean, std)
        assert str(refused.value) == "RunningNorm.from_public: mean and std need one entry per channel, std > 0"
    frozen = RunningNorm.from_public([0.0], [1.0])
    values, mask = _batch(1.0, 2.0)
    with pytest.raises(RuntimeError) as refused:
        frozen.update(values, mask)
    assert str(refused.value) == "RunningNorm.update: this norm is frozen (public constants); do not update it"
    with pytest.raises(RuntimeError) as refused:
        frozen.merge(1, torch.zeros(1), torch.zeros(1))
    assert str(refused.value) == "RunningNorm.merge: this norm is frozen (public constants); do not update it"


@pytest.mark.parametrize(
    ("values", "mask"),
    [
        (torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)),  # no channel axis
        (torch.zeros(2, 3, 2), torch.ones(2, 3, dtype=torch.bool)),  # two channels for a one-channel norm
        (torch.zeros(2, 3, 1), torch.ones(2, 4, dtype=torch.bool)),  # a mask of another length
    ],
)
def test_a_batch_of_the_wrong_shape_is_refused_in_full(values: torch.Tensor, mask: torch.Tensor) -> None:
    with pytest.raises(ValueError) as refused:
        RunningNorm(1).batch_moments(values, mask)
    got = f"got {tuple(values.shape)} and {tuple(mask.shape)}"
    assert str(refused.value) == f"RunningNorm.update: expected values [B, L, 1] and mask [B, L], {got}"


def test_the_moments_of_no_token_and_of_one_token() -> None:
    norm = RunningNorm(2, clip_std=None)
    values = torch.tensor([[[3.0, 4.0], [9.0, 9.0]]])
    count, mean, m2, clipped = norm.batch_moments(values, torch.tensor([[False, False]]))
    assert (count, clipped) == (0, 0) and mean.tolist() == [0.0, 0.0] and m2.tolist() == [0.0, 0.0]
    assert mean.dtype == torch.float64 and m2.dtype == torch.float64
    count, mean, m2, clipped = norm.batch_moments(values, torch.tensor([[True, False]]))
    assert (count, clipped) == (1, 0) and mean.tolist() == [3.0, 4.0] and m2.tolist() == [0.0, 0.0]


def test_the_band_comes_from_the_running_statistics_from_exactly_the_warm_up_count() -> None:
    norm = RunningNorm(1, clip_std=2.0, warmup_count=4)
    norm.update(*_batch(0.0, 1.0, 2.0, 3.0))
    assert norm.count == 4 and norm.clipped == 0
    # the batch's own median and MAD would clamp nothing here (its MAD is 0); the running band clamps all four
    count, mean, _, clipped = norm.batch_moments(*_batch(100.0, 100.0, 100.0, 101.0))
    assert clipped == 4 and mean.item() == pytest.approx(1.5 + 2.0 * float(np.std([0.0, 1.0, 2.0, 3.0])))


def test_during_warm_up_a_spread_under_one_clamps_its_outlier() -> None:
    norm = RunningNorm(1, clip_std=8.0)
    _, _, _, clipped = norm.batch_moments(*_batch(0.0, 0.1, 0.2, 0.3, 0.4, 100.0))
    assert clipped == 1  # MAD-based scale 0.22: the band is 1.8 wide, 100 is far outside


def test_numpy_arrays_normalize_as_tensors_do_and_back() -> None:
    norm = RunningNorm(2, clip_std=None)
    norm.update(*pad_batch([torch.tensor([[1.0, 10.0], [3.0, 30.0], [8.0, 20.0]])]))
    x = np.array([[2.0, 5.0], [-1.0, 40.0]])
    normalized = norm.normalize(x)
    np.testing.assert_allclose(normalized, norm.normalize(torch.tensor(x)).numpy(), rtol=1e-12)
    np.testing.assert_allclose(normalized, (x - norm.mean.numpy()) / norm.std.numpy(), rtol=1e-12)
    np.testing.assert_allclose(norm.denormalize(normalized), x, rtol=1e-12)
    np.testing.assert_allclose(
        norm.denormalize(torch.tensor(normalized)).numpy(), norm.denormalize(normalized), rtol=1e-12
    )


def test_every_field_survives_a_round_trip_and_an_old_state_gets_the_defaults() -> None:
    norm = RunningNorm.from_public([1.0, -2.0], [0.5, 3.0])
    norm.clipped, norm.warmup_count, norm.clip_std = 7, 99, None
    restored = RunningNorm(2, clip_std=3.0, warmup_count=5)
    restored.load_state_dict(norm.state_dict())
    assert restored.state_dict().keys() == norm.state_dict().keys()
    for key, value in norm.state_dict().items():
        got = restored.state_dict()[key]
        assert (got.tolist() if isinstance(got, torch.Tensor) else got) == (
            value.tolist() if isinstance(value, torch.Tensor) else value
        ), key
    assert restored.frozen is True and restored.clip_std is None
    old = {"channels": 1, "var_floor": 1e-6, "count": 2, "mean": [100_000_001.0], "m2": [2.0]}
    fresh = RunningNorm(1, clip_std=4.0, warmup_count=5)
    fresh.clipped = 3
    fresh.load_state_dict(old)
    assert (fresh.frozen, fresh.clipped, fresh.warmup_count, fresh.clip_std) == (False, 0, 5, None)
    assert fresh.mean.tolist() == [100_000_001.0] and fresh.mean.dtype == torch.float64
    assert fresh.state_dict()["m2"].dtype == torch.float64
