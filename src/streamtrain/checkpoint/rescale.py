"""A rank's share of a checkpoint, under the world size and partition count it runs with now.

State belongs to partitions, never to ranks. A rank restoring under another world size
reads, from every shard, the sections of the partitions it now owns
(:func:`restore_share`), so nothing is lost and nothing is read twice; its window then
keeps the top keys under its capacity share. The keys of sections from different old
shards are re-based on one reference time (each key's random draw is kept), and their
arrival order is renumbered by event time. A one-file checkpoint (a world of one rank)
is a one-shard checkpoint here (:func:`share_from_single_file`).

A restore whose topic differs is refused (:class:`CheckpointMismatch`); a topic that
grew partitions is handled on purpose (the new ones have no state and are read from
the consumer group's committed or earliest offsets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamtrain.checkpoint.format import CorruptCheckpoint, LoadedCheckpoint
from streamtrain.checkpoint.manifest import Manifest, read_common
from streamtrain.checkpoint.shards import (
    half_life_from_json,
    read_shard_blob,
    read_shard_index,
    section_items,
    window_meta,
)
from streamtrain.distributed.ownership import Ownership
from streamtrain.window.partitions import PartitionItems, join_partitions, split_by_partition
from streamtrain.window.storage import decay_rate


class CheckpointMismatch(Exception):
    """A valid checkpoint that this service must not restore (another topic, fewer partitions)."""


@dataclass
class RestoredShare:
    """What one rank takes back from a checkpoint (under possibly another world size)."""

    step: int
    path: Path
    common: dict[str, Any]  # model, optimizer, norm, trainer state (empty unless load_common)
    window_state: dict[str, Any]  # for RecencyWindow.load_state_dict
    next_offsets: dict[int, int]  # partition -> next offset, for the partitions it now owns
    owned_partitions: list[int]
    new_partitions: list[int]  # owned, but not in the checkpoint: read from committed/earliest offsets
    topology_changed: bool  # world size or partition count differ from the checkpoint's
    rank_state: dict[str, Any] | None  # the rank-local state, only when the topology is unchanged
    source_ranks: list[int] = field(default_factory=list)  # old ranks whose shards this share read
    loaded: LoadedCheckpoint | None = None  # a one-file checkpoint as read (restored from one)
    #: The trainer's state that follows partitions (DP: the DP windows): this rank's own under
    #: the same ownership, every old rank's after a rescale; empty when the shards hold none.
    partitioned_states: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class _Section:
    """One partition's items and the old rank whose shard held them."""

    items: PartitionItems
    source_rank: int


def restore_share(
    manifest: Manifest,
    *,
    rank: int,
    world_size: int,
    partition_count: int | None,
    topic: str,
    load_common: bool = True,
) -> RestoredShare:
    """This rank's share of a checkpoint under the ownership ``(world_size, partition_count)``.

    Reads the sections of the partitions the rank now owns from every shard (and nothing
    else), and the trainer state that follows partitions of every shard that holds one
    (only its own under the same ownership); verifies each against the shard index and the
    index against the manifest.
    CheckpointMismatch (one line) for another topic or fewer partitions than the
    checkpoint holds state for; CorruptCheckpoint for anything that does not verify.
    ``partition_count=None`` takes the checkpoint's (ownership does not depend on it;
    partitions added since have no state and are found by ingest).
    """
    if partition_count is None:
        partition_count = manifest.partition_count
    if manifest.topic != topic:
        raise CheckpointMismatch(
            f"checkpoint {manifest.directory.name} is of topic {manifest.topic!r}, this service reads {topic!r}; "
            "point CHECKPOINT_DIR at a directory of its own for this topic"
        )
    if partition_count < manifest.partition_count:
        raise CheckpointMismatch(
            f"checkpoint {manifest.directory.name} holds state of {manifest.partition_count} partitions of "
            f"{topic!r}, the topic now has {partition_count}; Kafka cannot remove partitions, so the topic was "
            "recreated: its offsets are meaningless, use a fresh CHECKPOINT_DIR"
        )
    ownership = Ownership(world_size=world_size, partition_count=partition_count)
    owned = ownership.partitions_of(rank)
    owned_set = set(owned)
    unchanged = (manifest.world_size, manifest.partition_count) == (world_size, partition_count)
    sections: list[_Section] = []
    shard_meta: dict[int, dict[str, Any]] = {}
    rank_state: dict[str, Any] | None = None
    partitioned: list[dict[str, Any]] = []
    for entry in manifest.shards:
        old_rank = int(entry["rank"])
        if unchanged and old_rank != rank:
            continue  # same ownership: only this rank's own shard holds its partitions
        # holds none of them? (the manifest's lists are disjoint, checked on reading it)
        wanted = unchanged or bool(owned_set.intersection(int(p) for p in entry["partitions"]))
        if not wanted and not entry.get("partitioned_state"):
            continue
        path = manifest.directory / str(entry["file"])
        index = read_shard_index(path, entry)
        if int(index["rank"]) != old_rank or int(index["step"]) != manifest.step or index["topic"] != manifest.topic:
            raise CorruptCheckpoint(
                path, f"shard says rank {index['rank']} step {index['step']}, the manifest disagrees"
            )
        if [int(e["partition"]) for e in index["sections"]] != [int(p) for p in entry["partitions"]]:
            raise CorruptCheckpoint(path, "the shard's partitions are not the ones the manifest lists")
        if "partitioned_state" in index:  # read from every shard: its records go wherever their partitions went
            partitioned.append(dict(read_shard_blob(path, index["_data_start"], index["partitioned_state"]).state))
        if not wanted:
            continue
        window = index["window"]
        shard_meta[old_rank] = window
        for section_entry in index["sections"]:
            partition = int(section_entry["partition"])
            if partition not in owned_set:
                continue
            loaded = read_shard_blob(path, index["_data_start"], section_entry)
            try:
                items = section_items(loaded.state, int(window["channels"]), str(path))
            except ValueError as exc:
                raise CorruptCheckpoint(path, str(exc)) from exc
            if items.partition != partition or len(items) != int(section_entry["items"]):
                raise CorruptCheckpoint(path, f"section of partition {partition} does not match its index entry")
            sections.append(_Section(items, old_rank))
        if unchanged:
            rank_state = dict(read_shard_blob(path, index["_data_start"], index["rank_state"]).state)
    common = read_common(manifest).state if load_common else {}
    window_state = _merge_sections(
        sections, shard_meta or {-1: _empty_meta(manifest.window)}, unchanged=unchanged, rank_state=rank_state
    )
    if rank_state is not None:
        rank_state.pop("window_rng_state", None)
    return RestoredShare(
        step=manifest.step,
        path=manifest.directory,
        common=common,
        window_state=window_state,
        next_offsets={s.items.partition: s.items.next_offset for s in sections if s.items.next_offset is not None},
        owned_partitions=owned,
        new_partitions=[p for p in owned if p >= manifest.partition_count],
        topology_changed=not unchanged,
        rank_state=rank_state,
        source_ranks=sorted(shard_meta),
        partitioned_states=partitioned,
    )


def _merge_sections(
    sections: Sequence[_Section],
    shard_meta: Mapping[int, Mapping[str, Any]],
    *,
    unchanged: bool,
    rank_state: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One window state from sections of one or more old shards (keys on one reference time)."""
    metas = list(shard_meta.values())
    if not metas:
        raise ValueError("no shard metadata to merge")
    channels = int(metas[0]["channels"])
    half_lives = {m["half_life_s"] for m in metas}
    if len(half_lives) != 1 or {int(m["channels"]) for m in metas} != {channels}:
        raise CorruptCheckpoint(Path("."), f"shards disagree on the window's half-life or channels: {metas}")
    half_life_s = half_life_from_json(metas[0]["half_life_s"])
    decay = decay_rate(half_life_s)
    references = [float(m["reference_ts"]) for m in metas if m["reference_ts"] is not None]
    reference = min(references) if references else None
    ordered = sorted(sections, key=lambda s: s.items.partition)
    joined = join_partitions([s.items for s in ordered], channels)
    if not unchanged and ordered and decay > 0.0:
        # key = λ·(ts − L) − ln E: the same event under the common reference L' gets key + λ·(L − L')
        shifts = []
        for section in ordered:
            old_reference = shard_meta[section.source_rank]["reference_ts"]
            shift = 0.0 if old_reference is None or reference is None else decay * (float(old_reference) - reference)
            shifts.append(np.full(len(section.items), shift))
        joined["keys"] = joined["keys"] + np.concatenate(shifts)
    n = joined["partitions"].shape[0]
    rejected_total: dict[str, int] = {}
    if unchanged:
        meta = metas[0]
        accepted_total = int(meta["accepted_total"])
        rejected_total = {str(k): int(v) for k, v in dict(meta.get("rejected_total") or {}).items()}
        version = int(meta["version"])
    else:
        # the ledger of covered messages is kept per rank, not per partition: after a
        # rescale it starts again from the items restored
        accepted_total = n
        # arrival order across shards is unknown: renumber by event time (then partition, offset)
        order = np.lexsort((joined["offsets"], joined["partitions"], joined["ts"]))
        seq = np.empty(n, dtype=np.int64)
        seq[order] = np.arange(n, dtype=np.int64)
        joined["seq"] = seq
        version = max(int(m["version"]) for m in metas)
    return {
        "capacity": int(metas[0]["capacity"]),
        "half_life_s": half_life_s,
        "channels": channels,
        "reference_ts": reference,
        **joined,
        "accepted_total": accepted_total,
        "rejected_total": rejected_total,
        "version": version,
        "rng_state": None if rank_state is None else rank_state.get("window_rng_state"),
    }


def _empty_meta(window: Mapping[str, Any]) -> dict[str, Any]:
    """Shard metadata for a rank that reads no shard (it owns no partition with state)."""
    return {**window, "reference_ts": None, "accepted_total": 0, "version": 0}


def share_from_single_file(
    loaded: LoadedCheckpoint, *, rank: int, world_size: int, partition_count: int | None
) -> RestoredShare:
    """This rank's share of a one-file checkpoint (:class:`streamtrain.checkpoint.store.CheckpointStore`).

    A service that ran as one process and now starts with several ranks takes its old
    checkpoint as a one-shard checkpoint: each rank keeps the partitions it now owns.
    The one-file format records no topic, so the caller vouches for it. The shared state
    is everything but ``"window"`` (the service saves ``{"window", "trainer"}``).
    """
    state = loaded.state
    window_state = state["window"]
    parts = split_by_partition(window_state)
    held = [part.partition for part in parts]
    if partition_count is None:
        partition_count = max(held) + 1 if held else 0
    if held and max(held) >= partition_count:
        raise CheckpointMismatch(
            f"checkpoint {loaded.path.name} holds partition {max(held)}, the topic has {partition_count} partitions; "
            "the topic was recreated: use a fresh CHECKPOINT_DIR"
        )
    ownership = Ownership(world_size=world_size, partition_count=partition_count)
    owned = ownership.partitions_of(rank)
    mine = [_Section(part, 0) for part in parts if part.partition in set(owned)]
    unchanged = world_size == 1
    rank_state = {"window_rng_state": window_state.get("rng_state")} if unchanged else None
    merged = _merge_sections(mine, {0: window_meta(window_state)}, unchanged=unchanged, rank_state=rank_state)
    return RestoredShare(
        step=loaded.step,
        path=loaded.path,
        common={key: value for key, value in state.items() if key != "window"},
        window_state=merged,
        next_offsets={s.items.partition: s.items.next_offset for s in mine if s.items.next_offset is not None},
        owned_partitions=owned,
        new_partitions=[p for p in owned if p not in set(held)],
        topology_changed=not unchanged,
        rank_state={} if unchanged else None,
        source_ranks=[0],
        loaded=loaded,
    )
