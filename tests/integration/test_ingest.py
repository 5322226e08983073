"""Ingest against the real broker: exactly-once into the window, dead letters byte-identical."""

from __future__ import annotations

import math
import time

import orjson
import pytest
from kafka_helpers import consume_all, produce, wait_for

from streamtrain.config import load_settings
from streamtrain.events import REASONS
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.metrics import Metrics
from streamtrain.window.reservoir import RecencyWindow

pytestmark = pytest.mark.integration


def valid(i: int, now: float) -> tuple[bytes, bytes]:
    sensor = f"sensor-{i % 5}"
    return sensor.encode(), orjson.dumps(
        {"sensor_id": sensor, "ts": now - 1, "values": [float(i), 0.5, 1.5][: 1 + i % 3]}
    )


def invalid_messages(now: float) -> list[tuple[bytes, bytes, str]]:
    return [
        (b"k1", b"\x00\x01 binary", "decode"),
        (b"k2", b'{"sensor_id": "a", "ts": 1}', "schema"),
        (b"k3", b'{"sensor_id": "a", "ts": 1, "values": [1, NaN]}', "non_finite"),
        (b"k4", orjson.dumps({"sensor_id": "a", "ts": now, "values": []}), "empty"),
        (b"k5", orjson.dumps({"sensor_id": "a", "ts": now, "values": [0.0] * 33}), "too_long"),
        (b"k6", orjson.dumps({"sensor_id": "a", "ts": now, "values": [[1.0, 2.0]]}), "bad_channels"),
        (b"k7", orjson.dumps({"sensor_id": "a", "ts": now, "values": [1.0], "label": 9}), "bad_label"),
        (b"k8", orjson.dumps({"sensor_id": "a", "ts": now + 10_000, "values": [1.0]}), "bad_timestamp"),
        (b"k9", b'{"sensor_id": "a", "ts": 1, "values": [' + b"1," * 3000 + b"1]}", "too_large"),
    ]


def make_ingestor(bootstrap: str, topic: str, capacity: int = 10_000) -> tuple[Ingestor, RecencyWindow]:
    settings = load_settings(
        kafka_bootstrap=bootstrap,
        topic=topic,
        group_id=f"g-{topic}",
        max_len=32,
        n_classes=3,
        max_message_bytes=4096,
        window_capacity=capacity,
        half_life_s=math.inf,
        topic_partitions=3,
    )
    window = RecencyWindow(capacity, math.inf, channels=1)
    return Ingestor(settings, window, Metrics()), window


def test_valid_land_once_invalid_dead_lettered_byte_identical(kafka_bootstrap: str, make_topic) -> None:
    topic = make_topic(partitions=3)
    now = time.time()
    good = [valid(i, now) for i in range(300)]
    bad = invalid_messages(now)
    produce(kafka_bootstrap, topic, good[:150] + [(k, v) for k, v, _ in bad] + good[150:])
    ingestor, window = make_ingestor(kafka_bootstrap, topic)
    ingestor.start()
    try:
        wait_for(lambda: ingestor.stats.seen_total >= 309, 60, "all messages consumed")
        time.sleep(1.0)  # nothing more should arrive
        assert ingestor.stats.seen_total == 309
        snap = window.snapshot()
        assert len(snap) == 300
        identities = list(zip(snap.partitions.tolist(), snap.offsets.tolist()))
        assert len(set(identities)) == 300  # exactly once
        assert sorted(v[0, 0] for v in snap.values) == list(range(300))  # the valid ones, all of them
        assert sum(snap.next_offsets.values()) == 309  # the state covers every consumed offset
        assert dict(ingestor.stats.rejected) == {reason: 1 for _, _, reason in bad}
        assert set(ingestor.stats.rejected) == set(REASONS)
        assert ingestor.flush_dead_letters()
    finally:
        ingestor.stop()

    dead = consume_all(kafka_bootstrap, f"{topic}.dlq", expected=len(bad))
    assert len(dead) == len(bad)
    sent = {value: (key, reason) for key, value, reason in bad}
    source = {(r.partition, r.offset): r.value for r in consume_all(kafka_bootstrap, topic, expected=309)}
    for record in dead:
        headers = {k: v.decode() for k, v in record.headers}
        key, reason = sent[record.value]  # byte-identical value
        assert record.key == key
        assert headers["reason"] == reason
        assert headers["source_topic"] == topic
        assert int(headers["source_partition"]) in (0, 1, 2)
        # the headers point at the very message that was dead-lettered
        assert source[int(headers["source_partition"]), int(headers["source_offset"])] == record.value


def test_service_started_before_the_broker_connects_once_it_is_up(private_broker) -> None:
    topic = "late-broker"
    ingestor, window = make_ingestor(private_broker.bootstrap, topic)
    ingestor.start()
    try:
        time.sleep(3)
        assert ingestor.running and not ingestor.connected
        private_broker.up()
        now = time.time()
        produce(private_broker.bootstrap, topic, [valid(i, now) for i in range(50)])
        wait_for(lambda: len(window) == 50, 90, "events from the late broker")
        assert ingestor.connected
    finally:
        ingestor.stop()


def test_many_poll_batches_through_the_decode_worker_land_once(kafka_bootstrap: str, make_topic) -> None:
    """Pipelined decoding over many poll batches (and the group's early rebalance) loses nothing."""
    topic = make_topic(partitions=3)
    now = time.time()
    produce(kafka_bootstrap, topic, [valid(i, now) for i in range(12_000)])
    settings = load_settings(
        kafka_bootstrap=kafka_bootstrap,
        topic=topic,
        group_id=f"g-{topic}",
        max_len=32,
        window_capacity=20_000,
        half_life_s=math.inf,
        poll_max_records=700,
        decode_workers=1,
    )
    window = RecencyWindow(20_000, math.inf)
    ingestor = Ingestor(settings, window, Metrics())
    ingestor.start()
    try:
        wait_for(lambda: ingestor.stats.seen_total >= 12_000, 90, "every message through the decode worker")
        snap = window.snapshot()
        assert len(snap) == 12_000
        assert len(set(zip(snap.partitions.tolist(), snap.offsets.tolist()))) == 12_000
        assert sum(snap.next_offsets.values()) == 12_000
    finally:
        ingestor.stop()
