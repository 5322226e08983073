"""Exact equality of checkpoint state trees, and a small model to fill them, for the checkpoint tests."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch


def assert_tree_equal(actual: Any, expected: Any, path: str = "state") -> None:
    """Exact equality: same types, dtypes, shapes and bits (nan == nan, -0.0 != 0.0)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(_tensor_bytes(actual), _tensor_bytes(expected)), path
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        if expected.dtype == object:
            for index, (a, e) in enumerate(zip(actual.reshape(-1), expected.reshape(-1))):
                assert_tree_equal(a, e, f"{path}.flat[{index}]")
        else:
            assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes(), path
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes(), path
    elif isinstance(expected, float):
        if math.isnan(expected):
            assert math.isnan(actual), path
        else:
            assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{path}: {actual} != {expected}"
    elif isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), path
        for (ka, va), (ke, ve) in zip(actual.items(), expected.items()):
            assert_tree_equal(ka, ke, f"{path} key {ke!r}")
            assert_tree_equal(va, ve, f"{path}[{ke!r}]")
        assert getattr(actual, "_metadata", None) == getattr(expected, "_metadata", None), path
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_tree_equal(a, e, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:  # empty tensors may carry stride 0, which view() refuses
        return torch.empty(0, dtype=torch.uint8)
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def small_model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
