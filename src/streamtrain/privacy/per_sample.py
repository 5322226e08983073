"""Per-sample gradients (torch.func), clipped over the whole gradient, summed.

``vmap(grad(loss of one example))`` gives every example its own gradient of every
parameter. Each example's gradient is scaled by ``min(1, C / ||g_i||)`` with ``||g_i||``
the L2 norm over all parameters together, and the scaled gradients are summed. The sum
is linear in the examples, so splitting a logical batch into token-budget micro-batches
and adding their sums gives the same result as one big batch (up to float rounding).

The per-example loss sees a batch of one, and the model masks padding, so an example's
gradient does not depend on which micro-batch it landed in or how far it was padded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from streamtrain.model import ModelOutput, total_loss

PerSampleLoss = Callable[[ModelOutput, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sensor_per_sample_loss(output: ModelOutput, x_norm: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B] per-example loss of a SensorModel: forecast MSE (+ cross-entropy when labelled)."""
    return total_loss(output, x_norm, mask, labels, reduction="per_sample")


#: Added to the norm before dividing, as Opacus does, so a zero gradient stays zero.
NORM_EPS = 1e-6


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """``min(1, C / ||g_i||)`` per example."""
    return (clip_norm / (norms + NORM_EPS)).clamp(max=1.0)


class PerSampleGradients:
    """Clipped per-sample gradient sums of ``model`` for padded micro-batches."""

    def __init__(self, model: nn.Module, clip_norm: float, loss_fn: PerSampleLoss = sensor_per_sample_loss) -> None:
        self.model = model
        self.clip_norm = float(clip_norm)
        self.loss_fn = loss_fn
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]

        def loss_of_one(params: dict, frozen: dict, x: torch.Tensor, mask: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
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
            grads = {name: torch.where(finite.view(-1, *([1] * (g.dim() - 1))), g, torch.zeros_like(g)) for name, g in grads.items()}
        summed = {name: torch.einsum("b,b...->...", factors, g) for name, g in grads.items()}
        return summed, norms
