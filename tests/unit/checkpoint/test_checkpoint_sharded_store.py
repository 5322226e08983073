"""The store of sharded checkpoints: pruning deletes the manifest first; export reads either kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sharded_cluster import (
    TOPIC,
    Topic,
    damage_common,
    mixed_directory,
    one_rank_window,
    save_one_rank,
)

from streamtrain.checkpoint import sharded_store
from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext


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
