"""Exactly-once participation in DP mode: SIGKILL the real service at the worst moments.

The real broker, the real ``streamtrain serve`` process, events produced all along. The
service is killed while events are eligible, in the middle of a checkpoint write, and
after checkpoints have been failing (while it kept training and publishing), and restarted
each time from its checkpoint directory. Afterwards the admission record alone must show
that every event was admitted at most once and took part in at most its K eligible steps,
across every life, and that no clock step ran twice.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import wait_for
from test_faults import BackgroundProducer, FaultyService, IdentifiedStream, kill_during_checkpoint_write, stop_and_kill

from streamtrain.privacy import participation
from streamtrain.privacy.admissions import Participation, _read_lines

pytestmark = pytest.mark.integration

TOKEN = "dp-crash-admin-token-3c9b"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
K = 20
R = 16
DP = dict(
    dp="on", shuffle="crypto", dp_noise_multiplier=1.5, dp_q0=0.3, dp_eligible_steps=K, dp_admit_per_step=R,
    dp_step_rate_hz=10, dp_target_epsilon=20, dp_token_budget=512, dp_delta=1e-9, dp_expected_units=1e6,
    max_len=16, admin_token=TOKEN, publish_interval_s=0.5, checkpoint_interval_s=3, group_instance_id="dp-replica-0",
)  # fmt: skip


def operator(service: FaultyService) -> dict[str, Any]:
    response = service.client.get("/v1/admin/dp", headers=AUTH)
    response.raise_for_status()
    return response.json()


def version(service: FaultyService) -> int:
    return int(service.get("/v1/model")["version"] or 0)


@pytest.fixture()
def started() -> Any:
    """Every service a test starts; whatever is still running at the end (a failed test) is killed."""
    services: list[FaultyService] = []
    yield services
    for service in services:
        if service.process is not None and service.process.poll() is None:
            stop_and_kill(service)


def assert_participation_bounded(counted: Participation, placed: Mapping[tuple[int, int], int], k: int) -> None:
    """From the record alone: no event admitted twice or eligible in more than ``k`` steps, some in
    exactly ``k`` (full eligibility is counted: the check can fail), and every admitted event produced."""
    twice = {event: at for event, at in counted.admissions.items() if len(at) > 1}
    assert not twice, f"{len(twice)} events admitted more than once, e.g. {sorted(twice.items())[:5]}"
    over = {event: n for event, n in counted.steps.items() if n > k}
    assert not over, f"{len(over)} events eligible in more than K={k} steps, e.g. {sorted(over.items())[:5]}"
    assert max(counted.steps.values()) == k
    assert set(counted.admissions) <= set(placed)


def resumed_lines(log_text: str) -> list[tuple[int, int, int]]:
    """(checkpoint step, record step, continued after) of every start in the log."""
    pattern = r"checkpoint at step (\d+), record at step (\d+): continuing after step (\d+)"
    return [tuple(map(int, m)) for m in re.findall(pattern, log_text)]  # type: ignore[misc]


@pytest.mark.expected_seconds(170)
@pytest.mark.timeout(600)  # five lives of 2K steps and more: 146-209 s here, past 300 s beside other test files
def test_sigkill_at_the_worst_moments_never_admits_an_event_twice(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path, started: list[FaultyService]
) -> None:
    topic = make_topic(partitions=2)
    ckpt = tmp_path / "ckpt"
    stream = IdentifiedStream(kafka_bootstrap, topic)
    rng = random.Random(13)
    moments = ["during_eligibility", "during_checkpoint_write", "after_failed_checkpoint", "during_eligibility"]
    hard_limit = resource.prlimit(os.getpid(), resource.RLIMIT_FSIZE)[1]
    starts: list[tuple[int, int, int]] = []
    with BackgroundProducer(stream, burst=8, interval_s=0.04):  # ~200 events/s, more than R = 16 per step admits
        for cycle, moment in enumerate(moments):
            service = FaultyService(
                kafka_bootstrap, topic, ckpt, tmp_path / f"serve{cycle}.log", pipe_output=True, **DP
            )
            started.append(service)
            service.start()
            lines = resumed_lines(service.log_text())
            assert lines, service.log_text()[-3000:]
            starts.append(lines[-1])
            restored_step = lines[-1][2]
            # it trains and publishes in this life, from events it admits in this life, for 2K steps
            # (steps slow down on a loaded machine: wait for steps, not seconds)
            wait_for(lambda: operator(service)["record_synced_step"] > restored_step + 2 * K, 180, "a durable record")
            first_version = version(service)
            wait_for(lambda: version(service) > first_version + 1, 60, "models published in this life")
            # admissions made in this life and durable before it is killed: 2R of them, so the record
            # the checks read holds > 100 events whatever the machine's pace (a fixed sleep did not)
            admitted_before = operator(service)["admitted_total"]
            wait_for(lambda: operator(service)["admitted_total"] >= admitted_before + 2 * R, 90, "admissions")
            synced = operator(service)["record_synced_step"]
            wait_for(lambda: operator(service)["record_synced_step"] > synced, 30, "the admissions durable")
            if moment == "during_eligibility":
                time.sleep(rng.uniform(0.2, 1.5))
                stop_and_kill(service)
            elif moment == "during_checkpoint_write":
                kill_during_checkpoint_write(service, ckpt)
            else:
                # checkpoints fail (the kernel refuses files past 64 KiB) while training and publishing go on
                failures = service.metric("streamtrain_checkpoint_failures_total")
                resource.prlimit(service.pid, resource.RLIMIT_FSIZE, (64 << 10, hard_limit))
                wait_for(lambda: service.metric("streamtrain_checkpoint_failures_total") >= failures + 2, 60,
                         "failing checkpoints")  # fmt: skip
                published = version(service)
                wait_for(lambda: version(service) > published, 30, "publishing to go on while checkpoints fail")
                stop_and_kill(service)
    # a last, graceful life: it must restart cleanly on what the crashes left
    final = FaultyService(kafka_bootstrap, topic, ckpt, tmp_path / "serve-final.log", pipe_output=True, **DP)
    started.append(final)
    final.start()
    starts.append(resumed_lines(final.log_text())[-1])
    wait_for(
        lambda: operator(final)["record_synced_step"] > starts[-1][2] + K, 60, "a durable record after the last start"
    )
    dp = final.get("/v1/model")["dp"]
    assert 0 < dp["epsilon"] <= dp["epsilon_cap"] <= dp["target_epsilon"]
    final.terminate()
    stream.flush()
    stream.close()

    # At least one start continued past its checkpoint: the record, not the checkpoint, set the clock.
    assert any(record > checkpoint for checkpoint, record, _ in starts), starts
    record_dir, clock_log = ckpt / "dp-admissions", ckpt / "dp-clock.jsonl"
    counted = participation(record_dir, clock_log)
    assert_participation_bounded(counted, stream.placed, K)
    assert len(counted.admissions) >= 4 * 2 * R  # the four killed lives' durable admissions, at least
    # no clock step ran twice, across every life
    steps = [int(entry["s"]) for entry in _read_lines(clock_log)]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)
    lives = {int(entry["l"]) for entry in _read_lines(clock_log)}
    assert len(lives) == len(moments) + 1
    (tmp_path / "participation.json").write_text(json.dumps({"events": len(counted.admissions), "starts": starts}))


@pytest.mark.expected_seconds(25)
def test_sensor_unit_bounds_each_sensor_end_to_end(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path, started: list[FaultyService]
) -> None:
    """DP_UNIT=sensor: from the record, every sensor had at most b events admitted per group,
    at most one group per K steps, and at most the lifetime number of groups."""
    topic = make_topic(partitions=1)
    ckpt = tmp_path / "ckpt"
    stream = IdentifiedStream(kafka_bootstrap, topic)  # seven sensors: sensor-(id % 7)
    b = 3
    settings = {**DP, "dp_unit": "sensor", "dp_sensor_events": b, "dp_noise_multiplier": 3.0, "dp_target_epsilon": 8.0,
                "dp_eligible_steps": 10}  # fmt: skip
    with BackgroundProducer(stream, burst=8, interval_s=0.04):
        service = FaultyService(kafka_bootstrap, topic, ckpt, tmp_path / "serve.log", pipe_output=True, **settings)
        started.append(service)
        service.start()
        # the clock starts before the consumer has joined (a slow start spends its first steps empty)
        try:
            wait_for(lambda: operator(service)["admitted_total"] > 0, 90, "a first admission")
        except AssertionError as err:
            raise AssertionError(f"{err}; operator plane: {operator(service)}") from None
        first = operator(service)["record_synced_step"]
        wait_for(lambda: operator(service)["record_synced_step"] > first + 60, 90, "60 more steps recorded")
        dp = service.get("/v1/model")["dp"]
        service.terminate()
    stream.flush()
    stream.close()
    assert dp["unit"] == "sensor" and dp["horizon"] == "lifetime" and dp["sensor_events"] == b
    lifetime = int(dp["max_groups_per_sensor"])
    assert lifetime >= 1 and dp["epsilon"] <= dp["epsilon_cap"] <= 8.0
    counted = participation(ckpt / "dp-admissions", ckpt / "dp-clock.jsonl")
    groups: dict[str, dict[int, int]] = {}  # sensor -> admission step -> events
    for event, at in counted.admissions.items():
        sensor = f"sensor-{stream.placed[event] % 7}"
        for step in at:
            groups.setdefault(sensor, {}).setdefault(step, 0)
            groups[sensor][step] += 1
    assert groups, "nothing was admitted"
    for sensor, by_step in groups.items():
        assert max(by_step.values()) <= b, (sensor, by_step)
        admitted_at = sorted(by_step)
        assert all(later - earlier >= 10 for earlier, later in zip(admitted_at, admitted_at[1:])), (sensor, admitted_at)
        assert len(admitted_at) <= lifetime, (sensor, admitted_at, lifetime)
