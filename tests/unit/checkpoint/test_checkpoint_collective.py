"""The collective checkpointer, on one rank and on several in threads: the manifest rule, fallback
past damage, vetoes, what it logs."""

from __future__ import annotations

import logging
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
    receipts,
    save_one_rank,
    two_checkpoints,
)
from thread_ranks import on_ranks

from streamtrain.checkpoint import collective
from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.format import CorruptCheckpoint, read_header
from streamtrain.checkpoint.incremental import WindowChain
from streamtrain.checkpoint.manifest import read_manifest, verify_checkpoint
from streamtrain.checkpoint.rescale import CheckpointMismatch
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.shards import read_shard_index, shard_name
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


def _each_rank_saves(
    store: ShardedCheckpointStore,
    states: list[Any],
    *,
    step: int,
    partition_count: int,
    vetoes: Any = None,
    **same: Any,
) -> list[Any]:
    """Every rank saves its whole window (``states[rank]``) at ``step`` together; ``vetoes[rank]`` makes it refuse."""
    return on_ranks(
        len(states),
        lambda rank, c: DistributedCheckpointer(store, c, topic=TOPIC).save(
            step=step, partition_count=partition_count, window_state=states[rank], common_state={},
            veto=None if vetoes is None else vetoes[rank], **same,
        ),
    )  # fmt: skip


def _each_rank_restores(store: ShardedCheckpointStore, partition_count: int | None, **same: Any) -> list[Any]:
    """Two ranks restore from ``store`` together."""
    return on_ranks(
        2,
        lambda rank, c: DistributedCheckpointer(store, c, topic=TOPIC).restore(partition_count=partition_count, **same),
    )


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
    shares = _each_rank_restores(store, None)
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
    assert _each_rank_restores(store, 2) == [None, None]


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
        results = _each_rank_saves(store, [w.state_dict() for w in windows], step=step, partition_count=2)
        paths.append(results[0].path)
    damage_section(paths[1])  # a section of rank 0's shard: only rank 0 finds it
    shares = _each_rank_restores(store, 2)
    assert [share.step for share in shares] == [1, 1]


def test_a_mismatch_on_one_rank_is_raised_on_every_rank(tmp_path: Path) -> None:
    windows = _consumed_by_two(2, 24, 30)
    store = ShardedCheckpointStore(tmp_path)
    _each_rank_saves(store, [w.state_dict() for w in windows], step=1, partition_count=2)
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
    only_one = [CheckpointStore(tmp_path / "step-1"), CheckpointStore(tmp_path / "none")]
    only_one[0].save({"window": window.state_dict(), "trainer": {}}, step=1)
    sharded = ShardedCheckpointStore(tmp_path / "sharded")
    for different in (stores, only_one):  # two steps; a checkpoint on one rank, none on the other
        results = on_ranks(
            2,
            lambda rank, c, different=different: DistributedCheckpointer(sharded, c, topic=TOPIC).restore(
                partition_count=2, single_file=different[rank]
            ),
        )
        for result in results:
            assert isinstance(result, RuntimeError)
            assert str(result) == (
                "ranks found different one-file checkpoints; CHECKPOINT_DIR must be one shared directory"
            )
    same = _each_rank_restores(sharded, 2, single_file=stores[0])
    assert [(s.step, s.owned_partitions, s.topology_changed) for s in same] == [(3, [0], True), (3, [1], True)]


def test_the_checkpointer_refuses_what_it_cannot_write(tmp_path: Path) -> None:
    store = ShardedCheckpointStore(tmp_path)
    with pytest.raises(
        ValueError, match=r"^a shard splits its window by partition: pass WindowChain\(by_partition=True\)$"
    ):
        DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC, chain=WindowChain())
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    window = RecencyWindow(10, math.inf)
    with pytest.raises(ValueError, match="^rank 0 writes the shared state: pass common_state$"):
        checkpointer.save(step=1, partition_count=1, window_state=window.state_dict(), common_state=None)


@pytest.mark.parametrize("captured", [False, True], ids=["whole", "captured"])
def test_the_partition_count_covers_partitions_held_only_by_an_offset_or_only_by_items(
    tmp_path: Path, captured: bool
) -> None:
    topic = Topic(partitions=3, seed=6)
    topic.produce(30)
    window = one_rank_window(topic)
    window.advance_offsets({4: 10})  # partition 4: dead letters only, no item in the window
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(tmp_path), Collectives(DistContext()), topic=TOPIC)
    state = window.capture_state() if captured else window.state_dict()
    result = checkpointer.save(step=1, partition_count=0, window_state=state, common_state={})
    assert result.ok and read_manifest(result.path).partition_count == 5
    items_only = {**window.state_dict(), "next_offsets": {}}
    result = checkpointer.save(step=2, partition_count=0, window_state=items_only, common_state={})
    assert result.ok and read_manifest(result.path).partition_count == 3
    empty = RecencyWindow(10, math.inf).state_dict()
    result = checkpointer.save(step=3, partition_count=1, window_state=empty, common_state={})
    assert result.ok and read_manifest(result.path).partition_count == 1


def test_every_file_of_a_checkpoint_carries_rank_0s_time_and_each_rank_gets_its_own_state_back(tmp_path: Path) -> None:
    windows = _consumed_by_two(3, 26, 60)
    store = ShardedCheckpointStore(tmp_path)

    def save(rank: int, c: Any) -> Any:
        return DistributedCheckpointer(store, c, topic=TOPIC).save(
            step=2, partition_count=3, window_state=windows[rank].state_dict(),
            common_state={"trainer": {"step": 2}} if rank == 0 else None, rank_state={"rank": rank},
            partitioned_state={"dp": [rank]}, clock=lambda: 1234.5 + rank,
        )  # fmt: skip

    results = on_ranks(2, save)
    assert [(r.ok, r.kind) for r in results] == [(True, "base")] * 2
    assert all(isinstance(r.seconds, float) and 0.0 <= r.seconds < 60.0 for r in results)
    manifest = read_manifest(results[0].path)
    assert manifest.created_at == 1234.5
    assert read_header(results[0].path / "common.stck")["created_at"] == 1234.5
    for rank, receipt in enumerate(receipts(results[0].path)[3]):
        assert read_shard_index(results[0].path / shard_name(rank), receipt)["created_at"] == 1234.5
    shares = _each_rank_restores(store, 3)
    assert [(s.rank_state, s.partitioned_states) for s in shares] == [
        ({"rank": 0}, [{"dp": [0]}]),
        ({"rank": 1}, [{"dp": [1]}]),
    ]


def test_a_topic_grown_since_the_checkpoint_moves_the_new_partition_to_its_owner(tmp_path: Path) -> None:
    windows = _consumed_by_two(2, 27, 40)
    store = ShardedCheckpointStore(tmp_path)
    chain_kinds = []

    def save(rank: int, c: Any) -> Any:
        checkpointer = DistributedCheckpointer(store, c, topic=TOPIC)
        first = checkpointer.save(
            step=1, partition_count=2, window_state=windows[rank].capture_state(),
            common_state={} if rank == 0 else None,
        )  # fmt: skip
        # the topic grew: ownership changed, so a delta on the last shard would restore under the wrong owner
        second = checkpointer.save(
            step=2, partition_count=3, window_state=windows[rank].capture_state(),
            common_state={} if rank == 0 else None,
        )  # fmt: skip
        chain_kinds.append((rank, first.kind, second.kind))
        return second

    on_ranks(2, save)
    assert sorted(chain_kinds) == [(0, "base", "base"), (1, "base", "base")]
    known = [None, 4]  # one rank has heard the topic has four partitions: every rank takes it
    shares = on_ranks(
        2, lambda rank, c: DistributedCheckpointer(store, c, topic=TOPIC).restore(partition_count=known[rank])
    )
    assert [(s.step, s.owned_partitions, s.new_partitions, s.topology_changed) for s in shares] == [
        (2, [0, 2], [], True),
        (2, [1, 3], [3], True),
    ]


def _one_file_store(root: Path, partitions: int, step: int) -> CheckpointStore:
    topic = Topic(partitions=partitions, seed=28)
    topic.produce(30)
    store = CheckpointStore(root)
    store.save({"window": one_rank_window(topic).state_dict(), "trainer": {}}, step=step)
    return store


@pytest.mark.parametrize("beside_a_sharded_one", [False, True], ids=["alone", "beside-a-sharded-one"])
def test_a_one_file_checkpoint_restores_onto_a_grown_topic(tmp_path: Path, beside_a_sharded_one: bool) -> None:
    sharded = ShardedCheckpointStore(tmp_path)
    if beside_a_sharded_one:  # an older sharded checkpoint makes the one-file checkpoint a candidate among several
        empty = RecencyWindow(10, math.inf).state_dict()
        _each_rank_saves(sharded, [empty, empty], step=1, partition_count=2, clock=lambda: 1.0)
    single_file = _one_file_store(tmp_path, partitions=2, step=5)
    shares = _each_rank_restores(sharded, 3, single_file=single_file)
    assert [(s.step, s.owned_partitions, s.new_partitions) for s in shares] == [(5, [0, 2], [2]), (5, [1], [])]


def test_a_one_file_checkpoint_one_rank_cannot_read_is_skipped_by_every_rank(tmp_path: Path) -> None:
    sharded = ShardedCheckpointStore(tmp_path / "shared")
    empty = RecencyWindow(10, math.inf).state_dict()
    _each_rank_saves(sharded, [empty, empty], step=1, partition_count=2)
    stores = [_one_file_store(tmp_path / "shared", partitions=2, step=5), CheckpointStore(tmp_path / "elsewhere")]
    shares = on_ranks(
        2,
        lambda rank, c: DistributedCheckpointer(sharded, c, topic=TOPIC).restore(
            partition_count=2, single_file=stores[rank]
        ),
    )
    assert [s.step for s in shares] == [1, 1]


def test_nothing_restores_when_no_checkpoint_loads(tmp_path: Path) -> None:
    topic = Topic(partitions=2, seed=29)
    topic.produce(20)
    store = ShardedCheckpointStore(tmp_path / "sharded")
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    assert checkpointer.restore(partition_count=2, single_file=CheckpointStore(tmp_path / "one-file")) is None
    result = checkpointer.save(
        step=1, partition_count=2, window_state=one_rank_window(topic).state_dict(), common_state={}
    )
    damage_common(result.path)  # the only checkpoint
    assert checkpointer.restore(partition_count=2) is None


def test_a_rank_that_wrote_its_shard_hears_why_the_checkpoint_failed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    windows = _consumed_by_two(2, 30, 20)
    store = ShardedCheckpointStore(tmp_path, keep=1)
    states = [w.state_dict() for w in windows]
    _each_rank_saves(store, states, step=1, partition_count=2, clock=lambda: 1.0)
    caplog.set_level(logging.INFO, logger=collective.__name__)
    vetoes = ["its dead letters are not acknowledged", None]  # rank 0 refuses; rank 1 writes its shard
    zero, one = _each_rank_saves(store, states, step=2, partition_count=2, vetoes=vetoes, clock=lambda: 2.0)
    directory = "chk-000000000002-2000"
    assert not zero.ok and not one.ok
    assert one.error == f"checkpoint {directory} was not sealed (another rank failed; see its log)"
    assert zero.error == (
        f"rank 0 could not write its part of checkpoint {directory}: "
        "RuntimeError: its dead letters are not acknowledged"
    )
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.ERROR, zero.error)]
    # a failed checkpoint prunes nothing: with keep=1 the last sealed one is all there is
    assert [m.step for m in store.manifests()] == [1]


def test_a_checkpoint_that_cannot_be_sealed_fails_on_every_rank_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    windows = _consumed_by_two(2, 31, 20)
    store = ShardedCheckpointStore(tmp_path)

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(collective, "write_manifest", read_only)
    caplog.set_level(logging.INFO, logger=collective.__name__)
    zero, one = _each_rank_saves(store, [w.state_dict() for w in windows], step=1, partition_count=2, clock=lambda: 3.0)
    sealing = "could not seal checkpoint chk-000000000001-3000: OSError: [Errno 30] Read-only file system"
    assert (zero.ok, zero.error) == (False, sealing)
    assert (one.ok, one.error) == (
        False,
        "checkpoint chk-000000000001-3000 was not sealed (another rank failed; see its log)",
    )
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.ERROR, sealing)]


def test_a_checkpoint_that_cannot_prune_is_still_sealed_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    topic = Topic(partitions=2, seed=32)
    topic.produce(20)
    store = ShardedCheckpointStore(tmp_path)

    def read_only(just_written: Path) -> list[Path]:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(store, "prune", read_only)
    caplog.set_level(logging.INFO, logger=collective.__name__)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    result = checkpointer.save(
        step=1, partition_count=2, window_state=one_rank_window(topic).state_dict(), common_state={}
    )
    assert result.ok and result.error is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"could not prune checkpoints in {tmp_path}: [Errno 30] Read-only file system")
    ]


def test_a_restore_says_what_it_restored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    windows = _consumed_by_two(2, 33, 30)
    store = ShardedCheckpointStore(tmp_path)
    _each_rank_saves(store, [w.state_dict() for w in windows], step=4, partition_count=2, clock=lambda: 5.0)
    caplog.set_level(logging.INFO, logger=collective.__name__)
    same = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    _each_rank_restores(store, 2)
    assert same.restore(partition_count=2) is not None  # one rank where two wrote: rescaled
    counts = [len(w.state_dict()["lengths"]) for w in windows]
    assert sorted(r.getMessage() for r in caplog.records) == sorted([
        f"restored step 4 from chk-000000000004-5000: {counts[0]} items of partitions [0]",
        f"restored step 4 from chk-000000000004-5000: {counts[1]} items of partitions [1]",
        f"restored step 4 from chk-000000000004-5000: {sum(counts)} items of partitions [0, 1] (rescaled)",
    ])  # fmt: skip
    caplog.clear()
    single_file = _one_file_store(tmp_path / "one-file", partitions=2, step=6)
    empty = ShardedCheckpointStore(tmp_path / "one-file")
    _each_rank_restores(empty, 2, single_file=single_file)
    name = single_file.list()[0].path.name
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"restored one-file checkpoint {name} as rank 0 of 2",
        f"restored one-file checkpoint {name} as rank 1 of 2",
    ]
