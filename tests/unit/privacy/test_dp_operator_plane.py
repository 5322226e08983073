"""DP mode in the service (no broker): the operator plane, publishing gated on the admission record, resume."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from streamtrain.config import load_settings
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.metrics import DP_PUBLIC_METRICS
from streamtrain.privacy import AdmissionRecordError
from streamtrain.privacy.admissions import AdmissionRecord
from streamtrain.runtime.service import Service
from streamtrain.serve.app import create_app

torch.set_num_threads(1)

TOKEN = "dp-operator-token-5d1e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DP = dict(
    dp="on", shuffle="crypto", d_model=16, n_heads=2, n_layers=1, max_len=32, token_budget=512, dp_token_budget=256,
    dp_noise_multiplier=1.5, dp_q0=0.2, dp_eligible_steps=10, dp_admit_per_step=8, dp_step_rate_hz=20.0,
    dp_expected_units=1e6, dp_delta=1e-9, kafka_bootstrap="127.0.0.1:9",
)  # fmt: skip


def make_service(tmp_path: Path, **overrides: Any) -> Service:
    return Service(load_settings(**{**DP, "checkpoint_dir": tmp_path / "ckpt", **overrides}))


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_dp_public_plane_shows_only_what_the_guarantee_covers(tmp_path: Path) -> None:
    service = make_service(tmp_path, admin_token=TOKEN)
    service.restore()
    service.trainer.publish()
    service.metrics.events_consumed.inc(5)
    service.metrics.train_tokens.inc(100)
    with TestClient(create_app(service)) as client:
        public = families(client.get("/metrics").text)
        assert public and public <= DP_PUBLIC_METRICS
        assert (
            not {"streamtrain_events_consumed", "streamtrain_train_tokens", "streamtrain_window_age_seconds"} & public
        )
        operator = families(client.get("/v1/admin/metrics", headers=AUTH).text)
        assert {"streamtrain_events_consumed", "streamtrain_train_tokens"} <= operator
        assert client.get("/v1/admin/metrics").status_code == 401
        # window statistics: operator plane, behind the token
        assert client.get("/v1/window").status_code == 401
        assert client.get("/v1/window", headers=AUTH).json()["capacity"] > 0
        model = client.get("/v1/model").json()
        assert model["tokens_trained"] is None and model["loss"] is None
        assert model["training"] == {"live_step": service.trainer.step}
        assert "mean_batch_size" not in model["dp"] and model["dp"]["unit"] == "event"
        assert model["dp"]["epsilon"] <= model["dp"]["epsilon_cap"] <= model["dp"]["target_epsilon"]
        operator_dp = client.get("/v1/admin/dp", headers=AUTH).json()
        assert {"mean_batch_size", "sampled_tokens", "mean_step_seconds", "record_synced_step"} <= set(operator_dp)
        reasons = " ".join(client.get("/readyz").json()["reasons"])
        assert "window has" not in reasons


def test_without_an_admin_token_dp_window_statistics_are_not_served(tmp_path: Path) -> None:
    service = make_service(tmp_path)
    with TestClient(create_app(service)) as client:
        assert client.get("/v1/window").status_code == 404
        assert client.get("/v1/admin/dp").status_code == 404


def arrivals(partition: int, offsets: range) -> EventBatch:
    events = [SensorEvent("s", 0.0, np.linspace(0, 1, 6, dtype=np.float32)[:, None]) for _ in offsets]
    return EventBatch.from_events(events, partitions=[partition] * len(offsets), offsets=list(offsets))


def run_steps(service: Service, count: int) -> None:
    engine = service.trainer.engine
    target = engine.steps + count
    deadline = time.monotonic() + 30
    while engine.steps < target and time.monotonic() < deadline:
        service.trainer._work()
    assert engine.steps >= target


def run_until_decided(service: Service, partition: int, watermark: int) -> None:
    """Run clock steps until the admitted arrivals' step has closed (the clock may be far ahead)."""
    window = service.trainer.engine.window
    deadline = time.monotonic() + 30
    while window.watermarks.get(partition, 0) < watermark and time.monotonic() < deadline:
        service.trainer._work()
    assert window.watermarks.get(partition, 0) >= watermark


def test_a_model_is_published_only_once_its_admissions_are_durable(tmp_path: Path) -> None:
    service = make_service(tmp_path, dp_admission_dir=tmp_path / "record")
    service.restore()
    trainer = service.trainer
    trainer.admit(arrivals(0, range(0, 20)), {0: 20})
    run_until_decided(service, 0, 20)
    record_dir = tmp_path / "record"
    record_dir.mkdir(exist_ok=True)
    record_dir.rename(tmp_path / "record-away")
    record_dir.write_text("not a directory: the record cannot be written")  # (works as root, unlike chmod)
    try:
        trainer.admit(arrivals(0, range(20, 30)), {0: 30})
        run_until_decided(service, 0, 30)  # decisions the record cannot take
        version = trainer._version
        assert trainer.publish() is None and trainer._version == version
        assert "not durable" in trainer.record_error
        assert any(r.startswith("dp_admission_record_failing") for r in service.readiness()[1])
        assert service.metrics.dp_record_failures._value.get() >= 1
        # nor is a checkpoint written that the record would not cover
        assert service.checkpoint() is None and "admission record" in service.checkpoint_error
    finally:
        record_dir.unlink()
        (tmp_path / "record-away").rename(record_dir)
    published = trainer.publish()
    assert published is not None and trainer.record_error is None
    assert trainer.record.synced_step == trainer.step


def test_restart_continues_after_the_recorded_step_and_above_its_watermarks(tmp_path: Path) -> None:
    first = make_service(tmp_path)
    first.restore()
    first.trainer.admit(arrivals(0, range(0, 10)), {0: 10})
    run_until_decided(first, 0, 10)
    assert first.checkpoint() is not None  # at step c
    checkpoint_step = first.trainer.step
    first.trainer.admit(arrivals(0, range(10, 20)), {0: 20})
    run_until_decided(first, 0, 20)
    run_steps(first, 2)
    first.trainer.publish()  # every step so far is durable in the record; the checkpoint is older
    recorded_step = first.trainer.step
    assert recorded_step > checkpoint_step
    second = make_service(tmp_path)
    second.restore()  # "crash": restore from the older checkpoint
    engine = second.trainer.engine
    assert engine.steps == recorded_step and engine.window.watermarks[0] == 20  # the record, not the checkpoint
    assert engine.window.gaps == [(checkpoint_step + 1, recorded_step)]
    engine.admit(arrivals(0, range(5, 25)), now=time.time())  # a re-read from the checkpoint's offsets
    run_until_decided(second, 0, 25)
    record = AdmissionRecord(tmp_path / "ckpt" / "dp-admissions", tmp_path / "ckpt" / "dp-clock.jsonl")
    second.trainer.record.sync()
    from streamtrain.privacy import participation

    counted = participation(record.directory, record.clock_path)
    assert all(len(steps) == 1 for steps in counted.admissions.values())  # nothing admitted twice
    assert all(n <= 10 for n in counted.steps.values())  # K = 10
    assert {o for _, o in counted.admissions} <= set(range(25))
    assert {o for (_, o) in counted.admissions if o >= 20}  # new events after the watermark were admitted


def test_a_record_older_than_the_checkpoint_is_refused(tmp_path: Path) -> None:
    first = make_service(tmp_path)
    first.restore()
    run_steps(first, 3)
    first.trainer.publish()  # record synced to step 3
    assert first.checkpoint() is not None
    (tmp_path / "ckpt" / "dp-clock.jsonl").unlink()  # the record was lost
    with pytest.raises(AdmissionRecordError, match="deleted or rolled back"):
        make_service(tmp_path).restore()


class FrozenClock:
    """Stands in for ``time.time`` in the DP trainer: both services see the same public times."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sensor_events(sensor: str, partition: int, offsets: range) -> EventBatch:
    rng = np.random.default_rng(abs(hash(sensor)) % 2**32 + offsets.start)
    events = [SensorEvent(sensor, 0.0, rng.normal(size=(6, 1)).astype(np.float32)) for _ in offsets]
    return EventBatch.from_events(events, partitions=[partition] * len(offsets), offsets=list(offsets))


def test_the_public_plane_is_byte_identical_for_streams_that_differ_in_one_sensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same settings, same public clock: /v1/model and /metrics agree, though sensor "a" sent only to one."""
    clock = FrozenClock()
    monkeypatch.setattr("streamtrain.privacy.trainer.time.time", clock)
    rate = DP["dp_step_rate_hz"]
    both: list[Service] = []
    for name in ("with-a", "without-a"):
        service = make_service(tmp_path / name)
        service.restore()
        both.append(service)
    clock.now = 1000.0
    for service in both:
        service.trainer._work()  # anchors the public clock at the same time
    offsets = {"with-a": 0, "without-a": 0}
    for k in range(1, 25):
        clock.now = 1000.0 + (k - 0.5) / rate
        for name, service in zip(offsets, both, strict=True):
            start = offsets[name]
            batches = [sensor_events("b", 0, range(start, start + 3))] if k >= 4 else []
            if name == "with-a":
                batches.insert(0, sensor_events("a", 1, range(start, start + 5)))
            for batch in batches:
                service.trainer.admit(batch, {0: start + 3, 1: start + 5})
            offsets[name] = start + 5
        clock.now = 1000.0 + k / rate + 1e-4
        for service in both:
            service.trainer._work()
        if k in (6, 24):  # still growing at 6 (K = 10), capped at 24
            assert all(service.trainer.step == k and service.trainer.published is not None for service in both)
            pages = []
            for service in both:
                with TestClient(create_app(service)) as client:
                    pages.append((client.get("/v1/model").content, client.get("/metrics").content))
            assert b'"epsilon":0.0' not in pages[0][0]
            assert pages[0] == pages[1]
        if k == 6:
            spent = [s.trainer.engine.epsilon_spent_by_data() for s in both]
    assert spent[0] > spent[1]  # the data-dependent figure (operator plane) does differ: the test can tell


def test_a_revocation_whose_record_cannot_be_made_durable_fences_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("streamtrain.privacy.trainer.REVOKE_SYNC_FIRST_WAIT_S", 0.0)
    service = make_service(tmp_path, dp_admission_dir=tmp_path / "record")
    service.restore()
    trainer = service.trainer
    fenced: list[str] = []
    trainer.on_fenced = fenced.append
    trainer.on_partitions_assigned([0])
    trainer.admit(arrivals(0, range(0, 20)), {0: 20})
    run_until_decided(service, 0, 20)
    assert trainer.publish() is not None
    trainer.admit(arrivals(0, range(20, 30)), {0: 30})
    run_until_decided(service, 0, 30)  # decided, not yet durable
    (tmp_path / "record").rename(tmp_path / "record-away")
    (tmp_path / "record").write_text("not a directory: the record cannot be written")
    trainer.on_partitions_revoked([0])
    assert len(fenced) == 1 and "revoked" in fenced[0] and trainer.fenced == fenced[0]
    (tmp_path / "record").unlink()
    (tmp_path / "record-away").rename(tmp_path / "record")  # the disk is back: still nothing may leave
    version = trainer._version
    assert trainer.publish() is None and trainer._version == version
    assert service.checkpoint() is None and "fenced" not in (service.checkpoint_error or "fenced")
    assert any(r.startswith("dp_fenced:") for r in service.readiness()[1])
    # the next owner reads the last durable watermark: what this process decided after it never happened
    assert AdmissionRecord(tmp_path / "record", tmp_path / "other" / "clock.jsonl").watermarks([0]) == {0: 20}


def test_partitions_whose_watermarks_cannot_be_read_are_not_admitted(tmp_path: Path) -> None:
    service = make_service(tmp_path, dp_admission_dir=tmp_path / "record")
    service.restore()
    trainer = service.trainer
    (tmp_path / "record").mkdir()
    (tmp_path / "record" / "partition-0.jsonl").write_bytes(b'{"s":1,"w":5,"a":[]}\tdeadbeef\n')  # damaged
    trainer.on_partitions_assigned([0])
    assert any(r.startswith("dp_partitions_not_admitted:") for r in service.readiness()[1])
    trainer.admit(arrivals(0, range(0, 10)), {0: 10})
    assert trainer.engine.window.arrived_total == 0
    assert trainer.operator_report()["turned_away"]["not_owned"] == 10  # why nothing arrives, on /v1/admin/dp
