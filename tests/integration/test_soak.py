"""The CI soak: 60 s of ingest + training + predict load through bench/soak.py.

Zero errors of any kind and bounded memory growth after warm-up. The 30-minute soak
(``python bench/soak.py --duration-s 1800``) holds RSS growth to 5%; a 40-second
steady phase is too short to tell a leak from allocator noise that precisely, so CI
allows 10% and the p99 may drift by 2x on a shared machine.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def load_soak_module():
    spec = importlib.util.spec_from_file_location("bench_soak", REPO / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.expected_seconds(90)
def test_a_60_second_soak_has_no_errors_and_bounded_memory(kafka_bootstrap: str, tmp_path: Path) -> None:
    soak = load_soak_module()
    config = soak.SoakConfig(bootstrap=kafka_bootstrap, duration_s=60, warmup_s=20, rate=200, predict_rps=20,
                             sample_s=2, window_capacity=2000, out_dir=tmp_path,  # fills in the warm-up
                             # eager float32, as the other integration services: compiling would take
                             # most of 60 s here (bench/soak.py counts it as warm-up; the 30-minute soak
                             # runs the compiled defaults)
                             service_env={"COMPILE": "off", "AMP": "off"})  # fmt: skip
    report = soak.run_soak(config)

    assert report.error_total == 0, report.errors
    assert len(report.samples) >= 25  # sampled throughout, the service answering every time
    assert report.rss_growth < 0.10, (report.rss_warm_mb, report.rss_end_mb)
    # No latency budget here: beside another test file on two cores, the second half's p99 is the
    # neighbour's (77 -> 307 ms in a CI run, 0 errors). bench/soak.py keeps its p99 budget, run alone.
    assert report.p99_first_ms > 0 and report.p99_second_ms > 0  # latencies measured in both halves
    # it kept up: everything sent was accepted, the lag stayed small, it trained and served
    assert report.events_sent >= 0.8 * config.rate * config.duration_s
    assert report.events_accepted >= report.events_sent - config.rate * 2
    assert report.lag_max < config.rate * 5
    assert report.train_steps > 100 and report.predicts >= 0.8 * config.predict_rps * config.duration_s
    assert report.plot.is_file() and report.plot.stat().st_size > 10_000
    assert report.data.is_file()
    assert all(s.p99_ms is None or math.isfinite(s.p99_ms) for s in report.samples)
