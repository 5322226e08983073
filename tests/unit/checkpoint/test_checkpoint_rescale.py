"""Rescaling sharded checkpoints: nothing lost or read twice, race draws kept, refusals."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sharded_cluster import (
    LN2,
    TOPIC,
    Cluster,
    Topic,
    assert_exact,
    flip,
    one_rank_window,
    resealed,
)

from streamtrain.checkpoint import rescale
from streamtrain.checkpoint import shards as shards_module
from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.manifest import read_manifest
from streamtrain.checkpoint.rescale import CheckpointMismatch, restore_share, share_from_single_file
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.shards import write_shard
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.distributed.ownership import Ownership
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window.reservoir import RecencyWindow


def consumed(
    partitions: int, seed: int, events: int, world_size: int, capacity: int, half_life_s: float
) -> tuple[Topic, Cluster]:
    """A topic of ``events`` events and a cluster of ``world_size`` ranks that consumed them."""
    topic = Topic(partitions, seed=seed)
    topic.produce(events)
    cluster = Cluster(world_size, capacity, half_life_s)
    cluster.consume(topic)
    return topic, cluster


def test_rescale_two_to_one_to_three_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    topic = Topic(partitions=5, seed=1)
    capacity = 10_000  # a uniform window larger than the stream: it must hold exactly what was sent
    cluster = Cluster(2, capacity, math.inf)
    topic.produce(400)
    cluster.consume(topic)
    assert_exact(cluster, topic)
    first = cluster.save(tmp_path, step=10, partition_count=5)

    one, shares = Cluster.restore(first, 1, capacity, math.inf, partition_count=5)
    assert shares[0].topology_changed and shares[0].source_ranks == [0, 1]
    assert shares[0].common["trainer"]["step"] == 10
    assert_exact(one, topic)
    topic.produce(300)
    one.consume(topic)  # resumes every partition from the restored offsets
    assert_exact(one, topic)
    second = one.save(tmp_path, step=20, partition_count=5)

    three, shares = Cluster.restore(second, 3, capacity, math.inf, partition_count=5)
    assert [s.owned_partitions for s in shares] == [[0, 3], [1, 4], [2]]
    assert_exact(three, topic)
    topic.produce(300)
    three.consume(topic)
    assert_exact(three, topic)
    assert len(topic.sent()) == 1000


@settings(max_examples=25, deadline=None)
@given(
    world_sizes=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    partitions=st.integers(1, 6),
    half_life=st.sampled_from([math.inf, 30.0]),
    produced=st.lists(st.integers(0, 80), min_size=4, max_size=4),
    seed=st.integers(0, 1000),
)
def test_rescale_keeps_every_event_and_its_race_draw(
    world_sizes: list[int], partitions: int, half_life: float, produced: list[int], seed: int
) -> None:
    topic = Topic(partitions, seed=seed)
    capacity = 2000  # larger than anything produced: nothing is evicted
    cluster = Cluster(world_sizes[0], capacity, half_life, seed=seed)
    draws: dict[tuple[int, int], float] = {}
    with tempfile.TemporaryDirectory() as root:
        for phase, world_size in enumerate(world_sizes[1:]):
            topic.produce(produced[phase])
            cluster.consume(topic)
            draws.update(cluster.race_draws())
            directory = cluster.save(Path(root), step=phase, partition_count=partitions)
            cluster, _ = Cluster.restore(directory, world_size, capacity, half_life, partition_count=partitions)
            assert_exact(cluster, topic)
            restored = cluster.race_draws()
            assert restored.keys() == draws.keys()
            for event, draw in restored.items():  # keys were re-based, not redrawn
                assert draw == pytest.approx(draws[event], abs=1e-6)


def test_a_capacity_share_keeps_the_top_keys(tmp_path: Path) -> None:
    topic, big = consumed(4, 3, 600, 2, 10_000, 60.0)
    directory = big.save(tmp_path, step=1, partition_count=4)
    small, _ = Cluster.restore(directory, 1, 100, 60.0, partition_count=4)
    everything = big.race_draws()
    held = small.windows[0].snapshot()
    # the kept items are exactly the 100 with the largest keys under one common reference
    keys = {}
    for window in big.windows:
        state = window.state_dict()
        for p, o, key in zip(state["partitions"].tolist(), state["offsets"].tolist(), state["keys"].tolist()):
            keys[(p, o)] = key + LN2 / 60.0 * (state["reference_ts"] - small.windows[0].state_dict()["reference_ts"])
    top = sorted(keys, key=keys.get, reverse=True)[:100]
    assert set(zip(held.partitions.tolist(), held.offsets.tolist())) == set(top)
    assert len(everything) == 600 and small.next_offsets() == big.next_offsets()


def test_same_ownership_restores_every_field(tmp_path: Path) -> None:
    topic, cluster = consumed(3, 5, 200, 2, 50, 45.0)
    directory = cluster.save(
        tmp_path, step=7, partition_count=3, rank_state={"sampler": {"passes": 4, "watermark": 123}}
    )
    manifest = read_manifest(directory)
    for rank, window in enumerate(cluster.windows):
        share = restore_share(manifest, rank=rank, world_size=2, partition_count=3, topic=TOPIC)
        assert not share.topology_changed and share.source_ranks == [rank]
        assert share.rank_state == {"sampler": {"passes": 4, "watermark": 123}}
        again = RecencyWindow(window.capacity, 45.0)
        again.load_state_dict(share.window_state)
        before, after = window.state_dict(), again.state_dict()
        for key in ("keys", "ts", "labels", "offsets", "partitions", "seq", "lengths", "values"):
            order_a = np.lexsort((before["offsets"], before["partitions"]))
            order_b = np.lexsort((after["offsets"], after["partitions"]))
            if key == "values":
                assert np.array_equal(np.sort(before[key], axis=None), np.sort(after[key], axis=None))
            else:
                np.testing.assert_array_equal(before[key][order_a], after[key][order_b])
        for key in ("next_offsets", "accepted_total", "version", "reference_ts", "rng_state"):
            assert before[key] == after[key], key
        # the restored window draws the same keys next, as the original would
        more = EventBatch.from_events([SensorEvent("x", 1.7e9 + 5, np.ones((2, 1), np.float32))], [rank], [999])
        np.testing.assert_array_equal(window.draw_keys(more.ts), again.draw_keys(more.ts))


def test_a_grown_topic_is_handled_on_purpose(tmp_path: Path) -> None:
    topic, cluster = consumed(3, 2, 150, 2, 10_000, math.inf)
    directory = cluster.save(tmp_path, step=3, partition_count=3)
    topic.grow(5)
    grown, shares = Cluster.restore(directory, 3, 10_000, math.inf, partition_count=5)
    assert [s.new_partitions for s in shares] == [[3], [4], []]
    assert all(p not in s.next_offsets for s in shares for p in s.new_partitions)
    topic.produce(200)
    grown.consume(topic)  # the new partitions start from offset 0 (the group's earliest)
    assert_exact(grown, topic)


def test_restores_that_must_be_refused(tmp_path: Path) -> None:
    topic, cluster = consumed(4, 0, 50, 2, 1000, math.inf)
    manifest = read_manifest(cluster.save(tmp_path, step=1, partition_count=4))
    with pytest.raises(CheckpointMismatch) as err:
        restore_share(manifest, rank=0, world_size=2, partition_count=4, topic="other-topic")
    assert "other-topic" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointMismatch, match="recreated"):
        restore_share(manifest, rank=0, world_size=2, partition_count=3, topic=TOPIC)
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(tmp_path), Collectives(DistContext()), topic="other")
    with pytest.raises(CheckpointMismatch):  # a refusal, not a fallback to an older checkpoint
        checkpointer.restore(partition_count=4)


def test_restore_without_a_partition_count_takes_the_checkpoints(tmp_path: Path) -> None:
    topic = Topic(partitions=3, seed=2)
    cluster = Cluster(2, 10_000, math.inf)
    topic.produce(90)
    cluster.consume(topic)
    directory = cluster.save(tmp_path, step=3, partition_count=3)
    shares = [
        restore_share(read_manifest(directory), rank=r, world_size=3, partition_count=None, topic=TOPIC)
        for r in range(3)
    ]
    assert [s.owned_partitions for s in shares] == [[0], [1], [2]] and all(s.new_partitions == [] for s in shares)
    assert sorted(p for s in shares for p in s.window_state["partitions"].tolist()) == sorted(
        p for p, _ in topic.sent()
    )


def test_a_one_file_checkpoint_is_a_one_shard_checkpoint(tmp_path: Path) -> None:
    topic = Topic(partitions=4, seed=11)
    topic.produce(120)
    window = one_rank_window(topic)
    single_file = CheckpointStore(tmp_path / "single-file")
    single_file.save({"window": window.state_dict(), "trainer": {"step": 42}}, step=42)
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(tmp_path), Collectives(DistContext()), topic=TOPIC)
    share = checkpointer.restore(partition_count=4, single_file=single_file)
    assert share is not None and share.step == 42 and share.common == {"trainer": {"step": 42}}
    assert not share.topology_changed and share.loaded is not None and share.loaded.step == 42
    again = RecencyWindow(10_000, math.inf)
    again.load_state_dict(share.window_state)
    assert again.state_dict()["rng_state"] == window.state_dict()["rng_state"]
    loaded = single_file.load_latest()
    assert loaded is not None
    halves = [share_from_single_file(loaded, rank=r, world_size=2, partition_count=4) for r in range(2)]
    union = []
    for rank, half in enumerate(halves):
        part = RecencyWindow(10_000, math.inf)
        part.load_state_dict(half.window_state)
        snap = part.snapshot()
        assert set(snap.partitions.tolist()) <= {p for p in range(4) if p % 2 == rank}
        union += list(zip(snap.partitions.tolist(), snap.offsets.tolist()))
    assert sorted(union) == sorted(topic.sent())
    with pytest.raises(CheckpointMismatch):
        share_from_single_file(loaded, rank=0, world_size=1, partition_count=2)


def test_state_that_follows_partitions_comes_from_every_shard_after_a_rescale(tmp_path: Path) -> None:
    """The DP windows' records follow their partitions, and a record may sit in a shard that holds none
    of the restoring rank's window partitions: after a rescale every shard's part is read (the manifest
    says which shards have one), under the same ownership only the rank's own."""
    topic, cluster = consumed(4, 3, 80, 2, 1000, math.inf)
    parts: list[dict[str, Any] | None] = [{"records": np.arange(3) + 10 * rank} for rank in range(2)]
    manifest = read_manifest(cluster.save(tmp_path, step=7, partition_count=4, partitioned=parts))
    assert [shard.get("partitioned_state") for shard in manifest.shards] == [True, True]

    def restored(rank: int, world_size: int) -> list[list[int]]:
        share = restore_share(manifest, rank=rank, world_size=world_size, partition_count=4, topic=TOPIC)
        return [np.asarray(part["records"]).tolist() for part in share.partitioned_states]

    assert [restored(rank, 2) for rank in range(2)] == [[[0, 1, 2]], [[10, 11, 12]]]  # unchanged: its own
    assert restored(0, 1) == [[0, 1, 2], [10, 11, 12]]
    assert restored(4, 5) == [[0, 1, 2], [10, 11, 12]]  # owns no partition of the topic: still reads every part
    # a shard without such state (the plain trainer's, or an earlier release's) gives none
    without = read_manifest(cluster.save(tmp_path, step=8, partition_count=4, partitioned=[None, parts[1]]))
    assert [shard.get("partitioned_state") for shard in without.shards] == [None, True]
    share = restore_share(without, rank=0, world_size=1, partition_count=4, topic=TOPIC)
    assert [np.asarray(part["records"]).tolist() for part in share.partitioned_states] == [[10, 11, 12]]
    # its bytes are covered by the shard's index like every section's
    flip(manifest.directory / "shard-00001.stsh", 0.999)
    with pytest.raises(CorruptCheckpoint, match="SHA-256 mismatch"):
        restore_share(manifest, rank=0, world_size=1, partition_count=4, topic=TOPIC)


def test_a_restore_keeps_the_whole_ledger_and_a_rescale_starts_it_again(tmp_path: Path) -> None:
    """``/v1/window``'s ledger survives a restart with the offsets (docs/contract.md); until stop 60 a
    sharded checkpoint did not record the events held out for the publish gate, and every restart
    counted them as never seen."""
    topic = Topic(partitions=3, seed=4)
    topic.produce(150)
    cluster = Cluster(2, 40, 45.0)  # evicts: more accepted than held
    cluster.consume(topic)
    for rank, window in enumerate(cluster.windows):
        window.advance_offsets({rank: 500 + rank}, rejected={"schema": 3 + rank}, held_out=7 + rank)
    before = [window.state_dict() for window in cluster.windows]
    directory = cluster.save(tmp_path, step=5, partition_count=3)
    again, shares = Cluster.restore(directory, 2, 40, 45.0, partition_count=3)
    for window, share, old in zip(again.windows, shares, before, strict=True):
        state = window.state_dict()
        for name in ("accepted_total", "rejected_total", "held_out_total", "next_offsets", "version"):
            assert state[name] == old[name], name
        assert window.seen_total == old["accepted_total"] + sum(old["rejected_total"].values()) + old["held_out_total"]
        assert share.next_offsets == {int(p): o for p, o in old["next_offsets"].items()}
        settings = {name: share.window_state[name] for name in ("capacity", "half_life_s", "channels")}
        assert settings == {"capacity": 20, "half_life_s": 45.0, "channels": 1}
    # a rescale: the ledger is per rank, so it starts again from the items restored
    one, (share,) = Cluster.restore(directory, 1, 40, 45.0, partition_count=3)
    state = one.windows[0].state_dict()
    assert state["accepted_total"] == len(state["offsets"]) == 40
    assert (state["rejected_total"], state["held_out_total"]) == ({}, 0)
    assert state["version"] == max(old["version"] for old in before)
    assert share.next_offsets == {int(p): o for old in before for p, o in old["next_offsets"].items()}


def test_a_rescale_numbers_arrival_by_event_time(tmp_path: Path) -> None:
    """Arrival order across shards is unknown, so a rescaled window's arrival numbers follow event
    time (then partition, offset): the order the fresh share of a pass and a delta's ``left_seq`` use."""
    topic, cluster = consumed(4, 9, 120, 2, 10_000, math.inf)
    one, _ = Cluster.restore(cluster.save(tmp_path, step=1, partition_count=4), 1, 10_000, math.inf, partition_count=4)
    state = one.windows[0].state_dict()
    by_time = np.lexsort((state["offsets"], state["partitions"], state["ts"]))
    np.testing.assert_array_equal(state["seq"][by_time], np.arange(120))
    # the partitions interleave in time, so the order in which they were joined would differ
    assert not np.array_equal(np.argsort(state["seq"]), np.lexsort((state["offsets"], state["partitions"])))


def test_the_refusals_say_what_to_do_in_full(tmp_path: Path) -> None:
    topic, cluster = consumed(4, 0, 50, 2, 1000, math.inf)
    directory = cluster.save(tmp_path, step=1, partition_count=4)
    manifest = read_manifest(directory)
    with pytest.raises(CheckpointMismatch) as err:
        restore_share(manifest, rank=0, world_size=2, partition_count=4, topic="other-topic")
    assert str(err.value) == (
        f"checkpoint {directory.name} is of topic {TOPIC!r}, this service reads 'other-topic'; "
        "point CHECKPOINT_DIR at a directory of its own for this topic"
    )
    with pytest.raises(CheckpointMismatch) as err:
        restore_share(manifest, rank=0, world_size=2, partition_count=3, topic=TOPIC)
    assert str(err.value) == (
        f"checkpoint {directory.name} holds state of 4 partitions of {TOPIC!r}, the topic now has 3; Kafka "
        "cannot remove partitions, so the topic was recreated: its offsets are meaningless, use a fresh "
        "CHECKPOINT_DIR"
    )
    single_file = CheckpointStore(tmp_path / "single-file")
    single_file.save({"window": one_rank_window(topic).state_dict(), "trainer": {}}, step=3)
    loaded = single_file.load_latest()
    assert loaded is not None
    for partition_count in (2, 3):  # it holds partition 3: a topic of 3 partitions cannot have it either
        with pytest.raises(CheckpointMismatch) as err:
            share_from_single_file(loaded, rank=0, world_size=1, partition_count=partition_count)
        assert str(err.value) == (
            f"checkpoint {loaded.path.name} holds partition 3, the topic has {partition_count} partitions; "
            "the topic was recreated: use a fresh CHECKPOINT_DIR"
        )


def test_a_restore_without_common_state_reads_only_the_window(tmp_path: Path) -> None:
    topic, cluster = consumed(2, 6, 40, 1, 1000, math.inf)
    directory = cluster.save(tmp_path, step=2, partition_count=2)
    (directory / "common.stck").unlink()  # never opened
    share = restore_share(
        read_manifest(directory), rank=0, world_size=1, partition_count=2, topic=TOPIC, load_common=False
    )
    assert share.common == {} and len(share.window_state["offsets"]) == 40


def test_a_rank_that_owns_no_partition_restores_an_empty_window(tmp_path: Path) -> None:
    topic, cluster = consumed(2, 6, 40, 1, 1000, 30.0)
    directory = cluster.save(tmp_path, step=2, partition_count=2)
    share = restore_share(read_manifest(directory), rank=2, world_size=3, partition_count=2, topic=TOPIC)
    assert (share.owned_partitions, share.source_ranks, share.next_offsets) == ([], [], {})
    window = RecencyWindow(333, 30.0)
    window.load_state_dict(share.window_state)
    state = window.state_dict()
    assert (len(state["offsets"]), state["accepted_total"], state["version"], state["reference_ts"]) == (0, 0, 0, None)


def test_an_unowned_shards_chain_is_not_read_for_its_state_that_follows_partitions(tmp_path: Path) -> None:
    """Only the newest link holds that state; a restoring rank that owns none of a shard's window
    partitions reads nothing older (a damaged base there is none of its business)."""
    topic = Topic(partitions=4, seed=2)
    cluster = Cluster(2, 60, 30.0, compaction_ratio=1e9)
    parts: list[dict[str, Any] | None] = [{"records": np.arange(2) + 10 * rank} for rank in range(2)]
    directories = []
    for step in range(2):
        topic.produce(60)
        cluster.consume(topic)
        directories.append(cluster.save(tmp_path, step=step, partition_count=4, partitioned=parts, incremental=True))
    assert ["delta_of" in shard for shard in read_manifest(directories[1]).shards] == [True, True]
    (directories[0] / "shard-00001.stsh").unlink()  # rank 1's base: partitions 1 and 3
    manifest = read_manifest(directories[1])
    share = restore_share(manifest, rank=0, world_size=4, partition_count=4, topic=TOPIC)  # owns partition 0
    assert share.source_ranks == [0]
    assert [np.asarray(part["records"]).tolist() for part in share.partitioned_states] == [[0, 1], [10, 11]]
    with pytest.raises(CorruptCheckpoint, match="builds on"):  # rank 1 of 4 owns partition 1: it must read it
        restore_share(manifest, rank=1, world_size=4, partition_count=4, topic=TOPIC)


def test_a_one_file_checkpoint_share_says_what_it_holds(tmp_path: Path) -> None:
    topic = Topic(partitions=4, seed=11)
    topic.produce(200)
    cluster = Cluster(1, 50, 30.0)  # evicts: more accepted than held
    cluster.consume(topic)
    window = cluster.windows[0]
    window.advance_offsets({3: 400}, rejected={"schema": 2}, held_out=5)
    old = window.state_dict()
    single_file = CheckpointStore(tmp_path)
    single_file.save({"window": old, "trainer": {"step": 9}}, step=9)
    loaded = single_file.load_latest()
    assert loaded is not None
    whole = share_from_single_file(loaded, rank=0, world_size=1, partition_count=None)  # the topic: 0-3
    assert (whole.owned_partitions, whole.new_partitions, whole.topology_changed) == ([0, 1, 2, 3], [], False)
    offsets = {int(p): o for p, o in old["next_offsets"].items()}
    assert (whole.rank_state, whole.source_ranks, whole.next_offsets) == ({}, [0], offsets)
    for name in ("accepted_total", "rejected_total", "held_out_total", "version", "rng_state", "reference_ts"):
        assert whole.window_state[name] == old[name], name
    grown = share_from_single_file(loaded, rank=1, world_size=2, partition_count=6)
    assert (grown.owned_partitions, grown.new_partitions, grown.topology_changed) == ([1, 3, 5], [5], True)
    assert (grown.rank_state, grown.source_ranks) == (None, [0])
    assert grown.next_offsets == {p: o for p, o in offsets.items() if p in (1, 3)}
    assert grown.window_state["rng_state"] is None  # the rank's key generator starts fresh
    assert grown.window_state["accepted_total"] == len(grown.window_state["offsets"])
    # keys re-based on the one shard's reference: every event keeps its race draw
    half = RecencyWindow(10_000, 30.0)
    half.load_state_dict(grown.window_state)
    before = {(p, o): k for p, o, k in zip(old["partitions"].tolist(), old["offsets"].tolist(), old["keys"].tolist())}
    after = half.state_dict()
    for p, o, k in zip(after["partitions"].tolist(), after["offsets"].tolist(), after["keys"].tolist()):
        assert k == pytest.approx(before[(p, o)], abs=1e-9)
    empty = CheckpointStore(tmp_path / "empty")
    empty.save({"window": RecencyWindow(10, 30.0).state_dict(), "trainer": {}}, step=1)
    nothing = empty.load_latest()
    assert nothing is not None
    share = share_from_single_file(nothing, rank=0, world_size=1, partition_count=None)  # holds no partition
    assert (share.owned_partitions, share.new_partitions) == ([], [])


def _chain_of_two(root: Path) -> tuple[Path, Path]:
    """Two checkpoints of two ranks over three partitions, the second's shards deltas on the first's."""
    topic = Topic(partitions=3, seed=12)
    cluster = Cluster(2, 60, 30.0, compaction_ratio=1e9)
    directories = []
    for step in range(2):
        topic.produce(50)
        cluster.consume(topic)
        directories.append(cluster.save(root, step=step, partition_count=3, incremental=True))
    assert ["delta_of" in shard for shard in read_manifest(directories[1]).shards] == [True, True]
    return directories[0], directories[1]


def _swap_files(record: dict[str, Any]) -> None:
    first, second = record["shards"]
    for key in ("file", "size", "sha256", "index_sha256"):
        first[key], second[key] = second[key], first[key]


def _another_parent(record: dict[str, Any]) -> None:
    record["shards"][0]["delta_of"]["sha256"] = "0" * 64


@pytest.mark.parametrize(
    ("edit", "topic", "file", "reason"),
    [
        (
            lambda r: r.update(topic="other"),
            "other",
            "shard-00000.stsh",
            f"shard says rank 0 step 1 topic {TOPIC!r}, the manifest disagrees",
        ),
        (_swap_files, TOPIC, "shard-00001.stsh", f"shard says rank 1 step 1 topic {TOPIC!r}, the manifest disagrees"),
        (
            lambda r: r["shards"][0]["partitions"].reverse(),
            TOPIC,
            "shard-00000.stsh",
            "the shard's partitions are not the ones the manifest lists",
        ),
        (_another_parent, TOPIC, "shard-00000.stsh", "the shard builds on another shard than the manifest lists"),
    ],
    ids=["topic", "rank", "partitions", "parent"],
)
def test_a_shard_that_is_not_the_one_its_manifest_lists_is_refused_by_name(
    tmp_path: Path, edit: Any, topic: str, file: str, reason: str
) -> None:
    """Even with the manifest's digest made to match: each shard's own index must say what the
    manifest says of it."""
    _, directory = _chain_of_two(tmp_path)
    resealed(directory, edit)
    with pytest.raises(CorruptCheckpoint) as err:
        restore_share(read_manifest(directory), rank=0, world_size=1, partition_count=3, topic=topic)
    assert (err.value.path, err.value.reason) == (directory / file, reason)


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (
            lambda r: r["shards"][0].update(file="shard-00009.stsh"),
            "it no longer holds the shard shard-00000.stsh named",
        ),
        (lambda r: r.update(topic="other"), "another topic or ownership"),
    ],
    ids=["file", "topic"],
)
def test_a_chain_whose_parent_is_not_what_its_child_names_is_refused_naming_both(
    tmp_path: Path, edit: Any, reason: str
) -> None:
    parent, child = _chain_of_two(tmp_path)
    resealed(parent, edit)
    with pytest.raises(CorruptCheckpoint) as err:
        restore_share(read_manifest(child), rank=0, world_size=1, partition_count=3, topic=TOPIC)
    assert err.value.path == child
    assert err.value.reason == (
        f"shard shard-00000.stsh builds on {parent.name}/shard-00000.stsh, which is unusable: {reason}"
    )


def test_a_section_that_does_not_decode_is_refused_naming_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, child = _chain_of_two(tmp_path)
    manifest = read_manifest(child)

    def refuse(state: Any, channels: int, where: str) -> Any:
        raise ValueError(f"{where}: refused here")

    monkeypatch.setattr(rescale, "delta_section_items", refuse)
    with pytest.raises(CorruptCheckpoint) as err:
        restore_share(manifest, rank=0, world_size=2, partition_count=3, topic=TOPIC)
    shard = child / "shard-00000.stsh"
    assert (err.value.path, err.value.reason) == (shard, f"{shard}: refused here")
    monkeypatch.undo()
    monkeypatch.setattr(rescale, "section_items", refuse)  # the base the delta builds on
    with pytest.raises(CorruptCheckpoint) as err:
        restore_share(manifest, rank=0, world_size=2, partition_count=3, topic=TOPIC)
    base = parent / "shard-00000.stsh"
    assert err.value.path == child
    assert err.value.reason == (
        f"shard shard-00000.stsh builds on {parent.name}/shard-00000.stsh, which is unusable: {base}: refused here"
    )


@pytest.mark.parametrize("wrong", ["an item short", "another partition"])
def test_a_section_that_does_not_match_its_index_entry_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: str
) -> None:
    _, child = _chain_of_two(tmp_path)
    replay = rescale._partition_items

    def mismatched(chain: Any, partition: int, channels: int) -> Any:
        items = replay(chain, partition, channels)
        if wrong == "another partition":
            return rescale.PartitionItems(partition + 1, items.next_offset, items.values, items.columns)
        keep = np.arange(len(items)) > 0
        lengths = items.columns["lengths"]
        values = items.values[np.repeat(keep, lengths)]
        columns = {name: column[keep] for name, column in items.columns.items()}
        return rescale.PartitionItems(partition, items.next_offset, values, columns)

    monkeypatch.setattr(rescale, "_partition_items", mismatched)
    with pytest.raises(CorruptCheckpoint) as err:
        restore_share(read_manifest(child), rank=0, world_size=2, partition_count=3, topic=TOPIC)
    reason = "section of partition 0 does not match its index entry"
    assert (err.value.path, err.value.reason) == (child / "shard-00000.stsh", reason)


def test_shards_that_disagree_on_the_window_are_refused(tmp_path: Path) -> None:
    """The manifest's writer refuses them; a manifest sealed by hand around such shards is refused on reading."""
    topic, cluster = consumed(3, 5, 60, 2, 100, 30.0)
    directory = cluster.save(tmp_path, step=4, partition_count=3)
    other = RecencyWindow(50, 60.0)
    Cluster.consume_into(other, topic, rank=1, world_size=2)
    receipt = write_shard(
        directory, step=4, rank=1, ownership=Ownership(2, 3), topic=TOPIC, window_state=other.state_dict()
    )
    resealed(
        directory,
        lambda r: r["shards"][1].update(size=receipt.size, sha256=receipt.sha256, index_sha256=receipt.index_sha256),
    )
    manifest = read_manifest(directory)
    restore_share(manifest, rank=1, world_size=2, partition_count=3, topic=TOPIC)  # one shard: nothing to disagree
    with pytest.raises(CorruptCheckpoint) as err:
        restore_share(manifest, rank=0, world_size=1, partition_count=3, topic=TOPIC)
    assert err.value.path == directory
    assert err.value.reason == ("its shards disagree on the window's half-life or channels: [('30.0', 1), ('60.0', 1)]")


def test_a_shard_of_an_earlier_release_restores_without_its_held_out_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards written before stop 60 recorded no ``held_out_total``: restored as 0, as then."""
    topic, cluster = consumed(2, 3, 30, 1, 1000, math.inf)
    cluster.windows[0].advance_offsets({0: 99}, held_out=4)
    record = shards_module.window_meta

    def earlier(window_state: Any) -> dict[str, Any]:
        return {k: v for k, v in record(window_state).items() if k != "held_out_total"}

    monkeypatch.setattr(shards_module, "window_meta", earlier)
    directory = cluster.save(tmp_path, step=1, partition_count=2)
    share = restore_share(read_manifest(directory), rank=0, world_size=1, partition_count=2, topic=TOPIC)
    assert (share.window_state["held_out_total"], share.window_state["accepted_total"]) == (0, 30)


def test_a_rescale_merges_a_shard_whose_window_only_moved_its_offsets(tmp_path: Path) -> None:
    """A rank whose partitions brought only dead letters or held-out events so far has sections (their
    offsets) and no reference time: nothing of it is re-keyed, and the others' items keep their draws."""
    topic = Topic(partitions=2, seed=8)
    topic.produce(40)
    cluster = Cluster(2, 1000, 30.0)
    Cluster.consume_into(cluster.windows[0], topic, rank=0, world_size=2)
    cluster.windows[1].advance_offsets({1: 17}, rejected={"schema": 17})
    assert cluster.windows[1].state_dict()["reference_ts"] is None
    draws = cluster.race_draws()
    directory = cluster.save(tmp_path, step=1, partition_count=2)
    one, (share,) = Cluster.restore(directory, 1, 1000, 30.0, partition_count=2)
    assert share.source_ranks == [0, 1] and share.next_offsets == {0: len(topic.events[0]), 1: 17}
    restored = one.race_draws()
    assert restored.keys() == draws.keys() and len(draws) == len(topic.events[0])
    for event, draw in restored.items():
        assert draw == pytest.approx(draws[event], abs=1e-9)


def test_a_chain_that_comes_back_to_a_checkpoint_it_holds_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digests each link records of its parent make a cycle impossible to write; a link read
    from a directory the chain names next (here by a stand-in for the index reader) is refused."""
    parent, child = _chain_of_two(tmp_path)
    open_shard = rescale._open_shard

    def opened_in_the_parent(manifest: Any, entry: Any) -> Any:
        link = open_shard(manifest, entry)
        return rescale._ShardLink(parent / link.path.name, link.index)

    monkeypatch.setattr(rescale, "_open_shard", opened_in_the_parent)
    with pytest.raises(CorruptCheckpoint) as err:
        restore_share(read_manifest(child), rank=0, world_size=2, partition_count=3, topic=TOPIC)
    assert err.value.path == child
    assert err.value.reason == (
        f"shard shard-00000.stsh builds on {parent.name}/shard-00000.stsh, which is unusable: "
        "the chain builds on itself"
    )
