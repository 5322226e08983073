"""Per-sample gradients (torch.func), clipped over the whole gradient, summed.

``vmap(grad(loss of one example))`` gives every example its own gradient of every
parameter. Each example's gradient is scaled by ``min(1, C / ||g_i||)`` with ``||g_i||``
the L2 norm over all parameters together, and the scaled gradients are summed. The sum
is linear in the examples, so splitting a logical batch into token-budget micro-batches
and adding their sums gives the same result as one big batch (up to float rounding).

The per-example loss sees a batch of one, and the model masks padding, so an example's
gradient does not depend on which micro-batch it landed in or how far it was padded.

For the noisy sum, :meth:`PerSampleGradients.grid_sum` puts each clipped gradient on an
integer grid (one clip norm = ``grid`` units), rounding every coordinate toward zero, and
checks in exact integer arithmetic that its squared norm is at most ``grid²`` (shrinking
the rare vector that float rounding pushed over): the sensitivity of the integer sum is
then exactly ``grid``, whatever the float arithmetic before did. With ``groups`` (the
sensor privacy unit) the gradients of one group's events are summed first and the sum is
clipped as one vector.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from streamtrain.model.losses import total_loss
from streamtrain.model.network import ModelOutput
from streamtrain.privacy.noise import GRID

PerSampleLoss = Callable[[ModelOutput, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sensor_per_sample_loss(
    output: ModelOutput, x_norm: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """[B] per-example loss of a SensorModel: forecast MSE (+ cross-entropy when labelled)."""
    return total_loss(output, x_norm, mask, labels, reduction="per_sample")


#: Added to the norm before dividing, as Opacus does, so a zero gradient stays zero.
NORM_EPS = 1e-6


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """``min(1, C / ||g_i||)`` per example."""
    return (clip_norm / (norms + NORM_EPS)).clamp(max=1.0)


#: Float64 bytes per block of the grid sum's passes: the float64 copies stay in cache and are
#: reused, where one [B, P] float64 array is fresh memory on every micro-batch (page faults:
#: docs/performance.md, the DP step).
_BLOCK_BYTES = 1 << 20


def _column_blocks(rows: torch.Tensor) -> list[slice]:
    width = max(256, _BLOCK_BYTES // (8 * max(1, rows.shape[0])))
    return [slice(start, start + width) for start in range(0, rows.shape[1], width)]


def _integers(values: torch.Tensor, factor: torch.Tensor, block: slice) -> torch.Tensor:
    """``trunc(values * factor)`` on a block of columns, as float64 (a cast to int32 truncates)."""
    return (values[:, block] * factor[:, None]).to(torch.int32).double()


def _exact_sums(values: torch.Tensor, factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of ``trunc(values * factor)``, exactly: each row's squared L2 norm ([B] float64) and the
    sum over the rows ([P] int64)."""
    squared = torch.zeros(values.shape[0], dtype=torch.float64, device=values.device)
    total = torch.empty(values.shape[1], dtype=torch.int64, device=values.device)
    for block in _column_blocks(values):
        wide = _integers(values, factor, block)
        squared += torch.linalg.vecdot(wide, wide)
        total[block] = wide.sum(dim=0).to(torch.int64)
    return squared, total


class PerSampleGradients:
    """Clipped per-sample gradient sums of ``model`` for padded micro-batches."""

    def __init__(self, model: nn.Module, clip_norm: float, loss_fn: PerSampleLoss = sensor_per_sample_loss) -> None:
        self.model = model
        self.clip_norm = float(clip_norm)
        self.loss_fn = loss_fn

        def loss_of_one(
            params: dict, frozen: dict, x: torch.Tensor, mask: torch.Tensor, label: torch.Tensor
        ) -> torch.Tensor:
            output = functional_call(self.model, {**frozen, **params}, (x[None], mask[None]))
            return self.loss_fn(output, x[None], mask[None], label[None])[0]

        self._per_sample = vmap(grad(loss_of_one), in_dims=(None, None, 0, 0, 0), randomness="different")

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        trainable = {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}
        frozen = {name: p.detach() for name, p in self.model.named_parameters() if not p.requires_grad}
        frozen.update(dict(self.model.named_buffers()))
        return trainable, frozen

    def per_sample(self, x_norm: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Unclipped per-example gradients: name -> [B, *parameter shape]."""
        trainable, frozen = self._state()
        # The math attention kernel has vmap batching rules; the fused CPU kernel's
        # backward would fall back to a per-example loop under vmap.
        with sdpa_kernel(SDPBackend.MATH):
            return self._per_sample(trainable, frozen, x_norm, mask, labels)

    def clipped_sum(
        self, x_norm: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(sum over the micro-batch of clipped gradients, each example's unclipped norm [B]).

        An example whose gradient is not finite contributes zero (its norm is reported as
        inf or NaN). That is a per-example decision, the same as replacing the example by a
        zero-gradient record, so it stays inside the privacy argument, unlike skipping the
        whole step, which would depend on every example in it.
        """
        grads = self.per_sample(x_norm, mask, labels)
        squared = torch.stack([g.reshape(g.shape[0], -1).square().sum(dim=1) for g in grads.values()]).sum(dim=0)
        norms = squared.sqrt()
        finite = torch.isfinite(norms)
        factors = torch.where(finite, clip_factors(norms, self.clip_norm), torch.zeros_like(norms))
        if not bool(finite.all()):
            grads = {
                name: torch.where(finite.view(-1, *([1] * (g.dim() - 1))), g, torch.zeros_like(g))
                for name, g in grads.items()
            }
        summed = {name: torch.einsum("b,b...->...", factors, g) for name, g in grads.items()}
        return summed, norms

    def grid_sum(
        self,
        x_norm: torch.Tensor,
        mask: torch.Tensor,
        labels: torch.Tensor,
        groups: torch.Tensor | None = None,
        n_groups: int | None = None,
        grid: int = GRID,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(int64 sum over the micro-batch of clipped gradients on the grid, unclipped norms).

        Each example's (or, with ``groups``, each group's summed) gradient is clipped to C,
        scaled by ``grid / C`` and rounded toward zero; an exact integer check guarantees
        ``||v||² <= grid²`` for every vector ``v`` summed. Non-finite gradients count as
        zero, as in :meth:`clipped_sum`. ``groups`` ([B] int64, values < ``n_groups``)
        assigns each example to its privacy unit.
        """
        grads = self.per_sample(x_norm, mask, labels)
        shapes = {name: g.shape[1:] for name, g in grads.items()}
        flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)
        del grads
        if groups is not None:
            finite_rows = torch.isfinite(flat).all(dim=1)
            flat = torch.where(finite_rows[:, None], flat, torch.zeros((), dtype=flat.dtype))
            count = int(n_groups) if n_groups is not None else int(groups.max()) + 1
            flat = torch.zeros(count, flat.shape[1], dtype=flat.dtype).index_add_(0, groups.to(torch.int64), flat)
        norms = torch.linalg.vector_norm(flat, dim=1).double()  # float32: a norm past 1e38 counts as non-finite
        finite = torch.isfinite(norms)
        scale = torch.where(finite, clip_factors(norms, self.clip_norm), torch.zeros_like(norms)) * (
            grid / self.clip_norm
        )
        if not bool(finite.all()):
            flat = torch.where(finite[:, None], flat, torch.zeros((), dtype=flat.dtype))
        factor = scale.to(flat.dtype)
        # Each vector is trunc(flat * factor): integers of magnitude <= 2^16 (1 + 2^-20), exact in
        # float32 and, with their squares and every partial sum below 2^53, in float64, so the
        # checks and the sum below are exact. Computed a block of columns at a time.
        limit = grid * grid
        squared, total = _exact_sums(flat, factor)
        if bool((over := squared > limit).any()):  # float rounding pushed a few units over: shrink those vectors
            scaled, squared = flat[over] * factor[over][:, None], squared[over]
            ones = torch.ones(scaled.shape[0], dtype=scaled.dtype)  # ``scaled`` is already scaled
            total -= _exact_sums(scaled, ones)[1]
            while bool((still := squared > limit).any()):
                shrink = (torch.sqrt(limit / squared[still]) * (1 - 2.0**-20)).to(scaled.dtype)
                scaled[still] = scaled[still] * shrink[:, None]
                squared[still] = _exact_sums(scaled[still], ones[still])[0]
            total += _exact_sums(scaled, ones)[1]
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name, shape in shapes.items():
            size = int(torch.Size(shape).numel())
            out[name] = total[offset : offset + size].reshape(shape)
            offset += size
        return out, norms
