"""A small fleet configuration and a fixed send time, shared by the simulation tests."""

from __future__ import annotations

from typing import Any

from streamtrain.tools.simulation_config import SimulationConfig

NOW = 1_764_412_345.0


def config(**overrides: Any) -> SimulationConfig:
    base: dict[str, Any] = {
        "sensors": 8,
        "length_median": 24,
        "max_len": 96,
        "run_id": "test",
        "max_message_bytes": 64 << 10,
    }
    return SimulationConfig(**(base | overrides))
