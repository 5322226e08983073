"""The trainer (``training/trainer.py``): its counters, metrics, report and state, and the training thread's helpers."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from small_trainer import make_small_trainer, random_walks

from streamtrain.data.collate import Batch
from streamtrain.data.randomness import make_randomness
from streamtrain.model.losses import forecast_loss
from streamtrain.training.protocol import RestoredParts, StepOutcome
from streamtrain.training.publishing import lower_thread_priority
from streamtrain.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quality"))  # the quality tests' service
from quality_service_fixtures import feed, oscillations, trained_service  # noqa: E402


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux only")
def test_lower_thread_priority_affects_the_calling_thread_and_its_children_only() -> None:
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def trainer() -> None:
        tid = threading.get_native_id()
        seen["before"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["lowered"] = lower_thread_priority(5)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)
        started = threading.Thread(target=child)  # e.g. the prefetch thread
        started.start()
        started.join()

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=trainer)
    thread.start()
    thread.join()
    assert seen["lowered"] is True
    assert seen["after"] == min(19, seen["before"] + 5)
    assert seen["child"] == seen["after"]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
    assert lower_thread_priority(0) is False


def _value(trainer: Trainer, name: str, **labels: str) -> float | None:
    return trainer.metrics.registry.get_sample_value(name, labels or None)


def _outcome(applied: bool = True, reason: str | None = None, *, seconds: float = 0.25, tokens: int = 100,
             loss: float = 0.5, naive: float = 1.0) -> StepOutcome:  # fmt: skip
    return StepOutcome(applied, reason, seconds, tokens, loss, naive)


def _first_batch(trainer: Trainer) -> Batch:
    batch = next(iter(trainer.dataset))
    assert batch.padded_tokens > batch.real_tokens > 0 and batch.batch_size > 1  # a count that could be mistaken
    return batch


def test_an_applied_step_counts_into_the_trainer_and_every_training_metric() -> None:
    trainer = make_small_trainer()
    batch = _first_batch(trainer)
    now = float(batch.ts.numpy().max()) + 100.0
    trainer._clock = lambda: now
    assert trainer._wait_for_replay_budget(batch.batch_size)  # credits the window's events to the budget
    with trainer.lock:
        trainer.apply_step(_outcome(tokens=batch.real_tokens, loss=0.5, naive=1.0), batch)
        trainer.apply_step(_outcome(seconds=0.5, tokens=batch.real_tokens, loss=0.3, naive=math.nan), batch)
    assert (trainer.step, trainer.tokens_trained) == (2, 2 * batch.real_tokens)
    assert trainer.loss_ema == pytest.approx(0.95 * 0.5 + 0.05 * 0.3, rel=1e-12)
    assert trainer.naive_loss_ema == 1.0  # a non-finite loss leaves the average as it was
    assert trainer.step_seconds == 0.75
    assert _value(trainer, "streamtrain_train_steps_total") == 2
    assert _value(trainer, "streamtrain_train_tokens_total") == 2 * batch.real_tokens
    assert _value(trainer, "streamtrain_train_padding_tokens_total") == 2 * (batch.padded_tokens - batch.real_tokens)
    assert _value(trainer, "streamtrain_train_loss") == trainer.loss_ema
    assert _value(trainer, "streamtrain_train_step_seconds_count") == 2
    assert _value(trainer, "streamtrain_train_step_seconds_sum") == 0.75
    assert _value(trainer, "streamtrain_train_batch_sequences_count") == 2
    assert _value(trainer, "streamtrain_train_batch_sequences_sum") == 2 * batch.batch_size
    assert trainer.replays.trained_items == 2 * batch.batch_size
    assert trainer.replays.per_event == 2 * batch.batch_size / trainer.window.accepted_total
    assert _value(trainer, "streamtrain_train_replays_per_event") == trainer.replays.per_event
    median_age = float(np.median(now - batch.ts.numpy()))
    assert _value(trainer, "streamtrain_train_sample_age_seconds_count") == 2
    assert _value(trainer, "streamtrain_train_sample_age_seconds_sum") == pytest.approx(2 * median_age, rel=1e-9)
    assert trainer.report().training["forecast_loss"] == trainer.loss_ema
    assert trainer.report().training["naive_last_value_loss"] == 1.0


def test_a_refused_step_counts_its_time_and_reason_and_no_step_counts_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trainer = make_small_trainer()
    batch = _first_batch(trainer)
    with trainer.lock, caplog.at_level(logging.WARNING, logger="streamtrain.training.trainer"):
        trainer.apply_step(_outcome(False, "non_finite_grad", seconds=0.125, loss=math.nan), batch)
        for reason in ("stop", "no_data"):  # no step ran anywhere: not even its time counts
            trainer.apply_step(_outcome(False, reason, seconds=9.0, loss=math.nan), batch)
    assert (trainer.step, trainer.tokens_trained, trainer.loss_ema, trainer.step_seconds) == (0, 0, None, 0.125)
    assert _value(trainer, "streamtrain_train_skipped_steps_total", reason="non_finite_grad") == 1
    assert _value(trainer, "streamtrain_train_skipped_steps_total", reason="non_finite_loss") == 0
    assert _value(trainer, "streamtrain_train_step_seconds_count") == 1
    assert _value(trainer, "streamtrain_train_step_seconds_sum") == 0.125
    for name in ("steps", "tokens", "padding_tokens"):
        assert _value(trainer, f"streamtrain_train_{name}_total") == 0
    assert _value(trainer, "streamtrain_train_batch_sequences_count") == 0
    assert trainer.replays.trained_items == 0
    assert [r.getMessage() for r in caplog.records] == ["step skipped: non_finite_grad"]


def test_a_step_without_a_batch_of_its_own_counts_the_step_but_none_of_this_rank_s_data() -> None:
    """A scaled-out rank that had no data this step: the global step and tokens count, its own metrics do not."""
    trainer = make_small_trainer()
    with trainer.lock:
        trainer.apply_step(_outcome(tokens=300, loss=0.25), None)
    assert (trainer.step, trainer.tokens_trained, trainer.loss_ema) == (1, 300, 0.25)
    assert _value(trainer, "streamtrain_train_steps_total") == 1
    assert _value(trainer, "streamtrain_train_loss") == 0.25
    assert _value(trainer, "streamtrain_train_tokens_total") == 0
    assert _value(trainer, "streamtrain_train_batch_sequences_count") == 0
    assert _value(trainer, "streamtrain_train_sample_age_seconds_count") == 0
    assert trainer.replays.trained_items == 0


def _through_the_first_pass(trainer: Trainer) -> Batch:
    """Batches until the first of the second pass (the first pass's end has been reported)."""
    for batch in trainer.dataset:
        if batch.position is not None and batch.position.pass_index == 1:
            return batch
    raise AssertionError("the dataset ended")


def test_the_report_before_anything_trained_then_after_a_pass_and_a_publication() -> None:
    trainer = make_small_trainer()
    report = trainer.report()
    assert report.training == {
        "live_step": 0, "forecast_loss": None, "naive_last_value_loss": None, "last_pass": {},
        "data_wait_share": None, "publish_held": 0, "last_gate": None, "budget_wait_seconds": 0.0,
    }  # fmt: skip
    assert report.quality is None and report.forecaster == {"kind": None, "last_publication": None}
    assert report.replays_per_event == 0.0 and report.public_progress
    _through_the_first_pass(trainer)
    trainer.step_seconds, trainer.data_wait_seconds, trainer.budget_wait_seconds = 3.0, 1.0, 2.5
    with trainer.lock:
        trainer.apply_step(_outcome(loss=0.5, naive=1.5), None)
    trainer.publish()
    published, selection = trainer.published, trainer.last_selection
    assert published is not None and selection is not None and trainer.last_pass is not None
    report = trainer.report()
    assert report.training == {
        "live_step": 1, "forecast_loss": 0.5, "naive_last_value_loss": 1.5,
        "last_pass": trainer.last_pass.as_metrics(), "data_wait_share": 1.0 / 4.25, "publish_held": 0,
        "last_gate": None if trainer.last_gate is None else dataclasses.asdict(trainer.last_gate),
        "budget_wait_seconds": 2.5,
    }  # fmt: skip
    assert report.forecaster == {**published.forecaster.report(), "last_publication": selection.report()}
    trainer.step_seconds, trainer.data_wait_seconds = 0.3, 0.1  # a share of a busy time under a second too
    assert trainer.report().training["data_wait_share"] == pytest.approx(0.25, rel=1e-12)
    assert report.forecaster["kind"] is not None and report.forecaster["last_publication"] is not None


def test_a_pass_end_sets_the_last_pass_and_its_gauges_but_not_its_number_or_snapshot() -> None:
    trainer = make_small_trainer()
    _through_the_first_pass(trainer)
    diagnostics = trainer.last_pass
    assert diagnostics is not None and diagnostics.pass_index == 0
    assert _value(trainer, "streamtrain_train_passes_total") == 1
    for field, value in diagnostics.as_metrics().items():
        shown = _value(trainer, "streamtrain_train_last_pass", field=field)
        if field in ("pass_index", "snapshot_version"):
            assert shown is None, field
        elif math.isnan(value):
            assert shown is not None and math.isnan(shown), field
        else:
            assert shown == value, field
    assert _value(trainer, "streamtrain_train_last_pass", field="batches") == diagnostics.batches > 1


def test_a_drift_clears_the_optimizer_s_moments_once_only_when_configured_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kept = make_small_trainer(drift_reaction="none")
    kept._on_drift(None)  # type: ignore[arg-type]
    assert kept.drift_reactions == 0 and kept.take_optimizer_reset() is False
    trainer = make_small_trainer(drift_reaction="reset_optimizer")
    with caplog.at_level(logging.INFO, logger="streamtrain.training.trainer"):
        trainer._on_drift(None)  # type: ignore[arg-type]
    assert trainer.drift_reactions == 1
    assert [r.getMessage() for r in caplog.records] == [
        "drift reaction: AdamW moments are cleared before the next step"
    ]
    assert trainer.take_optimizer_reset() is True and trainer.take_optimizer_reset() is False
    trainer._on_drift(None)  # type: ignore[arg-type]
    assert trainer.drift_reactions == 2 and trainer.take_optimizer_reset() is True


def test_an_automatic_rollback_takes_a_kept_version_and_skips_one_no_longer_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trainer = make_small_trainer(holdout_share=0.0, model_versions_keep=2)
    for _ in range(3):
        trainer.publish()  # versions 1-3; 2 and 3 kept
    with caplog.at_level(logging.WARNING, logger="streamtrain.training.trainer"):
        assert trainer._auto_rollback(1, "skill fell") is False
    assert [r.getMessage() for r in caplog.records] == [
        "automatic rollback to version 1 skipped: it is no longer kept (skill fell)"
    ]
    assert trainer.published is not None and trainer.published.version == 3 and trainer.quality.rollbacks == []
    assert trainer._auto_rollback(2, "skill fell") is True
    assert trainer.published.version == 2
    [rollback] = trainer.quality.rollbacks
    assert {k: v for k, v in rollback.items() if k != "at"} == {
        "to_version": 2, "from_version": 3, "trigger": "automatic", "reason": "skill fell",
    }  # fmt: skip
    assert _value(trainer, "streamtrain_model_rollbacks_total", trigger="automatic") == 1


def test_a_restore_brings_back_the_counters_the_loss_average_and_the_replay_budget() -> None:
    trainer = make_small_trainer(compile="off")
    assert trainer._wait_for_replay_budget(1)
    for batch in itertools.islice(trainer.dataset, 3):
        trainer.train_step(batch)
    trainer.publish()
    state = trainer.state_dict()
    assert trainer.loss_ema is not None and trainer.replays.trained_items > 0
    restored = make_small_trainer(seed=1)
    restored.load_state_dict(state)
    assert (restored.step, restored.tokens_trained, restored.loss_ema) == (3, trainer.tokens_trained, trainer.loss_ema)
    assert restored.replays.state_dict() == trainer.replays.state_dict()
    assert restored.published is not None and restored.published.version == 2  # after the kept version 1
    assert restored.registry.versions() == [1, 2]
    unfinished = make_small_trainer(seed=1)
    unfinished.load_state_dict({**state, "loss_ema": math.nan})
    assert unfinished.loss_ema is None  # a non-finite average is no average
    # a checkpoint of before the version counter, the replay budget and the kept versions
    earlier = make_small_trainer(seed=1)
    earlier.load_state_dict({k: v for k, v in state.items() if k not in ("version", "replays", "registry")})
    assert earlier.published is not None and earlier.registry.versions() == [1] and earlier.published.version == 1
    assert earlier.replays.trained_items == 0 and earlier.step == 3


def test_a_checkpoint_of_another_model_is_refused_with_both_configurations() -> None:
    trainer = make_small_trainer()
    state = trainer.state_dict()
    other = make_small_trainer(d_model=8)
    with pytest.raises(ValueError) as refused:
        other.load_state_dict(state)
    assert str(refused.value) == (
        f"checkpoint model {dict(trainer.model.config)} does not match the configured model {other.model.config}; "
        "use a fresh CHECKPOINT_DIR or the old settings"
    )
    assert other.step == 0 and other.published is None


def _waiting(trainer: Trainer, items: int) -> tuple[threading.Thread, list[bool]]:
    answer: list[bool] = []
    thread = threading.Thread(target=lambda: answer.append(trainer._wait_for_replay_budget(items)), daemon=True)
    thread.start()
    return thread, answer


def test_an_idle_trainer_counts_its_wait_publishes_what_moved_and_goes_on_when_events_arrive() -> None:
    trainer = make_small_trainer(max_replays_per_event=1.0, publish_max_share=1.0, compile="off")
    assert trainer._wait_for_replay_budget(0)  # credits the window's 96 events
    trainer.replays.spend(96)  # and spends them: nothing more may train
    try:
        started = time.monotonic()
        thread, answer = _waiting(trainer, 8)
        time.sleep(0.8)  # four rounds of 0.2 s, less the publication's time
        assert thread.is_alive() and answer == []
        # idle, it published once (nothing served), then never again: nothing it is made of moved,
        # however many publication intervals (0.05 s, or the publication's own time) passed
        assert trainer.registry.versions() == [1]
        trainer.window.insert_batch(random_walks(8, 1, time.time() + 8))  # 8 new events buy 8 item-trainings
        thread.join(5)
        idle = time.monotonic() - started
        assert not thread.is_alive() and answer == [True]
        # every round counted (not the publication): all of the time but the publication's
        assert idle - trainer.publish_seconds - 0.1 <= trainer.budget_wait_seconds <= idle
        assert _value(trainer, "streamtrain_train_budget_wait_seconds_total") == trainer.budget_wait_seconds
        assert trainer.report().training["budget_wait_seconds"] == trainer.budget_wait_seconds
        with trainer.lock:
            trainer.apply_step(_outcome(), None)  # a step trained since: the next idle wait publishes it
        trainer.replays.spend(8)
        waited_before = trainer.budget_wait_seconds
        started = time.monotonic()
        thread, answer = _waiting(trainer, 8)
        time.sleep(0.8)
        published = trainer.registry.versions()
        assert published[-1] > 1  # a candidate (and, were it held back, the refreshed version that serves on)
        time.sleep(0.4)
        assert trainer.registry.versions() == published  # and nothing more: nothing moved since
        trainer._stop.set()  # stopped while idle: no more waiting
        thread.join(5)
        idle = time.monotonic() - started
        assert not thread.is_alive() and answer == [False]
        assert idle - trainer.publish_seconds - 0.1 <= trainer.budget_wait_seconds - waited_before <= idle
    finally:
        trainer._stop.set()  # a waiting thread left by a failure ends too


def test_the_training_thread_prefetches_on_a_named_thread_at_the_configured_depth() -> None:
    trainer = make_small_trainer(prefetch_depth=3, compile="off")
    trainer.start()
    try:
        deadline = time.monotonic() + 30
        while trainer.step < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        prefetcher = trainer._prefetcher
        assert trainer.step >= 2 and prefetcher is not None and prefetcher.depth == 3
        assert "trainer-prefetch" in [t.name for t in threading.enumerate()]
    finally:
        trainer.stop()
    assert not trainer.running and trainer.last_error is None  # a stop is no failure


def test_a_trained_step_reports_and_counts_its_batch_and_a_drift_reset_restarts_adamw() -> None:
    trainer = make_small_trainer(compile="off", drift_reaction="reset_optimizer")
    batches = iter(trainer.dataset)
    first = next(batches)
    report = trainer.train_step(first)
    assert (report.step, report.applied, report.skipped_reason) == (1, True, None)
    assert (report.real_tokens, report.padded_tokens, report.sequences) == (
        first.real_tokens, first.padded_tokens, first.batch_size,
    )  # fmt: skip
    assert report.seconds > 0 and math.isfinite(report.loss)
    assert _value(trainer, "streamtrain_train_tokens_total") == first.real_tokens
    assert trainer.replays.trained_items == first.batch_size
    for _ in range(2):
        trainer.train_step(next(batches))
    parameter = next(trainer.model.parameters())
    assert int(trainer.optimizer.state[parameter]["step"]) == 3
    trainer._on_drift(None)  # type: ignore[arg-type]
    trainer.train_step(next(batches))
    assert int(trainer.optimizer.state[parameter]["step"]) == 1  # the moments started over at this step
    trainer.train_step(next(batches))
    assert int(trainer.optimizer.state[parameter]["step"]) == 2  # once


def test_evaluate_is_the_forecast_loss_of_the_live_model_over_real_positions_only() -> None:
    trainer = make_small_trainer(compile="off", amp="off")
    batches = iter(trainer.dataset)
    for _ in range(3):
        trainer.train_step(next(batches))
    batch = next(batches)
    assert batch.padded_tokens > batch.real_tokens  # pad positions a careless mask would count
    x_norm = trainer.norm.normalize(batch.values).float() * batch.mask[..., None]
    with torch.no_grad():
        expected = float(forecast_loss(trainer.model(x_norm, batch.mask), x_norm, batch.mask))
    assert math.isfinite(expected) and trainer.evaluate(batch) == pytest.approx(expected, rel=1e-6)
    assert trainer.step == 3  # no update


def _positions(sample: list[np.ndarray], whole: list[np.ndarray]) -> list[int]:
    return [next(i for i, item in enumerate(whole) if np.array_equal(item, drawn)) for drawn in sample]


def test_the_linear_forecaster_fits_a_seeded_sample_in_window_order_of_a_window_past_its_limit() -> None:
    trainer = make_small_trainer(linear_fit_items=40, shuffle="seeded")
    whole = trainer.window.pass_source().whole.values
    assert len(whole) == 96
    sample, share = trainer._linear_training_values()
    assert share == 40 / 96 and len(sample) == 40
    drawn = _positions(sample, whole)
    assert drawn == sorted(set(drawn))  # distinct items of the window, in its order
    assert drawn == sorted(make_randomness("seeded", 0, 0, purpose="linear").sample(96, 40))  # its own stream
    assert _positions(trainer._linear_training_values()[0], whole) == drawn  # the same for a version
    trainer._version += 1
    assert _positions(trainer._linear_training_values()[0], whole) != drawn  # another for the next
    trainer._version -= 1
    trainer.settings = trainer.settings.model_copy(update={"seed": 7})
    assert _positions(trainer._linear_training_values()[0], whole) != drawn  # and another for another seed
    everything = make_small_trainer(linear_fit_items=96)
    values, share = everything._linear_training_values()
    assert share == 1.0 and _positions(values, whole) == list(range(96))


def test_a_publication_sets_each_forecaster_s_held_out_error_gauge(tmp_path: Path) -> None:
    service = trained_service(tmp_path)
    trainer = service.trainer
    selection = trainer.last_selection
    assert selection is not None
    shown = {
        kind: _value(trainer, "streamtrain_model_holdout_mse", forecaster=kind)
        for kind in ("last_value", "linear", "network")
    }
    assert shown == {
        "last_value": selection.mse["last_value"], "linear": selection.mse["linear"],
        "network": selection.mse["candidate"],
    }  # fmt: skip
    assert len(set(shown.values())) == 3 and None not in shown.values()
    feed(service, oscillations(np.random.default_rng(9), 20, time.time()))  # scored by the version that serves
    quality = trainer.report().quality
    assert trainer.published is not None and quality is not None
    assert quality["serving_version"]["version"] == trainer.published.version


class _SlowSource:
    """The trainer's dataset, each batch ``seconds`` late (a slow window)."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.inner:
            time.sleep(self.seconds)
            yield batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_training_loop_counts_the_time_it_waits_for_batches_after_the_first() -> None:
    trainer = make_small_trainer(compile="off", publish_interval_s=3600.0, min_window_items=120)
    trainer.dataset = _SlowSource(trainer.dataset, 0.15)  # type: ignore[assignment]
    started = time.monotonic()
    trainer.start()
    try:
        time.sleep(1.0)  # the window (96 events) is below its minimum: the first batch waits
        trainer.window.insert_batch(random_walks(40, 2, time.time() + 40))
        deadline = time.monotonic() + 60
        while trainer.step < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        trainer.stop()
    wall = time.monotonic() - started
    steps, waited = trainer.step, trainer.data_wait_seconds
    assert steps >= 6 and trainer.last_error is None
    # every batch after the first came 0.15 s after the one before, less what the step (and the first
    # publication) took meanwhile; the first batch's wait (over a second) is warm-up, not counted
    assert (steps - 1) * 0.15 - trainer.step_seconds - trainer.publish_seconds - 0.05 <= waited
    assert waited <= (steps - 1) * 0.25 + 0.2 and waited < wall - 1.0  # slack for a loaded machine
    assert _value(trainer, "streamtrain_train_data_wait_seconds_total") == waited


def test_the_training_loop_idles_at_the_replay_budget_instead_of_replaying_the_window() -> None:
    trainer = make_small_trainer(compile="off", max_replays_per_event=1.0, publish_interval_s=3600.0)
    trainer.start()
    try:
        deadline = time.monotonic() + 30
        while trainer.budget_wait_seconds < 0.3 and time.monotonic() < deadline:
            time.sleep(0.02)
        trained = trainer.replays.trained_items
        time.sleep(0.3)
        assert trainer.replays.trained_items == trained  # idle: nothing more is trained
    finally:
        trainer.stop()
    assert trainer.budget_wait_seconds >= 0.3 and 0 < trained <= 96  # one replay of each of the 96 events at most
    assert trainer.last_error is None


def test_candidates_are_judged_against_the_reference_network_else_the_version_that_serves() -> None:
    trainer = make_small_trainer(compile="off")
    trainer.publish()
    first = trainer.published
    trainer.publish()
    serving = trainer.published
    assert first is not None and serving is not None and serving is not first
    judged_against: list[Any] = []
    select = trainer.quality.select

    def spy(candidate: Any, reference: Any, training_values: Any) -> Any:
        judged_against.append(reference)
        return select(candidate, reference, training_values)

    trainer.quality.select = spy  # type: ignore[method-assign]
    trainer.reference = None  # as after a rollback or a restore
    assert trainer._refreshed_network() is serving
    trainer.publish()
    assert judged_against == [serving]
    trainer.reference = first  # the best network that passed, not the latest
    assert trainer._refreshed_network() is first
    trainer.publish()
    assert judged_against == [serving, first]


def test_a_sharded_cut_keeps_the_rank_s_stream_and_quality_apart_and_a_new_owner_starts_them_fresh() -> None:
    trainer = make_small_trainer(compile="off")
    state = trainer.state_dict()
    parts = trainer.checkpoint_parts(state)
    assert sorted(parts.rank_local) == ["dataset", "quality", "rng"] and parts.by_partition is None
    assert sorted(parts.shared) == sorted(set(state) - {"dataset", "quality", "rng"})
    unchanged = RestoredParts(parts.shared, parts.rank_local, [], lambda partition: True, True)
    joined = trainer.state_from_parts(unchanged)
    assert sorted(joined) == sorted(state) and all(joined[key] is state[key] for key in state)
    another_owner = RestoredParts(parts.shared, None, [], lambda partition: True, False)
    fresh = trainer.state_from_parts(another_owner)
    assert sorted(fresh) == sorted(set(state) - {"quality"})
    assert fresh["dataset"] is not state["dataset"] and fresh["dataset"].keys() == state["dataset"].keys()
    assert all(fresh[key] is state[key] for key in parts.shared)
