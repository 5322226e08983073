"""Gaussian noise for DP-SGD from the OS CSPRNG, hardened against the floating-point attack.

Two threats, two measures:

* Predictable noise (a seeded PRNG whose state can be recovered) cancels the privacy
  argument. Noise here comes from the OS CSPRNG: with ``source="urandom"`` every random
  bit is drawn from ``os.urandom``; with ``source="philox"`` a Philox-4x64 generator is
  keyed with 128 fresh CSPRNG bits at every step (fast; security rests on the 128-bit key).
* Floating-point samplers leave gaps: the set of values ``f(D) + noise`` can take depends
  on ``f(D)``, which leaks it (Mironov 2012; Holohan & Braghin 2021 for the Gaussian).
  Following Holohan & Braghin (and Opacus' secure mode) each coordinate is the sum of four
  independent standard normals divided by two — still exactly N(0, 1) — which fills the
  gaps a single draw leaves. The draws are made in float64.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from streamtrain.data.randomness import CryptoRandomness, Randomness

NoiseSource = Literal["urandom", "philox"]
NOISE_SOURCES: tuple[str, ...] = ("urandom", "philox")
HARDENING_DRAWS = 4  # sum of 4 N(0, 1), divided by sqrt(4) = 2
_TWO_POW_MINUS_53 = 2.0**-53


class SecureGaussianNoise:
    """Standard normals (float64) for the noisy gradient sum."""

    def __init__(self, source: NoiseSource = "urandom", randomness: Randomness | None = None) -> None:
        if source not in NOISE_SOURCES:
            raise ValueError(f"noise source must be one of {NOISE_SOURCES}, got {source!r}; set STREAMTRAIN_DP_NOISE_SOURCE")
        self.source = source
        self.randomness = randomness if randomness is not None else CryptoRandomness()

    def _unhardened(self, n: int) -> np.ndarray:
        """``n`` independent N(0, 1) draws."""
        if self.source == "philox":
            key = self.randomness.raw_uint64(2)
            return np.random.Generator(np.random.Philox(key=key)).standard_normal(n)
        pairs = (n + 1) // 2
        words = self.randomness.raw_uint64(2 * pairs)
        # (0, 1) exclusive on the 2**-53 grid: log() never sees 0.
        uniform = ((words >> np.uint64(11)).astype(np.float64) + 0.5) * _TWO_POW_MINUS_53
        radius = np.sqrt(-2.0 * np.log(uniform[:pairs]))
        angle = (2.0 * np.pi) * uniform[pairs:]
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:n]

    def standard_normal(self, n: int) -> np.ndarray:
        """``n`` hardened N(0, 1) draws, float64."""
        draws = self._unhardened(HARDENING_DRAWS * n).reshape(HARDENING_DRAWS, n)
        return draws.sum(axis=0) / np.sqrt(HARDENING_DRAWS)

    def add_noise_(self, tensors: list[torch.Tensor], std: float) -> None:
        """Add N(0, std²) to every element of ``tensors`` in place (one draw for all)."""
        sizes = [t.numel() for t in tensors]
        noise = self.standard_normal(sum(sizes)) * std
        for tensor, chunk in zip(tensors, np.split(noise, np.cumsum(sizes)[:-1]), strict=True):
            tensor.add_(torch.from_numpy(chunk).reshape(tensor.shape).to(dtype=tensor.dtype, device=tensor.device))
