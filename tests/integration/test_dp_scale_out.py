"""DP on scale-out end to end: one DP model trained by two ranks, a SIGKILL, and 2 -> 1 -> 2.

The real broker, real ``streamtrain serve`` ranks (launched as torchrun launches them, gloo),
one checkpoint directory and one admission record; an unkeyed producer, so every sensor's
events reach every partition and so both ranks. Two ranks train; one is SIGKILLed (the other
leaves with status 17); one process restores the group's sharded checkpoint and ends with a
one-file one; two ranks restore that. Throughout, both ranks publish the same versions (the
same parameters and predictions) and report the same ε, the one-process accountant's at the
group's clock step. Afterwards the admission record alone must show: no event admitted twice
or eligible in more than K steps, no sensor with two groups less than K steps apart or more
than its lifetime groups, one clock line per step, one writer.
"""

from __future__ import annotations

import math
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import wait_for
from service_process import FAST_MODEL
from test_dp_crash import assert_participation_bounded
from test_faults import BackgroundProducer, IdentifiedStream
from test_scale_out import TOKEN, Group, assert_one_model, newest_manifest

from streamtrain.config import load_settings
from streamtrain.model.network import build_model
from streamtrain.privacy import participation
from streamtrain.privacy.accounting import PerEventAccountant, SensorLifetimeAccountant
from streamtrain.privacy.admissions import _read_lines
from streamtrain.privacy.config import DPConfig
from streamtrain.privacy.ledger import LEDGER_LOG

pytestmark = pytest.mark.integration

K = 10
B = 3
DIST_TIMEOUT_S = 10
EXIT_COLLECTIVE_FAILURE = 17
SETTINGS = dict(
    dp="on", shuffle="crypto", dp_unit="sensor", dp_sensor_events=B, dp_noise_multiplier=3.0, dp_q0=0.3,
    dp_eligible_steps=K, dp_admit_per_step=16, dp_step_rate_hz=10, dp_target_epsilon=8.0, dp_token_budget=512,
    dp_delta=1e-9, dp_expected_units=1e6, max_len=16, publish_interval_s=0.5, checkpoint_interval_s=2,
    dist_timeout_s=DIST_TIMEOUT_S,
)  # fmt: skip


class HotAndColdSensors(IdentifiedStream):
    """Half the events from 20 hot sensors (each a candidate every K steps: they spend their lifetime
    groups within seconds), half from 2000 cold ones (each an event every ~20 s: new candidates in
    every life)."""

    def sensor_name(self, event_id: int) -> str:
        half = event_id // 2
        return f"hot-{half % 20}" if event_id % 2 == 0 else f"cold-{half % 2000}"


def operator(rank: Any) -> dict[str, Any]:
    response = rank.client.get("/v1/admin/dp", headers={"Authorization": f"Bearer {TOKEN}"})
    response.raise_for_status()
    return dict(response.json())


def progressed(ranks: list[Any], steps: int, what: str) -> None:
    """Until rank 0's record is durable ``steps`` steps further (the group syncs it together)."""
    mark = operator(ranks[0])["record_synced_step"]
    wait_for(lambda: operator(ranks[0])["record_synced_step"] > mark + steps, 120, what)


def admission_state(ranks: list[Any], ckpt: Path, restored: list[int]) -> str:
    """What a stalled admission looked like: each rank's counters and the ledger's use per sensor."""
    keys = ("arrived_total", "admitted_total", "turned_away", "pending_steps", "window_records", "watermarks")
    seen = [{key: operator(rank).get(key) for key in keys} for rank in ranks]
    candidacies = Counter(s for entry in _read_lines(ckpt / "dp-admissions" / LEDGER_LOG) for s in entry["c"])
    by_count = sorted(Counter(candidacies.values()).items())
    return f"admitted at start {restored}, ranks {seen}, sensors by candidacies {by_count}"


def public_epsilon() -> Any:
    """The one-process accountant's public ε at clock step t (docs/privacy.md, public plane), for the
    service's model (FAST_MODEL's shape): its noised dimension enters the accounting."""
    shape = {name.lower(): value for name, value in FAST_MODEL.items() if name in ("D_MODEL", "N_HEADS", "N_LAYERS")}
    settings = load_settings(**SETTINGS, **shape)
    dimension = sum(p.numel() for p in build_model(settings).parameters() if p.requires_grad)
    config = DPConfig.from_settings(settings)
    lifetime = SensorLifetimeAccountant(
        PerEventAccountant.for_config(config, dimension=dimension), config.target_epsilon
    )
    return lambda t: lifetime.epsilon_after(min(-(-t // K), lifetime.max_groups)), lifetime.max_groups


def assert_one_release(ranks: list[Any], epsilon_at: Any) -> dict[str, Any]:
    """Both ranks at one public step report the same version and ε, the one-process accountant's."""

    def same_step() -> list[dict[str, Any]] | None:
        models = [rank.get("/v1/model") for rank in ranks]
        steps = {m["dp"]["steps"] for m in models}
        return models if len(steps) == 1 and len({m["version"] for m in models}) == 1 else None

    models = wait_for(same_step, 30, "the ranks to report one public step", interval=0.05)
    dps = [m["dp"] for m in models]
    assert dps[0] == dps[1], "one mechanism: every public figure equal on both ranks"
    assert dps[0]["epsilon"] == pytest.approx(epsilon_at(dps[0]["steps"]), rel=1e-12)
    assert [(m["world_size"], m["rank"]) for m in models] == [(len(ranks), r) for r in range(len(ranks))]
    return dps[0]


@pytest.mark.expected_seconds(100)
@pytest.mark.timeout(600)  # 90 s for a restarted group to admit ran out beside two other files
def test_two_dp_ranks_survive_a_kill_and_rescaling_with_participation_bounded(
    kafka_bootstrap: str, make_topic: Any, tmp_path: Path
) -> None:
    topic = make_topic(partitions=4)
    ckpt = tmp_path / "ckpt"
    logs = tmp_path / "logs"
    logs.mkdir()
    settings = {**SETTINGS, "admin_token": TOKEN}
    stream = HotAndColdSensors(kafka_bootstrap, topic, keyed=False)  # every sensor on every partition
    groups: list[Group] = []
    try:
        with BackgroundProducer(stream, burst=8, interval_s=0.04):  # ~200 events/s
            two = Group(2, kafka_bootstrap, topic, ckpt, logs, **settings).start()
            groups.append(two)
            wait_for(lambda: all(operator(r)["admitted_total"] > 0 for r in two.ranks), 90, "both ranks to admit")
            progressed(two.ranks, 3 * K, "two ranks: 3K durable steps")
            epsilon_at, lifetime = public_epsilon()
            assert_one_release(two.ranks, epsilon_at)
            wait_for(lambda: newest_manifest(ckpt).step > 0, 30, "a sharded DP checkpoint")
            two.ranks[1].kill()  # SIGKILL: no final checkpoint, the survivor must leave
            survivor = two.ranks[0].process
            assert survivor is not None
            assert survivor.wait(DIST_TIMEOUT_S + 30) == EXIT_COLLECTIVE_FAILURE

            one = Group(1, kafka_bootstrap, topic, ckpt, logs, plain=True, **settings).start()
            groups.append(one)
            progressed(one.ranks, 2 * K, "one process: 2K durable steps")
            assert one.ranks[0].get("/v1/model")["world_size"] == 1
            assert one.terminate_all() == [0]  # a final, one-file checkpoint

            again = Group(2, kafka_bootstrap, topic, ckpt, logs, **settings).start()
            groups.append(again)
            # a slow start spends its first steps empty: each rank admits in this life, then 3K more steps
            restored = [operator(rank)["admitted_total"] for rank in again.ranks]
            wait_for(lambda: all(operator(r)["admitted_total"] > n for r, n in zip(again.ranks, restored, strict=True)),
                     240, "both ranks to admit again",
                     describe=lambda: admission_state(again.ranks, ckpt, restored))  # fmt: skip
            progressed(again.ranks, 3 * K, "two ranks again: 3K durable steps")
            assert_one_model(again.ranks, min_step=0)  # one version: the same parameters and predictions
            dp = assert_one_release(again.ranks, epsilon_at)
            assert again.terminate_all() == [0, 0]
    finally:
        for group in groups:
            for rank in group.ranks:
                if rank.process is not None and rank.process.poll() is None:
                    rank.process.send_signal(signal.SIGKILL)
                    rank.process.wait(30)
        stream.flush()
        stream.close()

    assert dp["max_groups_per_sensor"] == lifetime and dp["unit"] == "sensor"
    clock_log = ckpt / "dp-clock.jsonl"
    steps = [int(entry["s"]) for entry in _read_lines(clock_log)]
    assert steps == sorted(set(steps)), "one clock line per step of the group, no step twice"
    counted = participation(ckpt / "dp-admissions", clock_log)
    assert len({by for made in counted.writers.values() for by in made}) == 1  # the group and the process: one writer
    assert_participation_bounded(counted, stream.placed, K)
    lives: dict[int, list[int]] = {}
    for entry in _read_lines(clock_log):
        lives.setdefault(int(entry["l"]), []).append(int(entry["s"]))
    assert len(lives) == 3  # three lives: 2, 1, 2 ranks
    for life, at in sorted(lives.items()):  # every life admitted, from every partition (both ranks' when two)
        admitted = {partition for (partition, _), steps in counted.admissions.items() if min(at) <= steps[0] <= max(at)}
        assert admitted == {0, 1, 2, 3}, (life, admitted)

    by_sensor: dict[str, dict[int, int]] = {}  # sensor -> admission step -> events
    for event, at in counted.admissions.items():
        sensor = stream.sensor_name(stream.placed[event])
        for step in at:
            by_sensor.setdefault(sensor, {}).setdefault(step, 0)
            by_sensor[sensor][step] += 1
    candidacies: dict[str, int] = {}
    for entry in _read_lines(ckpt / "dp-admissions" / LEDGER_LOG):
        for sensor in entry["c"]:
            candidacies[sensor] = candidacies.get(sensor, 0) + 1
    assert max(candidacies.values()) == lifetime  # sensors reach their lifetime bound: the check can fail
    for sensor, groups_at in by_sensor.items():
        assert max(groups_at.values()) <= B, (sensor, groups_at)  # one group of at most b events a step, group-wide
        assert len(groups_at) <= candidacies[sensor] <= lifetime, (sensor, len(groups_at), lifetime)
        admitted_at = sorted(groups_at)  # one writer, one clock: the spacing holds over both ranks
        assert all(later - earlier >= K for earlier, later in zip(admitted_at, admitted_at[1:])), (sensor, admitted_at)
    assert not math.isnan(dp["epsilon"]) and dp["epsilon"] <= dp["epsilon_cap"] <= 8.0
