"""Publishing in the background (``PUBLISH_IN_BACKGROUND``): the trainer steps on while a
candidate is judged, a rollback meanwhile makes that candidate lapse, a failed judgement is
counted and the next one runs, the judging thread's CPU time spaces publications, and stop()
ends the thread (a real Service, ingest not started, no Kafka)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from streamtrain.model.network import SensorModel
from streamtrain.runtime.service import Service
from streamtrain.training.publishing import ModelTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quality"))
from quality_service_fixtures import build_service, feed, oscillations, train  # noqa: E402


def fed_service(tmp: Path, **overrides: object) -> Service:
    service = build_service(tmp, **{"publish_in_background": True, **overrides})
    feed(service, oscillations(np.random.default_rng(3), 200, time.time()))
    return service


@contextmanager
def judging_held(trainer: ModelTrainer) -> Iterator[list[str]]:
    """Candidates' judgements wait inside the gate until the block ends; yields the names of
    the threads they ran on. A due publication is started by the block (from a thread of its
    own, which must come back at once)."""
    entered, release, threads = threading.Event(), threading.Event(), []

    def hold(model: SensorModel) -> None:
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(30), "the test never let the judgement go on"

    trainer.candidate_hook = hold
    trainer._last_publish = time.monotonic() - 7200.0  # due (PUBLISH_INTERVAL_S is an hour here)
    caller = threading.Thread(target=trainer._publish_if_due, daemon=True)
    try:
        caller.start()
        caller.join(5.0)
        assert not caller.is_alive(), "the trainer waited for the judgement"
        assert entered.wait(10.0), "no judgement started"
        yield threads
    finally:
        release.set()
        trainer.candidate_hook = None
    assert trainer.wait_for_judgement(30.0)


def test_the_trainer_steps_on_while_a_candidate_is_judged(tmp_path: Path) -> None:
    service = fed_service(tmp_path)
    trainer = service.trainer
    first = trainer.publish()
    train(service, 3)
    with judging_held(trainer) as threads:
        step = trainer.step
        train(service, 2)
        assert trainer.step == step + 2 and trainer.published is first
        trainer._last_publish = time.monotonic() - 7200.0
        trainer._publish_if_due()  # one judgement at a time: nothing else is frozen meanwhile
        assert trainer.registry.versions() == [first.version]
    assert threads == ["trainer-publish"]
    serving = trainer.published
    assert serving is not None and serving.version == first.version + 1 and serving.step == step
    assert trainer.publish_seconds > 0.0  # the judging thread's CPU time


def test_a_candidate_judged_across_a_rollback_lapses(tmp_path: Path) -> None:
    service = fed_service(tmp_path)
    trainer = service.trainer
    first = trainer.publish()
    train(service, 3)
    second = trainer.publish()
    assert trainer.published is second
    train(service, 3)
    with judging_held(trainer):
        trainer.rollback(first.version)  # does not wait for the judgement
        assert trainer.published is first
    assert trainer.published is first  # the candidate of the abandoned weights never serves
    assert trainer.registry.versions() == [first.version, second.version]
    train(service, 1)
    trainer._last_publish = time.monotonic() - 7200.0
    trainer._publish_if_due()
    assert trainer.wait_for_judgement(30.0)
    assert trainer.published is not None and trainer.published.version == second.version + 2


def test_a_failed_judgement_is_counted_and_the_next_one_runs(tmp_path: Path) -> None:
    service = fed_service(tmp_path)
    trainer = service.trainer
    first = trainer.publish()
    train(service, 2)

    def fail(model: SensorModel) -> None:
        raise RuntimeError("the gate broke")

    trainer.candidate_hook = fail
    trainer._last_publish = time.monotonic() - 7200.0
    trainer._publish_if_due()
    assert trainer.wait_for_judgement(30.0)
    assert trainer.last_error == "RuntimeError: the gate broke" and trainer.published is first
    trainer.candidate_hook = None
    trainer._publish_if_due()
    assert trainer.wait_for_judgement(30.0)
    assert trainer.published is not None and trainer.published.version > first.version


@pytest.mark.parametrize("background", [False, True])
def test_publishing_takes_at_most_its_share_of_the_trainers_time(tmp_path: Path, background: bool) -> None:
    service = fed_service(tmp_path, publish_interval_s=1.0, publish_max_share=0.1, publish_in_background=background)
    trainer = service.trainer
    trainer._publish_if_due()
    assert trainer.wait_for_judgement(30.0)
    first = trainer.published
    assert first is not None and trainer.publish_seconds > 0
    trainer.publish_seconds = 0.5  # a slow publication: the next waits 0.5 / 0.1 = 5 s, not 1 s
    trainer._last_publish = time.monotonic() - 2.0
    trainer._publish_if_due()
    assert trainer.wait_for_judgement(30.0)
    assert trainer.published is first
    trainer._last_publish = time.monotonic() - 5.1
    trainer._publish_if_due()
    assert trainer.wait_for_judgement(30.0)
    assert trainer.published is not first


def judging_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "trainer-publish"]


def test_a_running_trainer_publishes_from_its_judging_thread_until_stopped(tmp_path: Path) -> None:
    service = fed_service(tmp_path, publish_interval_s=0.05, compile="off")
    trainer = service.trainer
    others = set(judging_threads())  # earlier tests' services, never started, keep theirs
    trainer.start()
    deadline = time.monotonic() + 60.0
    while (trainer.published is None or trainer.published.version < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    mine = set(judging_threads()) - others
    assert len(mine) == 1
    trainer.stop()
    assert trainer.published is not None and trainer.published.version >= 2
    assert not any(thread.is_alive() for thread in mine)
    assert trainer.last_error is None
