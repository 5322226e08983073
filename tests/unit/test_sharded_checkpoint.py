"""Sharded checkpoints: round trips, the manifest rule, fallback past damage, rescaling.

Ranks are simulated in one process here (one window per rank, the shards written one
after another, the manifest last); the collective path with real processes is in
test_distributed.py.
"""

from __future__ import annotations

import json
import math
import pickle
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.checkpoint import shards as sc
from streamtrain.checkpoint.shards import (
    CheckpointMismatch,
    DistributedCheckpointer,
    ShardedCheckpointStore,
    read_manifest,
    restore_share,
    share_from_single_file,
    verify_checkpoint,
    write_common,
    write_manifest,
    write_shard,
)
from streamtrain.checkpoint.store import CheckpointStore, CorruptCheckpoint
from streamtrain.distributed.launch import Collectives, DistContext, Ownership, capacity_share
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window import RecencyWindow

TOPIC = "sensor-events"
LN2 = math.log(2.0)


class Topic:
    """A Kafka topic in memory: events per partition, offsets from 0."""

    def __init__(self, partitions: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.events: list[list[SensorEvent]] = [[] for _ in range(partitions)]
        self.clock = 1.7e9

    @property
    def partition_count(self) -> int:
        return len(self.events)

    def grow(self, partitions: int) -> None:
        self.events += [[] for _ in range(partitions - len(self.events))]

    def produce(self, count: int) -> None:
        for _ in range(count):
            p = int(self.rng.integers(0, len(self.events)))
            length = int(self.rng.integers(1, 12))
            self.clock += float(self.rng.exponential(2.0))
            values = self.rng.normal(size=(length, 1)).astype(np.float32)
            self.events[p].append(
                SensorEvent(f"s{p}-{len(self.events[p])}", self.clock, values, int(self.rng.integers(-1, 3)))
            )

    def sent(self) -> set[tuple[int, int]]:
        return {(p, o) for p, events in enumerate(self.events) for o in range(len(events))}


class Cluster:
    """``world_size`` ranks, each with its own window over the partitions it owns."""

    def __init__(self, world_size: int, capacity: int, half_life_s: float, seed: int = 0) -> None:
        self.world_size = world_size
        self.capacity = capacity
        self.windows = [
            RecencyWindow(
                capacity_share(capacity, rank, world_size), half_life_s, rng=np.random.default_rng(seed + rank)
            )
            for rank in range(world_size)
        ]

    def consume(self, topic: Topic) -> None:
        """Every rank reads its partitions from its next offsets to the end (as ingest will)."""
        ownership = Ownership(self.world_size, topic.partition_count)
        for rank, window in enumerate(self.windows):
            offsets = window.next_offsets
            for p in ownership.partitions_of(rank):
                start = offsets.get(p, 0)
                events = topic.events[p][start:]
                if events:
                    batch = EventBatch.from_events(events, [p] * len(events), range(start, start + len(events)))
                    window.insert_batch(batch, {p: start + len(events)})

    def save(self, root: Path, step: int, partition_count: int, topic: str = TOPIC, **shard_extra: Any) -> Path:
        """The collective save, one rank after another; the manifest last."""
        ownership = Ownership(self.world_size, partition_count)
        directory = ShardedCheckpointStore(root).create_directory(step, 1000 + step)
        receipts = [
            write_shard(
                directory,
                step=step,
                rank=rank,
                ownership=ownership,
                topic=topic,
                window_state=window.state_dict(),
                **shard_extra,
            )
            for rank, window in enumerate(self.windows)
        ]
        common = write_common(directory, {"trainer": {"step": step, "weights": torch.arange(4.0)}}, step=step)
        write_manifest(directory, step=step, topic=topic, ownership=ownership, common=common, shards=receipts)
        return directory

    @classmethod
    def restore(
        cls, directory: Path, world_size: int, capacity: int, half_life_s: float, partition_count: int
    ) -> tuple[Cluster, list[sc.RestoredShare]]:
        cluster = cls(world_size, capacity, half_life_s, seed=99)
        manifest = read_manifest(directory)
        shares = []
        for rank, window in enumerate(cluster.windows):
            share = restore_share(
                manifest, rank=rank, world_size=world_size, partition_count=partition_count, topic=TOPIC
            )
            window.load_state_dict(share.window_state)
            shares.append(share)
        return cluster, shares

    def items(self) -> list[tuple[int, int]]:
        out = []
        for window in self.windows:
            snap = window.snapshot()
            out += list(zip(snap.partitions.tolist(), snap.offsets.tolist()))
        return out

    def next_offsets(self) -> dict[int, int]:
        merged: dict[int, int] = {}
        for window in self.windows:
            for p, o in window.next_offsets.items():
                assert p not in merged, f"partition {p} is in two windows"
                merged[p] = o
        return merged

    def race_draws(self) -> dict[tuple[int, int], float]:
        """``key − λ·(ts − L)`` per event: its ``−ln E``, which no restore may change."""
        draws = {}
        for window in self.windows:
            snap, state = window.snapshot(), window.state_dict()
            decay = 0.0 if math.isinf(window.half_life_s) else LN2 / window.half_life_s
            reference = state["reference_ts"] or 0.0
            for p, o, key, ts in zip(
                snap.partitions.tolist(), snap.offsets.tolist(), snap.keys.tolist(), snap.ts.tolist()
            ):
                draws[(p, o)] = key - decay * (ts - reference)
        return draws


def _assert_exact(cluster: Cluster, topic: Topic) -> None:
    items = cluster.items()
    assert len(items) == len(set(items)), "an event is held twice"
    assert set(items) == topic.sent(), "an event was lost or invented"
    assert cluster.next_offsets() == {p: len(e) for p, e in enumerate(topic.events) if e}


# ----------------------------------------------------------------------------------------
# rescaling


def test_rescale_two_to_one_to_three_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    topic = Topic(partitions=5, seed=1)
    capacity = 10_000  # a uniform window larger than the stream: it must hold exactly what was sent
    cluster = Cluster(2, capacity, math.inf)
    topic.produce(400)
    cluster.consume(topic)
    _assert_exact(cluster, topic)
    first = cluster.save(tmp_path, step=10, partition_count=5)

    one, shares = Cluster.restore(first, 1, capacity, math.inf, partition_count=5)
    assert shares[0].topology_changed and shares[0].source_ranks == [0, 1]
    assert shares[0].common["trainer"]["step"] == 10
    _assert_exact(one, topic)
    topic.produce(300)
    one.consume(topic)  # resumes every partition from the restored offsets
    _assert_exact(one, topic)
    second = one.save(tmp_path, step=20, partition_count=5)

    three, shares = Cluster.restore(second, 3, capacity, math.inf, partition_count=5)
    assert [s.owned_partitions for s in shares] == [[0, 3], [1, 4], [2]]
    _assert_exact(three, topic)
    topic.produce(300)
    three.consume(topic)
    _assert_exact(three, topic)
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
            _assert_exact(cluster, topic)
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
    dead_letters = {0: {"acked_through": 17}, 2: {"acked_through": 3}}
    directory = cluster.save(
        tmp_path,
        step=7,
        partition_count=3,
        dead_letters=dead_letters,
        rank_state={"sampler": {"passes": 4, "watermark": 123}},
    )
    manifest = read_manifest(directory)
    for rank, window in enumerate(cluster.windows):
        share = restore_share(manifest, rank=rank, world_size=2, partition_count=3, topic=TOPIC)
        assert not share.topology_changed and share.source_ranks == [rank]
        assert share.rank_state == {"sampler": {"passes": 4, "watermark": 123}}
        assert share.dead_letters == {p: v for p, v in dead_letters.items() if p % 2 == rank}
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
    _assert_exact(grown, topic)


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


def test_a_rank_cannot_save_partitions_it_does_not_own(tmp_path: Path) -> None:
    topic = Topic(partitions=2)
    topic.produce(20)
    one = Cluster(1, 1000, math.inf)
    one.consume(topic)
    with pytest.raises(ValueError, match=r"partitions \[1\] that it does not own"):
        write_shard(
            tmp_path, step=0, rank=0, ownership=Ownership(2, 2), topic=TOPIC, window_state=one.windows[0].state_dict()
        )


# ----------------------------------------------------------------------------------------
# completeness and damage


def _two_checkpoints(root: Path) -> tuple[Topic, Path, Path]:
    topic = Topic(partitions=3, seed=7)
    cluster = Cluster(2, 10_000, math.inf)
    topic.produce(100)
    cluster.consume(topic)
    older = cluster.save(root, step=5, partition_count=3)
    topic.produce(100)
    cluster.consume(topic)
    newer = cluster.save(root, step=9, partition_count=3)
    return topic, older, newer


def _flip(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def _damage_section(d: Path) -> None:
    _flip(d / "shard-00001.stsh", 0.8)


def _damage_index(d: Path) -> None:
    _flip(d / "shard-00000.stsh", 60 / (d / "shard-00000.stsh").stat().st_size)


def _damage_common(d: Path) -> None:
    _flip(d / "common.stck", 0.7)


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
    _damage_section,
    _damage_index,
    _damage_common,
    _truncate_shard,
    _lose_manifest,
    _garble_manifest,
    _tamper_manifest,
    _lose_shard,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=[d.__name__.strip("_") for d in DAMAGES])
def test_restore_falls_back_past_an_incomplete_or_damaged_checkpoint(tmp_path: Path, damage: Any) -> None:
    topic, older, newer = _two_checkpoints(tmp_path)
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


def test_verify_catches_a_flip_in_a_section_no_reader_needed(tmp_path: Path) -> None:
    _, _, newer = _two_checkpoints(tmp_path)
    manifest = read_manifest(newer)
    _damage_section(newer)
    restore_share(manifest, rank=0, world_size=2, partition_count=3, topic=TOPIC)  # rank 0 never reads shard 1
    with pytest.raises(CorruptCheckpoint, match="SHA-256"):
        verify_checkpoint(newer)
    with pytest.raises(CorruptCheckpoint, match="SHA-256"):
        restore_share(manifest, rank=1, world_size=2, partition_count=3, topic=TOPIC)


def test_nothing_is_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, newer = _two_checkpoints(tmp_path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint read tried to unpickle")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    share = restore_share(read_manifest(newer), rank=0, world_size=1, partition_count=3, topic=TOPIC)
    assert len(share.window_state["lengths"]) == 200


def test_manifest_lists_the_cut(tmp_path: Path) -> None:
    topic, _, newer = _two_checkpoints(tmp_path)
    record = json.loads((newer / "manifest.json").read_text())
    assert record["ownership"] == {"rule": "modulo", "version": 1, "world_size": 2, "partition_count": 3}
    assert record["topic"] == TOPIC and record["step"] == 9
    assert [s["partitions"] for s in record["shards"]] == [[0, 2], [1]]
    assert sum(s["items"] for s in record["shards"]) == 200
    assert record["next_offsets"] == {str(p): len(e) for p, e in enumerate(topic.events)}
    assert record["window"] == {"channels": 1, "capacity": 10_000, "half_life_s": None}  # both shares
    for entry in [record["common"], *record["shards"]]:
        assert len(entry["sha256"]) == 64 and (newer / entry["file"]).stat().st_size == entry["size"]


# ----------------------------------------------------------------------------------------
# the store and the one-rank collective path


def _window(topic: Topic) -> RecencyWindow:
    cluster = Cluster(1, 10_000, math.inf)
    cluster.consume(topic)
    return cluster.windows[0]


def _save(checkpointer: DistributedCheckpointer, window: RecencyWindow, step: int) -> sc.SaveResult:
    return checkpointer.save(
        step=step, partition_count=3, window_state=window.state_dict(), common_state={"trainer": {"step": step}}
    )


def test_prune_keeps_the_newest_complete_and_deletes_the_manifest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = Topic(partitions=3)
    topic.produce(30)
    window = _window(topic)
    store = ShardedCheckpointStore(tmp_path, keep=2)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    leftover = store.create_directory(1, 1)  # an attempt that never got its manifest
    (leftover / "shard-00000.stsh").write_bytes(b"half")
    future = store.create_directory(999, 1)  # newer than anything written: left alone
    results = [_save(checkpointer, window, step) for step in (2, 3, 4, 5)]
    assert all(r.ok and r.error is None for r in results)
    assert results[-1].next_offsets == window.next_offsets
    names = [info.path.name for info in store.scan()]
    assert names == [future.name, results[-1].path.name, results[-2].path.name]
    assert [m.step for m in store.manifests()] == [5, 4]

    # a deletion that dies after removing the manifest leaves no "complete" checkpoint behind
    def crash(path: object) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(sc.shutil, "rmtree", crash)
    with pytest.raises(OSError):
        store.delete(results[-2].path)
    assert [m.step for m in store.manifests()] == [5]


def test_a_failed_write_seals_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topic = Topic(partitions=3)
    topic.produce(30)
    window = _window(topic)
    store = ShardedCheckpointStore(tmp_path)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC)
    assert _save(checkpointer, window, 1).ok

    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sc, "write_shard", full_disk)
    failed = _save(checkpointer, window, 2)
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
    assert _save(checkpointer, window, 3).ok


def test_a_one_file_checkpoint_is_a_one_shard_checkpoint(tmp_path: Path) -> None:
    topic = Topic(partitions=4, seed=11)
    topic.produce(120)
    window = _window(topic)
    legacy = CheckpointStore(tmp_path / "legacy")
    legacy.save({"window": window.state_dict(), "trainer": {"step": 42}}, step=42)
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(tmp_path), Collectives(DistContext()), topic=TOPIC)
    share = checkpointer.restore(partition_count=4, legacy=legacy)
    assert share is not None and share.step == 42 and share.common == {"trainer": {"step": 42}}
    assert not share.topology_changed and share.loaded is not None and share.loaded.step == 42
    again = RecencyWindow(10_000, math.inf)
    again.load_state_dict(share.window_state)
    assert again.state_dict()["rng_state"] == window.state_dict()["rng_state"]
    loaded = legacy.load_latest()
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


def test_no_checkpoint_means_none(tmp_path: Path) -> None:
    checkpointer = DistributedCheckpointer(
        ShardedCheckpointStore(tmp_path / "empty"), Collectives(DistContext()), topic=TOPIC
    )
    assert checkpointer.restore(partition_count=3) is None


def _mixed_directory(root: Path) -> tuple[Topic, RecencyWindow, CheckpointStore, DistributedCheckpointer]:
    """One directory holding one-file checkpoints (one process) and sharded ones (scaled out)."""
    topic = Topic(partitions=3, seed=5)
    topic.produce(60)
    window = _window(topic)
    legacy = CheckpointStore(root)
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(root), Collectives(DistContext()), topic=TOPIC)
    return topic, window, legacy, checkpointer


def test_the_newest_checkpoint_of_either_kind_is_restored(tmp_path: Path) -> None:
    topic, window, legacy, checkpointer = _mixed_directory(tmp_path)
    assert _save(checkpointer, window, 10).ok
    legacy.save({"window": window.state_dict(), "trainer": {"step": 20}}, step=20)
    share = checkpointer.restore(partition_count=None, legacy=legacy)
    assert share is not None and share.step == 20 and share.loaded is not None  # the one-file one is newer
    assert _save(checkpointer, window, 30).ok
    share = checkpointer.restore(partition_count=None, legacy=legacy)
    assert share is not None and share.step == 30 and share.loaded is None and share.common == {"trainer": {"step": 30}}
    # a damaged newest one-file checkpoint falls back to the sharded one before it, and is reported
    newest = legacy.save({"window": window.state_dict(), "trainer": {"step": 40}}, step=40)
    _flip(newest, 0.5)
    reported: list[Path] = []
    legacy.on_corrupt = lambda path, reason: reported.append(path)
    share = checkpointer.restore(partition_count=None, legacy=legacy)
    assert share is not None and share.step == 30 and reported == [newest]
    again = RecencyWindow(10_000, math.inf)
    again.load_state_dict(share.window_state)
    assert sorted(zip(again.snapshot().partitions.tolist(), again.snapshot().offsets.tolist())) == sorted(topic.sent())


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


def test_the_window_ledger_survives_an_unchanged_restore(tmp_path: Path) -> None:
    topic = Topic(partitions=2, seed=3)
    topic.produce(40)
    window = _window(topic)
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
    window = _window(topic)
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(tmp_path), Collectives(DistContext()), topic=TOPIC)
    result = checkpointer.save(step=1, partition_count=0, window_state=window.state_dict(), common_state={})
    assert result.ok
    assert read_manifest(result.path).partition_count == 3


def test_export_reads_the_newest_shared_state_of_either_kind(tmp_path: Path) -> None:
    _, window, legacy, checkpointer = _mixed_directory(tmp_path)
    assert sc.load_latest_common(tmp_path) is None
    legacy.save({"window": window.state_dict(), "trainer": {"step": 1}}, step=1)
    assert checkpointer.save(
        step=2, partition_count=3, window_state=window.state_dict(), common_state={"trainer": {"step": 2}}
    ).ok
    loaded = sc.load_latest_common(tmp_path)
    assert loaded is not None and loaded.step == 2 and loaded.state == {"trainer": {"step": 2}}
    _damage_common(checkpointer.store.manifests()[0].directory)
    loaded = sc.load_latest_common(tmp_path)
    assert loaded is not None and loaded.step == 1 and loaded.state["trainer"] == {"step": 1}
