"""The service on a three-broker cluster (deploy/kafka-cluster.sh) through a failover: nothing lost, nothing twice.

The cluster gets its own ports and data directory and is stopped afterwards. Topics have
replication 3 and ``min.insync.replicas=2`` (the cluster's defaults; the service creates
them). Under a steady load the broker leading partition 0 is SIGKILLed, then a second
broker, then both start again; the audit reads the window of a checkpoint by (partition,
offset) and the dead-letter topic by source place, as ``bench/chaos.py --brokers 3`` does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka_helpers import REPO, event, wait_for
from service_process import ServiceProcess

from streamtrain.checkpoint.store import read_checkpoint

CLUSTER = REPO / "deploy" / "kafka-cluster.sh"
TOPIC = "cluster-events"
TOKEN = "cluster-admin-token-7e2a"
RATE = 150  # valid events/s
MALFORMED = -1


def _free_base() -> int:
    """A base port with base..base+2 (clients) and base+100..base+102 (controllers) free."""
    for base in range(29092, 29992, 7):
        try:
            for port in [base, base + 1, base + 2, base + 100, base + 101, base + 102]:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports for a three-broker cluster")


@dataclass
class Cluster:
    port: int
    env: dict[str, str]

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{self.port + i}" for i in range(3))

    def run(self, *command: str) -> str:
        done = subprocess.run(
            [str(CLUSTER), *command], env=self.env, check=True, timeout=180, capture_output=True, text=True
        )
        return done.stdout

    def describe(self, topic: str) -> dict[int, dict[str, Any]]:
        """partition -> its metadata (leader_id, replica_nodes, isr_nodes), from the nodes that answer."""

        def ask() -> dict[int, dict[str, Any]] | None:
            try:
                admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=5000)
                try:
                    (described,) = admin.describe_topics([topic])
                finally:
                    admin.close()
                return {int(p["partition_index"]): p for p in described["partitions"]}
            except Exception:  # noqa: BLE001 - the node asked may be the one just killed
                return None

        return wait_for(ask, 60, f"metadata of {topic}", interval=0.5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    port = _free_base()
    home = tmp_path_factory.mktemp("kafka-cluster")
    env = {**os.environ, "KAFKA_CLUSTER_PORT": str(port), "KAFKA_CLUSTER_HOME": str(home), "PYTHON": sys.executable}
    subprocess.run([str(CLUSTER), "up"], env=env, check=True, timeout=240, stdout=subprocess.DEVNULL)
    try:
        yield Cluster(port, env)
    finally:
        subprocess.run([str(CLUSTER), "down"], env=env, check=False, timeout=180, stdout=subprocess.DEVNULL)


class SteadyFeed:
    """Valid events at RATE/s (first reading = event id) on an idempotent acks=all producer; every ack placed."""

    def __init__(self, bootstrap: str) -> None:
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, metadata_max_age_ms=5000,
                                      delivery_timeout_ms=300_000, request_timeout_ms=15_000,
                                      reconnect_backoff_max_ms=1000)  # fmt: skip
        self.placed: dict[tuple[int, int], int] = {}
        self.failed: list[BaseException] = []
        self.lock = threading.Lock()
        self.next_id = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="feed", daemon=True)
        self.closed = False

    def _place(self, label: int) -> Any:
        def placed(metadata: Any) -> None:
            with self.lock:
                self.placed[(metadata.partition, metadata.offset)] = label

        return placed

    def _send(self, key: bytes | None, value: bytes, label: int) -> None:
        future = self.producer.send(TOPIC, key=key, value=value)
        future.add_callback(self._place(label)).add_errback(self.failed.append)

    def _run(self) -> None:
        started = time.monotonic()
        while not self.stop.is_set():
            due = int((time.monotonic() - started) * RATE)
            while self.next_id < due:
                self._send(*event(self.next_id), self.next_id)
                self.next_id += 1
            self.stop.wait(0.02)

    def malformed(self, count: int, tag: str) -> None:
        for i in range(count):
            self._send(f"bad-{tag}".encode(), orjson.dumps({"sensor_id": f"bad-{tag}-{i}", "values": []}), MALFORMED)

    def ends(self) -> dict[int, int]:
        with self.lock:
            ends: dict[int, int] = {}
            for p, o in self.placed:
                ends[p] = max(ends.get(p, 0), o + 1)
            return ends

    def finish(self, timeout_s: float = 300) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(10)
        self.closed = True
        try:
            self.producer.flush(timeout_s)
        finally:
            self.producer.close(timeout=min(10, timeout_s))


def covered(service: ServiceProcess) -> dict[int, int]:
    return {int(p): int(o) for p, o in service.get("/v1/window")["next_offsets"].items()}


def reasons(service: ServiceProcess) -> tuple[int, list[str]]:
    response = service.client.get("/readyz")
    return response.status_code, list(response.json()["reasons"])


def degraded(service: ServiceProcess) -> list[str]:
    return [r for r in reasons(service)[1] if r.startswith("kafka_degraded:")]


def wait_all_past(service: ServiceProcess, past: dict[int, int], timeout_s: float, what: str) -> float:
    """Seconds until the window covers, in every partition, an event acknowledged after ``past``
    (the acknowledged ends at the fault): ingest resumed everywhere."""
    since = time.monotonic()
    wait_for(
        lambda: (now := covered(service)) and all(now.get(p, 0) > past.get(p, 0) for p in range(3)),
        timeout_s,
        f"every partition past {past} ({what})",
        interval=0.25,
    )
    return time.monotonic() - since


def audit_window(loaded: Any, placed: dict[tuple[int, int], int]) -> Counter[str]:
    """By (partition, offset): items twice, acknowledged events missing, items that are not the event at their place."""
    window = loaded.state["window"]
    lengths = np.asarray(window["lengths"], dtype=np.int64)
    flat = np.asarray(window["values"], dtype=np.float32).reshape(-1)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    ids = flat[starts].astype(np.int64).tolist() if lengths.size else []
    pairs = list(zip(np.asarray(window["partitions"]).tolist(), np.asarray(window["offsets"]).tolist()))
    valid = {po: label for po, label in placed.items() if label != MALFORMED}
    found = Counter()
    found["twice"] = len(pairs) - len(set(pairs))
    found["lost"] = len(set(valid) - set(pairs))
    found["not acknowledged there"] = sum(1 for po, i in zip(pairs, ids) if valid.get(po) != i)
    found["accepted_total - valid sent"] = int(window["accepted_total"]) - len(valid)
    return found


def dead_letters(bootstrap: str, expected: int) -> list[Any]:
    consumer = KafkaConsumer(f"{TOPIC}.dlq", bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                             enable_auto_commit=False, consumer_timeout_ms=5000)  # fmt: skip
    try:
        records: list[Any] = []
        deadline = time.monotonic() + 60
        while len(records) < expected and time.monotonic() < deadline:
            records.extend(consumer)
        records.extend(consumer)  # anything more (a second copy) within another 5 s
        return records
    finally:
        consumer.close()


@pytest.mark.expected_seconds(100)
def test_a_leader_killed_then_a_second_broker_then_both_back_loses_nothing_and_doubles_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "ck"
    service = ServiceProcess(cluster.bootstrap, TOPIC, checkpoints, tmp_path / "serve.log",
                             GROUP_ID="cluster", ADMIN_TOKEN=TOKEN, CHECKPOINT_INTERVAL_S="3", HALF_LIFE_S="inf",
                             WINDOW_CAPACITY="100000", TOPIC_PARTITIONS="3")  # fmt: skip
    feed = SteadyFeed(cluster.bootstrap)
    try:
        failover(cluster, service, feed, checkpoints)
    finally:
        if not feed.closed:
            feed.finish(timeout_s=0)  # a failed test: drop what waits, no atexit flush


def failover(cluster: Cluster, service: ServiceProcess, feed: SteadyFeed, checkpoints: Path) -> None:
    with service:
        wait_for(lambda: len(cluster.describe(TOPIC)) == 3, 60, "the service to create its topic")
        for name in (TOPIC, f"{TOPIC}.dlq"):  # replication 3 and min.insync.replicas=2: the cluster's defaults
            assert all(len(p["replica_nodes"]) == 3 for p in cluster.describe(name).values()), name
        admin = KafkaAdminClient(bootstrap_servers=cluster.bootstrap, request_timeout_ms=10000)
        configs = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, TOPIC, {"min.insync.replicas": None})], config_filter="all"
        )
        admin.close()
        assert configs["topic"][TOPIC]["min.insync.replicas"]["value"] == "2"

        feed.thread.start()
        feed.malformed(20, "before")
        service.wait_ready(120)
        wait_all_past(service, feed.ends(), 30, "warm-up")

        # 1. SIGKILL the leader of partition 0: the others elect new leaders, ingest goes on
        first = int(cluster.describe(TOPIC)[0]["leader_id"])
        cluster.run("kill", str(first))
        at_kill = feed.ends()
        feed.malformed(20, "one-down")
        resumed = wait_all_past(service, at_kill, 60, f"after SIGKILL of node {first}")
        named = wait_for(lambda: degraded(service), 40, "kafka_degraded in /readyz with one broker down")
        assert f"broker {first}" in named[0], named  # its leadership unreachable, then its replicas out of sync
        assert reasons(service)[0] == 200  # degraded, still ready: it reads from what remains

        # 2. SIGKILL a second broker (the new leader of partition 0): one node, no controller quorum,
        # and with min.insync.replicas=2 nothing more is acknowledged
        second = int(cluster.describe(TOPIC)[0]["leader_id"])
        if second == first:  # metadata not yet past the first kill
            second = min({1, 2, 3} - {first})
        cluster.run("kill", str(second))
        time.sleep(1)
        at_second_kill = feed.ends()
        feed.malformed(20, "two-down")
        time.sleep(10)
        assert service.process is not None and service.process.poll() is None
        assert degraded(service), reasons(service)

        # 3. both back: everything buffered meanwhile arrives, exactly once
        threads = [threading.Thread(target=cluster.run, args=("start", str(n))) for n in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert "stopped" not in cluster.run("status")
        back = wait_all_past(service, at_second_kill, 90, "after both nodes are back")
        feed.finish()
        assert not feed.failed, feed.failed[:3]
        ends = feed.ends()
        wait_for(lambda: covered(service) == ends, 120, f"the window to cover every acknowledged event {ends}")
        wait_for(lambda: not degraded(service), 90, "kafka_degraded to clear once the replicas are in sync")
        # a dead letter whose send expired while no quorum acknowledged anything is sent again after
        # its backoff (and may need a second delivery timeout): the cut waits for it, so the test does
        wait_for(lambda: service.get("/v1/window")["dead_letters_pending"] == 0, 120, "every dead letter acknowledged")

        response = service.client.post("/v1/admin/checkpoint", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200, response.text
        loaded = read_checkpoint(checkpoints / response.json()["path"])

    assert audit_window(loaded, feed.placed) == Counter(), "window audit"
    rejected = {po for po, label in feed.placed.items() if label == MALFORMED}
    letters = dead_letters(cluster.bootstrap, len(rejected))
    places = Counter((int(dict(r.headers)["source_partition"]), int(dict(r.headers)["source_offset"])) for r in letters)
    assert set(places) == rejected, f"dead letters missing {len(rejected - set(places))}"
    assert max(places.values()) == 1, f"dead letters twice: {[po for po, n in places.items() if n > 1][:5]}"
    assert len(feed.placed) - len(rejected) >= RATE * 30
    print(f"failover: resumed {resumed:.1f} s after the leader's SIGKILL, {back:.1f} s after both were back")
