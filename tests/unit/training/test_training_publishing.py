"""What both trainers share (``training/publishing.py``): publishing a frozen copy through the
gate, holding a candidate back, rolling back, the kept versions across a restore, and the
training thread. Inside a real Service where the gate is needed (ingest not started, no Kafka)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from streamtrain.config import Settings, load_settings
from streamtrain.metrics import Metrics
from streamtrain.model.forecasters import FORECASTER_KINDS
from streamtrain.model.inference import predict
from streamtrain.model.network import SensorModel, build_model
from streamtrain.model.normalization import RunningNorm
from streamtrain.runtime.service import Service
from streamtrain.training import publishing
from streamtrain.training.publishing import ModelTrainer, build_optimizer, lower_thread_priority

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quality"))  # the quality tests' service
from quality_service_fixtures import build_service, feed, oscillations, train, trained_service  # noqa: E402

PROBE = [np.sin(np.arange(20, dtype=np.float32))[:, None], np.cos(np.arange(9, dtype=np.float32))[:, None]]


def forecasts(model: SensorModel, norm: RunningNorm) -> list[float]:
    return [answer.next[0] for answer in predict(model, norm, PROBE, 512)]


def make_nan(model: SensorModel) -> None:
    with torch.no_grad():
        model.forecast_head.weight.fill_(float("nan"))


def scramble(model: SensorModel) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 5.0)


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = trained_service(tmp_path, publish_interval_s=0.5, model_versions_keep=5)
    yield svc
    svc.trainer.stop()


def test_a_publication_is_a_frozen_copy_with_its_loss_and_the_metrics_show_its_forecaster(service: Service) -> None:
    trainer = service.trainer
    published = trainer.published  # the fixture's, right after its training
    assert published is not None and published.loss == trainer.loss_ema is not None
    assert not any(p.requires_grad for p in published.model.parameters()) and not published.model.training
    assert published.model is not trainer.model
    assert service.metrics.model_version._value.get() == published.version
    shown = {kind: service.metrics.model_forecaster.labels(kind)._value.get() for kind in FORECASTER_KINDS}
    assert shown == {kind: float(kind == published.forecaster.kind) for kind in FORECASTER_KINDS}


def test_a_held_back_candidate_is_kept_unserved_and_the_reference_serves_on_in_a_version_stamped_now(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = service.trainer
    reference = trainer.published
    assert reference is not None
    time.sleep(0.02)
    trainer.candidate_hook = scramble
    began = time.time()
    with caplog.at_level(logging.WARNING, logger="streamtrain.training.publishing"):
        held = trainer.publish()
    serving = trainer.published
    assert serving is not None and serving.version == held.version + 1 and serving.model is reference.model
    assert began <= serving.published_at <= time.time() and serving.published_at > reference.published_at
    kept = trainer.registry.get(held.version)
    assert kept is held and kept.forecaster.kind == "network"  # kept as trained, not with the choice beside it
    gate = trainer.last_gate
    assert gate is not None and not gate.publish
    assert (
        f"candidate version {held.version} held back ({gate.reason}); version {serving.version} serves network of "
        f"version {reference.version} with {serving.forecaster.kind}"
    ) in caplog.messages
    trainer.publish()
    assert trainer.publish_held == 2 and service.metrics.publish_held._value.get() == 2


def test_a_first_candidate_that_fails_the_gate_leaves_nothing_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    svc = build_service(tmp_path, holdout_share=0.25, holdout_min_events=16)
    feed(svc, oscillations(np.random.default_rng(1), 400, time.time()))
    trainer = svc.trainer
    trainer.candidate_hook = make_nan
    with caplog.at_level(logging.WARNING, logger="streamtrain.training.publishing"):
        held = trainer.publish()
    assert trainer.published is None and trainer.registry.versions() == [held.version]
    assert trainer.last_gate is not None and trainer.last_gate.reason == "candidate forecasts are not finite"
    assert (
        f"candidate version {held.version} held back (candidate forecasts are not finite); version None keeps serving"
    ) in caplog.messages
    back = trainer.rollback(held.version)  # an admin may make any kept version serve, from nothing serving
    assert trainer.published is back and trainer.quality.rollbacks[-1]["from_version"] is None


def test_after_a_rollback_the_next_candidate_is_judged_against_the_version_that_serves_and_waits_an_interval(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = service.trainer
    first = trainer.published
    assert first is not None
    train(service, 5)
    second = trainer.publish()
    assert trainer.reference is not None
    with caplog.at_level(logging.WARNING, logger="streamtrain.training.publishing"):
        trainer.rollback(first.version, trigger="automatic", reason="skill fell")
    assert f"rolled back (automatic) from version {second.version} to version {first.version}: skill fell" in (
        caplog.messages
    )
    note = trainer.quality.rollbacks[-1]
    assert (note["to_version"], note["from_version"], note["trigger"], note["reason"]) == (
        first.version, second.version, "automatic", "skill fell",
    )  # fmt: skip
    assert trainer.reference is None
    trainer._publish_if_due()  # the interval (0.5 s) starts again at the rollback
    assert trainer.published is first
    trainer.candidate_hook = scramble
    trainer.publish()
    gate = trainer.last_gate
    assert gate is not None and not gate.publish and trainer.published is not None
    assert trainer.published.model is first.model  # judged against, and refreshed from, the rolled-back version
    trainer.rollback(first.version)
    assert trainer.quality.rollbacks[-1]["trigger"] == "admin"
    assert trainer.quality.rollbacks[-1]["reason"] == "asked by an admin"


def test_a_restore_brings_every_kept_version_back_and_gates_the_restored_model_against_the_one_that_served(
    service: Service,
) -> None:
    trainer = service.trainer
    first = trainer.published
    assert first is not None
    train(service, 3)
    trainer.publish()
    trainer.rollback(first.version)  # the version that serves is not the newest
    assert service.checkpoint() is not None
    restored = build_service(
        service.settings.checkpoint_dir, holdout_share=0.25, holdout_min_events=16, model_versions_keep=5
    )
    restored.trainer.candidate_hook = scramble  # the restored live model, broken
    restored.restore()
    again = restored.trainer
    assert again.publish_held == 1  # judged against version 1, which serves on
    assert again.published is not None and forecasts(again.published.model, again.published.norm) == pytest.approx(
        forecasts(first.model, first.norm)
    )
    for version in trainer.registry.versions():
        before, after = trainer.registry.get(version), again.registry.get(version)
        assert (after.step, after.tokens_trained, after.published_at, after.forecaster.kind) == (
            before.step, before.tokens_trained, before.published_at, before.forecaster.kind,
        )  # fmt: skip
        assert after.loss == pytest.approx(before.loss) and after.loss is not None
        assert not after.model.training and not any(p.requires_grad for p in after.model.parameters())
        assert forecasts(after.model, after.norm) == pytest.approx(forecasts(before.model, before.norm))


def test_a_registry_state_with_nothing_serving_restores_nothing_to_serve(tmp_path: Path) -> None:
    svc = build_service(tmp_path)
    trainer = svc.trainer
    assert trainer.load_registry_state({}) is False and trainer.published is None
    first = trainer.publish()
    state = trainer.registry_state()
    assert state["serving"] == first.version and [v["version"] for v in state["versions"]] == [first.version]
    fresh = build_service(tmp_path / "fresh").trainer
    assert fresh.load_registry_state({**state, "serving": None}) is False and fresh.published is None
    assert fresh.registry.versions() == [first.version]
    assert fresh.load_registry_state(state) is True and fresh.published is not None
    assert fresh.published.version == first.version and fresh.published.loss is None
    fresh._publish_if_due()  # a restored version serves a full interval before the next publication
    assert fresh.published.version == first.version


class Bare(ModelTrainer):
    """The shared trainer with no gate (the DP trainer's case): one unit of work given by the test."""

    def __init__(self, settings: Settings, work: list[BaseException | None]) -> None:
        super().__init__(settings, Metrics())
        self.model = build_model(settings).eval()
        self.norm = RunningNorm(settings.channels)
        self.loss_ema = None
        self.work = work
        self.done = threading.Event()

    @property
    def step(self) -> int:
        return 0

    def _work(self) -> None:
        if not self.work:
            self.done.set()
            self._stop.wait(0.01)
            return
        failure = self.work.pop(0)
        if failure is not None:
            raise failure


def bare_settings(tmp_path: Path, **overrides: object) -> Settings:
    return load_settings(
        kafka_bootstrap="127.0.0.1:9", checkpoint_dir=tmp_path, d_model=16, n_heads=2, n_layers=1, max_len=64,
        **overrides,
    )  # fmt: skip


def test_without_a_gate_every_candidate_serves_with_the_network() -> None:
    trainer = Bare(bare_settings(Path("/nonexistent"), publish_interval_s=0.05), [])
    published = trainer.publish()
    assert trainer.published is published and published.forecaster.kind == "network"
    assert (published.version, published.step, published.tokens_trained) == (1, 0, 0)
    gate, selection = trainer.last_gate, trainer.last_selection
    assert gate is not None and selection is not None
    assert (gate.publish, gate.reason, gate.holdout_events) == (True, "no gate", 0)
    assert selection.network is published and selection.reason == "no gate" and selection.forecaster.kind == "network"
    # published outside the loop (as a restore does): the next is due one interval later, not one share later
    time.sleep(0.1)
    trainer._publish_if_due()
    assert trainer.published is not None and trainer.published.version == 2


def test_the_training_thread_is_a_named_daemon_that_logs_a_failure_and_resumes_a_second_later(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = bare_settings(Path("/nonexistent"))
    pinned: list[tuple[object, ...]] = []
    monkeypatch.setattr(publishing, "pin_training_thread", lambda cpus, threads: pinned.append((cpus, threads)) or 7)
    monkeypatch.setattr(publishing, "release_training_cpus", lambda: pinned.append(("released",)))
    trainer = Bare(settings, [RuntimeError("boom"), None])
    waits: list[float | None] = []
    stop_wait = trainer._stop.wait

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        return stop_wait(0.0 if timeout == 1.0 else timeout)  # the test does not sit out the second

    monkeypatch.setattr(trainer._stop, "wait", wait)
    with caplog.at_level(logging.ERROR, logger="streamtrain.training.publishing"):
        trainer.start()
        assert trainer._thread is not None and trainer._thread.name == "trainer" and trainer._thread.daemon
        assert trainer.done.wait(10.0)
        trainer.stop()
    assert "trainer failed; resuming in 1s" in caplog.messages
    assert not trainer.running
    assert trainer.last_error == "RuntimeError: boom" and waits[0] == 1.0
    assert pinned == [(settings.train_cpus, settings.torch_threads), ("released",)]


def test_the_optimizer_is_fused_adamw_at_the_settings_rate_and_decay(tmp_path: Path) -> None:
    settings = bare_settings(tmp_path, learning_rate=3e-3, weight_decay=0.05)  # not AdamW's defaults
    optimizer = build_optimizer(build_model(settings), settings)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    assert optimizer.defaults["lr"] == settings.learning_rate
    assert optimizer.defaults["weight_decay"] == settings.weight_decay


def test_lowering_the_priority_is_refused_off_linux_and_when_the_system_refuses(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    result: dict[str, bool] = {}

    def lower(niceness: int) -> None:
        result["lowered"] = lower_thread_priority(niceness)

    def in_a_thread(niceness: int) -> bool:
        thread = threading.Thread(target=lower, args=(niceness,))
        thread.start()
        thread.join()
        return result.pop("lowered")

    if sys.platform.startswith("linux"):
        assert in_a_thread(1) is True  # one step is a step
    with caplog.at_level(logging.INFO, logger="streamtrain.training.publishing"):
        monkeypatch.setattr(publishing.sys, "platform", "darwin")
        assert in_a_thread(5) is False
        monkeypatch.setattr(publishing.sys, "platform", "linux")

        def refuse(*args: object) -> None:
            raise PermissionError("not allowed")

        monkeypatch.setattr(publishing.os, "setpriority", refuse)
        assert in_a_thread(5) is False
    assert "train_nice=5 ignored: per-thread priorities need Linux" in caplog.messages
    assert "could not lower the training threads' priority: not allowed" in caplog.messages
