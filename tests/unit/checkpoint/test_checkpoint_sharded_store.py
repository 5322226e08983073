"""The store of sharded checkpoints: pruning deletes the manifest first; export reads either kind."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from sharded_cluster import (
    TOPIC,
    Topic,
    damage_common,
    mixed_directory,
    one_rank_window,
    save_chain,
    save_one_rank,
)

from streamtrain.checkpoint import sharded_store
from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.window.reservoir import RecencyWindow


def test_prune_keeps_the_newest_complete_and_deletes_the_manifest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = Topic(partitions=3)
    topic.produce(30)
    window = one_rank_window(topic)
    store = ShardedCheckpointStore(tmp_path, keep=2)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    leftover = store.create_directory(1, 1)  # an attempt that never got its manifest
    (leftover / "shard-00000.stsh").write_bytes(b"half")
    future = store.create_directory(999, 1)  # newer than anything written: left alone
    results = [save_one_rank(checkpointer, window, step) for step in (2, 3, 4, 5)]
    assert all(r.ok and r.error is None for r in results)
    assert results[-1].next_offsets == window.next_offsets
    names = [info.path.name for info in store.scan()]
    assert names == [future.name, results[-1].path.name, results[-2].path.name]
    assert [m.step for m in store.manifests()] == [5, 4]

    # a deletion that dies after removing the manifest leaves no "complete" checkpoint behind
    def crash(path: object) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(sharded_store.shutil, "rmtree", crash)
    with pytest.raises(OSError):
        store.delete(results[-2].path)
    assert [m.step for m in store.manifests()] == [5]


def test_export_reads_the_newest_shared_state_of_either_kind(tmp_path: Path) -> None:
    _, window, single_file, checkpointer = mixed_directory(tmp_path)
    assert sharded_store.load_latest_common(tmp_path) is None
    single_file.save({"window": window.state_dict(), "trainer": {"step": 1}}, step=1)
    assert checkpointer.save(
        step=2, partition_count=3, window_state=window.state_dict(), common_state={"trainer": {"step": 2}}
    ).ok
    loaded = sharded_store.load_latest_common(tmp_path)
    assert loaded is not None and loaded.step == 2 and loaded.state == {"trainer": {"step": 2}}
    damage_common(checkpointer.store.manifests()[0].directory)
    loaded = sharded_store.load_latest_common(tmp_path)
    assert loaded is not None and loaded.step == 1 and loaded.state["trainer"] == {"step": 1}


def test_the_newest_model_configuration_is_read_from_either_kind_and_an_unreadable_header_is_passed_over(
    tmp_path: Path,
) -> None:
    _, window, single_file, checkpointer = mixed_directory(tmp_path)
    assert sharded_store.newest_model_config(tmp_path) is None
    assert sharded_store.newest_model_config(tmp_path / "missing") is None
    single_file.save({"window": window.state_dict(), "trainer": {"model_config": {"n_heads": 3}}}, step=1)
    assert sharded_store.newest_model_config(tmp_path) == {"n_heads": 3}
    common = {"trainer": {"model_config": {"n_heads": 2, "form": "f"}, "weights": torch.ones(4)}}
    assert checkpointer.save(step=2, partition_count=3, window_state=window.state_dict(), common_state=common).ok
    assert sharded_store.newest_model_config(tmp_path) == {"n_heads": 2, "form": "f"}
    manifest = checkpointer.store.manifests()[0]
    (manifest.directory / manifest.common["file"]).write_bytes(b"not a checkpoint")
    assert sharded_store.newest_model_config(tmp_path) == {"n_heads": 3}


def test_keep_is_a_positive_count_three_by_default(tmp_path: Path) -> None:
    assert ShardedCheckpointStore(tmp_path).keep == 3
    assert ShardedCheckpointStore(tmp_path, keep=1).keep == 1
    for bad in (0, True, 2.0, "3"):
        with pytest.raises(ValueError) as err:
            ShardedCheckpointStore(tmp_path, keep=bad)  # type: ignore[arg-type]
        assert str(err.value) == f"keep={bad!r}: keep at least 1 checkpoint"


def test_a_checkpoint_directory_is_made_private_under_a_root_made_as_needed(tmp_path: Path) -> None:
    store = ShardedCheckpointStore(tmp_path / "a" / "b")
    path = store.create_directory(7, 1234)
    assert path == tmp_path / "a" / "b" / "chk-000000000007-1234" and path.is_dir()
    assert store.create_directory(7, 1234) == path  # every rank calls it: the second finds it
    assert (path.stat().st_mode & 0o777, store.root.stat().st_mode & 0o777) == (0o700, 0o700)


def test_scan_reads_names_newest_first_and_passes_over_what_is_not_a_checkpoint_directory(tmp_path: Path) -> None:
    store = ShardedCheckpointStore(tmp_path / "root")
    assert store.scan() == []  # no root yet
    older, newer_same_step, newest = (store.create_directory(s, ms) for s, ms in ((3, 900), (3, 1000), (4, 5)))
    (newest / "manifest.json").write_text("{}")
    (store.root / "chk-000000000009-1").write_text("a file")
    (store.root / "notes").mkdir()
    (store.root / "chk-000000000008-1").symlink_to(older, target_is_directory=True)
    infos = store.scan()
    assert [(i.path, i.step, i.created_ms, i.complete) for i in infos] == [
        (newest, 4, 5, True),
        (newer_same_step, 3, 1000, False),
        (older, 3, 900, False),
    ]


def test_a_damaged_manifest_is_reported_once_and_a_failing_callback_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[Path, str]] = []

    def on_corrupt(path: Path, reason: str) -> None:
        seen.append((path, reason))
        raise RuntimeError("alerting is down")

    store = ShardedCheckpointStore(tmp_path, on_corrupt=on_corrupt)
    damaged = store.create_directory(2, 1)
    (damaged / "manifest.json").write_text("not json")
    with caplog.at_level(logging.WARNING, logger=sharded_store.__name__):
        assert store.manifests() == [] and store.manifests() == []
    [(path, reason)] = seen
    assert path == damaged and reason
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert messages == [
        (logging.WARNING, f"skipping checkpoint {damaged}: {reason}; falling back to an older one"),
        (logging.ERROR, f"on_corrupt callback failed for {damaged}"),
    ]
    store.report_corrupt(CorruptCheckpoint(damaged, "another reason"))
    assert seen[-1] == (damaged, "another reason")  # a new reason for the same checkpoint is news


def chain_of_seven(root: Path) -> list[Path]:
    """base, 3 deltas, base, 2 deltas: written by a store that prunes nothing."""
    window = RecencyWindow(60, 30.0, rng=np.random.default_rng(2))
    paths, kinds = save_chain(ShardedCheckpointStore(root, keep=100), Topic(partitions=3, seed=4), window, 7)
    assert kinds == ["base", "delta", "delta", "delta", "base", "delta", "delta"]
    return paths


def test_prune_returns_what_it_deleted_keeping_each_chain_a_kept_checkpoint_needs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = chain_of_seven(tmp_path)
    leftover = ShardedCheckpointStore(tmp_path).create_directory(0, 1)  # an attempt older than all
    assert ShardedCheckpointStore(tmp_path, keep=2).prune(tmp_path / "elsewhere") == []  # not one of ours
    # keep 2: the newest two build on one base; the whole older chain stays as a restore point beside it
    assert ShardedCheckpointStore(tmp_path, keep=2).prune(paths[-1]) == [leftover]
    # keep 1: the newest and the base and delta it builds on; the older chain goes, newest first
    with caplog.at_level(logging.WARNING, logger=sharded_store.__name__):
        assert ShardedCheckpointStore(tmp_path, keep=1).prune(paths[-1]) == paths[3::-1]
    assert caplog.records == []  # nothing sorts after the checkpoint just written
    assert [info.path for info in ShardedCheckpointStore(tmp_path).scan()] == paths[:3:-1]


def test_prune_keeps_and_names_a_checkpoint_newer_than_the_one_just_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = chain_of_seven(tmp_path)
    store = ShardedCheckpointStore(tmp_path, keep=1)
    with caplog.at_level(logging.WARNING, logger=sharded_store.__name__):
        deleted = store.prune(paths[4])  # as if base 4 had just been written, with 5 and 6 already there
    assert [r.getMessage() for r in caplog.records] == [
        f"checkpoint {p.name} sorts after the one just written ({paths[4].name}); restore will prefer it. "
        "Give each run its own checkpoint directory."
        for p in (paths[6], paths[5])
    ]
    assert deleted == paths[3::-1]  # 5 and 6 kept (and what they build on: 4), the older chain deleted


def test_a_checkpoint_that_cannot_be_deleted_is_logged_and_the_rest_still_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    paths = chain_of_seven(tmp_path)
    store = ShardedCheckpointStore(tmp_path, keep=1)
    delete = store.delete

    def stuck(path: Path) -> None:
        if path == paths[2]:
            raise OSError("device busy")
        delete(path)

    monkeypatch.setattr(store, "delete", stuck)
    with caplog.at_level(logging.WARNING, logger=sharded_store.__name__):
        assert store.prune(paths[-1]) == [paths[3], paths[1], paths[0]]
    assert [r.getMessage() for r in caplog.records] == [f"could not delete old checkpoint {paths[2]}: device busy"]


def test_the_newest_of_either_kind_is_by_step_then_by_creation_time(tmp_path: Path) -> None:
    _, window, single_file, checkpointer = mixed_directory(tmp_path)
    assert checkpointer.save(
        step=2, partition_count=3, window_state=window.state_dict(), common_state={"trainer": {"step": 2}}
    ).ok
    time.sleep(0.01)
    single_file.save({"window": window.state_dict(), "trainer": {"step": 1}}, step=1)  # written later, older step
    loaded = sharded_store.load_latest_common(tmp_path)
    assert loaded is not None and loaded.step == 2
    time.sleep(0.01)
    single_file.save({"window": window.state_dict(), "trainer": {"step": "2 again"}}, step=2)  # same step, later
    loaded = sharded_store.load_latest_common(tmp_path)
    assert loaded is not None and loaded.state["trainer"] == {"step": "2 again"}


def test_a_tie_of_step_and_millisecond_between_the_kinds_reads_one_of_them(tmp_path: Path) -> None:
    _, window, _, checkpointer = mixed_directory(tmp_path)
    CheckpointStore(tmp_path, clock=lambda: 100.0).save({"window": window.state_dict(), "trainer": {"kind": 1}}, step=2)
    common = {"trainer": {"kind": "sharded"}}
    assert checkpointer.save(
        step=2, partition_count=3, window_state=window.state_dict(), common_state=common, clock=lambda: 100.0
    ).ok
    loaded = sharded_store.load_latest_common(tmp_path)
    assert loaded is not None and loaded.state["trainer"] == {"kind": "sharded"}  # listed first, kept first


def test_the_keep_newest_complete_checkpoints_stay_beside_the_one_just_written(tmp_path: Path) -> None:
    topic = Topic(partitions=3)
    topic.produce(30)
    window = one_rank_window(topic)
    store = ShardedCheckpointStore(tmp_path, keep=3)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    results = [save_one_rank(checkpointer, window, step) for step in range(5)]  # bases: each needs only itself
    assert [info.path for info in store.scan()] == [r.path for r in results[:1:-1]]
