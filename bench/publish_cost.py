"""What a publication costs the trainer: the gate and the forecaster choice against no gate.

A service (no Kafka: poll batches are handed to the quality hook and the window as ingest
does) holds a window of random walks (lognormal lengths, median 48, the default model and
settings) and a full holdout; ``Trainer.publish()`` is timed with the holdout on
(``HOLDOUT_SHARE=0.1``: linear fit + one scoring pass of four models) and off, side by
side, medians of ``--repeats``.

    python bench/publish_cost.py [--window 90000] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.config import load_settings  # noqa: E402
from streamtrain.events import EventBatch, SensorEvent  # noqa: E402
from streamtrain.runtime.service import Service  # noqa: E402


def filled_service(window: int, holdout_share: float, seed: int = 0) -> Service:
    rng = np.random.default_rng(seed)
    service = Service(
        load_settings(kafka_bootstrap="127.0.0.1:9", checkpoint_dir=tempfile.mkdtemp(), holdout_share=holdout_share)
    )
    now, sent = time.time(), 0
    while len(service.window) < min(window, service.settings.window_capacity):
        lengths = np.clip(rng.lognormal(np.log(48), 0.5, 5000).astype(int), 2, 512)
        items = [
            SensorEvent(
                f"s{(sent + i) % 50}", now - 1e5 + sent + i, np.cumsum(rng.normal(size=n))[:, None].astype(np.float32)
            )
            for i, n in enumerate(lengths.tolist())
        ]
        sent += len(items)
        batch = EventBatch.from_events(items)
        to_window = service.ingest.before_insert(batch) if service.ingest.before_insert else batch
        service.window.insert_batch(to_window)
    return service


def timed_publications(service: Service, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        service.trainer.publish()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=90_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gated = filled_service(args.window, 0.1)
    plain = filled_service(args.window, 0.0)
    on, off = timed_publications(gated, args.repeats), timed_publications(plain, args.repeats)
    rows = [
        Row(
            "publish",
            f"seconds per publication, gate on (window {len(gated.window)}, "
            f"holdout {len(gated.trainer.quality.holdout)})",
            float(np.median(on)),
            float(np.median(off)),
            "PUBLISH_MAX_SHARE bounds its share of the trainer",
        ),  # fmt: skip
        Row("publish", "seconds per publication, gate on, fastest", float(np.min(on)), float(np.min(off))),
        Row("publish", "publication interval at PUBLISH_MAX_SHARE=0.1 (s)", max(2.0, float(np.median(on)) / 0.1)),
    ]
    emit(rows, args.json)


if __name__ == "__main__":
    main()
