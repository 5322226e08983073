"""Helpers for integration tests against the real broker."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, KafkaProducer

REPO = Path(__file__).resolve().parents[2]


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes]], partition: int | None = None) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=4 << 20)
    for key, value in messages:
        producer.send(topic, key=key, value=value, partition=partition)
    producer.flush(30)
    producer.close()


def consume_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 30.0) -> list[Any]:
    consumer = KafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False,
        group_id=None, max_partition_fetch_bytes=8 << 20,
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


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class Broker:
    """A second, private broker on another port (for outage tests); deploy/kafka.sh drives it."""

    def __init__(self, port: int, home: Path) -> None:
        self.port = port
        self.env = {**os.environ, "KAFKA_PORT": str(port), "KAFKA_HOME_DIR": str(home)}

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, command: str) -> None:
        subprocess.run([str(REPO / "deploy" / "kafka.sh"), command], env=self.env, check=True, timeout=180,
                       stdout=subprocess.DEVNULL)

    def up(self) -> None:
        self._run("up")

    def down(self) -> None:
        self._run("down")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
