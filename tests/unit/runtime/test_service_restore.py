"""The service's checkpoints: restore under changed settings, refusals, locks and counters."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamtrain.checkpoint.store import CheckpointStore

torch.set_num_threads(1)


def small_service(tmp_path: Path, **overrides: Any) -> Any:
    from streamtrain.config import load_settings
    from streamtrain.runtime.service import Service

    values: dict[str, Any] = dict(
        d_model=16, n_heads=2, n_layers=1, max_len=32, token_budget=512, min_window_items=8, warmup_steps=1,
        checkpoint_dir=tmp_path / "ckpt", window_capacity=200, half_life_s=3600.0, torch_threads=1, train_nice=0,
    )  # fmt: skip
    values.update(overrides)
    return Service(load_settings(**{name: value for name, value in values.items() if value is not None}))


def feed(service: Any, start: int, n: int, *, ts0: float = 1.7e9, rejected: dict[str, int] | None = None) -> None:
    from streamtrain.events import EventBatch, SensorEvent

    channels = service.settings.channels
    rng = np.random.default_rng(start)
    events = [
        SensorEvent(
            f"s{i % 5}", ts0 + start + i, rng.standard_normal((int(rng.integers(2, 12)), channels)).astype(np.float32)
        )
        for i in range(n)
    ]
    batch = EventBatch.from_events(events, offsets=np.arange(start, start + n))
    service.window.insert_batch(batch, {0: start + n}, rejected=rejected)


def a_training_batch(service: Any) -> Any:
    from streamtrain.data.collate import collate

    snapshot = service.window.snapshot()
    return collate(snapshot.values[:16], ts=snapshot.ts[:16])


def test_restore_with_another_half_life_rekeys_the_window_and_keeps_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = small_service(tmp_path, half_life_s=3600.0)
    for start in range(0, 86_400, 4_320):  # a day of events, one every 20 s
        feed(old, start, 216, ts0=1.7e9 + start * 19)
    assert old.checkpoint() is not None
    kept = old.window.snapshot()

    new = small_service(tmp_path, half_life_s="inf")
    with caplog.at_level("WARNING", logger="streamtrain.window"):
        assert new.restore() is not None
    assert "keyed with HALF_LIFE_S=3600; re-keyed its 200 items for HALF_LIFE_S=inf" in caplog.text
    snap = new.window.snapshot()
    order_old, order_new = np.argsort(kept.offsets), np.argsort(snap.offsets)
    np.testing.assert_allclose(  # the random part survives, the recency part is gone
        snap.keys[order_new], (kept.keys - math.log(2) / 3600 * (kept.ts - 1.7e9))[order_old], atol=1e-9
    )
    feed(new, 100_000, 2_000, ts0=1.7e9 + 86_400 * 20)
    assert (new.window.snapshot().offsets >= 100_000).any()  # the window still takes events


def test_restore_with_other_channels_refuses_with_one_line_and_loads_nothing(tmp_path: Path) -> None:
    from streamtrain.runtime.service import IncompatibleCheckpoint

    old = small_service(tmp_path, channels=1)
    feed(old, 0, 50)
    assert old.checkpoint() is not None
    new = small_service(tmp_path, channels=2)
    with pytest.raises(IncompatibleCheckpoint) as refused:
        new.restore()
    message = str(refused.value)
    assert "\n" not in message and "CHANNELS=1" in message and "CHANNELS=2" in message
    assert "STREAMTRAIN_CHECKPOINT_DIR" in message
    assert len(new.window) == 0 and new.trainer.step == 0 and new.published is None


def test_serve_with_an_incompatible_checkpoint_exits_2_with_that_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamtrain import cli

    old = small_service(tmp_path, channels=1)
    feed(old, 0, 50)
    assert old.checkpoint() is not None
    for name in list(os.environ):
        if name.startswith("STREAMTRAIN_"):
            monkeypatch.delenv(name)
    config = tmp_path / "serve.toml"
    config.write_text(
        f'checkpoint_dir = "{tmp_path / "ckpt"}"\nchannels = 2\nd_model = 16\nn_heads = 2\nn_layers = 1\nmax_len = 32\n'
        'kafka_bootstrap = "127.0.0.1:1"\nlog_level = "ERROR"\ncompile = "off"\n'
    )
    assert cli.main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("streamtrain: checkpoint ") and "CHANNELS=1" in err[0], err


def test_restore_with_another_model_size_names_every_changed_setting(tmp_path: Path) -> None:
    from streamtrain.runtime.service import IncompatibleCheckpoint

    old = small_service(tmp_path)
    feed(old, 0, 50)
    assert old.checkpoint() is not None
    with pytest.raises(IncompatibleCheckpoint, match=r"D_MODEL=16, N_LAYERS=1; .* D_MODEL=32, N_LAYERS=2"):
        small_service(tmp_path, d_model=32, n_layers=2).restore()


def test_a_checkpoint_with_other_heads_resumes_with_its_own_unless_n_heads_is_set(tmp_path: Path) -> None:
    from streamtrain.runtime.service import IncompatibleCheckpoint

    old = small_service(tmp_path, n_heads=2)
    feed(old, 0, 50)
    batch = a_training_batch(old)
    for _ in range(3):  # trained weights: an untrained residual model forecasts the last value with any heads
        old.trainer.train_step(batch)
    assert old.checkpoint() is not None
    resumed = small_service(tmp_path, n_heads=None)  # N_HEADS not set: its default is 4
    resumed.restore()
    assert resumed.settings.n_heads == 2 and "n_heads" not in resumed.settings.model_fields_set
    assert resumed.trainer.model.config["n_heads"] == 2 and resumed.trainer.step == old.trainer.step
    old.trainer.model.eval(), resumed.trainer.model.eval()
    with torch.no_grad():
        x_norm, mask = batch.values, batch.mask
        before, after = old.trainer.model(x_norm, mask).forecast, resumed.trainer.model(x_norm, mask).forecast
    assert torch.equal(before, after)  # the same function: the weights with the heads they were trained with
    fresh = small_service(tmp_path / "elsewhere", n_heads=None)
    assert fresh.settings.n_heads == 4  # no checkpoint: the default
    with pytest.raises(IncompatibleCheckpoint, match=r"N_HEADS=2; .* N_HEADS=4"):
        small_service(tmp_path, n_heads=4).restore()  # set by hand: kept, and refused


def test_the_window_ledger_survives_a_restore_and_the_evicted_counter_starts_at_zero(tmp_path: Path) -> None:
    old = small_service(tmp_path)
    for start in range(0, 1000, 100):
        feed(old, start, 100, rejected={"schema": 2})
    assert old.checkpoint() is not None
    new = small_service(tmp_path)
    new.restore()
    stats = new.window.stats()
    assert (stats.seen_total, stats.accepted_total, stats.rejected_total, stats.evicted_total) == (
        1020,
        1000,
        {"schema": 20},
        800,
    )
    assert new.window.evicted_since_start == 0  # what streamtrain_window_evicted_total starts from


def test_a_checkpoint_waits_for_the_training_step_without_holding_ingest_back(tmp_path: Path) -> None:
    import threading

    service = small_service(tmp_path)
    feed(service, 0, 100)
    written: list[Any] = []
    with service.trainer.lock:  # a training step in progress
        writer = threading.Thread(target=lambda: written.append(service.checkpoint()))
        writer.start()
        # the checkpoint is waiting for the step; ingest must still get its lock at once
        for _ in range(5):
            assert service.ingest.apply_lock.acquire(timeout=2.0), "ingest stalled behind a checkpoint"
            feed(service, 1000 + len(written) * 10, 10)
            service.ingest.apply_lock.release()
        assert writer.is_alive() and not written
    writer.join(timeout=30)
    assert written and written[0] is not None


def test_a_checkpoint_holds_the_state_of_one_moment_while_training_goes_on(tmp_path: Path) -> None:
    """The trainer's tensors are copied under its lock: a step that runs while the file is
    written (the trainer thread does not wait for the write) must not leak into it."""
    service = small_service(tmp_path)
    feed(service, 0, 100)
    service.trainer.train_step(a_training_batch(service))
    before = {k: v.clone() for k, v in service.trainer.model.state_dict().items()}
    save = service.store.save

    def save_while_training(state: Any, step: int) -> Path:
        service.trainer.train_step(a_training_batch(service))  # in production: another thread
        return save(state, step)

    service.store.save = save_while_training  # type: ignore[method-assign]
    assert service.checkpoint() is not None
    loaded = CheckpointStore(tmp_path / "ckpt").load_latest()
    assert loaded is not None and loaded.state["trainer"]["step"] == 1
    for name, tensor in before.items():
        assert torch.equal(loaded.state["trainer"]["model"][name], tensor), name
    assert not all(torch.equal(service.trainer.model.state_dict()[k], v) for k, v in before.items())


def test_torch_threads_is_the_count_of_every_thread_the_service_starts(tmp_path: Path) -> None:
    import threading

    try:
        small_service(tmp_path, torch_threads=2)
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # e.g. a predict worker
        thread.start()
        thread.join()
        assert seen == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_restore_across_dp_modes_is_refused_with_one_line(tmp_path: Path) -> None:
    from streamtrain.runtime.service import IncompatibleCheckpoint

    old = small_service(tmp_path)
    feed(old, 0, 50)
    assert old.checkpoint() is not None
    dp = small_service(tmp_path, dp="on", shuffle="crypto")
    with pytest.raises(IncompatibleCheckpoint, match=r"written with DP=off; .* DP=on") as refused:
        dp.restore()
    assert "\n" not in str(refused.value) and len(dp.window) == 0
