"""Per-sample clipped gradients: equal to a one-example-at-a-time reference, split-invariant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamtrain.data.bucketing import TokenBudget, plan_batches
from streamtrain.data.collate import collate
from streamtrain.data.randomness import SeededRandomness
from streamtrain.model.losses import total_loss
from streamtrain.model.network import SensorModel
from streamtrain.privacy.noise import GRID
from streamtrain.privacy.per_sample import NORM_EPS, PerSampleGradients, clip_factors


def make_model(n_classes: int = 2) -> SensorModel:
    torch.manual_seed(0)
    return SensorModel(2, n_classes=n_classes, d_model=16, n_heads=2, n_layers=2, max_len=64)


def ragged(seed: int, n: int) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    items = [rng.normal(size=(int(rng.integers(1, 30)), 2)).astype(np.float32) * 2 for _ in range(n)]
    labels = rng.integers(-1, 2, size=n)
    return items, labels


def reference_clipped_sum(
    model: SensorModel, items: list[np.ndarray], labels: np.ndarray, clip: float
) -> dict[str, torch.Tensor]:
    """One example at a time, unpadded, with ordinary autograd."""
    total = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for item, label in zip(items, labels, strict=True):
        x = torch.from_numpy(item)[None]
        mask = torch.ones(1, len(item), dtype=torch.bool)
        model.zero_grad()
        total_loss(model(x, mask), x, mask, torch.tensor([label]), reduction="per_sample").sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.square().sum() for g in grads.values()))
        factor = min(1.0, clip / (float(norm) + NORM_EPS))
        for name, g in grads.items():
            total[name] += factor * g
    return total


@pytest.mark.parametrize("clip", [0.05, 1000.0])  # mostly clipped / never clipped
def test_clipped_sum_matches_one_at_a_time_reference(clip: float) -> None:
    model = make_model()
    items, labels = ragged(1, 9)
    gradients = PerSampleGradients(model, clip)
    batch = collate(items, labels=labels)
    summed, norms = gradients.clipped_sum(batch.values, batch.mask, batch.labels)
    expected = reference_clipped_sum(model, items, labels, clip)
    for name in expected:
        torch.testing.assert_close(summed[name], expected[name], atol=2e-5, rtol=1e-4)
    assert norms.shape == (9,)
    if clip < 1:
        assert bool((norms > clip).all()), "the test wants every example clipped"


def test_each_clipped_gradient_has_norm_at_most_c() -> None:
    model = make_model()
    items, labels = ragged(2, 6)
    batch = collate(items, labels=labels)
    gradients = PerSampleGradients(model, clip_norm=0.1)
    per_sample = gradients.per_sample(batch.values, batch.mask, batch.labels)
    norms = torch.sqrt(sum(g.reshape(6, -1).square().sum(1) for g in per_sample.values()))
    clipped = norms * clip_factors(norms, 0.1)
    assert bool((clipped <= 0.1 + 1e-6).all())
    assert clip_factors(torch.tensor([0.0]), 1.0).item() == 1.0  # a zero gradient stays zero


def test_sum_is_the_same_however_the_batch_is_split() -> None:
    model = make_model()
    items, labels = ragged(3, 24)
    gradients = PerSampleGradients(model, clip_norm=0.5)
    whole = collate(items, labels=labels)
    reference, _ = gradients.clipped_sum(whole.values, whole.mask, whole.labels)
    lengths = np.array([len(v) for v in items])
    for seed, max_tokens in [(0, 40), (1, 120), (2, 10_000)]:
        plan = plan_batches(lengths, TokenBudget(max_tokens), SeededRandomness(seed), pool_size=len(items))
        assert len(plan.batches) > 1 or max_tokens == 10_000
        total = {name: torch.zeros_like(t) for name, t in reference.items()}
        for group in plan.batches:
            batch = collate([items[i] for i in group], labels=labels[group], pad_to_multiple_of=8)
            part, _ = gradients.clipped_sum(batch.values, batch.mask, batch.labels)
            for name in total:
                total[name] += part[name]
        for name in reference:
            torch.testing.assert_close(total[name], reference[name], atol=2e-5, rtol=1e-4)


def test_length_one_unlabelled_event_has_zero_gradient() -> None:
    """The 'zero record' the accountant's replace-one argument relies on (docs/privacy.md)."""
    model = make_model()
    batch = collate([np.ones((1, 2), np.float32)], labels=[-1])
    grads = PerSampleGradients(model, 1.0).per_sample(batch.values, batch.mask, batch.labels)
    assert all(bool((g == 0).all()) for g in grads.values())


def test_non_finite_example_contributes_zero_not_nan() -> None:
    model = make_model()
    items, labels = ragged(4, 4)
    gradients = PerSampleGradients(model, clip_norm=0.5)
    healthy = collate(items[:3], labels=labels[:3])
    expected, _ = gradients.clipped_sum(healthy.values, healthy.mask, healthy.labels)
    overflowing = [*items[:3], np.full((5, 2), 3e38, np.float32)]
    batch = collate(overflowing, labels=[*labels[:3], 1])
    summed, norms = gradients.clipped_sum(batch.values, batch.mask, batch.labels)
    assert not bool(torch.isfinite(norms[3])) and bool(torch.isfinite(norms[:3]).all())
    for name in expected:
        torch.testing.assert_close(summed[name], expected[name], atol=2e-5, rtol=1e-4)


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors.values()])


@pytest.mark.parametrize("clip", [0.05, 1000.0])
def test_grid_vectors_have_norm_at_most_the_grid_exactly(clip: float) -> None:
    """One example per call: the integer sum is that example's vector; its squared norm,
    computed in integers, is at most GRID², and it is the clipped gradient rounded toward 0."""
    model = make_model()
    items, labels = ragged(5, 6)
    gradients = PerSampleGradients(model, clip)
    for item, label in zip(items, labels, strict=True):
        batch = collate([item], labels=[label])
        ints, _ = gradients.grid_sum(batch.values, batch.mask, batch.labels)
        vector = flat(ints)
        assert vector.dtype == torch.int64
        assert int((vector * vector).sum()) <= GRID * GRID
        reference, _ = gradients.clipped_sum(batch.values, batch.mask, batch.labels)
        scaled = flat(reference).double() * (GRID / clip)
        assert bool((vector.double().abs() <= scaled.abs() + 1e-3).all())  # toward zero
        assert bool(((scaled - vector.double()).abs() <= 1 + 1e-3).all())  # within one grid unit
        if clip < 1 and len(item) > 1:
            assert int((vector * vector).sum()) >= (0.99 * GRID) ** 2  # clipped vectors fill the ball


def test_grid_sum_matches_the_float_clipped_sum_within_one_unit_per_example() -> None:
    model = make_model()
    items, labels = ragged(6, 12)
    gradients = PerSampleGradients(model, clip_norm=0.5)
    batch = collate(items, labels=labels)
    ints, norms = gradients.grid_sum(batch.values, batch.mask, batch.labels)
    floats, float_norms = gradients.clipped_sum(batch.values, batch.mask, batch.labels)
    torch.testing.assert_close(norms.float(), float_norms, rtol=1e-4, atol=1e-6)
    difference = flat(floats).double() * (GRID / 0.5) - flat(ints).double()
    assert float(difference.abs().max()) <= len(items) + 1e-3


def test_a_sensor_group_is_clipped_as_one_summed_gradient() -> None:
    model = make_model()
    items, labels = ragged(7, 5)
    gradients = PerSampleGradients(model, clip_norm=0.05)
    batch = collate(items, labels=labels)
    groups = torch.tensor([0, 1, 0, 2, 1])
    ints, norms = gradients.grid_sum(batch.values, batch.mask, batch.labels, groups=groups, n_groups=3)
    assert norms.shape == (3,)
    per_sample = gradients.per_sample(batch.values, batch.mask, batch.labels)
    matrix = torch.cat([g.reshape(5, -1) for g in per_sample.values()], dim=1).double()
    expected = torch.zeros(matrix.shape[1], dtype=torch.float64)
    for g in range(3):
        summed = matrix[groups == g].sum(dim=0)
        expected += summed * min(1.0, 0.05 / float(summed.norm())) * (GRID / 0.05)
    assert float((flat(ints).double() - expected).abs().max()) <= 3 + 1e-3  # one unit per group
    # the group's sum is clipped once: three groups give at most three clip norms of mass
    assert float(flat(ints).double().norm()) <= 3 * GRID


def test_a_model_with_dropout_in_training_mode_gets_per_sample_gradients() -> None:
    """Each example draws its own dropout mask inside vmap instead of the call failing."""
    torch.manual_seed(0)
    model = SensorModel(2, n_classes=2, d_model=16, n_heads=2, n_layers=1, max_len=64, dropout=0.5).train()
    items, labels = ragged(8, 3)
    batch = collate(items, labels=labels)
    summed, norms = PerSampleGradients(model, 1.0).clipped_sum(batch.values, batch.mask, batch.labels)
    assert norms.shape == (3,) and bool(torch.isfinite(norms).all())
    assert all(bool(torch.isfinite(g).all()) for g in summed.values())


def test_grid_sum_of_a_non_finite_example_contributes_zero() -> None:
    model = make_model()
    items, labels = ragged(4, 4)
    gradients = PerSampleGradients(model, clip_norm=0.5)
    healthy = collate(items[:3], labels=labels[:3])
    expected, _ = gradients.grid_sum(healthy.values, healthy.mask, healthy.labels)
    batch = collate([*items[:3], np.full((5, 2), 3e38, np.float32)], labels=[*labels[:3], 1])
    ints, norms = gradients.grid_sum(batch.values, batch.mask, batch.labels)
    assert not bool(torch.isfinite(norms[3])) and bool(torch.isfinite(norms[:3]).all())
    for name in expected:
        assert torch.equal(ints[name], expected[name])


@pytest.mark.parametrize("n_groups, expected_units", [(None, 3), (5, 5)])
def test_grid_sum_has_one_norm_per_group_counting_from_the_largest_id_unless_told(
    n_groups: int | None, expected_units: int
) -> None:
    model = make_model()
    items, labels = ragged(7, 5)
    gradients = PerSampleGradients(model, clip_norm=0.05)
    batch = collate(items, labels=labels)
    groups = torch.tensor([0, 1, 0, 2, 1])
    ints, norms = gradients.grid_sum(batch.values, batch.mask, batch.labels, groups=groups, n_groups=n_groups)
    assert norms.shape == (expected_units,)
    assert bool((norms[:3] > 0).all()) and bool((norms[3:] == 0).all())  # a group with no events has no gradient
    reference, _ = gradients.grid_sum(batch.values, batch.mask, batch.labels, groups=groups, n_groups=3)
    for name in reference:
        assert torch.equal(ints[name], reference[name])


def _fixed_gradient(vector: list[float], clip_norm: float) -> PerSampleGradients:
    """A PerSampleGradients whose one example has exactly the gradient ``vector``."""
    gradients = PerSampleGradients(torch.nn.Linear(1, 1), clip_norm)
    gradient = torch.tensor([vector], dtype=torch.float32)
    gradients.per_sample = lambda x, mask, labels: {"w": gradient.clone()}  # type: ignore[method-assign]
    return gradients


def _grid_vector(gradients: PerSampleGradients) -> list[int]:
    empty = torch.zeros(1, 1, 1)
    ints, _ = gradients.grid_sum(empty, empty.bool(), torch.zeros(1, dtype=torch.int64))
    return ints["w"].reshape(-1).tolist()


def test_a_grid_vector_that_rounding_pushed_outside_the_ball_is_shrunk_back_inside() -> None:
    # Float32 loses the last coordinate in the norm (2^40 + 256 rounds to 2^40), so every
    # coordinate scales to an exact integer and the integer vector has squared norm GRID² + 1.
    half = float(2**19)
    vector = _grid_vector(_fixed_gradient([half, half, half, half, 16.0], clip_norm=2.0**20))
    assert sum(v * v for v in vector) <= GRID * GRID
    assert vector == [GRID // 2 - 1] * 4 + [0]  # shrunk by a hair, then rounded toward zero


def test_a_shrunk_vector_enters_the_sum_of_many_only_as_shrunk() -> None:
    """Beside vectors that fit, among enough columns to take several blocks of the sum."""
    half, width = float(2**19), 70_000
    rows = torch.zeros(3, width)
    rows[0, :5] = torch.tensor([half, half, half, half, 16.0])  # pushed outside the ball by rounding
    rows[1, ::7] = 2.0**14  # fits: clipped to the ball, then rounded
    rows[2, -3:] = torch.tensor([3.0, -4.0, 0.5])
    gradients = PerSampleGradients(torch.nn.Linear(1, 1), clip_norm=2.0**20)
    gradients.per_sample = lambda x, mask, labels: {"w": rows.clone()}  # type: ignore[method-assign]
    total = _grid_vector(gradients)
    alone = [_grid_vector(_fixed_gradient(row.tolist(), clip_norm=2.0**20)) for row in rows]
    assert total == [sum(column) for column in zip(*alone, strict=True)]
    assert alone[1][0] > 0 and total[:5] == [GRID // 2 - 1 + alone[1][0]] + [GRID // 2 - 1] * 3 + [0]


def test_a_grid_vector_exactly_on_the_ball_is_kept_as_it_is() -> None:
    assert _grid_vector(_fixed_gradient([2.0**20], clip_norm=2.0**20)) == [GRID]


def test_a_float64_model_gets_a_grouped_grid_sum_too() -> None:
    torch.manual_seed(0)
    model = SensorModel(2, n_classes=2, d_model=16, n_heads=2, n_layers=1, max_len=64).double()
    items, labels = ragged(9, 3)
    batch = collate(items, labels=labels)
    gradients = PerSampleGradients(model, clip_norm=0.05)
    groups = torch.tensor([0, 1, 0])
    ints, norms = gradients.grid_sum(batch.values.double(), batch.mask, batch.labels, groups=groups, n_groups=2)
    assert norms.dtype == torch.float64 and bool((norms > 0.05).all()), "the test wants both groups clipped"
    vector = flat(ints)
    assert vector.dtype == torch.int64 and float(vector.double().norm()) <= 2 * GRID
