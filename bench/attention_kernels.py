"""Causal attention forward + backward at the service's head size: PyTorch's flash kernel beside
the other ways to compute it on a CPU.

The service's attention (``streamtrain.model.network.CausalSelfAttention``) calls
``scaled_dot_product_attention(..., is_causal=True)`` in float32, which on a CPU runs the flash
kernel. At head size 16 (width 64, 4 heads) that kernel reaches a few tens of GFLOP/s, far below
the core's matmul rate (docs/performance.md), so the question is whether another way of
computing the same thing is faster at these shapes: SDPA's math backend, the same math written
out (scores, causal mask, softmax, weighted sum), and that written-out math compiled by
inductor (dynamic shapes, as the service compiles its forward). Arms run in turn on the same
inputs; the value is each one's median milliseconds over ``--repeats`` calls, the baseline the
flash kernel's. One torch thread.

    python bench/attention_kernels.py [--repeats 25] [--json]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

BENCH = "attention_kernels"

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: (sequences, heads, padded length): the default model's 4 heads of 16 at the planner's usual
#: batch shapes (2,048-token budget: 128 x 16, 64 x 32, 32 x 64, 16 x 128) and the old 8,192 budget's 128 x 64.
SHAPES = ((128, 4, 16), (64, 4, 32), (32, 4, 64), (16, 4, 128), (128, 4, 64))


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    length = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def median_ms(attention: Attention, shape: tuple[int, int, int, int], repeats: int) -> float:
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)
    times = []
    for _ in range(repeats + 3):  # the first calls warm caches (and compile)
        started = time.perf_counter()
        attention(q, k, v).backward(grad)
        times.append(time.perf_counter() - started)
    kept = sorted(times[3:])
    return 1e3 * kept[len(kept) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    arms: dict[str, Attention] = {
        "sdpa math backend": sdpa_math,
        "written out": written_out,
        "written out, compiled": torch.compile(written_out, dynamic=True),
    }
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    for name, arm in arms.items():  # the same forecasts, or the comparison means nothing
        torch.testing.assert_close(arm(q, k, v), flash(q, k, v), atol=1e-5, rtol=1e-5, msg=name)
    rows: list[Row] = []
    for sequences, heads, length in SHAPES:
        shape = (sequences, heads, length, 64 // heads)
        label = f"[{sequences}, {heads}, {length}, {64 // heads}]"
        base = median_ms(flash, shape, args.repeats)
        rows.append(Row(BENCH, f"{label} flash (the service's), ms fwd+bwd", base, base))
        for name, arm in arms.items():
            rows.append(Row(BENCH, f"{label} {name}, ms fwd+bwd", median_ms(arm, shape, args.repeats), base))
    emit(rows, args.json)


if __name__ == "__main__":
    main()
