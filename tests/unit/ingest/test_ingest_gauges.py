"""The window's compaction metrics, as ingest's gauge update reports them."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

import streamtrain.ingest.ingestor as ingestor_module
from streamtrain.config import load_settings
from streamtrain.events import EventBatch
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.metrics import Metrics
from streamtrain.window.reservoir import RecencyWindow

NO_PARTITIONS = SimpleNamespace(assignment=lambda: set())


def events(start: int, n: int) -> EventBatch:
    lengths = np.full(n, 400)
    return EventBatch(
        sensor_ids=np.array(["s"] * n, dtype=object),
        ts=np.arange(start, start + n, dtype=np.float64),
        labels=np.zeros(n, np.int64),
        lengths=lengths,
        values=np.zeros((int(lengths.sum()), 1), np.float32),
        partitions=np.zeros(n, np.int32),
        offsets=np.arange(start, start + n),
    )


def test_compaction_bytes_count_each_merge_once_and_in_flight_shows_a_held_gather() -> None:
    held: list[Callable[[], None]] = []
    window = RecencyWindow(200, math.inf, slack=100, rng=np.random.default_rng(0), run_compaction=held.append)
    metrics = Metrics()
    ingest = Ingestor(load_settings(topic="events"), window, metrics)

    def report() -> tuple[float, float]:
        ingest._last_gauges = -math.inf  # the gauges are updated at most once a second
        ingest._update_gauges(NO_PARTITIONS)  # type: ignore[arg-type]
        return metrics.window_compaction_bytes._value.get(), metrics.window_compaction_in_flight._value.get()

    start = 0
    while not held:
        window.insert_batch(events(start, 50))
        start += 50
    assert report() == (0.0, 1.0)
    held.pop()()
    while window.compactions.merges_total == 0:
        window.insert_batch(events(start, 50))
        start += 50
    gathered = window.compactions.bytes_total
    assert gathered > 0 and report() == (gathered, float(window.compactions.in_flight))
    window.load_state_dict(window.state_dict())  # a restore keeps the counts: nothing is counted twice
    assert report()[0] == gathered


def test_the_first_gauge_update_is_not_held_back_on_a_machine_booted_a_moment_ago(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The monotonic clock starts at the machine's boot: a fresh VM's first second is not a past update."""
    window = RecencyWindow(200, math.inf, rng=np.random.default_rng(0))
    window.insert_batch(events(0, 3))
    metrics = Metrics()
    ingest = Ingestor(load_settings(topic="events"), window, metrics)
    monkeypatch.setattr(ingestor_module.time, "monotonic", lambda: 0.3)
    ingest._update_gauges(NO_PARTITIONS)  # type: ignore[arg-type]
    assert metrics.window_tokens._value.get() == 1200.0
