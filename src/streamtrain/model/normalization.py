"""Input normalization: per-channel running statistics over every real token seen so far.

Invariants:

* The statistics are exact whatever the batching: moments (count, mean, M2 = the sum of
  squared deviations) are merged with Chan et al.'s parallel formula in float64, in
  :func:`merge_moments`, the one implementation of that merge (the data-parallel step folds
  every rank's moments with it too, so all ranks hold bit-identical statistics).
* Padding never counts: only positions the mask marks real are merged.
* ``std`` is never 0 (a variance floor) and, before any data, the norm is the identity.
* A frozen norm (public constants, DP mode) is never updated: statistics of private data
  would leak through it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, overload

import numpy as np
import torch

from streamtrain.device import to_device_async


def merge_moments(
    count: int,
    mean: torch.Tensor,
    m2: torch.Tensor,
    other_count: int,
    other_mean: torch.Tensor,
    other_m2: torch.Tensor,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The (count, mean, M2) of the union of two disjoint samples, from each one's (Chan et al.).

    ``mean`` and ``m2`` are float64 ``[C]`` per sample; M2 is the sum of squared deviations
    from the sample's mean. Merging an empty sample returns the other one's moments (copies):
    the result never aliases an argument. Folding samples left to right in a fixed order gives
    bit-identical results on every process that folds them.
    """
    if other_count == 0:
        return count, mean.clone(), m2.clone()
    if count == 0:
        return other_count, other_mean.clone(), other_m2.clone()
    total = count + other_count
    delta = other_mean - mean
    merged_mean = mean + delta * (other_count / total)
    merged_m2 = m2 + other_m2 + delta.square() * (count * other_count / total)
    return total, merged_mean, merged_m2


class RunningNorm:
    """Per-channel running mean and variance over real tokens.

    Batch statistics are merged with Chan's parallel formula in float64, so the result
    equals the statistics of everything seen so far regardless of how it was batched.
    The variance has a floor so that ``std`` is never 0 (a constant channel normalizes
    to 0, not to NaN). Before any data, mean is 0 and std is 1 (identity).

    The statistics never forget, so one valid event with readings near 3e38 would set the
    variance for good and squash every later input to 0. Readings further than
    ``clip_std`` standard deviations from the mean are therefore clamped to that band
    before they are merged (the model still sees them as they are; only the statistics are
    protected). Until ``warmup_count`` tokens are in, the band comes from the batch's own
    median and MAD (no band for a channel whose MAD is 0: half its readings are equal and
    its spread cannot be judged yet). Data without such outliers gets the exact statistics.
    """

    def __init__(
        self, channels: int, var_floor: float = 1e-6, clip_std: float | None = 8.0, warmup_count: int = 1024
    ) -> None:
        if channels < 1:
            raise ValueError(f"RunningNorm: channels must be >= 1, got {channels}")
        if not var_floor > 0:
            raise ValueError(f"RunningNorm: var_floor must be > 0, got {var_floor}")
        if clip_std is not None and not clip_std > 0:
            raise ValueError(f"RunningNorm: clip_std must be > 0 or None, got {clip_std}")
        self.channels = channels
        self.var_floor = float(var_floor)
        self.clip_std = None if clip_std is None else float(clip_std)
        self.warmup_count = int(warmup_count)
        self.clipped = 0  # readings clamped before merging, all time
        self.count = 0
        self._mean = torch.zeros(channels, dtype=torch.float64)
        self._m2 = torch.zeros(channels, dtype=torch.float64)  # sum of squared deviations
        self.frozen = False

    @classmethod
    def from_public(cls, mean: Sequence[float], std: Sequence[float]) -> RunningNorm:
        """A frozen norm from public constants (DP mode: statistics of private data leak)."""
        mean_t = torch.as_tensor(mean, dtype=torch.float64).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float64).reshape(-1)
        if mean_t.shape != std_t.shape or not bool((std_t > 0).all()):
            raise ValueError("RunningNorm.from_public: mean and std need one entry per channel, std > 0")
        norm = cls(int(mean_t.numel()), var_floor=float(std_t.min()) ** 2 * 1e-6)
        norm.count = 1
        norm._mean = mean_t.clone()
        norm._m2 = std_t.square().clone()  # count 1 → var = m2
        norm.frozen = True
        return norm

    @property
    def mean(self) -> torch.Tensor:
        return self._mean.clone()

    @property
    def var(self) -> torch.Tensor:
        if self.count == 0:
            return torch.ones(self.channels, dtype=torch.float64)
        return (self._m2 / self.count).clamp_min(self.var_floor)

    @property
    def std(self) -> torch.Tensor:
        return self.var.sqrt()

    def update(self, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Merge the statistics of the real tokens of ``values [B, L, C]`` (``mask [B, L]``)."""
        if self.frozen:
            raise RuntimeError("RunningNorm.update: this norm is frozen (public constants); do not update it")
        count, mean, m2, clipped = self.batch_moments(values, mask)
        if count:
            self.merge(count, mean, m2, clipped)

    def batch_moments(self, values: torch.Tensor, mask: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """(count, mean, M2, clamped) of the real tokens of ``values [B, L, C]``, as :meth:`update`
        would merge them, clamped to this norm's outlier band first; the norm is left unchanged.

        After the warm-up the band comes from the running statistics (the same on every rank);
        during warm-up from the batch itself (median and MAD).
        """
        if values.dim() != 3 or values.shape[-1] != self.channels or values.shape[:2] != mask.shape:
            raise ValueError(
                f"RunningNorm.update: expected values [B, L, {self.channels}] and mask [B, L], "
                f"got {tuple(values.shape)} and {tuple(mask.shape)}"
            )
        real = values.detach()[mask.bool()].to(torch.float64)  # [N, C]
        n = int(real.shape[0])
        if n == 0:
            zeros = torch.zeros(self.channels, dtype=torch.float64)
            return 0, zeros, zeros.clone(), 0
        clipped = 0
        if self.clip_std is not None:
            real, clipped = self._clamp_outliers(real, self.clip_std)
        batch_mean = real.mean(dim=0)
        return n, batch_mean, (real - batch_mean).square().sum(dim=0), clipped

    def merge(self, count: int, mean: torch.Tensor, m2: torch.Tensor, clipped: int = 0) -> None:
        """Fold the moments of ``count`` readings this norm has not seen (``mean``, ``m2``: ``[C]``)
        into its statistics; ``clipped`` of them were clamped to the outlier band first."""
        if self.frozen:
            raise RuntimeError("RunningNorm.merge: this norm is frozen (public constants); do not update it")
        self.count, self._mean, self._m2 = merge_moments(
            self.count, self._mean, self._m2, count, mean.to(torch.float64), m2.to(torch.float64)
        )
        self.clipped += int(clipped)

    def _clamp_outliers(self, real: torch.Tensor, clip_std: float) -> tuple[torch.Tensor, int]:
        """``real [N, C]`` clamped to ``clip_std`` deviations around the centre, and how many were."""
        if self.count >= self.warmup_count:
            center, scale = self._mean, self.std
        else:
            center = real.median(dim=0).values
            scale = 1.4826 * (real - center).abs().median(dim=0).values  # MAD → std for normal data
            scale = torch.where(scale > 0, scale, torch.full_like(scale, math.inf))
        band = clip_std * scale
        clamped = torch.minimum(torch.maximum(real, center - band), center + band)
        return clamped, int((clamped != real).sum())

    def _as_float(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std in ``x``'s dtype on ``x``'s device; the statistics stay float64 on the host.

        On a GPU both go over in one non-blocking copy from pinned memory: a plain ``.to``
        from pageable memory would make the trainer wait for every queued kernel each step.
        """
        both = to_device_async(torch.stack([self._mean, self.std]).to(x.dtype), x.device)
        return both[0], both[1]

    @overload
    def normalize(self, x: torch.Tensor) -> torch.Tensor: ...

    @overload
    def normalize(self, x: np.ndarray) -> np.ndarray: ...

    def normalize(self, x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        if isinstance(x, np.ndarray):
            return (x - self._mean.numpy()) / self.std.numpy()
        mean, std = self._as_float(x)
        return (x - mean) / std

    @overload
    def denormalize(self, x: torch.Tensor) -> torch.Tensor: ...

    @overload
    def denormalize(self, x: np.ndarray) -> np.ndarray: ...

    def denormalize(self, x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        if isinstance(x, np.ndarray):
            return x * self.std.numpy() + self._mean.numpy()
        mean, std = self._as_float(x)
        return x * std + mean

    def state_dict(self) -> dict[str, Any]:
        return {
            "channels": self.channels,
            "var_floor": self.var_floor,
            "clip_std": self.clip_std,
            "warmup_count": self.warmup_count,
            "clipped": self.clipped,
            "count": self.count,
            "mean": self._mean.clone(),
            "m2": self._m2.clone(),
            "frozen": self.frozen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["channels"]) != self.channels:
            raise ValueError(
                f"RunningNorm.load_state_dict: checkpoint has {state['channels']} channels, "
                f"this norm {self.channels}; use the same CHANNELS setting"
            )
        self.var_floor = float(state["var_floor"])
        self.clip_std = None if state.get("clip_std") is None else float(state["clip_std"])
        self.warmup_count = int(state.get("warmup_count", self.warmup_count))
        self.clipped = int(state.get("clipped", 0))
        self.count = int(state["count"])
        self._mean = torch.as_tensor(state["mean"], dtype=torch.float64).clone()
        self._m2 = torch.as_tensor(state["m2"], dtype=torch.float64).clone()
        self.frozen = bool(state.get("frozen", False))
