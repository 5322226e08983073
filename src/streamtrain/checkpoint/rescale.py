"""A rank's share of a checkpoint, under the world size and partition count it runs with now.

State belongs to partitions, never to ranks. A rank restoring under another world size
reads, from every shard, the sections of the partitions it now owns
(:func:`restore_share`), so nothing is lost and nothing is read twice; its window then
keeps the top keys under its capacity share. The keys of sections from different old
shards are re-based on one reference time (each key's random draw is kept), and their
arrival order is renumbered by event time. A one-file checkpoint (a world of one rank)
is a one-shard checkpoint here (:func:`share_from_single_file`). A delta shard is read
with the chain it builds on, every link verified, each partition's sections replayed;
the trainer state that follows partitions (DP: the DP window) is whole in every link,
so only the newest link's is read.

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
from streamtrain.checkpoint.incremental import replay_items
from streamtrain.checkpoint.manifest import Manifest, read_common, read_manifest
from streamtrain.checkpoint.shards import (
    SECTION_COLUMNS,
    delta_section_items,
    half_life_from_json,
    read_shard_blob,
    read_shard_index,
    section_items,
    window_meta,
)
from streamtrain.distributed.ownership import Ownership
from streamtrain.window.partitions import PartitionItems, empty_partition, join_partitions, split_by_partition
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
    else), each replayed along its shard's chain, and the trainer state that follows
    partitions of every shard that holds one, even a shard holding none of the rank's
    partitions (only its own under the same ownership), from the shard's newest link
    alone (:func:`_partitioned_state`); verifies each against the shard index and the
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
        # the window's items need the shard's whole chain; the state that follows partitions
        # is whole in its newest link (read from every shard: its records go wherever their
        # partitions went)
        chain = _shard_chain(manifest, entry) if wanted else [_open_shard(manifest, entry)]
        newest = chain[0]
        if "partitioned_state" in newest.index:
            partitioned.append(_partitioned_state(newest))
        if not wanted:
            continue
        window = newest.index["window"]
        shard_meta[old_rank] = window
        for section_entry in newest.index["sections"]:
            partition = int(section_entry["partition"])
            if partition not in owned_set:
                continue
            try:
                items = _partition_items(chain, partition, int(window["channels"]))
            except CorruptCheckpoint as err:
                if err.path.parent == manifest.directory:
                    raise  # this checkpoint's own shard
                raise _broken_link(manifest, entry, f"{err.path.parent.name}/{err.path.name}", err) from err
            if items.partition != partition or len(items) != int(section_entry["items"]):
                raise CorruptCheckpoint(newest.path, f"section of partition {partition} does not match its index entry")
            sections.append(_Section(items, old_rank))
        if unchanged:
            rank_state = dict(
                read_shard_blob(newest.path, newest.index["_data_start"], newest.index["rank_state"]).state
            )
    settings = {(str(m["half_life_s"]), int(m["channels"])) for m in shard_meta.values()}
    if len(settings) > 1:  # the manifest's writer refuses such shards; a hand-made manifest may not
        raise CorruptCheckpoint(
            manifest.directory, f"its shards disagree on the window's half-life or channels: {sorted(settings)}"
        )
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


@dataclass(frozen=True)
class _ShardLink:
    """One shard of a chain, its index verified against its checkpoint's manifest."""

    path: Path
    index: dict[str, Any]


def _open_shard(manifest: Manifest, entry: Mapping[str, Any]) -> _ShardLink:
    """A shard's index, verified against ``entry`` of ``manifest``; CorruptCheckpoint when it disagrees."""
    path = manifest.directory / str(entry["file"])
    index = read_shard_index(path, entry)
    if (
        int(index["rank"]) != int(entry["rank"])
        or int(index["step"]) != manifest.step
        or index["topic"] != manifest.topic
    ):
        raise CorruptCheckpoint(
            path,
            f"shard says rank {index['rank']} step {index['step']} topic {index['topic']!r}, the manifest disagrees",
        )
    if [int(e["partition"]) for e in index["sections"]] != [int(p) for p in entry["partitions"]]:
        raise CorruptCheckpoint(path, "the shard's partitions are not the ones the manifest lists")
    if index.get("delta_of") != entry.get("delta_of"):
        raise CorruptCheckpoint(path, "the shard builds on another shard than the manifest lists")
    return _ShardLink(path, index)


def _shard_chain(manifest: Manifest, entry: Mapping[str, Any]) -> list[_ShardLink]:
    """The shard ``entry`` and the shards its window builds on (a delta's ``delta_of``), newest first.

    Every link is verified against its own checkpoint's manifest, and named by the digests
    its child records; a damaged, missing or replaced link makes the whole chain (and so the
    checkpoint) unusable: CorruptCheckpoint against ``manifest``'s checkpoint, naming the link.
    """
    chain = [_open_shard(manifest, entry)]
    parent = entry.get("delta_of")
    while parent is not None:
        where = f"{parent['checkpoint']}/{parent['file']}"
        try:
            if parent["checkpoint"] in {link.path.parent.name for link in chain}:
                raise CorruptCheckpoint(manifest.directory / where, "the chain builds on itself")
            listed = read_manifest(manifest.directory.parent / str(parent["checkpoint"]))
            found = next((shard for shard in listed.shards if shard["file"] == parent["file"]), None)
            if found is None or (found["sha256"], found["index_sha256"]) != (parent["sha256"], parent["index_sha256"]):
                raise CorruptCheckpoint(listed.directory, f"it no longer holds the shard {parent['file']} named")
            if listed.topic != manifest.topic or listed.ownership != manifest.ownership:
                raise CorruptCheckpoint(listed.directory, "another topic or ownership")
            chain.append(_open_shard(listed, found))
        except CorruptCheckpoint as err:
            raise _broken_link(manifest, entry, where, err) from err
        parent = found.get("delta_of")
    return chain


def _partitioned_state(newest: _ShardLink) -> dict[str, Any]:
    """The trainer state that follows partitions (DP: the DP window) a shard holds at its cut.

    Every shard, base or delta, carries its own whole section of it (it is small and
    changes every step, so a delta of it would save little and cost a replay): the
    newest link's is the state of this checkpoint's cut, and the links it builds on,
    cut at earlier steps, are never read for it. Their window items are (the chain).
    """
    return dict(read_shard_blob(newest.path, newest.index["_data_start"], newest.index["partitioned_state"]).state)


def _broken_link(manifest: Manifest, entry: Mapping[str, Any], link: str, err: CorruptCheckpoint) -> CorruptCheckpoint:
    """The checkpoint of ``manifest`` is unusable: its shard ``entry`` builds on ``link``, which is not."""
    return CorruptCheckpoint(
        manifest.directory, f"shard {entry['file']} builds on {link}, which is unusable: {err.reason}"
    )


def _partition_items(chain: Sequence[_ShardLink], partition: int, channels: int) -> PartitionItems:
    """One partition's items at the newest link's cut: its base section and every delta's changes."""
    # oldest first: each link's section as (items, left) (a base's: its items and no left), None without one
    loaded: list[tuple[PartitionItems, np.ndarray] | None] = []
    for link in reversed(chain):
        entry = next((e for e in link.index["sections"] if int(e["partition"]) == partition), None)
        if entry is None:
            loaded.append(None)  # the partition had neither items nor an offset at that cut
            continue
        state = read_shard_blob(link.path, link.index["_data_start"], entry).state
        try:
            if link.index.get("delta_of") is None:
                loaded.append((section_items(state, channels, str(link.path)), np.zeros(0, dtype=np.int64)))
            else:
                loaded.append(delta_section_items(state, channels, str(link.path)))
        except ValueError as exc:
            raise CorruptCheckpoint(link.path, str(exc)) from exc
    newest = loaded[-1]
    assert newest is not None  # the caller asks for a partition the newest link lists
    if len(loaded) == 1:
        return newest[0]
    empty = (empty_partition(partition, None, channels), np.zeros(0, dtype=np.int64))
    base, *deltas = [empty if link is None else link for link in loaded]

    def items_of(part: PartitionItems) -> dict[str, Any]:
        return {**part.columns, "values": part.values}

    replayed = replay_items(
        items_of(base[0]),
        [(items_of(entered), left) for entered, left in deltas],
        channels=channels,
        columns=SECTION_COLUMNS,
    )
    values = np.asarray(replayed.pop("values"), dtype=np.float32)
    return PartitionItems(partition, newest[0].next_offset, values, replayed)


def _merge_sections(
    sections: Sequence[_Section],
    shard_meta: Mapping[int, Mapping[str, Any]],
    *,
    unchanged: bool,
    rank_state: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One window state from sections of one or more old shards (keys on one reference time), whose
    metadata agree on the window's half-life and channels."""
    metas = list(shard_meta.values())
    channels = int(metas[0]["channels"])
    half_life_s = half_life_from_json(metas[0]["half_life_s"])
    decay = decay_rate(half_life_s)
    references = [float(m["reference_ts"]) for m in metas if m["reference_ts"] is not None]
    reference = min(references) if references else None
    ordered = sorted(sections, key=lambda s: s.items.partition)
    joined = join_partitions([s.items for s in ordered], channels)
    if not unchanged and ordered:
        # key = λ·(ts − L) − ln E: the same event under the common reference L' gets key + λ·(L − L')
        shifts = []
        for section in ordered:
            old_reference = shard_meta[section.source_rank]["reference_ts"]
            shift = 0.0 if old_reference is None or reference is None else decay * (float(old_reference) - reference)
            shifts.append(np.full(len(section.items), shift))
        joined["keys"] = joined["keys"] + np.concatenate(shifts)
    n = joined["partitions"].shape[0]
    rejected_total: dict[str, int] = {}
    held_out_total = 0
    if unchanged:
        meta = metas[0]
        accepted_total = int(meta["accepted_total"])
        rejected_total = {str(k): int(v) for k, v in dict(meta.get("rejected_total") or {}).items()}
        held_out_total = int(meta.get("held_out_total", 0))  # shards before stop 60 did not record it
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
        "held_out_total": held_out_total,
        "version": version,
        "rng_state": None if rank_state is None else rank_state.get("window_rng_state"),
    }


def _empty_meta(window: Mapping[str, Any]) -> dict[str, Any]:
    """Shard metadata for a rank that reads no shard (it owns no partition with state; the topology
    changed, so its ledger starts from nothing)."""
    return {**window, "reference_ts": None, "version": 0}


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
