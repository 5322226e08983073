"""The manifest that seals a sharded checkpoint, and the checks every reader makes against it.

``manifest.json`` is written last, by rank 0, once every shard is durable
(:mod:`streamtrain.checkpoint.shards` describes the directory). A checkpoint without it,
or whose manifest names a file that is missing, has another size or another SHA-256,
is not valid; restore falls back to the previous complete one. The manifest carries
the SHA-256 of its own canonical JSON, so an edit that keeps it valid JSON is caught
too. It lists, per shard, the partitions, item count and next offsets it holds (and
whether it holds trainer state that follows partitions, the DP window), so a checkpoint
can be inspected (and a rescaled restore planned) without opening a shard, and for a
delta shard the shard it builds on (``delta_of``) and its ``chain``: the checkpoints it
builds on back to its base, newest first (what pruning must keep). A delta shard's
trainer state that follows partitions is whole, never a delta: its chain is for the
window items alone.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamtrain.checkpoint.files import file_sha256, read_range, write_atomically
from streamtrain.checkpoint.format import CorruptCheckpoint, LoadedCheckpoint, decode_checkpoint, reject_json_constant
from streamtrain.checkpoint.shards import (
    DIR_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileReceipt,
    canonical_json,
    check_file_size,
    half_life_from_json,
    read_shard_index,
)
from streamtrain.distributed.ownership import Ownership


def write_manifest(
    directory: Path | str,
    *,
    step: int,
    topic: str,
    ownership: Ownership,
    common: FileReceipt,
    shards: Sequence[FileReceipt],
    created_at: float | None = None,
) -> Path:
    """Seal a checkpoint: read back every shard's index, then write the manifest, LAST.

    Reading the indexes back proves every shard is visible here (on a shared volume) and
    that its index is the one its rank hashed; the manifest then lists, per shard, its
    partitions, items and next offsets, so the checkpoint can be inspected without
    opening a shard.
    """
    directory = Path(directory)
    if len(shards) != ownership.world_size:
        raise ValueError(
            f"a checkpoint of {ownership.world_size} ranks needs {ownership.world_size} shards, got {len(shards)}"
        )
    listed = []
    next_offsets: dict[str, int] = {}
    window: dict[str, Any] = {}
    for rank, receipt in enumerate(shards):
        index = read_shard_index(directory / receipt.file, receipt)
        shard_window = {key: index["window"][key] for key in ("channels", "half_life_s")}
        if window and shard_window != {key: window[key] for key in shard_window}:
            raise ValueError(f"shards disagree on the window settings: rank 0 {window}, rank {rank} {shard_window}")
        # the capacity recorded is the whole window's: the sum of the ranks' shares
        window = {**shard_window, "capacity": int(window.get("capacity", 0)) + int(index["window"]["capacity"])}
        if index["rank"] != rank or index["step"] != step:
            raise CorruptCheckpoint(directory / receipt.file, f"shard says rank {index['rank']} step {index['step']}")
        sections = index["sections"]
        for entry in sections:
            if entry["next_offset"] is not None:
                next_offsets[str(entry["partition"])] = int(entry["next_offset"])
        listed.append(
            {
                "rank": rank,
                "file": receipt.file,
                "size": receipt.size,
                "sha256": receipt.sha256,
                "index_sha256": receipt.index_sha256,
                "partitions": [int(entry["partition"]) for entry in sections],
                "items": int(sum(int(entry["items"]) for entry in sections)),
                **({"partitioned_state": True} if "partitioned_state" in index else {}),
                **_chain_of(directory, index, topic, ownership),
            }
        )
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step": int(step),
        "created_at": time.time() if created_at is None else float(created_at),
        "topic": topic,
        "ownership": ownership.as_dict(),
        "window": window,
        "common": {"file": common.file, "size": common.size, "sha256": common.sha256},
        "shards": listed,
        "next_offsets": next_offsets,  # written with sorted keys, as the whole record
    }
    manifest["sha256"] = _manifest_digest(manifest)
    path = directory / MANIFEST_NAME
    write_atomically(path, [json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode("ascii")])
    return path


def _chain_of(directory: Path, index: Mapping[str, Any], topic: str, ownership: Ownership) -> dict[str, Any]:
    """A delta shard's manifest fields: ``delta_of`` (the shard it builds on) and ``chain`` (the
    checkpoints its window builds on, newest first); nothing for a base.

    The parent must be sealed, of the same topic and ownership, and list the shard with
    the digests the delta names (ValueError otherwise: the checkpoint is not sealed).
    """
    parent = index.get("delta_of")
    if parent is None:
        return {}
    listed = read_manifest(directory.parent / str(parent["checkpoint"]))
    entry = next((shard for shard in listed.shards if shard["file"] == parent["file"]), None)
    if entry is None or (entry["sha256"], entry["index_sha256"]) != (parent["sha256"], parent["index_sha256"]):
        raise ValueError(f"the shard {parent['checkpoint']}/{parent['file']} a delta builds on was replaced")
    if listed.topic != topic or listed.ownership != ownership:
        raise ValueError(f"a delta builds on {parent['checkpoint']}, of another topic or ownership")
    return {"delta_of": dict(parent), "chain": [listed.directory.name, *entry.get("chain", [])]}


def _manifest_digest(record: Mapping[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON without its own digest: no bit goes unchecked."""
    return hashlib.sha256(canonical_json({k: v for k, v in record.items() if k != "sha256"})).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """A parsed, structurally checked manifest of one complete checkpoint."""

    directory: Path
    step: int
    created_at: float
    topic: str
    ownership: Ownership
    window: dict[str, Any]  # channels, capacity (all ranks together), half_life_s (None = uniform)
    common: dict[str, Any]
    shards: list[dict[str, Any]]
    next_offsets: dict[int, int]

    @property
    def builds_on(self) -> set[str]:
        """The checkpoints (directory names) the windows of its delta shards build on."""
        return {name for shard in self.shards for name in shard.get("chain", [])}

    @property
    def world_size(self) -> int:
        return self.ownership.world_size

    @property
    def partition_count(self) -> int:
        return self.ownership.partition_count

    @property
    def created_ms(self) -> int:
        """The creation time in the directory's name, which orders checkpoints of one step."""
        match = DIR_NAME.match(self.directory.name)
        return int(match.group(2)) if match else int(self.created_at * 1000)


def read_manifest(directory: Path | str) -> Manifest:
    """Parse ``directory/manifest.json``; CorruptCheckpoint when it is missing or malformed."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpoint(
            directory, "no manifest: the checkpoint was never completed (or is being deleted)"
        ) from None
    except OSError as exc:
        raise CorruptCheckpoint(directory, f"manifest unreadable: {exc}") from exc
    try:
        record = json.loads(raw, parse_constant=reject_json_constant)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        if record.get("format") != FORMAT_NAME or record.get("version") != FORMAT_VERSION:
            raise CorruptCheckpoint(
                directory,
                f"manifest format {record.get('format')!r} version {record.get('version')!r}; this streamtrain reads "
                f"{FORMAT_NAME!r} version {FORMAT_VERSION}",
            )
        if record.get("sha256") != _manifest_digest(record):
            raise CorruptCheckpoint(
                directory, "manifest SHA-256 mismatch: it changed after writing (bit rot or an edit)"
            )
        ownership = Ownership.from_dict(record["ownership"])
        shards = list(record["shards"])
        if [int(s["rank"]) for s in shards] != list(range(ownership.world_size)):
            raise ValueError(f"shards {[s.get('rank') for s in shards]} are not ranks 0..{ownership.world_size - 1}")
        for entry in [record["common"], *shards]:
            if not _is_plain_name(entry["file"]) or int(entry["size"]) < 0 or len(str(entry["sha256"])) != 64:
                raise ValueError(f"file entry {entry!r} is malformed")
        for shard in shards:
            _check_chain(shard)
        holders: dict[int, int] = {}
        for shard in shards:
            for partition in shard["partitions"]:
                if int(partition) in holders:
                    raise ValueError(
                        f"partition {partition} is in the shards of ranks {holders[int(partition)]} and {shard['rank']}"
                    )
                if not 0 <= int(partition) < ownership.partition_count:
                    raise ValueError(
                        f"partition {partition} is outside the {ownership.partition_count} partitions recorded"
                    )
                holders[int(partition)] = int(shard["rank"])
        window = dict(record["window"])
        int(window["channels"]), int(window["capacity"]), half_life_from_json(window["half_life_s"])
        manifest = Manifest(
            directory=directory,
            step=int(record["step"]),
            created_at=float(record["created_at"]),
            topic=str(record["topic"]),
            ownership=ownership,
            window=window,
            common=dict(record["common"]),
            shards=shards,
            next_offsets={int(p): int(o) for p, o in dict(record.get("next_offsets") or {}).items()},
        )
    except CorruptCheckpoint:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(directory, f"manifest is malformed: {exc}") from exc
    name = DIR_NAME.match(directory.name)
    if name is not None and int(name.group(1)) != manifest.step:
        raise CorruptCheckpoint(directory, f"directory says step {int(name.group(1))}, manifest says {manifest.step}")
    return manifest


def _check_chain(shard: Mapping[str, Any]) -> None:
    """ValueError unless a shard entry's ``delta_of`` and ``chain`` name sealed checkpoints' shards plainly."""
    parent, chain = shard.get("delta_of"), shard.get("chain")
    if parent is None and chain is None:
        return
    if not isinstance(parent, dict) or not isinstance(chain, list) or not chain:
        raise ValueError(f"shard {shard['file']!r} has a malformed delta_of {parent!r} or chain {chain!r}")
    if not all(isinstance(name, str) and DIR_NAME.match(name) for name in chain) or len(set(chain)) != len(chain):
        raise ValueError(f"shard {shard['file']!r} has a chain {chain!r} that is not distinct checkpoint names")
    if parent.get("checkpoint") != chain[0] or not _is_plain_name(parent.get("file")):
        raise ValueError(f"shard {shard['file']!r} builds on {parent!r}, which its chain {chain!r} does not start with")
    if any(len(str(parent.get(key))) != 64 for key in ("sha256", "index_sha256")):
        raise ValueError(f"shard {shard['file']!r} names its parent by malformed digests")


def _is_plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def verify_checkpoint(directory: Path | str) -> Manifest:
    """Check every byte of a checkpoint against its manifest (whole-file SHA-256s)."""
    manifest = read_manifest(directory)
    for entry in [manifest.common, *manifest.shards]:
        path = manifest.directory / entry["file"]
        check_file_size(path, int(entry["size"]))
        try:
            _, sha = file_sha256(path)
        except OSError as exc:
            raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
        if sha != entry["sha256"]:
            raise CorruptCheckpoint(path, "SHA-256 mismatch against the manifest (bit rot or partial overwrite)")
    return manifest


def read_common(manifest: Manifest) -> LoadedCheckpoint:
    """The shared state (model, optimizer, ...), verified against the manifest."""
    entry = manifest.common
    path = manifest.directory / entry["file"]
    check_file_size(path, int(entry["size"]))
    try:
        data = read_range(path, 0, int(entry["size"]))
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorruptCheckpoint(path, "SHA-256 mismatch against the manifest (bit rot or partial overwrite)")
    loaded = decode_checkpoint(data, path)
    if loaded.step != manifest.step:
        raise CorruptCheckpoint(path, f"holds step {loaded.step}, the manifest says {manifest.step}")
    return loaded
