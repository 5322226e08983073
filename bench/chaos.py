"""Chaos soak: the service at 5,000 events/s while its world breaks, then an exact audit.

Runs its own broker (``deploy/kafka.sh`` on a free port) and a real ``streamtrain serve``
(default window of 100,000 items, uniform so the items held are a fair sample; static
group membership, as a StatefulSet replica has), feeds it ``--rate`` events/s whose first
reading is the event's id, and at random times (seeded) injects, in turn:

``broker_restart``      the broker stops for 2-6 s and starts again, data kept
``add_partitions``      the topic gets one more partition
``member_join_leave``   a second consumer joins the service's group for 8-15 s, then leaves
``oversized``           three 1.5 MB messages (over ``MAX_MESSAGE_BYTES``, within the topic's limit)
``malformed``           300 messages that break the event format, every reason
``sigkill``             SIGKILL of the service, restarted at once (same checkpoints, same member id)

Every second it reads ``/v1/window``. At the end it stops producing, waits until the
service has read everything, writes a checkpoint through the admin route and audits:

- the window, by (partition, offset): no item twice, each item's readings are those of the
  event Kafka acknowledged at that place, and the window's accepted count equals the valid
  events below the offsets it covers (a lost event makes it smaller, a doubled one larger);
  with ``--window-capacity`` at least the events sent, the items must be exactly those events;
- stalls: a partition whose records wait and whose covered offset does not move for more
  than 3 s; healed = moving again, timed from the end of the fault that explains it (or
  from its start when none does); every one must heal within ``--heal-target-s`` (30 s);
- ingest restarts, by reason, summed over the service's processes;
- dead letters: every rejected message in ``<topic>.dlq``, whole or as its stand-in
  (duplicates are counted: a SIGKILL before a checkpoint re-reads, and re-forwards, them);
- RSS of the last service process (with its decode worker): growth from just after its
  warm-up to the end, under 5%. The service runs on jemalloc when it can be had, as the
  image runs it (``--malloc glibc``: glibc's, whose RSS settles far higher; docs/operations.md).

    python bench/chaos.py --duration-s 240            # a short look (about 6 minutes with the audit)
    python bench/chaos.py --duration-s 1800           # the 30-minute soak

``--brokers 3`` runs the three-broker cluster of ``deploy/kafka-cluster.sh`` instead (topics
with replication 3, ``min.insync.replicas=2``) and injects its failover, once:

``leader_kill``         SIGKILL of the broker leading partition 0 (the others elect new leaders)
``second_kill``         ``--one-down-s`` later, SIGKILL of a second broker
                        (the new leader of partition 0): one node is left, the controller quorum
                        is lost, and with ``min.insync.replicas=2`` no write is acknowledged
``restart_both``        ``--two-down-s`` later both start again (data kept)

with 300 malformed messages (dead letters) before the first kill and while one, then two
brokers are down. Besides the audit above it reports the events/s the service ingested with
one and with two brokers down as a ratio to the 20 s before the first kill, the time until
every partition moves again after the kill and after the restart, and what ``/readyz``
said meanwhile; dead letters written twice count as a failure here.

    python bench/chaos.py --brokers 3 --duration-s 150 --rate 2000

Exits non-zero when a target is missed. Needs Java and the Kafka jars (``deploy/kafka.sh``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewPartitions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _kafka import REPO, Broker, free_port  # noqa: E402
from _malloc import CHOICES, malloc_env  # noqa: E402
from _table import Row, emit  # noqa: E402

from streamtrain.checkpoint.store import read_checkpoint  # noqa: E402

TOKEN = "chaos-admin-token-5d1c"
KINDS = ("broker_restart", "add_partitions", "member_join_leave", "oversized", "malformed", "sigkill")
FAILOVER_KINDS = ("leader_kill", "second_kill", "restart_both", "malformed")
BASELINE_S = 20.0  # --brokers 3: the ingest rate before the first kill is measured over this long
UNKNOWN, MALFORMED, OVERSIZED = -9, -1, -2  # labels of places that hold no valid event
STALL_S = 3.0


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 240.0
    rate: float = 5000.0
    partitions: int = 3
    window_capacity: int = 100_000
    half_life_s: str = "inf"
    warmup_s: float = 45.0  # before the first fault
    tail_s: float = 45.0  # after the last fault, before production stops
    fault_gap_s: float = 40.0  # mean time between faults
    rss_warmup_s: float = 90.0  # after the last service start, before RSS counts
    rss_span_s: float = 30.0
    heal_target_s: float = 30.0
    rss_target: float = 0.05
    length_median: float = 32.0
    checkpoint_interval_s: float = 30.0
    feed_processes: int = 2
    seed: int = 0
    malloc: str = "auto"  # jemalloc as the image runs it when it can be had (bench/_malloc.py); "glibc" to compare
    brokers: int = 1  # 3: the three-broker cluster (deploy/kafka-cluster.sh) and its failover instead of KINDS
    one_down_s: float = 30.0  # --brokers 3: from the leader's SIGKILL to the second broker's
    two_down_s: float = 15.0  # --brokers 3: from the second SIGKILL to restarting both

    @property
    def kinds(self) -> tuple[str, ...]:
        return FAILOVER_KINDS if self.brokers == 3 else KINDS


# ---------------------------------------------------------------------------------------
# the three-broker cluster (--brokers 3)


def free_cluster_port() -> int:
    """A base port with base..base+2 (clients) and base+100..base+102 (controllers) free."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(30000, 60000)
        try:
            for port in [base + i for i in range(3)] + [base + 100 + i for i in range(3)]:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports for a three-broker cluster")


class Cluster:
    """``deploy/kafka-cluster.sh`` on free ports with its own data directory: three KRaft nodes."""

    nodes = (1, 2, 3)

    def __init__(self, home: Path) -> None:
        self.port = free_cluster_port()
        self.env = {**os.environ, "KAFKA_CLUSTER_PORT": str(self.port), "KAFKA_CLUSTER_HOME": str(home),
                    "PYTHON": sys.executable}  # fmt: skip

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{self.port + i}" for i in range(3))

    def run(self, *command: str) -> None:
        subprocess.run([str(REPO / "deploy" / "kafka-cluster.sh"), *command], env=self.env, check=True, timeout=240,
                       stdout=subprocess.DEVNULL)  # fmt: skip

    def up(self) -> None:
        self.run("up")

    def down(self) -> None:
        self.run("down")

    def kill(self, node: int) -> None:
        self.run("kill", str(node))

    def start(self, *nodes: int) -> None:
        """Start ``nodes`` together (a node waits for a controller quorum to finish starting)."""
        threads = [threading.Thread(target=self.run, args=("start", str(n))) for n in nodes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def leader(self, topic: str, partition: int, timeout_s: float = 60) -> tuple[int, list[int]]:
        """(leader node, in-sync replicas) of a partition, from the brokers that answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=5000)
                try:
                    (described,) = admin.describe_topics([topic])
                finally:
                    admin.close()
                for entry in described["partitions"]:
                    if entry["partition_index"] == partition and entry["leader_id"] >= 0:
                        return int(entry["leader_id"]), [int(n) for n in entry["isr_nodes"]]
            except Exception:  # noqa: BLE001 - a node just killed may be the one asked: ask again
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"no leader for {topic}[{partition}]")
            time.sleep(0.5)


# ---------------------------------------------------------------------------------------
# what Kafka acknowledged where


class Placement:
    """(partition, offset) -> label (event id >= 0, or MALFORMED / OVERSIZED), from the producers' acks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._labels: dict[int, np.ndarray] = {}
        self.ends: dict[int, int] = {}
        self.rejected: dict[tuple[int, int], str] = {}  # rejected message -> SHA-256 of its value
        self.failed_sends = 0

    def record(self, partition: int, offset: int, label: int, digest: str | None = None) -> None:
        with self._lock:
            labels = self._labels.get(partition)
            if labels is None or offset >= labels.size:
                grown = np.full(max(1 << 16, offset + 1, 0 if labels is None else 2 * labels.size), UNKNOWN, np.int64)
                if labels is not None:
                    grown[: labels.size] = labels
                self._labels[partition] = labels = grown
            labels[offset] = label
            self.ends[partition] = max(self.ends.get(partition, 0), offset + 1)
            if digest is not None:
                self.rejected[(partition, offset)] = digest

    def merge(self, labels: dict[int, np.ndarray]) -> None:
        """Fold in what a feed process placed (each place was acknowledged to one producer only)."""
        with self._lock:
            for partition, theirs in labels.items():
                mine = self._labels.get(partition, np.zeros(0, np.int64))
                merged = np.full(max(mine.size, theirs.size), UNKNOWN, np.int64)
                merged[: mine.size] = mine
                merged[: theirs.size] = np.maximum(merged[: theirs.size], theirs)
                self._labels[partition] = merged
                known = np.flatnonzero(merged != UNKNOWN)
                if known.size:
                    self.ends[partition] = max(self.ends.get(partition, 0), int(known[-1]) + 1)

    def see_ends(self, ends: dict[int, int]) -> None:
        with self._lock:
            for partition, end in ends.items():
                self.ends[partition] = max(self.ends.get(partition, 0), end)

    def labels(self, partition: int, end: int) -> np.ndarray:
        with self._lock:
            labels = self._labels.get(partition, np.zeros(0, np.int64))[:end]
        return np.concatenate([labels, np.full(max(0, end - labels.size), UNKNOWN, np.int64)])

    def snapshot_ends(self) -> dict[int, int]:
        with self._lock:
            return dict(self.ends)


def producer_config(bootstrap: str) -> dict[str, Any]:
    # Buffer through broker restarts rather than fail; pick up added partitions within 5 s.
    return dict(bootstrap_servers=bootstrap, acks="all", linger_ms=5, delivery_timeout_ms=600_000, max_block_ms=600_000,
                request_timeout_ms=15_000, metadata_max_age_ms=5000, reconnect_backoff_max_ms=1000)  # fmt: skip


def feed_process(
    index: int, workers: int, bootstrap: str, topic: str, config: ChaosConfig, stop: Any, ends: Any, out: str
) -> None:
    """One feed process: events ``index, index + workers, ...`` at ``rate / workers`` per second;
    reports its acknowledged log ends as it goes and every place it was given at the end."""
    placement = Placement()
    producer = KafkaProducer(**producer_config(bootstrap))
    rng = np.random.default_rng([config.seed, index])
    lengths = np.clip(np.round(rng.lognormal(math.log(config.length_median), 0.5, 4096)), 1, 511).astype(int)
    tails = [[round(float(x), 4) for x in rng.normal(0, 1, n - 1)] for n in lengths]
    failed = [0]

    def placed(event_id: int) -> Any:
        return lambda metadata: placement.record(metadata.partition, metadata.offset, event_id)

    def on_error(error: Exception) -> None:
        failed[0] += 1

    rate = config.rate / workers
    sent, owed, last, reported = 0, 0.0, time.monotonic(), 0.0
    while not stop.is_set():
        now = time.monotonic()
        owed = min(owed + (now - last) * rate, rate * 0.2)
        last = now
        wall = time.time()
        while owed >= 1:
            event_id = index + workers * sent
            sent += 1
            owed -= 1
            sensor = f"s{event_id % 64}"
            value = orjson.dumps(
                {"sensor_id": sensor, "ts": wall - 0.5, "values": [float(event_id), *tails[event_id % 4096]]}
            )
            producer.send(topic, key=sensor.encode(), value=value).add_callback(placed(event_id)).add_errback(on_error)
        if now - reported >= 0.5:
            ends.put(placement.snapshot_ends())
            reported = now
        stop.wait(0.01)
    producer.flush(600)
    producer.close(timeout=10)
    ends.put(placement.snapshot_ends())
    labels = {p: placement.labels(p, e) for p, e in placement.snapshot_ends().items()}
    np.savez(out, sent=np.array([sent, failed[0]]), **{f"p{p}": a for p, a in labels.items()})


class Feed:
    """Valid events at ``rate``/s from ``processes`` feed processes; special messages on demand; every ack placed."""

    def __init__(
        self, bootstrap: str, topic: str, config: ChaosConfig, placement: Placement, workdir: Path, processes: int
    ) -> None:
        self.topic, self.placement, self.workdir = topic, placement, workdir
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._ends = context.Queue()
        self._outs = [workdir / f"feed-{i}.npz" for i in range(processes)]
        self._processes = [
            context.Process(
                target=feed_process,
                args=(i, processes, bootstrap, topic, config, self._stop, self._ends, str(out)),
                name=f"feed-{i}",
                daemon=True,
            )  # fmt: skip
            for i, out in enumerate(self._outs)
        ]
        # special messages from here, on a non-idempotent producer: a refused one must not stop anything
        # (idempotent for the failover run, which sends none too large: a retry after a leader's
        # SIGKILL must not put a second copy in the topic)
        self.special = KafkaProducer(**producer_config(bootstrap), enable_idempotence=config.brokers == 3,
                                     max_request_size=4 << 20)  # fmt: skip
        self.sent = 0
        self._pump = threading.Thread(target=self._drain_ends, name="feed-ends", daemon=True)

    def start(self) -> None:
        for process in self._processes:
            process.start()
        self._pump.start()

    def _drain_ends(self) -> None:
        while True:
            try:
                ends = self._ends.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in self._processes):
                    return
                continue
            self.placement.see_ends(ends)

    def send_special(self, values: list[bytes], label: int) -> None:
        for value in values:
            digest = hashlib.sha256(value).hexdigest()

            def on_ack(metadata: Any, digest: str = digest) -> None:
                self.placement.record(metadata.partition, metadata.offset, label, digest)

            def on_error(error: Exception) -> None:
                self.placement.failed_sends += 1

            self.special.send(self.topic, key=b"chaos", value=value).add_callback(on_ack).add_errback(on_error)

    def stop(self) -> None:
        """Stop producing; wait for every ack; fold every feed process's places in."""
        self._stop.set()
        self.special.flush(600)
        for process in self._processes:
            process.join(900)
        self._pump.join(10)
        for out in self._outs:
            with np.load(out) as data:
                sent, failed = (int(x) for x in data["sent"])
                self.sent += sent
                self.placement.failed_sends += failed
                self.placement.merge({int(k[1:]): data[k] for k in data.files if k.startswith("p")})

    def close(self) -> None:
        self._stop.set()
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        self.special.close(timeout=10)


def malformed_messages(count: int, rng: random.Random) -> list[bytes]:
    now = time.time()
    kinds = [
        lambda i: b"\x00\x01 not json " + str(i).encode(),
        lambda i: orjson.dumps({"sensor_id": f"m{i}", "ts": now}),
        lambda i: b'{"sensor_id": "m%d", "ts": 1, "values": [1, NaN]}' % i,
        lambda i: orjson.dumps({"sensor_id": f"m{i}", "ts": now, "values": []}),
        lambda i: orjson.dumps({"sensor_id": f"m{i}", "ts": now, "values": [0.5] * 600}),
        lambda i: orjson.dumps({"sensor_id": f"m{i}", "ts": now, "values": [[1.0, 2.0]]}),
        lambda i: orjson.dumps({"sensor_id": f"m{i}", "ts": now + 1e6, "values": [1.0]}),
        lambda i: orjson.dumps({"sensor_id": f"m{i}", "ts": now, "values": [1.0], "label": "three"}),
    ]
    return [kinds[rng.randrange(len(kinds))](i) for i in range(count)]


# ---------------------------------------------------------------------------------------
# the service


class Service:
    """One ``streamtrain serve`` process; a SIGKILLed one is replaced by a new Service."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = int(env["STREAMTRAIN_HTTP_PORT"])
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "streamtrain.cli", "serve"], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        self.started = time.monotonic()
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)
        self.restarts: dict[str, int] = {}

    def alive(self) -> bool:
        return self.process.poll() is None

    def window(self) -> dict[str, Any] | None:
        try:
            response = self.client.get("/v1/window")
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def readiness(self) -> tuple[bool, list[str]] | None:
        try:
            response = self.client.get("/readyz")
            return response.status_code == 200, list(response.json().get("reasons", []))
        except (httpx.HTTPError, ValueError):
            return None

    def wait_healthy(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"the service exited ({self.process.returncode}); see {self.log_path}")
            try:
                if self.client.get("/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"the service was not healthy after {timeout_s}s; see {self.log_path}")

    def rss_mb(self) -> float | None:
        try:
            root = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20
        except psutil.Error:
            return None

    def checkpoint(self) -> dict[str, Any]:
        response = self.client.post("/v1/admin/checkpoint", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
        response.raise_for_status()
        return response.json()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        self.client.close()

    def terminate(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.client.close()


# ---------------------------------------------------------------------------------------
# the run


@dataclass
class Sample:
    t: float
    covered: dict[int, int] | None  # None: the service did not answer
    produced: dict[int, int]
    rss_mb: float | None
    process: int
    readiness: tuple[bool, list[str]] | None = None  # --brokers 3: /readyz (ready, reasons)


@dataclass
class Fault:
    kind: str
    start: float
    end: float = 0.0
    note: str = ""


@dataclass
class Stall:
    partition: int
    start: float
    end: float  # math.inf: never healed
    heal_s: float
    explained_by: str


@dataclass
class ChaosRun:
    config: ChaosConfig
    workdir: Path
    placement: Placement = field(default_factory=Placement)
    samples: list[Sample] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    processes: list[Service] = field(default_factory=list)
    final_checkpoint: dict[str, Any] = field(default_factory=dict)
    dead_letters: list[Any] = field(default_factory=list)
    rate: float = 0.0  # valid events/s produced
    malloc: str = "glibc"  # what the service ran on
    killed: list[int] = field(default_factory=list)  # --brokers 3: the nodes SIGKILLed, in order


def schedule(config: ChaosConfig, rng: random.Random) -> list[tuple[float, str]]:
    """Fault times and kinds: each kind once per round (at least one round), in random order;
    the SIGKILLs fall in the first half, so the last service process lives long enough for RSS."""
    active = max(1.0, config.duration_s - config.warmup_s - config.tail_s)
    rounds = max(1, round(active / (config.fault_gap_s * len(KINDS))))
    count = rounds * len(KINDS)
    slot = active / count
    times = [config.warmup_s + i * slot + rng.uniform(0, 0.3 * slot) for i in range(count)]
    first_half = [i for i, t in enumerate(times) if t <= config.warmup_s + active / 2]
    kills = set(rng.sample(first_half, min(rounds, len(first_half))))
    others = [
        kind for _ in range(rounds + 1) for kind in rng.sample([k for k in KINDS if k != "sigkill"], len(KINDS) - 1)
    ]
    kinds = ["sigkill" if i in kills else others.pop(0) for i in range(count)]
    return list(zip(times, kinds))


def failover_schedule(config: ChaosConfig) -> list[tuple[float, str]]:
    """--brokers 3: dead letters before the failover, the leader's SIGKILL, dead letters with one
    broker down, the second SIGKILL, dead letters with two down, both back."""
    kill = config.warmup_s
    second = kill + config.one_down_s
    return [(kill - 10, "malformed"), (kill, "leader_kill"), (kill + 5, "malformed"), (second, "second_kill"),
            (second + 3, "malformed"), (second + config.two_down_s, "restart_both")]  # fmt: skip


def run(config: ChaosConfig, workdir: Path) -> ChaosRun:
    rng = random.Random(config.seed)
    chaos = ChaosRun(config, workdir)
    broker: Broker | Cluster = Broker(workdir / "kafka") if config.brokers == 1 else Cluster(workdir / "kafka-cluster")
    broker.up()
    topic = "chaos-events"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    env.update({f"STREAMTRAIN_{k}": str(v) for k, v in {
        "KAFKA_BOOTSTRAP": broker.bootstrap, "TOPIC": topic, "GROUP_ID": "chaos", "GROUP_INSTANCE_ID": "chaos-0",
        "HTTP_HOST": "127.0.0.1", "HTTP_PORT": free_port(), "CHECKPOINT_DIR": workdir / "ckpt", "ADMIN_TOKEN": TOKEN,
        "WINDOW_CAPACITY": config.window_capacity, "HALF_LIFE_S": config.half_life_s,
        "TOPIC_PARTITIONS": config.partitions, "CHECKPOINT_INTERVAL_S": config.checkpoint_interval_s,
        # the audit counts every valid event in accepted_total: none held out for the holdout's scores
        "HOLDOUT_SHARE": 0,
    }.items()})  # fmt: skip
    chaos.malloc, preload = malloc_env(config.malloc)
    env.update(preload)
    placement = chaos.placement
    feed: Feed | None = None
    stop_monitor = threading.Event()
    partitions = [config.partitions]

    def spawn() -> Service:
        service = Service(env, workdir / f"serve-{len(chaos.processes)}.log")
        chaos.processes.append(service)
        return service

    def monitor() -> None:
        t0 = time.monotonic()
        while not stop_monitor.is_set():
            service = chaos.processes[-1]
            window = service.window() if service.alive() else None
            covered = None if window is None else {int(p): int(o) for p, o in window["next_offsets"].items()}
            if window is not None:
                service.restarts = {k: int(v) for k, v in window.get("ingest_restarts_total", {}).items()}
            ready = service.readiness() if config.brokers == 3 and service.alive() else None
            chaos.samples.append(Sample(time.monotonic() - t0, covered, placement.snapshot_ends(), service.rss_mb(),
                                        len(chaos.processes) - 1, ready))  # fmt: skip
            stop_monitor.wait(1.0)

    def member_join_leave(seconds: float) -> None:
        consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, group_id="chaos", enable_auto_commit=False,
                                 client_id="chaos-intruder")  # fmt: skip
        consumer.subscribe([topic])
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            consumer.poll(timeout_ms=250)
        consumer.close(autocommit=False)

    service = spawn()
    try:
        service.wait_healthy()
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, request_timeout_ms=30000)
        deadline = time.monotonic() + 60
        while topic not in set(admin.list_topics()) and time.monotonic() < deadline:  # the service creates it
            time.sleep(0.2)
        admin.close()
        feed = Feed(broker.bootstrap, topic, config, placement, workdir, config.feed_processes)
        monitor_thread = threading.Thread(target=monitor, name="monitor", daemon=True)
        started = time.monotonic()
        monitor_thread.start()
        feed.start()

        def chaos_time() -> float:
            return time.monotonic() - started

        down: list[Fault] = []  # --brokers 3: the kills in progress (they end when their node is back)
        for at, kind in schedule(config, rng) if config.brokers == 1 else failover_schedule(config):
            while chaos_time() < at:
                time.sleep(0.2)
            fault = Fault(kind, chaos_time())
            print(f"[{fault.start:7.1f} s] {kind}", file=sys.stderr, flush=True)
            if kind in ("leader_kill", "second_kill"):
                assert isinstance(broker, Cluster)
                leader, in_sync = broker.leader(topic, 0)
                if leader in chaos.killed:  # metadata not yet past the first kill: any node still up
                    leader = min(set(broker.nodes) - set(chaos.killed))
                fault.note = f"node {leader} (led partition 0, in sync: {in_sync})"
                broker.kill(leader)
                chaos.killed.append(leader)
                chaos.faults.append(fault)
                down.append(fault)
                continue
            elif kind == "restart_both":
                assert isinstance(broker, Cluster)
                broker.start(*chaos.killed)
                fault.note = f"nodes {chaos.killed}"
                for killed in down:
                    killed.end = chaos_time()
            elif kind == "broker_restart":
                broker.down()
                time.sleep(rng.uniform(2, 6))
                broker.up()
            elif kind == "add_partitions":
                partitions.append(partitions[-1] + 1)
                admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, request_timeout_ms=30000)
                admin.create_partitions({topic: NewPartitions(partitions[-1])})
                admin.close()
                fault.note = f"{partitions[-1]} partitions"
            elif kind == "member_join_leave":
                member_join_leave(rng.uniform(8, 15))
            elif kind == "oversized":
                feed.send_special([os.urandom(1_500_000) for _ in range(3)], OVERSIZED)
            elif kind == "malformed":
                feed.send_special(malformed_messages(300, rng), MALFORMED)
            elif kind == "sigkill":
                chaos.processes[-1].kill()
                spawn()
            fault.end = chaos_time()
            chaos.faults.append(fault)
        while chaos_time() < config.duration_s:
            time.sleep(0.5)
        print(
            f"[{chaos_time():7.1f} s] production stops; waiting for the service to read everything",
            file=sys.stderr,
            flush=True,
        )
        feed.stop()
        service = chaos.processes[-1]
        ends = placement.snapshot_ends()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            window = service.window()
            if window is not None and {int(p): int(o) for p, o in window["next_offsets"].items()} == ends:
                break
            time.sleep(1.0)
        stop_monitor.set()
        monitor_thread.join(10)
        chaos.final_checkpoint = service.checkpoint()
        chaos.dead_letters = read_dead_letters(broker.bootstrap, f"{topic}.dlq")
    finally:
        stop_monitor.set()
        for process in chaos.processes:
            process.terminate()
        if feed is not None:
            feed.close()
        broker.down()
    chaos.rate = feed.sent / config.duration_s if feed else 0.0
    return chaos


def read_dead_letters(bootstrap: str, topic: str) -> list[Any]:
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_partition_fetch_bytes=8 << 20,
        consumer_timeout_ms=10_000,
    )
    records = list(consumer)
    consumer.close()
    return records


# ---------------------------------------------------------------------------------------
# the audit


def find_stalls(chaos: ChaosRun) -> list[Stall]:
    """Per partition: records waited and its covered offset did not move for more than STALL_S."""
    stalls: list[Stall] = []
    partitions = sorted({p for s in chaos.samples for p in s.produced})
    for p in partitions:
        last_covered: int | None = None
        clock: float | None = None  # since when it has been behind without moving
        for sample in chaos.samples:
            produced = sample.produced.get(p, 0)
            covered = None if sample.covered is None else sample.covered.get(p, 0)
            if covered is not None and (last_covered is None or covered > last_covered):
                if clock is not None and sample.t - clock > STALL_S:
                    stalls.append(make_stall(chaos, p, clock, sample.t))
                last_covered, clock = covered, None
            reference = last_covered or 0
            if produced > reference and clock is None:
                clock = sample.t
            elif produced <= reference:
                clock = None
        if clock is not None and chaos.samples and chaos.samples[-1].t - clock > STALL_S:
            stalls.append(make_stall(chaos, p, clock, math.inf))
    return stalls


def make_stall(chaos: ChaosRun, partition: int, start: float, end: float) -> Stall:
    """``heal_s``: the longest part of the stall with no fault in progress (faults run from
    their start to their end: a broker back up, a killed service started again, a member gone).
    A stall that outlasts its faults by that much took that long to heal."""
    overlapping = sorted((f for f in chaos.faults if f.start <= end and f.end >= start), key=lambda f: f.start)
    longest, cursor = 0.0, start
    for fault in overlapping:
        if fault.start > cursor:
            longest = max(longest, fault.start - cursor)
        cursor = max(cursor, fault.end)
    longest = max(longest, end - cursor)
    # the fault a stall follows: one in progress, or one that ended just before (a restart's start-up)
    near = {f.kind for f in chaos.faults if f.start <= end and f.end + 2 * STALL_S >= start}
    return Stall(partition, start, end, longest, ",".join(sorted(near)) or "none")


def dump(chaos: ChaosRun, stalls: list[Stall]) -> Path:
    path = chaos.workdir / "chaos-timeline.json"
    path.write_text(json.dumps({
        "config": chaos.config.__dict__,
        "faults": [f.__dict__ for f in chaos.faults],
        "stalls": [{**s.__dict__, "end": None if math.isinf(s.end) else s.end} for s in stalls],
        "samples": [{"t": x.t, "covered": x.covered, "produced": x.produced, "rss_mb": x.rss_mb, "process": x.process,
                     "readiness": x.readiness} for x in chaos.samples],
    }))  # fmt: skip
    return path


def audit_window(chaos: ChaosRun) -> dict[str, float]:
    config, placement = chaos.config, chaos.placement
    loaded = read_checkpoint(chaos.workdir / "ckpt" / chaos.final_checkpoint["path"])
    window = loaded.state["window"]
    lengths = np.asarray(window["lengths"], dtype=np.int64)
    flat = np.asarray(window["values"], dtype=np.float32).reshape(-1)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if lengths.size else np.zeros(0, np.int64)
    ids = flat[starts].astype(np.int64) if lengths.size else np.zeros(0, np.int64)
    parts = np.asarray(window["partitions"], dtype=np.int64)
    offsets = np.asarray(window["offsets"], dtype=np.int64)
    covered = {int(p): int(o) for p, o in window["next_offsets"].items()}
    ends = placement.snapshot_ends()
    pairs = parts * (1 << 40) + offsets
    duplicates = int(pairs.size - np.unique(pairs).size)
    valid_below = 0
    unknown_below = 0
    label_of: dict[int, np.ndarray] = {}
    for p, end in covered.items():
        labels = placement.labels(p, end)
        label_of[p] = labels
        valid_below += int((labels >= 0).sum())
        unknown_below += int((labels == UNKNOWN).sum())
    mismatches = 0
    beyond = 0
    for p in np.unique(parts):
        mine = parts == p
        labels = label_of.get(int(p), np.zeros(0, np.int64))
        at = offsets[mine]
        inside = at < labels.size
        beyond += int((~inside).sum())
        mismatches += int((labels[at[inside]] != ids[mine][inside]).sum())
    accepted = int(window["accepted_total"])
    complete = config.window_capacity >= valid_below
    missing_complete = valid_below - int(np.unique(pairs).size) if complete else 0
    return {
        "items": float(len(pairs)),
        "duplicates": float(duplicates),
        "lost": float(max(0, valid_below - accepted)) + float(max(0, missing_complete)),
        "doubled": float(max(0, accepted - valid_below)),
        "mismatches": float(mismatches + beyond),
        "uncovered_partitions": float(sum(1 for p, e in ends.items() if covered.get(p, 0) != e)),
        "unacknowledged_places": float(unknown_below),
        "complete": float(complete),
        "valid_sent": float(valid_below),
    }


def audit_dead_letters(chaos: ChaosRun) -> dict[str, float]:
    expected: dict[tuple[int, int], str] = chaos.placement.rejected
    seen: Counter[tuple[int, int]] = Counter()
    wrong = 0
    stand_ins = 0
    for record in chaos.dead_letters:
        headers = {k: v.decode() for k, v in record.headers}
        identity = (int(headers["source_partition"]), int(headers["source_offset"]))
        seen[identity] += 1
        if "stand_in_cause" in headers:
            stand_ins += 1
            ok = headers.get("original_sha256") == expected.get(identity)
        else:
            ok = hashlib.sha256(record.value or b"").hexdigest() == expected.get(identity)
        wrong += 0 if ok else 1
    return {
        "expected": float(len(expected)),
        "missing": float(len(set(expected) - set(seen))),
        "duplicates": float(sum(c - 1 for c in seen.values() if c > 1)),
        "wrong": float(wrong),
        "stand_ins": float(stand_ins),
    }


def rss_growth(chaos: ChaosRun) -> float:
    config = chaos.config
    last = len(chaos.processes) - 1
    mine = [s for s in chaos.samples if s.process == last and s.rss_mb is not None]
    if not mine:
        return math.nan
    first_t = mine[0].t
    warm = [
        s.rss_mb
        for s in mine
        if first_t + config.rss_warmup_s <= s.t <= first_t + config.rss_warmup_s + config.rss_span_s
    ]
    end = [s.rss_mb for s in mine if s.t >= mine[-1].t - config.rss_span_s]
    if not warm or mine[-1].t - first_t < config.rss_warmup_s + 2 * config.rss_span_s:
        return math.nan  # the last process did not live long enough to tell
    return float(np.median(end) / np.median(warm) - 1.0)


def _covered_at(chaos: ChaosRun, t: float) -> dict[int, int] | None:
    """The service's covered offsets at the last sample (with an answer) at or before ``t``."""
    last = None
    for sample in chaos.samples:
        if sample.t > t:
            break
        if sample.covered is not None:
            last = sample.covered
    return last


def _rate(chaos: ChaosRun, start: float, end: float, produced: bool = False) -> float:
    """Events/s the service ingested (covered offsets), or Kafka acknowledged, between two times."""
    inside = [s for s in chaos.samples if start <= s.t <= end and (produced or s.covered is not None)]
    if len(inside) < 2 or inside[-1].t <= inside[0].t:
        return math.nan

    def total(sample: Sample) -> int:
        return sum((sample.produced if produced else sample.covered or {}).values())

    return (total(inside[-1]) - total(inside[0])) / (inside[-1].t - inside[0].t)


def _resumed(stalls: list[Stall], start: float, end: float, since: float) -> float:
    """Seconds from ``since`` until the last stall that began in [start, end) ended (0: none did)."""
    ends = [stall.end for stall in stalls if start - 1.0 <= stall.start < end]
    return max(0.0, max(ends, default=since) - since)


def failover_figures(chaos: ChaosRun, stalls: list[Stall]) -> tuple[list[Row], dict[str, float]]:
    """--brokers 3: ingest rates by phase against the rate before, times to resume, what /readyz said."""
    faults = {f.kind: f for f in chaos.faults if f.kind != "malformed"}
    kill, second, restart = faults["leader_kill"].start, faults["second_kill"].start, faults["restart_both"]
    back = restart.end
    before = _rate(chaos, kill - BASELINE_S, kill)
    produced_before = _rate(chaos, kill - BASELINE_S, kill, produced=True)
    phases = {
        "one broker down": (kill, second),
        "two brokers down": (second, restart.start),
        "restarting both": (restart.start, back),
    }
    rows = [Row("chaos", "failover: events/s ingested before (20 s)", before)]
    figures: dict[str, float] = {"before": before}
    for name, (start, end) in phases.items():
        ingested = _rate(chaos, start, end)
        figures[name] = ingested / before if before else math.nan
        rows.append(Row("chaos", f"failover: events/s ingested, {name}", ingested, baseline=before))
        rows.append(Row("chaos", f"failover: events/s acknowledged to producers, {name}",
                        _rate(chaos, start, end, produced=True), baseline=produced_before))  # fmt: skip
        answered = [s.readiness for s in chaos.samples if start <= s.t <= end and s.readiness is not None]
        ready = sum(1 for ok, _ in answered if ok) / len(answered) if answered else math.nan
        named = [r for _, reasons in answered for r in reasons if r.startswith("kafka_degraded:")]
        rows.append(Row("chaos", f"readiness: share of /readyz answers ready, {name}", ready))
        rows.append(Row("chaos", f"readiness: share naming kafka_degraded, {name}",
                        sum(1 for _, reasons in answered if any(r.startswith("kafka_degraded:") for r in reasons))
                        / len(answered) if answered else math.nan))  # fmt: skip
        if named:
            print(f"readiness, {name}: {Counter(named).most_common(1)[0][0]}", file=sys.stderr)
    after = _rate(chaos, back, back + BASELINE_S)
    rows.append(Row("chaos", "failover: events/s ingested, 20 s after both are back", after, baseline=before))
    # resumed: the stalls (records waiting, covered offset still for > 3 s) that the fault began are over
    resume_kill = _resumed(stalls, kill, second, kill)
    resume_back = _resumed(stalls, second, math.inf, back)
    figures.update(resume_kill=resume_kill, resume_back=resume_back)
    rows += [
        Row("chaos", "failover: every partition moving again after the leader's SIGKILL, s", resume_kill),
        Row("chaos", "failover: restarting both nodes took, s", back - restart.start),
        Row("chaos", "failover: every partition moving again after both are back, s", resume_back),
    ]
    caught = next(
        (s.t - back for s in chaos.samples if s.t > back and s.covered is not None
         and sum(s.produced.values()) - sum(s.covered.values()) <= max(1.0, chaos.config.rate)),
        math.inf,
    )  # fmt: skip
    rows.append(Row("chaos", "failover: lag under 1 s of events again after both are back, s", caught))
    print(f"failover: killed nodes {chaos.killed}; " + "; ".join(f"{f.kind} at {f.start:.1f} s {f.note}".strip()
          for f in chaos.faults if f.kind != "malformed"), file=sys.stderr)  # fmt: skip
    return rows, figures


def report(chaos: ChaosRun) -> tuple[list[Row], bool]:
    config = chaos.config
    window = audit_window(chaos)
    letters = audit_dead_letters(chaos)
    stalls = find_stalls(chaos)
    print(f"chaos: timeline in {dump(chaos, stalls)}", file=sys.stderr)
    heal_max = max((s.heal_s for s in stalls), default=0.0)
    restarts: Counter[str] = Counter()
    for process in chaos.processes:
        restarts.update(process.restarts)
    growth = rss_growth(chaos)
    faults = Counter(f.kind for f in chaos.faults)
    rows = [
        Row("chaos", "duration_s", config.duration_s),
        Row("chaos", "brokers", float(config.brokers)),
        Row("chaos", f"malloc: {chaos.malloc}", 1),
        Row("chaos", "events/s produced", chaos.rate, target=f"{config.rate:g}"),
        *[Row("chaos", f"faults: {kind}", float(faults[kind])) for kind in config.kinds],
        Row(
            "chaos",
            "window items audited" + (" (all events)" if window["complete"] else " (uniform sample)"),
            window["items"],
        ),
        Row("chaos", "window: duplicated (partition, offset)", window["duplicates"], target="0"),
        Row("chaos", "window: events lost", window["lost"], target="0"),
        Row("chaos", "window: events counted twice", window["doubled"], target="0"),
        Row("chaos", "window: items not the event at their place", window["mismatches"], target="0"),
        Row("chaos", "window: partitions not read to the end", window["uncovered_partitions"], target="0"),
        Row("chaos", "stalls (partition-level, > 3 s)", float(len(stalls))),
        Row("chaos", "stall healed in, max s", heal_max, target=f"<= {config.heal_target_s:g}"),
        Row("chaos", "stalls no fault explains", float(sum(s.explained_by == "none" for s in stalls))),
        *[
            Row("chaos", f"ingest restarts: {reason}", float(restarts.get(reason, 0)))
            for reason in ("unassigned", "no_fetch_progress", "no_heartbeat", "error")
        ],  # fmt: skip
        Row("chaos", "dead letters expected", letters["expected"]),
        Row("chaos", "dead letters missing", letters["missing"], target="0"),
        Row("chaos", "dead letters not matching their message", letters["wrong"], target="0"),
        Row("chaos", "dead letters written twice", letters["duplicates"], target="0" if config.brokers == 3 else ""),
        Row("chaos", "dead letters as stand-ins", letters["stand_ins"]),
        Row("chaos", "RSS growth after warm-up (last process)", growth, target=f"< {config.rss_target:.0%}"),
    ]
    ok = (
        window["duplicates"]
        == window["lost"]
        == window["doubled"]
        == window["mismatches"]
        == window["uncovered_partitions"]
        == 0
        and heal_max <= config.heal_target_s
        and letters["missing"] == letters["wrong"] == 0
        and (math.isnan(growth) or growth < config.rss_target)
    )
    if config.brokers == 3:
        failover, _ = failover_figures(chaos, stalls)
        rows += failover
        ok = ok and letters["duplicates"] == 0
    for stall in sorted(stalls, key=lambda s: -s.heal_s)[:10]:
        print(f"stall: partition {stall.partition} {stall.start:.1f}-{stall.end:.1f} s, healed in {stall.heal_s:.1f} s "
              f"(after: {stall.explained_by})", file=sys.stderr)  # fmt: skip
    if window["unacknowledged_places"]:
        print(
            f"note: {window['unacknowledged_places']:.0f} places below the covered offsets had no ack "
            f"({chaos.placement.failed_sends} failed sends): the count check is loose by that much",
            file=sys.stderr,
        )
    return rows, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = ChaosConfig()
    parser.add_argument(
        "--duration-s", type=float, default=defaults.duration_s, help="production time, faults included"
    )
    parser.add_argument("--rate", type=float, default=defaults.rate, help="valid events per second")
    parser.add_argument(
        "--window-capacity",
        type=int,
        default=defaults.window_capacity,
        help="the service's WINDOW_CAPACITY; at least the events sent makes the audit complete",
    )
    parser.add_argument("--fault-gap-s", type=float, default=defaults.fault_gap_s, help="mean time between faults")
    parser.add_argument(
        "--feed-processes", type=int, default=defaults.feed_processes, help="producer processes sharing --rate"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--brokers",
        type=int,
        choices=(1, 3),
        default=defaults.brokers,
        help="3: the three-broker cluster (deploy/kafka-cluster.sh) and its failover, not the one broker's faults",
    )
    parser.add_argument(
        "--warmup-s", type=float, default=None, help="before the first fault (default 45, --brokers 3: 40)"
    )
    parser.add_argument(
        "--one-down-s", type=float, default=defaults.one_down_s, help="--brokers 3: one broker down this long"
    )
    parser.add_argument(
        "--two-down-s", type=float, default=defaults.two_down_s, help="--brokers 3: two brokers down this long"
    )
    parser.add_argument(
        "--malloc",
        choices=CHOICES,
        default=defaults.malloc,
        help="the service's malloc: jemalloc preloaded as in the image (deploy/jemalloc.sh), glibc's, or auto",
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="work directory to keep (logs, checkpoints, broker data)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config = ChaosConfig(duration_s=args.duration_s, rate=args.rate, window_capacity=args.window_capacity,
                         fault_gap_s=args.fault_gap_s, feed_processes=args.feed_processes, seed=args.seed,
                         malloc=args.malloc, brokers=args.brokers, one_down_s=args.one_down_s,
                         two_down_s=args.two_down_s,
                         warmup_s=args.warmup_s or (40.0 if args.brokers == 3 else defaults.warmup_s))  # fmt: skip
    if config.brokers == 3:
        needed = config.warmup_s + config.one_down_s + config.two_down_s + 2 * BASELINE_S
        if config.duration_s < needed:
            parser.error(f"--brokers 3 needs --duration-s of at least {needed:g} (the failover and 20 s after it)")
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"chaos: work directory {workdir}", file=sys.stderr)
    chaos = run(config, workdir)
    rows, ok = report(chaos)
    emit(rows, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
