"""The quality machinery inside a real Service (ingest not started, no Kafka): the publish
gate holding back a broken candidate, rollback by admin and automatically, checkpoints of
the kept versions, and the settings refused at start-up."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from streamtrain.config import SettingsError, load_settings
from streamtrain.model.inference import predict
from streamtrain.model.network import SensorModel
from streamtrain.quality.scoring import EventScores
from streamtrain.runtime.service import Service
from streamtrain.serve.app import create_app

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/unit/quality: the service the quality tests share
from quality_service_fixtures import AUTH, build_service, feed, oscillations, train, trained_service  # noqa: E402


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = trained_service(tmp_path)
    yield svc
    svc.trainer.stop()


def test_a_broken_candidate_is_held_back_and_the_serving_version_keeps_answering(service: Service) -> None:
    trainer = service.trainer
    serving = trainer.published
    assert serving is not None and len(trainer.quality.holdout) >= 16
    train(service, 5)
    good = trainer.publish()
    assert trainer.published is good and trainer.last_gate is not None and trainer.last_gate.publish

    def corrupt(model: SensorModel) -> None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 5.0)

    trainer.candidate_hook = corrupt
    broken = trainer.publish()
    serving = trainer.published  # the reference network (the best that passed) serves, its choice made afresh
    assert trainer.reference is not None
    assert serving is not None and serving.model is trainer.reference.model and serving.version == broken.version + 1
    assert not trainer.last_gate.publish and trainer.last_gate.candidate_mse > trainer.last_gate.serving_mse
    assert broken.version in trainer.registry.versions()  # kept, not served
    assert service.metrics.publish_held._value.get() == 1
    with TestClient(create_app(service)) as client:
        answer = client.post("/v1/predict", json={"instances": [{"values": [0.1, 0.5, 0.4, 0.2]}]})
        assert answer.status_code == 200 and answer.json()["model_version"] == serving.version
        report = client.get("/v1/model").json()
        assert report["version"] == serving.version and report["training"]["publish_held"] == 1
        assert broken.version in report["versions"]
    trainer.candidate_hook = None
    assert trainer.publish() is trainer.published  # a sound candidate passes again


def test_quality_in_v1_model_and_metrics(service: Service) -> None:
    feed(service, oscillations(np.random.default_rng(1), 200, time.time()))
    with TestClient(create_app(service)) as client:
        quality = client.get("/v1/model").json()["quality"]
        metrics = client.get("/metrics").text
    assert quality["n"] == 200  # every event fed after the publish was scored
    # a stationary stream (the fixture's oscillations, 400 + 200 of them): no drift, in the report and the metric
    assert quality["drifts"] == 0 and quality["recent_drifts"] == []
    assert "\nstreamtrain_drift_detected_total 0.0\n" in metrics
    assert quality["skill"] == pytest.approx(1 - quality["prequential_mse"] / quality["naive_mse"])
    assert quality["skill"] > 0  # the trained model beats the last value on these oscillations
    assert quality["holdout"]["held_out_total"] > 0
    for name in ("streamtrain_prequential_mse", "streamtrain_prequential_naive_mse",
                 "streamtrain_prequential_events_total", "streamtrain_drift_detected_total",
                 "streamtrain_publish_held_total"):  # fmt: skip
        assert f"\n{name} " in metrics, name


def test_quality_is_null_until_the_first_score(tmp_path: Path) -> None:
    svc = build_service(tmp_path)
    with TestClient(create_app(svc)) as client:
        assert client.get("/v1/model").json()["quality"] is None
        svc.trainer.publish()
        feed(svc, oscillations(np.random.default_rng(2), 10, time.time()))
        assert client.get("/v1/model").json()["quality"]["n"] == 10


def test_rollback_by_admin(service: Service) -> None:
    trainer = service.trainer
    first = trainer.published
    train(service, 5)
    second = trainer.publish()
    assert trainer.published is second
    with TestClient(create_app(service)) as client:
        assert client.post("/v1/admin/rollback", json={"version": first.version}).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert client.post("/v1/admin/rollback", json={"version": first.version}, headers=wrong).status_code == 403
        missing = client.post("/v1/admin/rollback", json={"version": 999}, headers=AUTH)
        assert missing.status_code == 404 and "999" in missing.json()["detail"]
        assert client.post("/v1/admin/rollback", json={"version": "x"}, headers=AUTH).status_code == 422
        done = client.post("/v1/admin/rollback", json={"version": first.version}, headers=AUTH)
        assert done.status_code == 200 and done.json() == {"version": first.version, "previous": second.version}
        answer = client.post("/v1/predict", json={"instances": [{"values": [1.0, 2.0, 3.0]}]}).json()
        assert answer["model_version"] == first.version
        feed(service, oscillations(np.random.default_rng(5), 20, time.time()))  # quality shows once scored
        assert client.get("/v1/model").json()["quality"]["rollbacks"][-1]["trigger"] == "admin"
    # Training goes on from the rolled-back weights.
    for live, kept in zip(trainer.model.state_dict().values(), first.model.state_dict().values()):
        torch.testing.assert_close(live, kept)
    assert service.metrics.model_rollbacks.labels("admin")._value.get() == 1


def scores(k: int, mse: float) -> EventScores:
    return EventScores(np.full(k, 10), np.full(k, 10 * mse), np.full(k, 10.0), np.full(k, np.nan), np.full(k, np.nan))


def test_automatic_rollback_when_the_serving_version_loses_skill(tmp_path: Path) -> None:
    svc = build_service(tmp_path, rollback_min_events=50, rollback_margin=0.1)
    feed(svc, oscillations(np.random.default_rng(3), 100, time.time()))
    trainer = svc.trainer
    first = trainer.publish()
    trainer.quality.record(scores(60, 0.4), first.version)  # skill 0.6
    second = trainer.publish()
    trainer.quality.record(scores(60, 0.45), second.version)  # 0.55: within the margin
    assert trainer.published is second
    third = trainer.publish()
    trainer.quality.record(scores(60, 0.9), third.version)  # 0.1: far below version 2's
    assert trainer.published is second
    assert svc.metrics.model_rollbacks.labels("automatic")._value.get() == 1
    assert trainer.quality.rollbacks[-1]["from_version"] == third.version


def test_kept_versions_and_quality_survive_a_checkpoint(service: Service, tmp_path: Path) -> None:
    trainer = service.trainer
    first = trainer.published
    train(service, 3)
    trainer.publish()
    trainer.rollback(first.version)
    feed(service, oscillations(np.random.default_rng(4), 50, time.time()))
    assert service.checkpoint() is not None
    restored = build_service(service.settings.checkpoint_dir, holdout_share=0.25, holdout_min_events=16)
    restored.restore()
    kept = trainer.registry.versions()
    # The kept versions come back as rollback targets; the restored live model is the next version.
    assert restored.trainer.registry.versions() == [*kept, trainer._version + 1]
    assert restored.published.version == trainer._version + 1
    assert restored.published.step == trainer.step
    back = restored.trainer.rollback(first.version)
    values = [np.sin(np.arange(20, dtype=np.float32))[:, None]]
    assert predict(back.model, back.norm, values, 512)[0].next == pytest.approx(
        predict(first.model, first.norm, values, 512)[0].next
    )
    report, before = restored.trainer.quality.report(first.version), trainer.quality.report(first.version)
    assert report["n"] == before["n"] and report["prequential_mse"] == pytest.approx(before["prequential_mse"])
    assert len(restored.trainer.quality.holdout) == len(trainer.quality.holdout)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"holdout_share": 1.0}, "holdout_share (STREAMTRAIN_HOLDOUT_SHARE)=1.0: Value error, must be below 1"),
        ({"holdout_share": 0.05, "dp": "on", "shuffle": "crypto"}, "must be 0 with dp=on"),
        ({"drift_detector": "cusum"}, "drift_detector"),
        ({"quality_max_events_per_s": -1}, "quality_max_events_per_s"),
    ],
)
def test_conflicting_settings_are_refused_with_one_line(overrides: dict[str, Any], says: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(**overrides)
    assert says in str(refused.value) and "\n" not in str(refused.value)
