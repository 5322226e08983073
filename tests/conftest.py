"""Shared test settings: one torch thread (the machine has 2 cores), quiet kafka logs, no compiling.

``STREAMTRAIN_COMPILE=off`` (unless the environment says otherwise): compiling the forwards
takes tens of seconds per process on this machine, once for every trainer a test builds and
every service an integration test starts. The compiled path has tests of its own
(tests/unit/model/test_model_compiled.py), which ask for it explicitly.
"""

from __future__ import annotations

import logging
import os

import torch

torch.set_num_threads(1)
logging.getLogger("kafka").setLevel(logging.WARNING)
os.environ.setdefault("STREAMTRAIN_COMPILE", "off")
