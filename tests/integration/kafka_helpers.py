"""Helpers for integration tests against the real broker."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient

REPO = Path(__file__).resolve().parents[2]


def produce(
    bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes]], partition: int | None = None
) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=4 << 20)
    for key, value in messages:
        producer.send(topic, key=key, value=value, partition=partition)
    producer.flush(30)
    producer.close()


def consume_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 30.0) -> list[Any]:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=None,
        max_partition_fetch_bytes=8 << 20,
    )
    records: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(records) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        for batch in consumer.poll(timeout_ms=500).values():
            records.extend(batch)
    finally:
        consumer.close()
    return records


def wait_for(
    condition: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval: float = 0.1,
    describe: Callable[[], str] | None = None,
) -> Any:
    """Poll ``condition`` until truthy; on timeout fail, with ``describe()`` saying what was seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    seen = f"; {describe()}" if describe is not None else ""
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{seen}")


class Broker:
    """A second, private broker on another port (for outage tests); deploy/kafka.sh drives it."""

    def __init__(self, port: int, home: Path) -> None:
        self.port = port
        self.env = {**os.environ, "KAFKA_PORT": str(port), "KAFKA_HOME_DIR": str(home)}

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, command: str) -> None:
        subprocess.run(
            [str(REPO / "deploy" / "kafka.sh"), command],
            env=self.env,
            check=True,
            timeout=180,
            stdout=subprocess.DEVNULL,
        )

    def up(self) -> None:
        self._run("up")

    def down(self) -> None:
        self._run("down")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 all free (a broker binds KAFKA_PORT + 1 for its controller).

    Drawn below the kernel's ephemeral range, so no client connection made between this probe and
    the server's bind can take one of them (``free_port`` alone cannot promise P + 1).
    """
    low, high = 20000, 32768 - count  # Linux's ephemeral ports start at 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} free ports in a row below {high + count}")


def topic_exists(bootstrap: str, topic: str) -> bool:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    try:
        return topic in set(admin.list_topics())
    finally:
        admin.close()


def event(event_id: int, now: float | None = None) -> tuple[bytes, bytes]:
    """A valid event whose first reading is its id (so the window shows which event an item is)."""
    sensor = f"sensor-{event_id % 7}"
    values = [float(event_id)] + [0.25 * (event_id % 5) + k for k in range(event_id % 4)]
    ts = (time.time() if now is None else now) - 1.0
    return sensor.encode(), orjson.dumps({"sensor_id": sensor, "ts": ts, "values": values})


class Placements:
    """Produces messages and records where Kafka put each one: (partition, offset) -> label.

    ``label`` is the event id for a valid event, or any hashable the test picks for others.
    """

    def __init__(self, bootstrap: str, topic: str, **producer_config: Any) -> None:
        self.topic = topic
        config = {"acks": "all", "linger_ms": 5, "max_request_size": 4 << 20, **producer_config}
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, **config)
        self.placed: dict[tuple[int, int], Any] = {}
        self.next_id = 0

    def send(self, key: bytes | None, value: bytes, label: Any, partition: int | None = None) -> None:
        record = self.producer.send(self.topic, key=key, value=value, partition=partition).get(timeout=60)
        self.placed[(record.partition, record.offset)] = label

    def events(self, count: int, partition: int | None = None) -> list[int]:
        """Send ``count`` valid events (asynchronously, then wait for all); their ids."""
        futures = []
        for _ in range(count):
            event_id, self.next_id = self.next_id, self.next_id + 1
            key, value = event(event_id)
            futures.append((event_id, self.producer.send(self.topic, key=key, value=value, partition=partition)))
        self.producer.flush(60)
        for event_id, future in futures:
            record = future.get(timeout=60)
            self.placed[(record.partition, record.offset)] = event_id
        return [event_id for event_id, _ in futures]

    def end_offsets(self) -> dict[int, int]:
        ends: dict[int, int] = {}
        for partition, offset in self.placed:
            ends[partition] = max(ends.get(partition, 0), offset + 1)
        return ends

    def close(self) -> None:
        self.producer.close(timeout=10)


def assert_window_holds_exactly(window: Any, placed: dict[tuple[int, int], Any]) -> None:
    """The window holds every produced valid event once (by (partition, offset)), with its own readings,
    and nothing else."""
    snapshot = window.snapshot()
    pairs = list(zip(snapshot.partitions.tolist(), snapshot.offsets.tolist()))
    assert len(pairs) == len(set(pairs)), f"{len(pairs) - len(set(pairs))} duplicates in the window"
    valid = {po: label for po, label in placed.items() if isinstance(label, int)}
    missing, extra = set(valid) - set(pairs), set(pairs) - set(valid)
    assert not missing and not extra, (
        f"missing {sorted(missing)[:5]} ({len(missing)}), extra {sorted(extra)[:5]} ({len(extra)})"
    )
    firsts = [float(v[0, 0]) for v in snapshot.values]
    wrong = [(po, valid[po]) for po, first in zip(pairs, firsts) if first != valid[po]]
    assert not wrong, f"items with another event's readings: {wrong[:5]}"
