"""Shared output for benchmarks: a readable table, or one JSON object per line."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass
class Row:
    bench: str
    metric: str
    value: float
    baseline: float | None = None
    target: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0) or self.value is None:
            return None
        return self.value / self.baseline


def emit(rows: Sequence[Row], as_json: bool) -> None:
    if as_json:
        for row in rows:
            out = asdict(row)
            out["ratio"] = row.ratio
            print(json.dumps(out))
        return
    header = ("bench", "metric", "value", "baseline", "ratio", "target")
    body = [
        (
            r.bench,
            r.metric,
            _fmt(r.value),
            _fmt(r.baseline),
            "" if r.ratio is None else f"{r.ratio:.2f}x",
            r.target,
        )
        for r in rows
    ]
    print_columns(header, body)


def print_columns(header: Sequence[str], body: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns as wide as their widest cell, under a ruled header."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for b in body:
        print("  ".join(c.ljust(w) for c, w in zip(b, widths)))


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.4g}"
