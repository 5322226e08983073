"""Device parameters for tests: the CPU always runs, CUDA is skipped with a reason where absent.

``@pytest.mark.parametrize("device", DEVICES)`` runs a test on the CPU and, marked ``gpu``,
on the first CUDA device. Without CUDA the GPU case is reported as skipped with
:data:`NO_CUDA`, never silently passed; ``pytest -m gpu`` runs only the GPU cases (what
``scripts/gpu-check.sh`` runs on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device on this machine (torch.cuda.is_available() is False); runs on a GPU: scripts/gpu-check.sh"

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

CUDA = pytest.param("cuda", marks=needs_cuda, id="cuda")
DEVICES = [pytest.param("cpu", id="cpu"), CUDA]
