"""scripts/gpu-check.sh --dry-run: the GPU check's every step, on the CPU with tiny sizes.

The GPU machine is lent rarely and briefly, so the script it runs must be known to work
before it gets there: same steps, same files, same summary, with ``--device cpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
FILES = {
    "summary.md", "summary.json", "env.json", "tests.txt", "train_throughput.jsonl",
    "predict_latency.jsonl", "latency.jsonl", "gpu-check.log",
}  # fmt: skip


@pytest.mark.expected_seconds(200)
@pytest.mark.slow
@pytest.mark.timeout(900)  # the subprocess's own limit: the suite's 300 s cut a slow machine's dry run (~7 min)
def test_the_dry_run_runs_every_step_and_writes_the_summary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == FILES  # the 8 files the device tool brings back, nothing else
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mode"] == "dry" and set(summary["steps"].values()) == {"0"}
    assert list(summary["steps"]) == [
        "tests",
        "train-bf16",
        "train-float32",
        "train-bf16-budget-131072",
        "predict",
        "latency",
    ]
    figures = {f["figure"]: f for f in summary["figures"]}
    assert figures["GPU tests (test_device, test_model, test_predict_batcher)"]["verdict"] == "met"
    for run in ("bf16", "float32", "bf16-budget-131072"):
        assert figures[f"[{run}] real tokens/s"]["value"] > 0
        assert 0 <= figures[f"[{run}] data-wait share"]["value"] < 1
    assert figures["predict p99 s: 32 instances, concurrency 8, while training"]["value"] > 0
    assert figures["events/s fed"]["value"] > 0
    assert "in-process" in summary["broker"]  # no broker on a machine without one: said, not hidden
    tests = (tmp_path / "tests.txt").read_text()
    if not torch.cuda.is_available():  # GPU cases skipped with their reason, not passed
        assert "SKIPPED" in tests and "no CUDA device on this machine" in tests
    assert "| figure | value | target | verdict |" in (tmp_path / "summary.md").read_text()
