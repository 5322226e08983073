"""Shared test settings: one torch thread (the machine has 2 cores), quiet kafka logs."""

from __future__ import annotations

import logging

import torch

torch.set_num_threads(1)
logging.getLogger("kafka").setLevel(logging.WARNING)
