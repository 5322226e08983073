"""The manifest: it lists the cut, and verifying against it catches any flipped bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sharded_cluster import (
    TOPIC,
    damage_section,
    two_checkpoints,
)

from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.manifest import read_manifest, verify_checkpoint
from streamtrain.checkpoint.rescale import restore_share


def test_manifest_lists_the_cut(tmp_path: Path) -> None:
    topic, _, newer = two_checkpoints(tmp_path)
    record = json.loads((newer / "manifest.json").read_text())
    assert record["ownership"] == {"rule": "modulo", "version": 1, "world_size": 2, "partition_count": 3}
    assert record["topic"] == TOPIC and record["step"] == 9
    assert [s["partitions"] for s in record["shards"]] == [[0, 2], [1]]
    assert sum(s["items"] for s in record["shards"]) == 200
    assert record["next_offsets"] == {str(p): len(e) for p, e in enumerate(topic.events)}
    assert record["window"] == {"channels": 1, "capacity": 10_000, "half_life_s": None}  # both shares
    for entry in [record["common"], *record["shards"]]:
        assert len(entry["sha256"]) == 64 and (newer / entry["file"]).stat().st_size == entry["size"]


def test_verify_catches_a_flip_in_a_section_no_reader_needed(tmp_path: Path) -> None:
    _, _, newer = two_checkpoints(tmp_path)
    manifest = read_manifest(newer)
    damage_section(newer)
    restore_share(manifest, rank=0, world_size=2, partition_count=3, topic=TOPIC)  # rank 0 never reads shard 1
    with pytest.raises(CorruptCheckpoint, match="SHA-256"):
        verify_checkpoint(newer)
    with pytest.raises(CorruptCheckpoint, match="SHA-256"):
        restore_share(manifest, rank=1, world_size=2, partition_count=3, topic=TOPIC)
