"""The collective checkpointer (one rank here): the manifest rule, fallback past damage, vetoes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from sharded_cluster import (
    TOPIC,
    Cluster,
    Topic,
    damage_common,
    damage_section,
    flip,
    mixed_directory,
    one_rank_window,
    save_one_rank,
    two_checkpoints,
)
from thread_ranks import on_ranks

from streamtrain.checkpoint import collective
from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.manifest import read_manifest, verify_checkpoint
from streamtrain.checkpoint.rescale import CheckpointMismatch
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.store import CheckpointStore
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
    window.advance_offsets({0: 999}, rejected={"decode": 2, "schema": 1}, held_out=5)
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(tmp_path), Collectives(DistContext()), topic=TOPIC)
    assert checkpointer.save(step=1, partition_count=2, window_state=window.state_dict(), common_state={}).ok
    share = checkpointer.restore(partition_count=2)
    assert share is not None
    again = RecencyWindow(10_000, math.inf)
    again.load_state_dict(share.window_state)
    assert (again.seen_total, again.accepted_total, again.rejected_total, again.held_out_total) == (
        window.seen_total,
        window.accepted_total,
        window.rejected_total,
        5,
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


# ------------------------------------------------------------------ several ranks, in threads of this process


def _windows(topic: Topic, world: int) -> list[RecencyWindow]:
    windows = [RecencyWindow(10_000, math.inf) for _ in range(world)]
    for rank, window in enumerate(windows):
        Cluster.consume_into(window, topic, rank=rank, world_size=world)
    return windows


def _consumed_by_two(partitions: int, seed: int, events: int) -> list[RecencyWindow]:
    topic = Topic(partitions, seed=seed)
    topic.produce(events)
    return _windows(topic, 2)


def test_two_ranks_seal_one_checkpoint_and_restore_it_together(tmp_path: Path) -> None:
    windows = _consumed_by_two(3, 21, 90)
    store = ShardedCheckpointStore(tmp_path)

    def save(rank: int, c: Any) -> Any:
        checkpointer = DistributedCheckpointer(store, c, topic=TOPIC)
        first = checkpointer.save(
            step=4, partition_count=3 - rank, window_state=windows[rank].capture_state(),
            common_state={"trainer": {"step": 4}} if rank == 0 else None, clock=lambda: 1000.0 + rank,
        )  # fmt: skip
        second = checkpointer.save(
            step=5, partition_count=3, window_state=windows[rank].capture_state(),
            common_state={"trainer": {"step": 5}} if rank == 0 else None, clock=lambda: 1001.0,
        )  # fmt: skip
        return first, second

    results = on_ranks(2, save)
    for rank, (first, second) in enumerate(results):
        assert first.ok and first.error is None and first.step == 4 and (first.kind, second.kind) == ("base", "delta")
        assert first.path.name == "chk-000000000004-1000000"  # rank 0's clock names it
        assert first.next_offsets == {int(p): o for p, o in windows[rank].state_dict()["next_offsets"].items()}
        assert first.shard_bytes == (first.path / f"shard-{rank:05d}.stsh").stat().st_size
    manifest = read_manifest(results[0][1].path)
    assert manifest.partition_count == 3 and manifest.world_size == 2  # the largest count any rank gave
    shares = on_ranks(2, lambda rank, c: DistributedCheckpointer(store, c, topic=TOPIC).restore(partition_count=None))
    assert [(s.step, s.owned_partitions, s.topology_changed) for s in shares] == [(5, [0, 2], False), (5, [1], False)]
    assert [s.common for s in shares] == [{"trainer": {"step": 5}}] * 2
    for share, window in zip(shares, windows, strict=True):
        assert sorted(share.window_state["offsets"].tolist()) == sorted(window.state_dict()["offsets"].tolist())


def test_a_rank_that_cannot_write_fails_the_checkpoint_on_every_rank(tmp_path: Path) -> None:
    windows = _consumed_by_two(2, 22, 40)
    store = ShardedCheckpointStore(tmp_path)

    def save(rank: int, c: Any) -> Any:
        return DistributedCheckpointer(store, c, topic=TOPIC).save(
            step=3, partition_count=2, window_state=windows[rank].state_dict(),
            common_state={} if rank == 0 else None, veto="its dead letters are not acknowledged" if rank else None,
            clock=lambda: 7.0,
        )  # fmt: skip

    zero, one = on_ranks(2, save)
    directory = "chk-000000000003-7000"
    assert not zero.ok and not one.ok and zero.next_offsets == one.next_offsets == {}
    assert (zero.shard_bytes, one.shard_bytes) == (0, 0)
    assert zero.error == f"ranks [1] could not write their shards of {directory}"
    assert one.error == (
        f"rank 1 could not write its part of checkpoint {directory}: "
        "RuntimeError: its dead letters are not acknowledged"
    )
    assert not (tmp_path / directory / "manifest.json").exists()
    assert on_ranks(2, lambda rank, c: DistributedCheckpointer(store, c, topic=TOPIC).restore(partition_count=2)) == [
        None,
        None,
    ]


def test_ranks_at_different_steps_refuse_to_cut(tmp_path: Path) -> None:
    store = ShardedCheckpointStore(tmp_path)
    window = RecencyWindow(10, math.inf)

    def save(rank: int, c: Any) -> Any:
        return DistributedCheckpointer(store, c, topic=TOPIC).save(
            step=10 + rank, partition_count=1, window_state=window.state_dict(), common_state={}
        )

    for result in on_ranks(2, save):
        assert isinstance(result, RuntimeError)
        assert str(result) == "ranks cut a checkpoint at different steps [10, 11]; they must run in lockstep"


def test_a_shard_damaged_on_one_rank_makes_every_rank_fall_back_together(tmp_path: Path) -> None:
    topic = Topic(partitions=2, seed=23)
    store = ShardedCheckpointStore(tmp_path)
    paths = []
    for step in (1, 2):
        topic.produce(30)
        windows = _windows(topic, 2)
        results = on_ranks(
            2,
            lambda rank, c, step=step, windows=windows: DistributedCheckpointer(store, c, topic=TOPIC).save(
                step=step, partition_count=2, window_state=windows[rank].state_dict(), common_state={}
            ),
        )
        paths.append(results[0].path)
    damage_section(paths[1])  # a section of rank 0's shard: only rank 0 finds it
    shares = on_ranks(2, lambda rank, c: DistributedCheckpointer(store, c, topic=TOPIC).restore(partition_count=2))
    assert [share.step for share in shares] == [1, 1]


def test_a_mismatch_on_one_rank_is_raised_on_every_rank(tmp_path: Path) -> None:
    windows = _consumed_by_two(2, 24, 30)
    store = ShardedCheckpointStore(tmp_path)
    on_ranks(
        2,
        lambda rank, c: DistributedCheckpointer(store, c, topic=TOPIC).save(
            step=1, partition_count=2, window_state=windows[rank].state_dict(), common_state={}
        ),
    )
    topics = ["other-topic", TOPIC]  # rank 0 is misconfigured; rank 1 would load
    results = on_ranks(
        2, lambda rank, c: DistributedCheckpointer(store, c, topic=topics[rank]).restore(partition_count=2)
    )
    assert all(isinstance(result, CheckpointMismatch) for result in results)
    assert str(results[0]).startswith("checkpoint chk-000000000001-") and "reads 'other-topic'" in str(results[0])
    assert str(results[1]) == "another rank refused checkpoint step 1; see rank 0's log"


def test_ranks_that_find_different_one_file_checkpoints_refuse(tmp_path: Path) -> None:
    topic = Topic(partitions=2, seed=25)
    topic.produce(20)
    window = one_rank_window(topic)
    stores = []
    for rank in range(2):
        single_file = CheckpointStore(tmp_path / f"rank-{rank}")
        single_file.save({"window": window.state_dict(), "trainer": {}}, step=3 + rank)
        stores.append(single_file)
    sharded = ShardedCheckpointStore(tmp_path / "sharded")
    results = on_ranks(
        2,
        lambda rank, c: DistributedCheckpointer(sharded, c, topic=TOPIC).restore(
            partition_count=2, single_file=stores[rank]
        ),
    )
    for result in results:
        assert isinstance(result, RuntimeError)
        assert str(result) == "ranks found different one-file checkpoints; CHECKPOINT_DIR must be one shared directory"
    same = on_ranks(
        2,
        lambda rank, c: DistributedCheckpointer(sharded, c, topic=TOPIC).restore(
            partition_count=2, single_file=stores[0]
        ),
    )
    assert [(s.step, s.owned_partitions, s.topology_changed) for s in same] == [(3, [0], True), (3, [1], True)]
