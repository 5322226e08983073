"""The simulator against the real broker (deploy/kafka.sh up): every record arrives, keyed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict

import pytest
from kafka.admin import KafkaAdminClient
from kafka_helpers import Broker, consume_all, wait_for

from streamtrain.events import EventLimits, Rejection, SensorEvent, decode_event
from streamtrain.tools.simulate import main, run_simulation
from streamtrain.tools.simulation_config import SimulationConfig

pytestmark = pytest.mark.integration

BOOTSTRAP = os.environ.get("STREAMTRAIN_TEST_KAFKA", "127.0.0.1:9092")
PARTITIONS = 3


@pytest.fixture()
def topic():
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=BOOTSTRAP, client_id="test-simulate-admin", request_timeout_ms=10_000
        )
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"no Kafka broker at {BOOTSTRAP} ({exc}); start it with: deploy/kafka.sh up")
    name = f"test-simulate-{uuid.uuid4().hex[:12]}"
    admin.create_topics({name: {"num_partitions": PARTITIONS, "replication_factor": 1}}, wait_for_metadata=True)
    try:
        yield name
    finally:
        admin.delete_topics([name])
        admin.close()


def read_all(topic: str, expected: int, timeout_s: float = 30.0) -> list:
    """Every record of ``topic`` (waits for ``expected``, then a moment more for duplicates)."""
    return consume_all(BOOTSTRAP, topic, expected, timeout_s)


def test_every_simulated_record_reaches_the_topic_keyed_by_sensor(topic):
    cfg = SimulationConfig(
        bootstrap=BOOTSTRAP,
        topic=topic,
        rate=2000.0,
        count=600,
        sensors=12,
        channels=2,
        n_classes=3,
        length_median=32,
        max_len=128,
        malformed_share=0.15,
        event_ids=True,
        seed=7,
        run_id="it",
    )
    report = run_simulation(cfg)
    assert report.sent == 600 and report.delivery_errors == 0, report.first_delivery_error

    records = read_all(topic, 600)
    assert len(records) == 600
    partitions_of_key: dict[bytes, set[int]] = defaultdict(set)
    for record in records:
        partitions_of_key[record.key].add(record.partition)
    assert len(partitions_of_key) == 12
    assert all(len(p) == 1 for p in partitions_of_key.values())  # one sensor stays on one partition

    limits = EventLimits(
        max_len=cfg.max_len, channels=cfg.channels, n_classes=cfg.n_classes, max_message_bytes=cfg.max_message_bytes
    )
    now = time.time()
    outcomes = Counter()
    event_ids = set()
    for record in records:
        decoded = decode_event(record.value, limits, now)
        outcomes[decoded.reason if isinstance(decoded, Rejection) else "valid"] += 1
        if isinstance(decoded, SensorEvent):
            assert decoded.sensor_id.encode() == record.key
            event_ids.add(json.loads(record.value)["event_id"])
    assert outcomes["too_large"] == report.malformed_by_reason.get("too_large", 0)  # oversized records got through
    assert sum(v for k, v in outcomes.items() if k != "valid") == report.malformed
    assert {k: v for k, v in outcomes.items() if k != "valid"} == report.malformed_by_reason
    assert len(event_ids) == outcomes["valid"] == 600 - report.malformed


def test_command_line_entry_point_produces_the_requested_count(topic):
    code = main(
        ["--bootstrap", BOOTSTRAP, "--topic", topic, "--count", "150", "--rate", "0", "--seed", "3", "--sensors", "4"]
    )
    assert code == 0
    assert len(read_all(topic, 150)) == 150


@pytest.mark.expected_seconds(30)
def test_ctrl_c_with_the_broker_gone_stops_within_the_close_timeout_and_says_what_is_in_flight(
    private_broker: Broker, tmp_path
):
    private_broker.up()
    log = tmp_path / "simulate.log"
    with log.open("w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "streamtrain.tools.simulate", "--bootstrap", private_broker.bootstrap]
            + ["--rate", "2000", "--progress-interval-s", "0.5", "--close-timeout-s", "3"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: "progress: sent" in log.read_text(), 60, "the simulation to send")
        private_broker.down()
        time.sleep(2)  # records pile up in the producer, unacknowledged
        run.send_signal(signal.SIGINT)
        stopping = time.monotonic()
        code = run.wait(timeout=60)
        stopped_in_s = time.monotonic() - stopping
    finally:
        run.kill()
    text = log.read_text()
    assert code == 1, text[-2000:]
    assert "were still unacknowledged when the run stopped (close_timeout_s 3)" in text
    assert "Traceback" not in text
    # 3 s of waiting, a send blocked on the full buffer or missing metadata (max_block_ms 15 s), exit
    assert stopped_in_s < 25, f"took {stopped_in_s:.1f} s to stop"
