"""Secure Gaussian noise: standard deviation within a chi-square bound, both sources."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from streamtrain.data.randomness import CryptoRandomness, SeededRandomness
from streamtrain.privacy.noise import SecureGaussianNoise

ALPHA = 1e-6


def chi_square_bounds(n: int) -> tuple[float, float]:
    return stats.chi2.ppf(ALPHA / 2, n - 1) / (n - 1), stats.chi2.ppf(1 - ALPHA / 2, n - 1) / (n - 1)


@pytest.mark.parametrize("source", ["urandom", "philox"])
def test_standard_normal_variance_mean_and_shape(source: str) -> None:
    noise = SecureGaussianNoise(source, SeededRandomness(7))  # seeded bits so the test is deterministic
    n = 200_000
    draws = noise.standard_normal(n)
    low, high = chi_square_bounds(n)
    assert low <= draws.var(ddof=1) <= high
    assert abs(draws.mean()) <= 5 / np.sqrt(n)
    assert stats.kstest(draws, "norm").pvalue > ALPHA


def test_add_noise_scales_by_std_across_tensors() -> None:
    noise = SecureGaussianNoise("urandom", SeededRandomness(8))
    tensors = [torch.zeros(300, 100), torch.zeros(50_000), torch.zeros(7)]
    noise.add_noise_(tensors, std=2.5)
    flat = torch.cat([t.reshape(-1) for t in tensors]).double().numpy() / 2.5
    low, high = chi_square_bounds(flat.size)
    assert low <= flat.var(ddof=1) <= high
    assert tensors[0].dtype == torch.float32
    # one draw for all tensors: no tensor repeats another's noise
    assert not np.allclose(tensors[1][:7].numpy(), tensors[2].numpy())


def test_default_source_is_the_os_csprng_and_draws_differ() -> None:
    noise = SecureGaussianNoise()
    assert isinstance(noise.randomness, CryptoRandomness)
    assert not np.array_equal(noise.standard_normal(16), noise.standard_normal(16))
    with pytest.raises(ValueError, match="NOISE_SOURCE"):
        SecureGaussianNoise("mt19937")  # type: ignore[arg-type]
