"""Training FLOPs of the service's model and this core's matmul rate: the yardstick of issue 24.

A step's work is counted as the issue counts it: ``6 × parameters`` per real token (forward
2, backward 4) plus causal self-attention, whose scores and weighted sum cost
``2 · d_model · n(n+1)`` per layer forward for a sequence of ``n`` real readings (query
``t`` meets ``t + 1`` keys), three times that with the backward. Padding is not counted:
only the work on real readings is useful.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def training_flops(parameters: int, d_model: int, n_layers: int, lengths: np.ndarray) -> float:
    """FLOPs of one forward + backward over sequences of these real ``lengths``."""
    n = np.asarray(lengths, dtype=np.float64)
    dense = 6.0 * parameters * float(n.sum())
    attention = 3.0 * n_layers * 2.0 * d_model * float((n * (n + 1.0)).sum())
    return dense + attention


def matmul_flop_rate(size: int = 1024, repeats: int = 20, threads: int = 1) -> float:
    """Best FLOP/s of a ``size``² float32 matmul on ``threads`` torch threads (the reference rate)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        out = torch.empty(size, size)
        for _ in range(3):
            torch.mm(a, b, out=out)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return 2.0 * size**3 / best
