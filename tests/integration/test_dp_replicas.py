"""Two DP replicas in one consumer group sharing one admission record (``DP_ADMISSION_DIR``).

The real broker and two real ``streamtrain serve`` processes, each with its own checkpoint
directory; an unkeyed producer, so every sensor's events reach every partition and both
replicas; a third member joins the group and leaves (two rebalances move partitions between
the replicas), then each replica is SIGKILLed and restarted. Afterwards the shared record
alone must show that no event was admitted twice or took part in more than K steps, and
that no sensor had more than its lifetime number of groups over both replicas.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer
from kafka_helpers import wait_for
from test_dp_crash import TOKEN, assert_participation_bounded, operator
from test_faults import BackgroundProducer, FaultyService, IdentifiedStream, stop_and_kill

from streamtrain.privacy import participation
from streamtrain.privacy.admissions import _read_lines
from streamtrain.privacy.ledger import LEDGER_LOG

pytestmark = pytest.mark.integration

K = 10
B = 3
SETTINGS = dict(
    dp="on", shuffle="crypto", dp_unit="sensor", dp_sensor_events=B, dp_noise_multiplier=3.0, dp_q0=0.3,
    dp_eligible_steps=K, dp_admit_per_step=16, dp_step_rate_hz=10, dp_target_epsilon=8.0, dp_token_budget=512,
    dp_delta=1e-9, dp_expected_units=1e6, max_len=16, admin_token=TOKEN, publish_interval_s=0.5,
    checkpoint_interval_s=3,
)  # fmt: skip


def candidacies(shared: Path) -> dict[str, int]:
    """Per sensor, the candidacies (groups) the shared ledger holds, read from its file."""
    counts: dict[str, int] = {}
    for entry in _read_lines(shared / LEDGER_LOG):
        for sensor in entry["c"]:
            counts[sensor] = counts.get(sensor, 0) + 1
    return counts


@pytest.mark.expected_seconds(90)
@pytest.mark.timeout(600)  # 240 s beside two other test files
def test_replicas_sharing_one_record_admit_each_event_once_and_bound_each_sensor(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    topic = make_topic(partitions=4)
    shared = tmp_path / "admissions"
    # 600 sensors, each on every partition (an event each every 3 s): sensors spend their lifetime
    # groups within the run, on both replicas
    stream = IdentifiedStream(kafka_bootstrap, topic, keyed=False, sensors=600)
    lives = {"a": 0, "b": 0}
    running: dict[str, FaultyService] = {}

    def start(*names: str) -> None:
        """Spawn them all, then wait for each: a replica started alone for long spends every sensor's
        lifetime groups in the shared ledger before the other admits anything (a slow CI start did)."""
        for name in names:
            lives[name] += 1
            running[name] = FaultyService(
                kafka_bootstrap, topic, tmp_path / f"ckpt-{name}", tmp_path / f"{name}-{lives[name]}.log",
                pipe_output=True, dp_admission_dir=shared, group_instance_id=f"dp-{name}", **SETTINGS,
            ).spawn()  # fmt: skip
        for name in names:
            running[name].wait_healthy()

    def progressed(steps: int) -> None:
        marks = {name: operator(service)["record_synced_step"] for name, service in running.items()}
        for name, service in running.items():
            wait_for(lambda s=service, m=marks[name]: operator(s)["record_synced_step"] > m + steps, 120,
                     f"replica {name} to record {steps} more steps")  # fmt: skip

    try:
        with BackgroundProducer(stream, burst=8, interval_s=0.04):  # ~200 events/s
            start("a", "b")
            progressed(2 * K)
            for name, service in running.items():
                wait_for(lambda s=service: operator(s)["admitted_total"] > 0, 60, f"replica {name} to admit")
            intruder = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=f"g-{topic}", enable_auto_commit=False)
            intruder.subscribe([topic])
            wait_for(lambda: intruder.poll(timeout_ms=100) is not None and intruder.assignment(), 60, "a rebalance")
            time.sleep(2.0)
            intruder.close()  # leaves: a second rebalance
            progressed(K)
            for name in ("a", "b"):
                stop_and_kill(running[name])
                start(name)
                progressed(K)
            # on until some sensor has spent its lifetime groups (the bound the checks below test
            # must be reached): how many steps that takes depends on the machine's pace
            lifetime = int(running["a"].get("/v1/model")["dp"]["max_groups_per_sensor"])
            # (120 s ran out beside two other test files)
            wait_for(lambda: max(candidacies(shared).values(), default=0) >= lifetime, 360,
                     "a sensor to reach its lifetime groups")  # fmt: skip
        dp = running["a"].get("/v1/model")["dp"]
        for service in running.values():
            service.terminate()
    finally:
        for service in running.values():
            if service.process is not None and service.process.poll() is None:
                stop_and_kill(service)
        stream.flush()
        stream.close()

    clocks = [tmp_path / f"ckpt-{name}" / "dp-clock.jsonl" for name in ("a", "b")]
    counted = participation(shared, clocks)
    writers = {by for made in counted.writers.values() for by in made}
    assert len(writers) == 2 and None not in writers  # both replicas admitted, and every line names its writer
    assert_participation_bounded(counted, stream.placed, K)

    lifetime = int(dp["max_groups_per_sensor"])
    groups: dict[str, dict[tuple[str | None, int], int]] = {}  # sensor -> (writer, admission step) -> events
    for event, at in counted.admissions.items():
        sensor = f"sensor-{stream.placed[event] % stream.sensors}"
        for step, by in zip(at, counted.writers[event], strict=True):
            groups.setdefault(sensor, {}).setdefault((by, step), 0)
            groups[sensor][(by, step)] += 1
    candidates = candidacies(shared)
    assert max(candidates.values()) == lifetime  # sensors reach their lifetime bound: the check can fail
    for sensor, by_group in groups.items():
        assert max(by_group.values()) <= B, (sensor, by_group)
        assert len(by_group) <= candidates[sensor] <= lifetime, (sensor, len(by_group), lifetime)
        for writer in writers:
            steps = sorted(step for by, step in by_group if by == writer)
            assert all(later - earlier >= K for earlier, later in zip(steps, steps[1:])), (sensor, writer, steps)
