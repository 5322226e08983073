"""A Kafka topic in memory and a cluster of ranks, one window each, for the sharded checkpoint tests.

Ranks are simulated in one process (one window per rank, the shards written one after
another, the manifest last); the collective path with real processes is in
tests/unit/distributed/test_distributed_processes.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamtrain.checkpoint.collective import DistributedCheckpointer, SaveResult
from streamtrain.checkpoint.incremental import PendingWindow, WindowChain
from streamtrain.checkpoint.manifest import _manifest_digest, read_manifest, write_manifest
from streamtrain.checkpoint.rescale import RestoredShare, restore_share
from streamtrain.checkpoint.sharded_store import ShardedCheckpointStore
from streamtrain.checkpoint.shards import FileReceipt, shard_present, write_common, write_shard
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistContext, capacity_share
from streamtrain.distributed.ownership import Ownership
from streamtrain.events import EventBatch, SensorEvent
from streamtrain.window.reservoir import RecencyWindow

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

    def __init__(self, world_size: int, capacity: int, half_life_s: float, seed: int = 0, **chain: Any) -> None:
        self.world_size = world_size
        self.capacity = capacity
        self.windows = [
            RecencyWindow(
                capacity_share(capacity, rank, world_size), half_life_s, rng=np.random.default_rng(seed + rank)
            )
            for rank in range(world_size)
        ]
        # each rank's shards, as its DistributedCheckpointer chains them (save(incremental=True))
        self.chains = [WindowChain(by_partition=True, **chain) for _ in range(world_size)]

    def consume(self, topic: Topic) -> None:
        """Every rank reads its partitions from its next offsets to the end (as ingest will)."""
        for rank, window in enumerate(self.windows):
            self.consume_into(window, topic, rank=rank, world_size=self.world_size)

    @staticmethod
    def consume_into(window: RecencyWindow, topic: Topic, *, rank: int, world_size: int) -> None:
        """Rank ``rank``'s window reads its partitions from its next offsets to the end."""
        offsets = window.next_offsets
        for p in Ownership(world_size, topic.partition_count).partitions_of(rank):
            start = offsets.get(p, 0)
            events = topic.events[p][start:]
            if events:
                batch = EventBatch.from_events(events, [p] * len(events), range(start, start + len(events)))
                window.insert_batch(batch, {p: start + len(events)})

    def save(
        self,
        root: Path,
        step: int,
        partition_count: int,
        topic: str = TOPIC,
        *,
        partitioned: list[dict[str, Any] | None] | None = None,
        incremental: bool = False,
        **shard_extra: Any,
    ) -> Path:
        """The collective save, one rank after another; the manifest last.

        ``partitioned``: each rank's trainer state that follows partitions (the DP window), if
        any. ``incremental``: each rank's shard a delta on its shard of the last checkpoint
        this cluster saved so, where its chain allows (else the window whole).
        """
        ownership = Ownership(self.world_size, partition_count)
        directory = ShardedCheckpointStore(root).create_directory(step, 1000 + step)
        states: list[Mapping[str, Any] | PendingWindow] = [
            chain.next_window(
                window.capture_state(),
                parent_present=lambda parent: shard_present(root, parent),
                scope=(rank, ownership),
            )
            if incremental
            else window.state_dict()
            for rank, (window, chain) in enumerate(zip(self.windows, self.chains, strict=True))
        ]
        receipts = [
            write_shard(
                directory,
                step=step,
                rank=rank,
                ownership=ownership,
                topic=topic,
                window_state=state,
                partitioned_state=None if partitioned is None else partitioned[rank],
                **shard_extra,
            )
            for rank, state in enumerate(states)
        ]
        common = write_common(directory, {"trainer": {"step": step, "weights": torch.arange(4.0)}}, step=step)
        write_manifest(directory, step=step, topic=topic, ownership=ownership, common=common, shards=receipts)
        for chain, state, receipt in zip(self.chains, states, receipts, strict=True):
            if isinstance(state, PendingWindow):
                chain.linked(state, receipt.parent_ref(directory.name), receipt.size)
        return directory

    @classmethod
    def restore(
        cls, directory: Path, world_size: int, capacity: int, half_life_s: float, partition_count: int, **chain: Any
    ) -> tuple[Cluster, list[RestoredShare]]:
        cluster = cls(world_size, capacity, half_life_s, seed=99, **chain)
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


def assert_exact(cluster: Cluster, topic: Topic) -> None:
    items = cluster.items()
    assert len(items) == len(set(items)), "an event is held twice"
    assert set(items) == topic.sent(), "an event was lost or invented"
    assert cluster.next_offsets() == {p: len(e) for p, e in enumerate(topic.events) if e}


def two_checkpoints(root: Path) -> tuple[Topic, Path, Path]:
    topic = Topic(partitions=3, seed=7)
    cluster = Cluster(2, 10_000, math.inf)
    topic.produce(100)
    cluster.consume(topic)
    older = cluster.save(root, step=5, partition_count=3)
    topic.produce(100)
    cluster.consume(topic)
    newer = cluster.save(root, step=9, partition_count=3)
    return topic, older, newer


def flip(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def damage_section(d: Path) -> None:
    flip(d / "shard-00001.stsh", 0.8)


def damage_common(d: Path) -> None:
    flip(d / "common.stck", 0.7)


def one_rank_window(topic: Topic) -> RecencyWindow:
    cluster = Cluster(1, 10_000, math.inf)
    cluster.consume(topic)
    return cluster.windows[0]


def save_chain(
    store: ShardedCheckpointStore,
    topic: Topic,
    window: RecencyWindow,
    steps: int,
    after_each: Callable[[WindowChain], None] | None = None,
) -> tuple[list[Path], list[str]]:
    """``steps`` checkpoints of one rank's ``window`` into ``store``, 20 events more each, on a chain of
    up to three deltas that never compacts; their directories and kinds ("base", "delta")."""
    chain = WindowChain(by_partition=True, compaction_ratio=1e9, max_chain=3)
    checkpointer = DistributedCheckpointer(store, Collectives(DistContext()), topic=TOPIC, chain=chain)
    paths, kinds = [], []
    for step in range(steps):
        topic.produce(20)
        Cluster.consume_into(window, topic, rank=0, world_size=1)
        result = checkpointer.save(
            step=step, partition_count=3, window_state=window.capture_state(), common_state={"trainer": {}}
        )
        paths.append(result.path)
        kinds.append(result.kind)
        if after_each is not None:
            after_each(chain)
    return paths, kinds


def save_one_rank(checkpointer: DistributedCheckpointer, window: RecencyWindow, step: int) -> SaveResult:
    return checkpointer.save(
        step=step, partition_count=3, window_state=window.state_dict(), common_state={"trainer": {"step": step}}
    )


def mixed_directory(root: Path) -> tuple[Topic, RecencyWindow, CheckpointStore, DistributedCheckpointer]:
    """One directory holding one-file checkpoints (one process) and sharded ones (scaled out)."""
    topic = Topic(partitions=3, seed=5)
    topic.produce(60)
    window = one_rank_window(topic)
    single_file = CheckpointStore(root)
    checkpointer = DistributedCheckpointer(ShardedCheckpointStore(root), Collectives(DistContext()), topic=TOPIC)
    return topic, window, single_file, checkpointer


def receipts(directory: Path) -> tuple[int, Ownership, FileReceipt, list[FileReceipt]]:
    """What the ranks reported when ``directory`` was sealed, read back from its manifest: step,
    ownership, the common file's receipt and each shard's (what ``write_manifest`` takes)."""
    record = json.loads((directory / "manifest.json").read_text())
    common = FileReceipt(record["common"]["file"], record["common"]["size"], record["common"]["sha256"])
    shards = [FileReceipt(s["file"], s["size"], s["sha256"], s["index_sha256"]) for s in record["shards"]]
    return int(record["step"]), Ownership.from_dict(record["ownership"]), common, shards


def resealed(directory: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    """Edit ``directory``'s manifest and seal it again (its own digest made to match): what only
    the structural checks can catch."""
    record = json.loads((directory / "manifest.json").read_text())
    edit(record)
    record["sha256"] = _manifest_digest(record)
    (directory / "manifest.json").write_text(json.dumps(record))
