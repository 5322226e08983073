"""Shard files: a rank writes only what it owns, and reading one never unpickles."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
from sharded_cluster import (
    TOPIC,
    Cluster,
    Topic,
    two_checkpoints,
)

from streamtrain.checkpoint.manifest import read_manifest
from streamtrain.checkpoint.rescale import restore_share
from streamtrain.checkpoint.shards import write_shard
from streamtrain.distributed.ownership import Ownership


def test_a_rank_cannot_save_partitions_it_does_not_own(tmp_path: Path) -> None:
    topic = Topic(partitions=2)
    topic.produce(20)
    one = Cluster(1, 1000, math.inf)
    one.consume(topic)
    with pytest.raises(ValueError, match=r"partitions \[1\] that it does not own"):
        write_shard(
            tmp_path, step=0, rank=0, ownership=Ownership(2, 2), topic=TOPIC, window_state=one.windows[0].state_dict()
        )


def test_nothing_is_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, newer = two_checkpoints(tmp_path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint read tried to unpickle")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    share = restore_share(read_manifest(newer), rank=0, world_size=1, partition_count=3, topic=TOPIC)
    assert len(share.window_state["lengths"]) == 200
