"""The collective checkpointer (one rank here): the manifest rule, fallback past damage, vetoes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from sharded_cluster import (
    TOPIC,
    Topic,
    damage_common,
    damage_section,
    flip,
    mixed_directory,
    one_rank_window,
    save_one_rank,
    two_checkpoints,
)

from streamtrain.checkpoint import collective
from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.manifest import read_manifest, verify_checkpoint
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.window.reservoir import RecencyWindow


def _damage_index(d: Path) -> None:
    flip(d / "shard-00000.stsh", 60 / (d / "shard-00000.stsh").stat().st_size)


def _truncate_shard(d: Path) -> None:
    path = d / "shard-00001.stsh"
    path.write_bytes(path.read_bytes()[:-10])


def _lose_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _garble_manifest(d: Path) -> None:
    (d / "manifest.json").write_text('{"format": "streamtrain.sharded-checkpoint", "version": 1, "step": 9')


def _tamper_manifest(d: Path) -> None:  # valid JSON, plausible numbers: only the digest tells
    path = d / "manifest.json"
    path.write_text(path.read_text().replace('"partition_count": 3', '"partition_count": 7'))


def _lose_shard(d: Path) -> None:
    (d / "shard-00000.stsh").unlink()


DAMAGES = [
    damage_section,
    _damage_index,
    damage_common,
    _truncate_shard,
    _lose_manifest,
    _garble_manifest,
    _tamper_manifest,
    _lose_shard,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__.strip("_") for d in DAMAGES])
def test_restore_falls_back_past_an_incomplete_or_damaged_checkpoint(tmp_path: Path, damage: Any) -> None:
    topic, older, newer = two_checkpoints(tmp_path)
    damage(newer)
    reported: list[tuple[Path, str]] = []
    store = ShardedCheckpointStore(tmp_path, on_corrupt=lambda path, reason: reported.append((path, reason)))
    share = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC).restore(partition_count=3)
    assert share is not None and share.step == 5 and share.path == older
    if damage is not _lose_manifest:  # a missing manifest is not damage, just not a checkpoint
        assert len(reported) == 1 and newer in (reported[0][0], *reported[0][0].parents)
        with pytest.raises(CorruptCheckpoint):
            verify_checkpoint(newer)
    verify_checkpoint(older)


def test_a_failed_write_seals_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topic = Topic(partitions=3)
    topic.produce(30)
    window = one_rank_window(topic)
    store = ShardedCheckpointStore(tmp_path)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    assert save_one_rank(checkpointer, window, 1).ok

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(collective, "write_shard", full_disk)
    failed = save_one_rank(checkpointer, window, 2)
    assert not failed.ok and "No space left" in (failed.error or "") and failed.next_offsets == {}
    assert not (failed.path / "manifest.json").exists()
    monkeypatch.undo()
    vetoed = checkpointer.save(
        step=2,
        partition_count=3,
        window_state=window.state_dict(),
        common_state={},
        veto="dead letters not acknowledged",
    )
    assert not vetoed.ok and "dead letters not acknowledged" in (vetoed.error or "")
    assert [m.step for m in store.manifests()] == [1]
    assert checkpointer.restore(partition_count=3).step == 1  # type: ignore[union-attr]
    assert save_one_rank(checkpointer, window, 3).ok


def test_no_checkpoint_means_none(tmp_path: Path) -> None:
    checkpointer = DistributedCheckpointer(
        ShardedCheckpointStore(tmp_path / "empty"), Collectives(DistContext()), topic=TOPIC
    )
    assert checkpointer.restore(partition_count=3) is None


def test_the_newest_checkpoint_of_either_kind_is_restored(tmp_path: Path) -> None:
    topic, window, single_file, checkpointer = mixed_directory(tmp_path)
    assert save_one_rank(checkpointer, window, 10).ok
    single_file.save({"window": window.state_dict(), "trainer": {"step": 20}}, step=20)
    share = checkpointer.restore(partition_count=None, single_file=single_file)
    assert share is not None and share.step == 20 and share.loaded is not None  # the one-file one is newer
    assert save_one_rank(checkpointer, window, 30).ok
    share = checkpointer.restore(partition_count=None, single_file=single_file)
    assert share is not None and share.step == 30 and share.loaded is None and share.common == {"trainer": {"step": 30}}
    # a damaged newest one-file checkpoint falls back to the sharded one before it, and is reported
    newest = single_file.save({"window": window.state_dict(), "trainer": {"step": 40}}, step=40)
    flip(newest, 0.5)
    reported: list[Path] = []
    single_file.on_corrupt = lambda path, reason: reported.append(path)
    share = checkpointer.restore(partition_count=None, single_file=single_file)
    assert share is not None and share.step == 30 and reported == [newest]
    again = RecencyWindow(10_000, math.inf)
    again.load_state_dict(share.window_state)
    assert sorted(zip(again.snapshot().partitions.tolist(), again.snapshot().offsets.tolist())) == sorted(topic.sent())


def test_the_window_ledger_survives_an_unchanged_restore(tmp_path: Path) -> None:
    topic = Topic(partitions=2, seed=3)
    topic.produce(40)
    window = one_rank_window(topic)
    window.advance_offsets({0: 999}, rejected={"decode": 2, "schema": 1})
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(tmp_path), Collectives(DistContext()), topic=TOPIC)
    assert checkpointer.save(step=1, partition_count=2, window_state=window.state_dict(), common_state={}).ok
    share = checkpointer.restore(partition_count=2)
    assert share is not None
    again = RecencyWindow(10_000, math.inf)
    again.load_state_dict(share.window_state)
    assert (again.seen_total, again.accepted_total, again.rejected_total) == (
        window.seen_total,
        window.accepted_total,
        window.rejected_total,
    )


def test_the_partition_count_covers_what_the_window_holds(tmp_path: Path) -> None:
    """A rank that has not yet heard the topic's partition count still writes a valid checkpoint."""
    topic = Topic(partitions=3, seed=4)
    topic.produce(30)
    window = one_rank_window(topic)
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(tmp_path), Collectives(DistContext()), topic=TOPIC)
    result = checkpointer.save(step=1, partition_count=0, window_state=window.state_dict(), common_state={})
    assert result.ok
    assert read_manifest(result.path).partition_count == 3
