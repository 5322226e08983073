"""The DP micro-batch's gradient sum against the same code at another git revision, side by side.

:meth:`~streamtrain.privacy.per_sample.PerSampleGradients.grid_sum` (per-sample gradients,
clipping, the integer grid, the exact sum) of this checkout and of ``--before`` (its
``per_sample.py`` loaded from git), on the service's default model and micro-batches of the
DP token budget (1,024 padded tokens) at several lengths, called in turn in one process
(the order alternating every round) so load on the shared machine hits both alike. Rows:
median milliseconds per call of each, their ratio, the per-sample gradients alone (what
the grid sum adds to them), and whether the two returned the same integers and norms.
One torch thread.

Run: ``python bench/dp_grid_sum.py --before 368bb7f [--rounds N] [--json]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.config import load_settings  # noqa: E402
from streamtrain.model.network import build_model  # noqa: E402
from streamtrain.privacy import per_sample  # noqa: E402

BENCH = "dp_grid_sum"
SHAPES = ((128, 8), (64, 16), (32, 32), (16, 64))  # sequences x padded length: 1,024 tokens each


def module_at(revision: str) -> ModuleType:
    """``streamtrain/privacy/per_sample.py`` as it was at ``revision``, imported under another name."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{revision}:src/streamtrain/privacy/per_sample.py"],
        cwd=root, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "per_sample_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("per_sample_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same(a: tuple[dict[str, torch.Tensor], torch.Tensor], b: tuple[dict[str, torch.Tensor], torch.Tensor]) -> bool:
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and torch.equal(a[1], b[1])


def timed(calls: dict[str, Callable[[], Any]], rounds: int, warmup: int) -> dict[str, float]:
    """Median milliseconds of each call, the calls taken in turn, their order alternating."""
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(warmup + rounds):
        for name in calls if round_ % 2 == 0 else reversed(calls):
            started = time.perf_counter()
            calls[name]()
            if round_ >= warmup:
                seconds[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision whose grid_sum is the baseline")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(load_settings())
    before = module_at(args.before).PerSampleGradients(model, args.clip)
    after = per_sample.PerSampleGradients(model, args.clip)
    rows: list[Row] = []
    for count, length in SHAPES:
        x = torch.randn(count, length, 1)
        mask = torch.ones(count, length, dtype=torch.bool)
        mask[: count // 2, length // 2 :] = False  # half the sequences padded
        batch = (x, mask, torch.zeros(count, dtype=torch.int64))
        calls = {
            "before": partial(before.grid_sum, *batch),
            "after": partial(after.grid_sum, *batch),
            "per_sample": partial(after.per_sample, *batch),
        }
        ms = timed(calls, args.rounds, args.warmup)
        shape = f"{count}x{length}"
        rows += [
            Row(BENCH, f"grid_sum ms {shape}: after vs before", ms["after"], ms["before"], "< 1.0x"),
            Row(BENCH, f"grid_sum ms {shape}: after vs per-sample gradients alone", ms["after"], ms["per_sample"]),
            Row(BENCH, f"same integers and norms {shape}", float(same(calls["before"](), calls["after"]())), None, "1"),
        ]
    emit(rows, args.json)


if __name__ == "__main__":
    main()
