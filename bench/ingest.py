"""Ingest into the window vs a bare kafka-python poll loop over the same preloaded topic.

Both read every message of one topic with the same consumer settings; the bare loop
only counts records, ours decodes, validates, dead-letters and inserts into the window.
Rates are measured from the first record to the last, so group-join time is excluded
from both. Needs the broker: ``deploy/kafka.sh up``; run ``python bench/ingest.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import orjson
from kafka import KafkaConsumer, KafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.config import load_settings
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.ingest.topics import ensure_topics
from streamtrain.metrics import Metrics
from streamtrain.window.reservoir import RecencyWindow


def preload(bootstrap: str, topic: str, count: int, partitions: int, seed: int = 0) -> None:
    ensure_topics(bootstrap, {topic: partitions, f"{topic}.dlq": partitions})
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(48), 0.8, count).astype(int), 4, 512)
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, batch_size=1 << 20, acks=1)
    now = time.time()
    for i, length in enumerate(lengths.tolist()):
        sensor = f"sensor-{i % 64}"
        values = np.round(rng.standard_normal(length), 4).tolist()
        producer.send(
            topic, key=sensor.encode(), value=orjson.dumps({"sensor_id": sensor, "ts": now, "values": values})
        )
    producer.flush()
    producer.close()


def consumer_settings(bootstrap: str, max_records: int) -> dict:
    return dict(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=max_records,
        max_partition_fetch_bytes=8 << 20,
        fetch_max_bytes=64 << 20,
    )


def bare_poll_rate(bootstrap: str, topic: str, count: int, max_records: int) -> float:
    consumer = KafkaConsumer(group_id=f"bare-{uuid.uuid4().hex[:6]}", **consumer_settings(bootstrap, max_records))
    consumer.subscribe([topic])
    seen, first = 0, None
    while seen < count:
        records = consumer.poll(timeout_ms=500)
        n = sum(len(batch) for batch in records.values())
        if n and first is None:
            first, n_first = time.perf_counter(), n
        seen += n
    elapsed = time.perf_counter() - first
    consumer.close()
    return (seen - n_first) / elapsed


def ingest_rate(bootstrap: str, topic: str, count: int, max_records: int, capacity: int) -> float:
    settings = load_settings(
        kafka_bootstrap=bootstrap,
        topic=topic,
        group_id=f"ours-{uuid.uuid4().hex[:6]}",
        poll_max_records=max_records,
        window_capacity=capacity,
        half_life_s=3600.0,
    )
    window = RecencyWindow(capacity, settings.half_life_s, rng=np.random.default_rng(0))
    ingestor = Ingestor(settings, window, Metrics())
    ingestor.start()
    first = None
    deadline = time.monotonic() + 300
    while ingestor.stats.seen_total < count:
        if first is None and ingestor.stats.seen_total:
            first, n_first = time.perf_counter(), ingestor.stats.seen_total
        if time.monotonic() > deadline:
            ingestor.stop()
            raise SystemExit(f"ingest stalled at {ingestor.stats.seen_total} of {count} messages")
        time.sleep(0.001)
    elapsed = time.perf_counter() - first
    ingestor.stop()
    assert len(window) == min(capacity, count)
    return (count - n_first) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("STREAMTRAIN_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--events", type=int, default=150_000)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--max-records", type=int, default=5000, help="records per poll (both loops)")
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; best rate of each side")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    topic = f"bench-ingest-{uuid.uuid4().hex[:8]}"
    preload(args.bootstrap, topic, args.events, args.partitions)
    bare, ours = [], []
    for _ in range(args.rounds):
        bare.append(bare_poll_rate(args.bootstrap, topic, args.events, args.max_records))
        ours.append(ingest_rate(args.bootstrap, topic, args.events, args.max_records, args.capacity))
    emit([Row("ingest_into_window", "events/s", max(ours), max(bare), ">= 0.7x bare poll")], args.json)


if __name__ == "__main__":
    main()
