"""Shared test settings: one torch thread (the machine has 2 cores), quiet kafka logs, no
compiling, float32 training.

``STREAMTRAIN_COMPILE=off`` (unless the environment says otherwise): compiling the forwards
takes tens of seconds per process on this machine, once for every trainer a test builds and
every service an integration test starts. The compiled path has tests of its own
(tests/unit/model/test_model_compiled.py), which ask for it explicitly.

``STREAMTRAIN_AMP=off``: ``AMP=auto`` trains in bf16 on a CPU with AMX and in float32 on
one without, so the same test would compute differently from machine to machine. Tests of
bf16 and of the resolution of ``auto`` ask for them (tests/unit/test_device.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch

torch.set_num_threads(1)
logging.getLogger("kafka").setLevel(logging.WARNING)
os.environ.setdefault("STREAMTRAIN_COMPILE", "off")
os.environ.setdefault("STREAMTRAIN_AMP", "off")


@pytest.fixture(autouse=True)
def no_compile_thread_outlives_its_test() -> Iterator[None]:
    """A background ``torch.compile`` left running poisons the tests after it: dynamo puts the
    global torch RNG back as it found it when each trace began, from its own thread, so a later
    test's ``torch.get_rng_state()`` can come back rewound (seen in CI)."""
    yield
    from streamtrain.model.compiled import compiling

    assert not compiling(), "this test left a torch.compile thread running: wait for it or set compile off"
