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
)

from streamtrain.checkpoint.collective import DistributedCheckpointer
from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.manifest import read_manifest
from streamtrain.checkpoint.rescale import CheckpointMismatch, restore_share, share_from_single_file
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window.reservoir import RecencyWindow


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
    topic = Topic(partitions=4, seed=3)
    topic.produce(600)
    big = Cluster(2, 10_000, 60.0)
    big.consume(topic)
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
    topic = Topic(partitions=3, seed=5)
    topic.produce(200)
    cluster = Cluster(2, 50, 45.0)
    cluster.consume(topic)
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
    topic = Topic(partitions=3, seed=2)
    topic.produce(150)
    cluster = Cluster(2, 10_000, math.inf)
    cluster.consume(topic)
    directory = cluster.save(tmp_path, step=3, partition_count=3)
    topic.grow(5)
    grown, shares = Cluster.restore(directory, 3, 10_000, math.inf, partition_count=5)
    assert [s.new_partitions for s in shares] == [[3], [4], []]
    assert all(p not in s.next_offsets for s in shares for p in s.new_partitions)
    topic.produce(200)
    grown.consume(topic)  # the new partitions start from offset 0 (the group's earliest)
    assert_exact(grown, topic)


def test_restores_that_must_be_refused(tmp_path: Path) -> None:
    topic = Topic(partitions=4)
    topic.produce(50)
    cluster = Cluster(2, 1000, math.inf)
    cluster.consume(topic)
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
    topic = Topic(partitions=4, seed=3)
    topic.produce(80)
    cluster = Cluster(2, 1000, math.inf)
    cluster.consume(topic)
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
