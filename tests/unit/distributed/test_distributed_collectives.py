"""The backend choice, and the collectives of a world of one rank (no process group: each
returns its input). Several ranks as real processes: test_distributed_processes.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamtrain.distributed.collectives import Collectives, resolve_backend
from streamtrain.distributed.launch import DistConfigError, DistContext
from streamtrain.distributed.wire import StepSignals


def test_backend_choice() -> None:
    assert resolve_backend("auto", "cpu") == "gloo"
    assert resolve_backend("gloo", "cpu") == "gloo"
    with pytest.raises(DistConfigError, match="CUDA"):
        resolve_backend("nccl", "cpu")
    with pytest.raises(DistConfigError, match="auto"):
        resolve_backend("mpi", "cpu")
    if torch.distributed.is_nccl_available():
        assert resolve_backend("auto", "cuda") == "nccl"
        # ranks that share a GPU: NCCL refuses two ranks of one communicator on one GPU
        assert resolve_backend("auto", "cuda", gpus_shared=True) == "gloo"
        with pytest.raises(
            DistConfigError, match="^DIST_BACKEND=nccl with more ranks on this host than GPUs.*DIST_BACKEND=gloo"
        ):
            resolve_backend("nccl", "cuda", gpus_shared=True)


def test_one_rank_sums_and_settings_checks_are_local() -> None:
    c = Collectives(DistContext())
    np.testing.assert_array_equal(c.sum_rows([1.5, 2.0, math.inf]), [1.5, 2.0, math.inf])
    c.agree_settings({"d_model": 64, "amp": "off"})  # one rank agrees with itself


def test_one_rank_collectives_are_local() -> None:
    c = Collectives(DistContext())
    agreement = c.agree(7, StepSignals(stop=True, has_data=True), {"real_tokens": 12}, [1.0, 2.0])
    assert agreement.stop and not agreement.checkpoint and agreement.ranks_with_data == 1
    assert agreement.totals == {"real_tokens": 12}
    np.testing.assert_array_equal(agreement.per_rank, [[1.0, 2.0]])
    layer = torch.nn.Linear(2, 1)
    tail = c.allreduce_gradients(layer.parameters(), torch.tensor([3.0]))
    assert tail is not None and float(tail) == 3.0
    assert all(p.grad is not None and not p.grad.any() for p in layer.parameters())  # zeros, not None
    assert c.agree_all(True) and c.max_int(5) == 5 and c.broadcast_ints([4]) == [4]
    with pytest.raises(ValueError, match="2\\*\\*53"):
        c.agree(0, StepSignals(), {"tokens": 2**60})
