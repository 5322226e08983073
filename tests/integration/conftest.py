"""Integration fixtures: the real broker (deploy/kafka.sh up), unique topics, a service."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kafka.admin import KafkaAdminClient, NewTopic
from kafka_helpers import Broker, free_ports

BOOTSTRAP = os.environ.get("STREAMTRAIN_TEST_KAFKA", "127.0.0.1:9092")


def _reachable(bootstrap: str) -> bool:
    host, _, port = bootstrap.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


#: what a test without an ``expected_seconds`` mark is taken to cost when files are ordered
UNMARKED_SECONDS = 10.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest integration files first. scripts/test.sh gives each worker a file at a time
    in collection order (``--dist loadfile --no-loadscope-reorder``), and the run ends when the
    last file started does: a long file started last kept one worker busy minutes after the
    others were done. A file's weight: its tests' ``expected_seconds`` marks."""
    here = Path(__file__).parent
    weight: dict[Path, float] = {}
    for item in items:
        if here in item.path.parents:
            mark = item.get_closest_marker("expected_seconds")
            weight[item.path] = weight.get(item.path, 0.0) + (float(mark.args[0]) if mark else UNMARKED_SECONDS)
    items.sort(key=lambda item: -weight.get(item.path, 0.0))  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def _no_holdout_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ingest audits here compare the window with every event sent; a held-out event never
    enters the window (it is counted in held_out_total). Tests of the holdout set it themselves."""
    monkeypatch.setenv("STREAMTRAIN_HOLDOUT_SHARE", "0")


@pytest.fixture(scope="session", autouse=True)
def _no_service_outlives_the_tests() -> Iterator[None]:
    yield
    from service_process import kill_leftovers

    kill_leftovers()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    if not _reachable(BOOTSTRAP):
        pytest.fail(f"no Kafka broker at {BOOTSTRAP}: start it with deploy/kafka.sh up (scripts/test.sh does)")
    return BOOTSTRAP


@pytest.fixture()
def make_topic(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """Create uniquely named topics (and their .dlq); delete them afterwards."""
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=15000)
    created: list[str] = []

    def create(partitions: int = 1, prefix: str = "it") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(name, partitions, 1), NewTopic(f"{name}.dlq", partitions, 1)], timeout_ms=15000)
        created.extend([name, f"{name}.dlq"])
        return name

    yield create
    try:
        admin.delete_topics(created, timeout_ms=15000)
    except Exception:  # noqa: BLE001 - cleanup is best effort
        pass
    admin.close()


@pytest.fixture()
def private_broker(tmp_path: Path) -> Iterator[Broker]:
    broker = Broker(free_ports(2), tmp_path / "kafka")
    try:
        yield broker
    finally:
        broker.down()
