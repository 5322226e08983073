"""Fault injection end to end: the real broker, the real ``streamtrain serve`` process.

Every simulated event carries a unique id (``values[0]`` and ``event_id``) and Kafka gives
it a unique (partition, offset); the producer side records both. The window keeps each
item's (partition, offset) and readings, and a checkpoint (written on demand through the
admin route) holds the window with the offsets it covers, so after any fault the test can
compare sets exactly: the window holds every produced record below the covered offsets,
each once, with its own readings, and nothing else.
"""

from __future__ import annotations

import math
import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psutil
import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from kafka_helpers import Broker, wait_for
from prometheus_client.parser import text_string_to_metric_families
from service_process import ServiceProcess, track

from streamtrain.checkpoint.format import LoadedCheckpoint
from streamtrain.checkpoint.store import CheckpointStore, read_checkpoint
from streamtrain.config import load_settings
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.metrics import Metrics
from streamtrain.window.reservoir import RecencyWindow

pytestmark = pytest.mark.integration

TOKEN = "fault-test-admin-token-7f3a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# A uniform window larger than any stream here: it must hold every event exactly once.
SETTINGS = dict(max_len=16, window_capacity=50_000, half_life_s="inf", admin_token=TOKEN, min_window_items=16)


# ---------------------------------------------------------------------------------------
# helpers


class IdentifiedStream:
    """Produces events with unique ids and records where Kafka put each one."""

    def __init__(
        self, bootstrap: str, topic: str, keyed: bool = True, sensors: int = 7, **producer_config: Any
    ) -> None:
        self.topic = topic
        self.sensors = sensors  # event i comes from sensor-(i % sensors)
        self.keyed = keyed  # False: no key, so one sensor's events spread over every partition
        self.producer = KafkaProducer(
            bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5, **producer_config
        )
        self.next_id = 0
        self.placed: dict[tuple[int, int], int] = {}  # (partition, offset) -> event id
        self._pending: list[tuple[int, Any]] = []
        self._lock = threading.Lock()

    def send(self, count: int) -> None:
        now = time.time()
        with self._lock:
            for _ in range(count):
                event_id = self.next_id
                self.next_id += 1
                sensor = self.sensor_name(event_id)
                values = [float(event_id)] + [0.1 * (event_id % 13) + k for k in range(1 + event_id % 6)]
                payload = {"sensor_id": sensor, "ts": now - 1.0, "values": values, "event_id": f"ev-{event_id}"}
                key = sensor.encode() if self.keyed else None
                future = self.producer.send(self.topic, key=key, value=orjson.dumps(payload))
                self._pending.append((event_id, future))

    def sensor_name(self, event_id: int) -> str:
        """The sensor that sends event ``event_id``."""
        return f"sensor-{event_id % self.sensors}"

    def flush(self, timeout_s: float = 120) -> dict[tuple[int, int], int]:
        """Wait for every send to be acknowledged; a failed delivery fails the test."""
        self.producer.flush(timeout_s)
        with self._lock:
            for event_id, future in self._pending:
                record = future.get(timeout=timeout_s)
                self.placed[(record.partition, record.offset)] = event_id
            self._pending.clear()
        assert len(set(self.placed.values())) == len(self.placed) == self.next_id
        return self.placed

    def end_offsets(self) -> dict[int, int]:
        ends: dict[int, int] = {}
        for partition, offset in self.placed:
            ends[partition] = max(ends.get(partition, 0), offset + 1)
        return ends

    def close(self) -> None:
        self.producer.close(timeout=10)


class BackgroundProducer:
    """Keeps producing small bursts on a thread until stopped (through outages, too)."""

    def __init__(self, stream: IdentifiedStream, burst: int = 5, interval_s: float = 0.05) -> None:
        self.stream, self.burst, self.interval_s = stream, burst, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.stream.send(self.burst)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> BackgroundProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class FaultyService(ServiceProcess):
    """ServiceProcess plus what fault tests need: spawn without waiting, SIGSTOP, children,
    and (``pipe_output``) logs through a pipe, so file-size limits hit only checkpoints."""

    def __init__(self, *args: Any, pipe_output: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pipe_output = pipe_output
        self._copier: threading.Thread | None = None

    def spawn(self) -> FaultyService:
        if not self.pipe_output:
            log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
            self.process = subprocess.Popen(
                [sys.executable, "-m", "streamtrain.cli", "serve"], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
            track(self.process)  # a failed check still stops it (the integration conftest)
            log.close()
            return self
        self.process = subprocess.Popen(
            [sys.executable, "-m", "streamtrain.cli", "serve"],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        track(self.process)
        self._copier = threading.Thread(target=self._copy_output, daemon=True)
        self._copier.start()
        return self

    def _copy_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        with open(self.log_path, "ab", buffering=0) as log:
            for line in self.process.stdout:
                log.write(line)

    def start(self) -> FaultyService:
        self.spawn()
        self.wait_healthy()
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def log_text(self) -> str:
        if self._copier is not None:
            time.sleep(0.2)  # let the copier catch up
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(self.client.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        raise AssertionError(f"metric {name}{labels} not exposed")

    def live_step(self) -> int:
        return int(self.get("/v1/model")["training"]["live_step"])

    def checkpoint_now(self, directory: Path) -> LoadedCheckpoint:
        response = self.client.post("/v1/admin/checkpoint", headers=AUTH)
        assert response.status_code == 200, response.text
        return read_checkpoint(directory / response.json()["path"])

    def predict_ok(self) -> bool:
        response = self.client.post("/v1/predict", json={"instances": [{"values": [0.5, 1.5, 2.5]}]})
        return response.status_code == 200 and len(response.json()["predictions"]) == 1

    def readiness(self) -> tuple[int, list[str]]:
        response = self.client.get("/readyz")
        return response.status_code, response.json().get("reasons", [])


def window_items(loaded: LoadedCheckpoint) -> tuple[list[tuple[int, int]], np.ndarray, dict[int, int]]:
    """(partition, offset) of every window item, its event id (first reading), covered offsets."""
    window = loaded.state["window"]
    lengths = np.asarray(window["lengths"], dtype=np.int64)
    flat = np.asarray(window["values"], dtype=np.float32).reshape(-1)  # channels = 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    pairs = list(zip(np.asarray(window["partitions"]).tolist(), np.asarray(window["offsets"]).tolist()))
    covered = {int(p): int(o) for p, o in window["next_offsets"].items()}
    return pairs, flat[starts] if lengths.size else np.zeros(0, np.float32), covered


def assert_window_exact(loaded: LoadedCheckpoint, placed: dict[tuple[int, int], int], everything: bool = False) -> int:
    """The window is exactly the produced records below the offsets it covers: no duplicate,
    no gap, each with its own readings. Returns the number of items."""
    pairs, ids, covered = window_items(loaded)
    assert len(pairs) == len(set(pairs)), f"duplicates in the window: {len(pairs) - len(set(pairs))}"
    expected = {po for po in placed if po[1] < covered.get(po[0], 0)}
    missing, extra = expected - set(pairs), set(pairs) - expected
    assert not missing, f"{len(missing)} produced events missing from the window, e.g. {sorted(missing)[:5]}"
    assert not extra, (
        f"{len(extra)} window items that were never produced (or lie beyond its offsets): {sorted(extra)[:5]}"
    )
    wrong = [(po, placed[po], int(i)) for po, i in zip(pairs, ids.tolist()) if placed[po] != int(i)]
    assert not wrong, f"items whose readings belong to another event: {wrong[:5]}"
    ends: dict[int, int] = {}
    for p, o in placed:
        ends[p] = max(ends.get(p, 0), o + 1)
    assert all(covered.get(p, 0) <= end for p, end in ends.items()), (covered, ends)
    if everything:
        assert len(pairs) == len(placed) and covered == ends, (len(pairs), len(placed), covered, ends)
    return len(pairs)


def wait_covered(service: FaultyService, stream: IdentifiedStream, timeout_s: float = 90) -> None:
    ends = {str(p): o for p, o in stream.end_offsets().items()}
    wait_for(
        lambda: service.get("/v1/window")["next_offsets"] == ends,
        timeout_s,
        f"the window to cover {ends}",
        interval=0.25,
    )


def newest_valid(directory: Path) -> tuple[str, int] | None:
    loaded = CheckpointStore(directory).load_latest()
    return None if loaded is None else (loaded.path.name, loaded.step)


def restored_line(service: FaultyService) -> tuple[str, int] | None:
    text = service.log_text()
    match = re.search(r"restored (ckpt-\S+\.stck): step (\d+)", text)
    if match:
        return match.group(1), int(match.group(2))
    assert "starting fresh" in text, text[-3000:]
    return None


def stop_and_kill(service: FaultyService) -> None:
    """SIGKILL, then make sure no child process (decode worker, resource tracker) outlives it."""
    children = service.descendants()
    service.kill()
    gone, alive = psutil.wait_procs(children, timeout=20)
    for process in alive:  # do not leak them into the rest of the suite, but fail
        process.kill()
    assert not alive, f"processes outlived the SIGKILLed service: {[p.pid for p in alive]}"


# ---------------------------------------------------------------------------------------
# 1. broker outage


@pytest.mark.expected_seconds(100)
def test_broker_outage_keeps_serving_and_loses_nothing(private_broker: Broker, tmp_path: Path) -> None:
    private_broker.up()
    topic = "outage-events"
    admin = KafkaAdminClient(bootstrap_servers=private_broker.bootstrap, request_timeout_ms=15000)
    admin.create_topics([NewTopic(topic, 2, 1), NewTopic(f"{topic}.dlq", 2, 1)], timeout_ms=15000)
    admin.close()
    ckpt = tmp_path / "ckpt"
    # no replay budget: with it the trainer idles once it has trained each event MAX_REPLAYS_PER_EVENT
    # times, broker or no broker, and this test is about training not waiting for the broker
    service = FaultyService(
        private_broker.bootstrap,
        topic,
        ckpt,
        tmp_path / "serve.log",
        checkpoint_interval_s=1,
        max_replays_per_event=0,
        **SETTINGS,
    )
    # The producer buffers while the broker is away and delivers once it is back.
    stream = IdentifiedStream(
        private_broker.bootstrap, topic, delivery_timeout_ms=300_000, max_block_ms=300_000, request_timeout_ms=10_000
    )
    with service:
        stream.send(300)
        stream.flush()
        service.wait_ready()
        wait_covered(service, stream)
        with BackgroundProducer(stream):
            time.sleep(1.0)
            private_broker.down()
            wait_for(lambda: service.readiness()[0] == 503, 30, "/readyz to turn 503")
            status, reasons = service.readiness()
            assert any(r.startswith("kafka_not_connected") for r in reasons), reasons
            step = service.live_step()
            # the outage: alive, serving, training, checkpointing; not ready
            for _ in range(3):
                assert service.client.get("/healthz").status_code == 200
                assert service.readiness()[0] == 503
                assert service.predict_ok()
                time.sleep(0.5)
            assert service.metric("streamtrain_kafka_connected") == 0
            wait_for(lambda: service.live_step() > step, 30, "training to go on during the outage")
            started = time.monotonic()
            service.checkpoint_now(ckpt)  # window state during the outage, durable
            assert time.monotonic() - started < 8, "a checkpoint must not wait on the absent broker"
            private_broker.up()
            wait_for(lambda: service.readiness()[0] == 200, 90, "/readyz to turn 200 again", interval=0.25)
            time.sleep(1.0)  # production goes on after the broker returned
        stream.flush()
        wait_covered(service, stream)
        # a broker just back may still show its partitions leaderless for a metadata refresh or
        # two (kafka_degraded, ready all along): the reasons clear once leaders are elected
        wait_for(lambda: service.readiness() == (200, []), 30, "/readyz with no reason left")
        produced = len(stream.placed)
        assert produced > 300
        loaded = service.checkpoint_now(ckpt)
        assert assert_window_exact(loaded, stream.placed, everything=True) == produced
        window = service.get("/v1/window")
        assert window["size"] == window["accepted_total"] == produced and window["evicted_total"] == 0
    stream.close()


# ---------------------------------------------------------------------------------------
# 2. SIGKILL at random moments


def all_threads_stopped(pid: int) -> bool:
    """Every thread in state T (a SIGSTOP takes effect thread by thread)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just exited
    return bool(states) and all(state in ("T", "t") for state in states)


def kill_during_checkpoint_write(service: FaultyService, directory: Path, timeout_s: float = 30) -> None:
    """Freeze the process the moment a temp checkpoint file appears; if it is still there
    (the write has not completed), SIGKILL it frozen; otherwise let it go on and retry."""
    ours = f".{service.pid}.tmp"  # not the one a previous run left behind
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(name.endswith(ours) for name in os.listdir(directory)):
            os.kill(service.pid, signal.SIGSTOP)
            # SIGSTOP is asynchronous: until the process is seen stopped, its writer may
            # still finish (rename the temp file) after we looked.
            wait_for(
                lambda: all_threads_stopped(service.pid), 10, "every thread of the service to stop", interval=0.001
            )
            temps = [name for name in os.listdir(directory) if name.endswith(ours)]
            if temps:
                stop_and_kill(service)
                assert (directory / temps[0]).exists()  # the half-written file stays behind, under a temp name
                return
            os.kill(service.pid, signal.SIGCONT)
    raise AssertionError(f"no checkpoint write caught in {timeout_s}s")


@pytest.mark.expected_seconds(120)
def test_sigkill_at_random_moments_keeps_the_window_exact(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    topic = make_topic(partitions=3)
    ckpt = tmp_path / "ckpt"
    stream = IdentifiedStream(kafka_bootstrap, topic)
    rng = random.Random(6)
    settings = {**SETTINGS, "checkpoint_interval_s": 0.4, "checkpoint_keep": 3}
    moments = ["random", "during_checkpoint_write", "while_starting", "random", "during_checkpoint_write"]
    steps: list[int] = []
    resumed_s: list[float] = []  # from healthy to ingesting again
    for cycle, moment in enumerate(moments):
        expected = newest_valid(ckpt) if ckpt.exists() else None
        # One consumer group and one static member id for every run, as a StatefulSet
        # replica has: the restarted process takes over its killed predecessor's member at
        # once (without the id it would wait out the 45 s session timeout), and resumes
        # from the checkpoint's offsets, not the group's.
        service = FaultyService(
            kafka_bootstrap, topic, ckpt, tmp_path / f"serve{cycle}.log", group_instance_id="replica-0", **settings
        )
        if moment == "while_starting":  # killed while it restores and imports: nothing may break
            service.spawn()
            time.sleep(rng.uniform(0.5, 2.0))
            stop_and_kill(service)
            continue
        service.start()
        # it restored the newest checkpoint that had completed: the step never goes back past it
        assert restored_line(service) == expected
        restored_step = service.get("/v1/model")["step"]
        assert restored_step >= (expected[1] if expected else 0) and restored_step >= (steps[-1] if steps else 0)
        steps.append(restored_step)
        # and its window is exactly what the checkpoint covered plus what it consumed since
        assert_window_exact(service.checkpoint_now(ckpt), stream.placed)
        with BackgroundProducer(stream, burst=10, interval_s=0.04):
            covered = sum(service.get("/v1/window")["next_offsets"].values())
            started = time.monotonic()
            wait_for(lambda: sum(service.get("/v1/window")["next_offsets"].values()) > covered + 100, 60, "ingest")
            resumed_s.append(time.monotonic() - started)
            wait_for(lambda: service.live_step() > restored_step, 60, "training")
            if moment == "random":
                time.sleep(rng.uniform(0.2, 2.5))
                stop_and_kill(service)
            else:
                kill_during_checkpoint_write(service, ckpt)
        stream.flush()

    # far below the 45 s session timeout a killed dynamic member would hold the partitions
    assert max(resumed_s) < 25, resumed_s
    final = FaultyService(
        kafka_bootstrap, topic, ckpt, tmp_path / "serve-final.log", group_instance_id="replica-0", **settings
    )
    expected = newest_valid(ckpt)  # before it starts: its own checkpoints (every 0.4 s) come later
    with final:
        assert restored_line(final) == expected and final.get("/v1/model")["step"] >= expected[1] >= steps[-1]
        wait_covered(final, stream)
        loaded = final.checkpoint_now(ckpt)
        assert assert_window_exact(loaded, stream.placed, everything=True) == len(stream.placed) > 1000
        window = final.get("/v1/window")
        assert window["size"] == window["accepted_total"] == len(stream.placed)
        # the live service may be writing its own checkpoint now: only the dead writers' temp files count
        own = f".{final.pid}.tmp"
        stale = [n for n in os.listdir(ckpt) if n.endswith(".tmp") and not n.endswith(own)]
        assert not stale, "stale temp files of dead writers are removed"
    stream.close()


def test_a_rebalance_in_the_middle_of_a_backlog_neither_duplicates_nor_skips(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    """A second member joins and leaves the group while batches are in flight to the
    window (a rolling deploy's overlap): every partition must go on exactly where its
    last polled batch ended, not where the window's applied offsets stand."""
    topic = make_topic(partitions=3)
    stream = IdentifiedStream(kafka_bootstrap, topic)
    stream.send(30_000)
    stream.flush()
    settings = load_settings(
        kafka_bootstrap=kafka_bootstrap, topic=topic, group_id=f"g-{topic}", max_len=16, half_life_s="inf",
        window_capacity=100_000, poll_max_records=500, checkpoint_dir=tmp_path,
    )  # fmt: skip
    window = RecencyWindow(100_000, math.inf, channels=1)
    ingestor = Ingestor(settings, window, Metrics())
    ingestor.start()
    try:
        wait_for(lambda: window.accepted_total > 0, 60, "ingest to start")
        intruder = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=f"g-{topic}", enable_auto_commit=False)
        intruder.subscribe([topic])
        wait_for(lambda: intruder.poll(timeout_ms=100) is not None and intruder.assignment(), 60, "the rebalance")
        intruder.close()  # leaves: everything goes back to the service
        with BackgroundProducer(stream):
            time.sleep(1.0)
        stream.flush()
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 90, "the window to cover the topic")
    finally:
        ingestor.stop()
    snapshot = window.snapshot()
    pairs = list(zip(snapshot.partitions.tolist(), snapshot.offsets.tolist()))
    assert len(pairs) - len(set(pairs)) == 0, "duplicates"
    assert set(pairs) == set(stream.placed) and window.accepted_total == len(stream.placed)
    stream.close()


# ---------------------------------------------------------------------------------------
# 3. corrupt checkpoints


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for position in (len(data) // 3, len(data) - 7):
        data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def wrong_checksum(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[24:56] = bytes(32)  # the SHA-256 field of the prefix
    path.write_bytes(bytes(data))


@pytest.mark.expected_seconds(45)
def test_corrupt_checkpoints_fall_back_to_the_previous_good_one(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    topic = make_topic(partitions=2)
    ckpt = tmp_path / "ckpt"
    stream = IdentifiedStream(kafka_bootstrap, topic)
    settings = {**SETTINGS, "checkpoint_interval_s": 300, "checkpoint_keep": 10}
    first = FaultyService(kafka_bootstrap, topic, ckpt, tmp_path / "serve1.log", **settings).start()
    written = []
    for _burst in range(3):  # three checkpoints at growing steps and windows
        # the step before the events: with the replay budget it may have trained them all once they are covered
        step = first.live_step()
        stream.send(150)
        stream.flush()
        wait_covered(first, stream)
        wait_for(lambda: first.live_step() > step, 60, "training")
        written.append(first.checkpoint_now(ckpt))
    stream.send(150)
    stream.flush()
    wait_covered(first, stream)
    # SIGTERM: a graceful stop writes a final checkpoint covering everything, and leaves no child behind
    children = first.descendants()
    assert first.terminate() == 0  # after the final checkpoint, not by the signal (-15)
    assert not psutil.wait_procs(children, timeout=20)[1]
    files = CheckpointStore(ckpt).list()
    assert [f.path for f in files[1:4]] == [w.path for w in reversed(written)]
    assert assert_window_exact(read_checkpoint(files[0].path), stream.placed, everything=True) == 600
    damage = {files[0].path: (truncate, "truncated"), files[1].path: (flip_bytes, "SHA-256 mismatch"),
              files[2].path: (wrong_checksum, "SHA-256 mismatch")}  # fmt: skip
    for path, (corrupt, _) in damage.items():
        corrupt(path)
    good = files[3]
    stream.send(100)  # more arrive while it is down
    stream.flush()

    second = FaultyService(kafka_bootstrap, topic, ckpt, tmp_path / "serve2.log", **settings)  # same group: it was left
    with second:
        log = second.log_text()
        for path, (_, reason) in damage.items():
            line = next(
                (ln for ln in log.splitlines() if "skipping corrupt checkpoint" in ln and path.name in ln), None
            )
            assert line is not None and reason in line, (path.name, log[-3000:])
        assert restored_line(second) == (good.path.name, good.step)
        assert second.metric("streamtrain_checkpoints_corrupt_total") == 3
        assert second.get("/v1/model")["step"] >= good.step
        wait_covered(second, stream)
        loaded = second.checkpoint_now(ckpt)
        assert assert_window_exact(loaded, stream.placed, everything=True) == len(stream.placed)
    stream.close()


# ---------------------------------------------------------------------------------------
# 4. checkpoint directory unwritable, then full


@pytest.mark.expected_seconds(35)
def test_unwritable_or_full_checkpoint_dir_is_counted_retried_and_reported(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    topic = make_topic(partitions=2)
    ckpt = tmp_path / "ckpt"
    aside = tmp_path / "ckpt-aside"
    stream = IdentifiedStream(kafka_bootstrap, topic)
    service = FaultyService(kafka_bootstrap, topic, ckpt, tmp_path / "serve.log", pipe_output=True,
                            checkpoint_interval_s=0.5, **SETTINGS)  # fmt: skip
    hard_limit = resource.prlimit(os.getpid(), resource.RLIMIT_FSIZE)[1]
    with service:
        stream.send(200)
        stream.flush()
        service.wait_ready()
        wait_for(lambda: service.metric("streamtrain_checkpoints_written_total") >= 1, 30, "a first checkpoint")

        def failing_phase(expected_error: str) -> None:
            failures = service.metric("streamtrain_checkpoint_failures_total")
            wait_for(
                lambda: service.metric("streamtrain_checkpoint_failures_total") >= failures + 2, 30, "retried failures"
            )
            status, reasons = service.readiness()
            assert status == 200, reasons  # still ready: it ingests, trains and serves
            failing = [r for r in reasons if r.startswith("checkpoint_failing")]
            assert failing and expected_error in failing[0], reasons
            step, seen = service.live_step(), service.get("/v1/window")["accepted_total"]
            stream.send(50)
            stream.flush()
            wait_for(lambda: service.get("/v1/window")["accepted_total"] >= seen + 50, 30, "ingest going on")
            wait_for(lambda: service.live_step() > step, 30, "training going on")
            assert service.predict_ok()
            refused = service.client.post("/v1/admin/checkpoint", headers=AUTH)
            assert refused.status_code == 503 and "checkpoint failed" in refused.json()["detail"]
            assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")] if ckpt.is_dir() else True

        def recovers() -> None:
            written = service.metric("streamtrain_checkpoints_written_total")
            wait_for(
                lambda: service.metric("streamtrain_checkpoints_written_total") > written,
                30,
                "a checkpoint after the fix",
            )
            wait_for(
                lambda: not any(r.startswith("checkpoint_failing") for r in service.readiness()[1]),
                10,
                "the reason to clear",
            )

        # unwritable: the directory is replaced by a regular file
        ckpt.rename(aside)
        ckpt.write_text("not a directory")
        failing_phase("File exists")
        ckpt.unlink()
        aside.rename(ckpt)
        recovers()

        # full: the kernel refuses to grow files past 8 KiB (EFBIG, as a full volume refuses with ENOSPC)
        resource.prlimit(service.pid, resource.RLIMIT_FSIZE, (8192, hard_limit))
        try:
            failing_phase("File too large")
            for info in CheckpointStore(ckpt).list():  # nothing partial under a checkpoint name
                read_checkpoint(info.path)
        finally:
            resource.prlimit(service.pid, resource.RLIMIT_FSIZE, (hard_limit, hard_limit))
        recovers()
        assert "checkpoint failed (training and serving go on; retrying)" in service.log_text()
        wait_covered(service, stream)
        assert_window_exact(service.checkpoint_now(ckpt), stream.placed, everything=True)
    stream.close()
