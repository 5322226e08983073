"""Real sensor series that a package ships (River's bundled CSV files; nothing is downloaded).

``occupancy``: an office room's temperature, humidity, light and CO2 (4 channels, 509
readings, one every 16 minutes; River's change-point data set, with annotated changes).
``water_flow``: hourly water flow through a pipeline branch (1 channel, 1268 readings).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Series:
    name: str
    ts: np.ndarray  # float64 [T], Unix seconds
    values: np.ndarray  # float32 [T, C]
    channel_names: tuple[str, ...]
    change_points: tuple[int, ...] = ()  # indices annotated as changes (when the data set has them)


def _river_dir() -> Path:
    import river  # the bench/test extra ships it; the files are inside the wheel

    return Path(river.__file__).parent


def _read(path: Path, time_column: str, time_format: str, columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    ts = np.array([datetime.strptime(r[time_column], time_format).timestamp() for r in rows], dtype=np.float64)
    values = np.array([[float(r[c]) for c in columns] for r in rows], dtype=np.float32)
    return ts, values


def occupancy() -> Series:
    columns = ["V1", "V2", "V3", "V4"]
    ts, values = _read(_river_dir() / "drift" / "datasets" / "occupancy.csv", "time", "%Y-%m-%d %H:%M:%S", columns)
    from river.drift.datasets import Occupancy

    changes = sorted({int(i) for marks in Occupancy().annotations.values() for i in marks})
    return Series("occupancy", ts, values, ("temperature", "humidity", "light", "co2"), tuple(changes))


def water_flow() -> Series:
    ts, values = _read(_river_dir() / "datasets" / "water-flow.csv", "Time", "%Y-%m-%dT%H:%M:%S%z", ["Water flow [l/s]"])
    return Series("water_flow", ts, values, ("flow",))


SERIES = {"occupancy": occupancy, "water_flow": water_flow}


def sliding_windows(values: np.ndarray, length: int, stop: int | None = None) -> list[np.ndarray]:
    """Every run of ``length`` consecutive readings that ends before ``stop`` (stride 1)."""
    stop = len(values) if stop is None else stop
    return [values[i : i + length] for i in range(0, stop - length + 1)]
