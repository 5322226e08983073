"""summary.json and summary.md for scripts/gpu-check.sh: the issue's figures against its targets.

Reads what the steps wrote so far (it runs after every step, so a run cut short still
leaves a summary): tests.txt, train_throughput.jsonl (rows of each run tagged with its
``run`` name), predict_latency.jsonl, latency.jsonl, env.json, and the step exit codes.

``python scripts/gpu_check_summary.py OUT STATUS_FILE MODE SECONDS BROKER_NOTE``
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any


def read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut off by a time limit
    return rows


def pick(rows: list[dict[str, Any]], metric_part: str, run: str | None = None) -> dict[str, Any] | None:
    for row in rows:
        if metric_part in row["metric"] and (run is None or row.get("run") == run):
            return row
    return None


def figure(
    label: str, row: dict[str, Any] | None, target: str = "", key: str = "value", ok: Any = None
) -> dict[str, Any]:
    value = None if row is None else row.get(key)
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    verdict = "" if ok is None or missing else ("met" if ok(value) else "NOT met")
    source = None if row is None else f"{row['bench']}: {row['metric']}"
    return {"figure": label, "value": value, "target": target, "verdict": verdict, "source": source}


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return "" if value is None else str(value)


def summarize(out: Path, status_file: Path, mode: str, seconds: int, broker: str) -> str:
    status = (
        dict(line.split() for line in status_file.read_text().splitlines() if line.strip())
        if status_file.exists()
        else {}
    )
    tests = (out / "tests.txt").read_text() if (out / "tests.txt").exists() else ""
    closing = [line for line in tests.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    train = read_rows(out / "train_throughput.jsonl")
    predict, latency = read_rows(out / "predict_latency.jsonl"), read_rows(out / "latency.jsonl")
    # the dry run selects only the CUDA cases, which skip on a CPU; on the GPU they must run
    tests_ok = (
        bool(closing)
        and not re.search(r"\d+ (failed|error)", closing[-1])
        and (mode == "dry" or re.search(r"\d+ passed", closing[-1]) is not None)
    )
    figures = [
        {"figure": "GPU tests (test_device, test_model, test_predict_batcher)", "target": "0 failed",
         "value": closing[-1].strip("= ") if closing else f"no result (exit {status.get('tests')})",
         "verdict": "met" if tests_ok else "NOT met", "source": "tests.txt"},
    ]  # fmt: skip
    for run in ("bf16", "float32", "bf16-budget-131072"):
        figures += [
            figure(f"[{run}] real tokens/s", pick(train, "real tokens/s", run)),
            figure(
                f"[{run}] GPU busy share (torch.profiler)",
                pick(train, "GPU busy share", run),
                ">= 0.90",
                ok=lambda v: v >= 0.90,
            ),
            figure(f"[{run}] GPU utilization (NVML mean)", pick(train, "NVML", run)),
            figure(f"[{run}] data-wait share", pick(train, "data-wait share", run), "<= 0.05", ok=lambda v: v <= 0.05),
        ]
    figures += [
        figure("[bf16] producer ms/batch (plan + gather + collate)", pick(train, "producer ms/batch", "bf16")),
        figure("[bf16] collate_flat alone ms/batch", pick(train, "collate_flat alone", "bf16")),
        figure("[bf16] pin ms/batch (producer thread)", pick(train, "pin ms/batch", "bf16")),
        figure(
            "[bf16] producer batches/s over training steps/s",
            pick(train, "producer batches/s", "bf16"),
            "> 1",
            key="ratio",
            ok=lambda v: v > 1,
        ),
        figure(
            "predict p99 s: 32 instances, concurrency 8, while training",
            pick(predict, "p99 s (HTTP while training vs bare forward)"),
        ),
        figure(
            "predict p99 / bare GPU forward p99",
            pick(predict, "p99 s (HTTP while training vs bare forward)"),
            "(CPU bench's: <= 3x)",
            key="ratio",
        ),
        figure(
            "bare GPU forward p99 s (32 instances)",
            pick(predict, "p99 s (HTTP while training vs bare forward)"),
            key="baseline",
        ),
        figure(
            "event-to-trained p50 s at 5k events/s (trained events)",
            pick(latency, "p50 s, trained events only"),
            "<= 2 s",
            ok=lambda v: v <= 2,
        ),
        figure("event-to-trained p50 s, every event (untrained = inf)", pick(latency, "all measured events")),
        figure("share of measured events trained", pick(latency, "share of measured events trained")),
        figure("events/s fed", pick(latency, "events/s achieved")),
        figure("real tokens/s while at 5k events/s", pick(latency, "real tokens trained/s")),
    ]
    env_text = (out / "env.json").read_text() if (out / "env.json").exists() else ""
    env = json.loads(env_text) if env_text.strip() else {}
    summary = {"mode": mode, "seconds": seconds, "broker": broker, "steps": status, "figures": figures, "env": env}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    lines = [
        f"# GPU check ({mode}): {env.get('device')}",
        "",
        f"{seconds} s so far; latency: {broker}; step exit codes: {status}",
        f"settings on the device: {env.get('settings')}",
        "",
        "| figure | value | target | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {f['figure']} | {fmt(f['value'])} | {f['target']} | {f['verdict']} |" for f in figures]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    out_dir, status_path, run_mode, elapsed, broker_note = sys.argv[1:6]
    summarize(Path(out_dir), Path(status_path), run_mode, int(elapsed), broker_note)
