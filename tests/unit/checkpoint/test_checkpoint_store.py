"""The one-file store: exact round trips, ordering and pruning, fallback past corrupt files, write errors."""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from state_trees import assert_tree_equal, small_model_and_optimizer

from streamtrain.checkpoint import store as store_module
from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.incremental import WindowChain
from streamtrain.checkpoint.store import CheckpointStore, CheckpointWriteError, read_checkpoint, read_checkpoint_link
from streamtrain.events import EventBatch
from streamtrain.window.reservoir import RecencyWindow

torch.set_num_threads(1)

LOGGER = "streamtrain.checkpoint.store"


PREFIX = struct.Struct("<8sQQ32s")  # the layout the module docstring documents


def make_clock(start: float = 1_700_000_000.0):
    ticks = itertools.count()
    return lambda: start + next(ticks)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(batch), batch).backward()
    optimizer.step()


def realistic_state() -> dict[str, Any]:
    model, optimizer = small_model_and_optimizer(seed=0)
    train_step(model, optimizer, torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 30, size=50).astype(np.int64)
    values = rng.standard_normal(int(lengths.sum()) * 2).astype(np.float32)
    values.flags.writeable = False  # snapshots hand out read-only arrays
    window = {
        "values": values,
        "lengths": lengths,
        "keys": rng.random(50),
        "ts": 1_764_412_345.125 + np.arange(50, dtype=np.float64),
        "labels": rng.integers(-1, 3, size=50),
        "sensor_ids": np.array([f"pump-{i % 7}" for i in range(47)] + ["capteur-é-😀", " padded\t", ""], dtype=object),
        "partitions": rng.integers(0, 3, size=50).astype(np.int32),
        "offsets": np.arange(50, dtype=np.int64) * 3,
        "next_offsets": {0: 148, 1: 150, 2: 3},
        "version": 17,
        "half_life_s": math.inf,
        "max_age_s": None,
    }
    generator = torch.Generator().manual_seed(11)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": 1,
        "norm": {"count": 3, "mean": torch.zeros(2, dtype=torch.float64), "m2": torch.ones(2, dtype=torch.float64)},
        "rng": {
            "numpy": rng.bit_generator.state,
            "torch": torch.get_rng_state(),
            "torch_generator": generator.get_state(),
            "python": __import__("random").Random(5).getstate(),
        },
        "window": window,
        "mask": torch.tensor([True, False, True]),
        "loss": {"last": float("nan"), "best": -math.inf, "zero": -0.0},
        "blob": b"\x00\xffraw",
        "note": None,
    }


def test_realistic_state_round_trips_exactly_through_the_store(tmp_path: Path) -> None:
    state = realistic_state()
    store = CheckpointStore(tmp_path / "ckpt", clock=make_clock())
    path = store.save(state, step=1)
    loaded = store.load_latest()
    assert loaded is not None and loaded.path == path and loaded.step == 1
    assert loaded.created_at == 1_700_000_000.0
    assert_tree_equal(loaded.state, state)
    assert list(loaded.state["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay ints


def test_restored_state_resumes_training_and_random_streams_identically(tmp_path: Path) -> None:
    model, optimizer = small_model_and_optimizer(seed=0)
    batch = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    train_step(model, optimizer, batch)
    numpy_rng = np.random.default_rng(3)
    numpy_rng.random(5)
    torch_rng = torch.Generator().manual_seed(4)
    torch.rand(3, generator=torch_rng)
    store = CheckpointStore(tmp_path)
    store.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "numpy_rng": numpy_rng.bit_generator.state,
            "torch_rng": torch_rng.get_state(),
        },
        step=1,
    )
    loaded = store.load_latest()
    assert loaded is not None

    restored_model, restored_optimizer = small_model_and_optimizer(seed=99)
    restored_model.load_state_dict(loaded.state["model"])
    restored_optimizer.load_state_dict(loaded.state["optimizer"])
    train_step(model, optimizer, batch)
    train_step(restored_model, restored_optimizer, batch)
    for original, restored in zip(model.parameters(), restored_model.parameters()):
        assert torch.equal(original, restored)

    restored_numpy = np.random.default_rng(0)
    restored_numpy.bit_generator.state = loaded.state["numpy_rng"]
    assert np.array_equal(restored_numpy.random(8), numpy_rng.random(8))
    restored_torch = torch.Generator()
    restored_torch.set_state(loaded.state["torch_rng"])
    assert torch.equal(torch.rand(8, generator=restored_torch), torch.rand(8, generator=torch_rng))


# ----------------------------------------------------------------------------------------
# the store: ordering, pruning, listing


def test_load_latest_picks_highest_step_then_latest_time(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=10, clock=make_clock())
    for step in (1, 3, 2):
        store.save({"step": step}, step=step)
    newest = store.save({"step": 3, "second": True}, step=3)
    loaded = store.load_latest()
    assert loaded is not None and loaded.path == newest and loaded.state == {"step": 3, "second": True}
    assert [info.step for info in store.list()] == [3, 3, 2, 1]
    assert store.latest_step == 3


def test_empty_or_missing_directory_loads_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "never-created")
    assert store.load_latest() is None
    assert store.list() == []
    assert store.latest_step is None


def test_keep_prunes_to_the_newest_files_and_removes_stale_temp_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2, clock=make_clock())
    store.save({"x": 0}, step=0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale_ours = tmp_path / f".ckpt-000000000000-1.stck.{os.getpid()}.tmp"
    stale_dead = tmp_path / f".ckpt-000000000000-2.stck.{dead.pid}.tmp"
    in_flight_elsewhere = tmp_path / f".ckpt-000000000000-3.stck.{os.getppid()}.tmp"
    for temp in (stale_ours, stale_dead, in_flight_elsewhere):
        temp.write_bytes(b"partial")
    for step in range(1, 5):
        store.save({"x": step}, step=step)
    assert [info.step for info in store.list()] == [4, 3]
    assert not stale_ours.exists() and not stale_dead.exists()
    assert in_flight_elsewhere.exists()  # a live process may still be writing it


def test_pruning_counts_only_good_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2, clock=make_clock())
    oldest_good = store.save({"x": 1}, step=1)
    second = store.save({"x": 2}, step=2)
    _flip_byte(second, offset=-5)
    store.save({"x": 3}, step=3)
    assert oldest_good.exists() and second.exists()  # 1 is still one of the 2 newest good ones
    store.save({"x": 4}, step=4)
    assert not oldest_good.exists() and not second.exists()


def test_a_lower_step_save_is_kept_and_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = CheckpointStore(tmp_path, keep=1, clock=make_clock())
    store.save({"run": 1}, step=100)
    restarted = store.save({"run": 2}, step=5)
    assert restarted.exists()
    assert any("prefer" in record.getMessage() for record in caplog.records)


def test_files_are_private_to_the_service_user(tmp_path: Path) -> None:
    directory = tmp_path / "fresh"
    path = CheckpointStore(directory).save({"x": 1}, step=1)
    assert path.stat().st_mode & 0o777 == 0o600
    assert directory.stat().st_mode & 0o777 == 0o700
    assert path.name.startswith("ckpt-000000000001-") and path.suffix == ".stck"


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_keep_must_be_a_positive_int(tmp_path: Path, keep: Any) -> None:
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, keep=keep)


# ----------------------------------------------------------------------------------------
# corruption: fall back to the previous good checkpoint, log it, report it


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _corrupt(path: Path, kind: str) -> None:
    data = path.read_bytes()
    header_length = PREFIX.unpack_from(data)[1]
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "truncated_last_byte":
        path.write_bytes(data[:-1])
    elif kind == "truncated_inside_prefix":
        path.write_bytes(data[:20])
    elif kind == "flipped_payload_byte":
        _flip_byte(path, offset=-3)
    elif kind == "flipped_header_byte":
        _flip_byte(path, offset=PREFIX.size + header_length // 2)
    elif kind == "flipped_length_byte":
        _flip_byte(path, offset=9)
    elif kind == "wrong_checksum":
        path.write_bytes(data[:24] + hashlib.sha256(b"something else").digest() + data[56:])
    elif kind == "garbage":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, len(data), dtype=np.uint8).tobytes())
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("truncated", "truncated"),
        ("truncated_last_byte", "truncated"),
        ("truncated_inside_prefix", "shorter than"),
        ("flipped_payload_byte", "SHA-256 mismatch"),
        ("flipped_header_byte", "SHA-256 mismatch"),
        ("flipped_length_byte", "truncated"),
        ("wrong_checksum", "SHA-256 mismatch"),
        ("garbage", "magic bytes"),
        ("empty", "empty file"),
    ],
)
def test_corrupt_newest_falls_back_to_previous_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, reason: str
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    reports: list[tuple[Path, str]] = []
    store = CheckpointStore(
        tmp_path, keep=5, on_corrupt=lambda path, why: reports.append((path, why)), clock=make_clock()
    )
    good = store.save({"weights": torch.arange(100.0), "step": 1}, step=1)
    bad = store.save({"weights": torch.arange(100.0) * 2, "step": 2}, step=2)
    _corrupt(bad, kind)

    fresh = CheckpointStore(tmp_path, on_corrupt=lambda path, why: reports.append((path, why)))
    loaded = fresh.load_latest()

    assert loaded is not None and loaded.path == good and loaded.state["step"] == 1
    assert torch.equal(loaded.state["weights"], torch.arange(100.0))
    assert len(reports) == 1 and reports[0][0] == bad and reason in reports[0][1]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and bad.name in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()
    with pytest.raises(CorruptCheckpoint, match=reason):
        read_checkpoint(bad)


def test_each_corrupt_file_is_reported_once(tmp_path: Path) -> None:
    reports: list[Path] = []
    store = CheckpointStore(tmp_path, keep=2, on_corrupt=lambda path, why: reports.append(path), clock=make_clock())
    store.save({"x": 1}, step=1)
    bad = store.save({"x": 2}, step=2)
    _corrupt(bad, "wrong_checksum")
    store.load_latest()
    store.load_latest()
    assert store.latest_step == 1
    store.save({"x": 3}, step=3)  # pruning looks at the same file again
    assert reports == [bad]


def test_all_corrupt_loads_nothing(tmp_path: Path) -> None:
    reports: list[Path] = []
    store = CheckpointStore(tmp_path, keep=3, on_corrupt=lambda path, why: reports.append(path), clock=make_clock())
    paths = [store.save({"x": step}, step=step) for step in range(3)]
    for path in paths:
        _corrupt(path, "truncated")
    assert store.load_latest() is None
    assert sorted(reports) == sorted(paths)


def test_a_renamed_file_whose_header_disagrees_is_refused(tmp_path: Path) -> None:
    reports: list[str] = []
    store = CheckpointStore(tmp_path, keep=5, on_corrupt=lambda path, why: reports.append(why), clock=make_clock())
    store.save({"x": 1}, step=1)
    two = store.save({"x": 2}, step=2)
    two.rename(tmp_path / two.name.replace("000000000002", "000000000009"))
    loaded = store.load_latest()
    assert loaded is not None and loaded.step == 1
    assert reports == ["file name says step 9, header says step 2"]


def test_a_failing_on_corrupt_callback_does_not_stop_the_fallback(tmp_path: Path) -> None:
    def broken(path: Path, reason: str) -> None:
        raise RuntimeError("metrics backend down")

    store = CheckpointStore(tmp_path, keep=5, on_corrupt=broken, clock=make_clock())
    store.save({"x": 1}, step=1)
    _corrupt(store.save({"x": 2}, step=2), "empty")
    loaded = store.load_latest()
    assert loaded is not None and loaded.step == 1


# ----------------------------------------------------------------------------------------
# unwritable or full directory: a clear error, nothing partial left, the next save works


def test_directory_under_a_regular_file_raises_write_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    store = CheckpointStore(blocker / "checkpoints")
    with pytest.raises(CheckpointWriteError, match="not-a-directory/checkpoints") as caught:
        store.save({"x": 1}, step=1)
    assert isinstance(caught.value.cause, OSError)
    assert store.load_latest() is None


@pytest.mark.parametrize("failing_call", ["open", "fsync", "replace"])
def test_disk_full_leaves_nothing_and_the_retry_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing_call: str
) -> None:
    store = CheckpointStore(tmp_path, clock=make_clock())
    previous = store.save({"x": 1}, step=1)
    real = getattr(os, failing_call)

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        if failing_call == "fsync" or str(args[0]).endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, failing_call, disk_full)
    with pytest.raises(CheckpointWriteError, match="No space left on device") as caught:
        store.save({"x": 2}, step=2)
    assert caught.value.step == 2 and caught.value.directory == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == [previous.name]

    monkeypatch.undo()
    retried = store.save({"x": 2}, step=2)
    loaded = store.load_latest()
    assert loaded is not None and loaded.path == retried and loaded.state == {"x": 2}


def test_bad_arguments_to_save_are_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError, match="step"):
        store.save({}, step=-1)
    with pytest.raises(TypeError, match="dict"):
        store.save([1, 2], step=1)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------
# what the mutation run asked: messages, names, the verdict cache, chains, stale temp files


def small_window_chain(tmp_path: Path, store: CheckpointStore, saves: int) -> list[Path]:
    """``saves`` checkpoints of a small window: a base, then deltas on it."""
    window = RecencyWindow(20, rng=np.random.default_rng(0))
    chain, paths = WindowChain(), []
    for step in range(saves):
        batch = EventBatch(
            sensor_ids=np.array([f"s{step}-{i}" for i in range(5)], dtype=object),
            ts=np.full(5, float(step)),
            labels=np.zeros(5, np.int64),
            lengths=np.ones(5, np.int64),
            values=np.full((5, 1), step, np.float32),
            partitions=np.zeros(5, np.int32),
            offsets=np.arange(5 * step, 5 * step + 5),
        )
        window.insert_batch(batch, {0: 5 * step + 5})
        pending = chain.window_state(window.capture_state(), tmp_path)
        paths.append(store.save({"window": pending.state, "step": step}, step=step))
        chain.written(pending, paths[-1])
    return paths


def test_the_store_logs_what_it_writes_and_reads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    store = CheckpointStore(tmp_path, clock=make_clock(1234.5678))
    base, delta = small_window_chain(tmp_path, store, 2)
    assert base.name == "ckpt-000000000000-1234567.stck"  # the creation time in milliseconds
    loaded = store.load_latest()
    assert loaded is not None and (loaded.path, loaded.created_at) == (delta, 1235.5678)
    assert [record.getMessage() for record in caplog.records] == [
        f"wrote checkpoint {base} (step 0, {base.stat().st_size} bytes)",
        f"wrote checkpoint {delta} (step 1, {delta.stat().st_size} bytes)",
        f"read checkpoint {delta.name} as a base and 1 window deltas",
        f"loaded checkpoint {delta} (step 1)",
    ]
    infos = store.list()
    assert [(i.path, i.step, i.created_at, i.size_bytes) for i in infos] == [
        (delta, 1, 1235.567, delta.stat().st_size),
        (base, 0, 1234.567, base.stat().st_size),
    ]


def test_each_file_is_read_once_and_only_when_its_verdict_or_contents_are_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    read_link = store_module.read_checkpoint_link
    monkeypatch.setattr(
        store_module, "read_checkpoint_link", lambda path: reads.append(Path(path).name) or read_link(path)
    )
    store = CheckpointStore(tmp_path, keep=3, clock=make_clock())
    paths = small_window_chain(tmp_path, store, 4)  # each save prunes: it verifies the files it keeps
    assert store.latest_step == 3 and reads == []  # what it wrote is known good
    assert store.load_latest() is not None
    assert paths[-1].name in reads and len(reads) == len(set(reads))  # each link of its chain once
    reads.clear()
    assert store.latest_step == 3 and reads == []
    reader = CheckpointStore(tmp_path)  # knows nothing yet: it reads what it verifies, once
    assert reader.latest_step == 3 and reader.latest_step == 3
    assert paths[-1].name in reads and len(reads) == len(set(reads))
    reads.clear()
    assert CheckpointStore(tmp_path).load_latest() is not None
    assert paths[-1].name in reads and len(reads) == len(set(reads))  # verifying it read the contents too


def test_removing_a_file_another_process_already_deleted_is_silent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    CheckpointStore(tmp_path)._remove(tmp_path / "ckpt-000000000001-1.stck")
    assert caplog.records == []


def test_a_file_damaged_without_changing_its_size_or_time_is_caught_when_read(tmp_path: Path) -> None:
    """The verdict cache keys on (size, mtime, inode); a bit flipped in place with the mtime put back
    is found by the digest when the contents are read, and remembered from then on."""
    reports: list[tuple[Path, str]] = []
    store = CheckpointStore(tmp_path, on_corrupt=lambda path, why: reports.append((path, why)), clock=make_clock())
    path = store.save({"x": 1}, step=1)
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    with open(path, "r+b") as file:
        file.write(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert store.load_latest() is None and store.load_latest() is None and store.load_latest() is None
    digest = "SHA-256 mismatch: the contents changed after writing (bit rot or partial overwrite)"
    assert reports == [(path, digest), (path, digest)]  # when read, and when first inspected again


def test_a_broken_chain_is_reported_once_with_its_links_reason(tmp_path: Path) -> None:
    reports: list[tuple[str, str]] = []
    store = CheckpointStore(tmp_path, keep=5, clock=make_clock())
    base, delta = small_window_chain(tmp_path, store, 2)
    _flip_byte(base, offset=-3)
    reader = CheckpointStore(tmp_path, on_corrupt=lambda path, why: reports.append((path.name, why)))
    assert reader.load_latest() is None and reader.load_latest() is None
    digest = "SHA-256 mismatch: the contents changed after writing (bit rot or partial overwrite)"
    assert reports == [(base.name, digest), (delta.name, f"its window builds on {base.name}: {digest}")]


def test_a_skipped_file_is_logged_with_its_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    bad = CheckpointStore(tmp_path).save({"x": 1}, step=1)
    _corrupt(bad, "empty")
    assert CheckpointStore(tmp_path).load_latest() is None
    assert [record.getMessage() for record in caplog.records] == [
        f"skipping corrupt checkpoint {bad}: empty file; falling back to an older one"
    ]


def test_a_file_that_cannot_be_read_is_reported_as_unreadable(tmp_path: Path) -> None:
    reports: list[tuple[Path, str]] = []
    store = CheckpointStore(tmp_path, on_corrupt=lambda path, why: reports.append((path, why)))
    missing = tmp_path / "ckpt-000000000001-1.stck"
    assert store.read(missing) is None
    assert reports == [(missing, f"unreadable: [Errno 2] No such file or directory: '{missing}'")]
    (tmp_path / "ckpt-000000000002-1.stck").mkdir()
    with pytest.raises(CorruptCheckpoint) as refused:
        read_checkpoint_link(tmp_path / "ckpt-000000000002-1.stck")
    assert refused.value.path == tmp_path / "ckpt-000000000002-1.stck"
    assert refused.value.reason.startswith("unreadable: [Errno 21] Is a directory")


def test_the_default_keeps_three_and_the_directory_may_be_nested(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "a" / "b", clock=make_clock())
    for step in range(5):
        store.save({"x": step}, step=step)
    assert [info.step for info in store.list()] == [4, 3, 2]


@pytest.mark.parametrize(
    ("step", "state", "error", "message"),
    [
        (True, {}, ValueError, "step=True: a checkpoint step must be a non-negative int"),
        (1.5, {}, ValueError, "step=1.5: a checkpoint step must be a non-negative int"),
        (1, [1], TypeError, "state is a list; a checkpoint state must be a dict"),
    ],
)
def test_save_refuses_a_bad_step_or_state_by_name(
    tmp_path: Path, step: Any, state: Any, error: type, message: str
) -> None:
    with pytest.raises(error) as refused:
        CheckpointStore(tmp_path).save(state, step=step)
    assert str(refused.value) == message
    assert list(tmp_path.iterdir()) == []


def test_write_errors_say_what_to_do(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointWriteError) as caught:
        CheckpointStore(blocker / "checkpoints").save({"x": 1}, step=3)
    assert str(caught.value) == (
        f"could not write the step-3 checkpoint to {blocker / 'checkpoints'}: {caught.value.cause}. Free space on "
        "that volume or make the directory writable by the service user (STREAMTRAIN_CHECKPOINT_DIR)."
    )


def test_what_goes_wrong_around_a_save_is_logged_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = CheckpointStore(tmp_path, keep=1, clock=make_clock())
    high = store.save({"run": 1}, step=100)
    low = store.save({"run": 2}, step=5)
    assert [record.getMessage() for record in caplog.records] == [
        f"saved {low.name}, but {high.name} sorts after it (higher step); load_latest will prefer that one. "
        "Give each run its own checkpoint directory."
    ]
    caplog.clear()
    directory = tmp_path / "ckpt-000000000001-1.stck"
    directory.mkdir()  # not a file: cannot be deleted as one
    store.save({"run": 3}, step=101)
    assert [record.getMessage() for record in caplog.records] == [
        f"could not delete old checkpoint file {directory}: [Errno 21] Is a directory: '{directory}'"
    ]
    caplog.clear()

    def unlistable(path: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "scandir", unlistable)
    saved = store.save({"run": 4}, step=102)
    assert saved.exists()  # written; only the pruning failed
    assert store.load_latest() is None
    assert [record.getMessage() for record in caplog.records] == [
        f"could not prune checkpoint directory {tmp_path}: [Errno 13] Permission denied",
        f"cannot list checkpoint directory {tmp_path} ([Errno 13] Permission denied); starting without a checkpoint",
    ]


def test_a_failing_callback_is_logged_with_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def broken(path: Path, reason: str) -> None:
        raise RuntimeError("metrics backend down")

    caplog.set_level(logging.ERROR, logger=LOGGER)
    store = CheckpointStore(tmp_path, on_corrupt=broken, clock=make_clock())
    bad = store.save({"x": 2}, step=2)
    _corrupt(bad, "empty")
    assert CheckpointStore(tmp_path, on_corrupt=broken).load_latest() is None
    assert [record.getMessage() for record in caplog.records] == [f"on_corrupt callback failed for {bad}"]


def test_a_vanished_entry_does_not_hide_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path, keep=5, clock=make_clock())
    saved = [store.save({"x": step}, step=step) for step in (1, 2)]
    (tmp_path / "ckpt-000000000009-1.stck").symlink_to(tmp_path / "gone")  # listed, then cannot be stat'ed
    scandir = os.scandir  # the dangling entry listed first
    monkeypatch.setattr(os, "scandir", lambda path: sorted(scandir(path), key=lambda entry: not entry.is_symlink()))
    assert [info.path for info in store.list()] == saved[::-1]


def test_temp_files_of_live_writers_stay_and_their_writers_are_not_signalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    child = (
        "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); print('ready', flush=True); time.sleep(60)"
    )
    sleeper = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)  # SIGHUP would end it
    try:
        assert sleeper.stdout is not None and sleeper.stdout.readline() == "ready\n"
        live = tmp_path / f".ckpt-000000000000-1.stck.{sleeper.pid}.tmp"
        live.write_bytes(b"partial")
        CheckpointStore(tmp_path).save({"x": 1}, step=1)
        assert live.exists()  # kept: a live process may still be writing it
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=1.0)  # and the writer untouched: asked with signal 0 only
    finally:
        sleeper.kill()
        sleeper.wait()
    for error, kept in ((PermissionError(errno.EPERM, "not ours"), True), (OSError(errno.EINVAL, "bad pid"), False)):
        temp = tmp_path / ".ckpt-000000000000-2.stck.999999.tmp"
        temp.write_bytes(b"partial")

        def kill(pid: int, signal: int, error: OSError = error) -> None:
            raise error

        monkeypatch.setattr(os, "kill", kill)
        CheckpointStore(tmp_path).save({"x": 2}, step=2)
        monkeypatch.undo()
        assert temp.exists() == kept  # another user's live process may be writing it; a bad pid is gone
