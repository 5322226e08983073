"""Sharded checkpoints for N ranks: the directory layout, and the shard files in it.

A sharded checkpoint is a consistent cut: every rank cuts it at the same training step
(the lockstep agreement decides when; :mod:`streamtrain.checkpoint.collective`). It is
one directory under ``CHECKPOINT_DIR``::

    chk-{step:012d}-{unix_ms}/
        shard-00000.stsh    rank 0's window, by partition, and its rank-local state
        shard-00001.stsh    rank 1's ...
        common.stck         model, optimizer, normalization, trainer state (rank 0 writes it)
        manifest.json       written LAST, by rank 0, once every shard is durable

Without ``manifest.json`` (:mod:`streamtrain.checkpoint.manifest`) a directory is not a
checkpoint. Every file is written through
:func:`streamtrain.checkpoint.files.write_atomically`; nothing is ever unpickled
(safetensors and JSON only, in blobs of :mod:`streamtrain.checkpoint.format`, whose
SHA-256 covers every byte).

Shard file, ``.stsh``::

    offset   size   field
    0        8      SHARD_MAGIC
    8        8      index length I, unsigned little-endian
    16       32     SHA-256 of the index
    48       I      index, UTF-8 JSON: the shard's metadata and a table of sections
    48 + I   ...    sections back to back, each one format blob

A section holds one partition's window items (readings, keys, sensor ids, offsets, ...,
the columns of :data:`streamtrain.window.storage.ITEM_COLUMNS`) with the partition's next
offset; one more section holds the rank-local state (the window's key RNG, the
sampler's progress), which only a restart with the same ownership takes back; a last,
optional one the trainer's state that follows partitions (DP: the DP window's records),
which every rank reads from every shard after a rescale and takes its partitions' share
of (the trainer's :meth:`~streamtrain.training.protocol.ContinuousTrainer.state_from_parts`). The index
gives each section's position, length and SHA-256, so a reader seeks straight to the
partitions it owns (as Flink's key-group offsets let a subtask read only its key
groups); the manifest records each shard's whole-file SHA-256 and the SHA-256 of its
index, which commits to every section. Sections written by earlier releases also carry
``dead_letters`` and ``accepted_total``, which nothing filled in; readers ignore them.

A shard may be a *delta* on the same rank's shard of an earlier sealed checkpoint (its
index then names it: ``delta_of``, the checkpoint directory, file, and SHA-256 of the
file and of its index): each section then holds what entered the partition since
(``entered``: the same columns and readings) and the arrival numbers of the items that
left it (``left_seq``); a section's ``items`` is still the partition's item count at the
cut, and the counters, offsets, rank-local state and the trainer's state that follows
partitions are whole (that last is small and changes every step: each shard carries its
own cut's, and a restore reads the newest link's alone; the chain is for the window
items). The manifest names each shard's chain; :mod:`streamtrain.checkpoint.rescale`
reads it back.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

from streamtrain.checkpoint.files import Chunk, chunk_length, chunk_pieces, read_range, write_atomically
from streamtrain.checkpoint.format import (
    CorruptCheckpoint,
    LoadedCheckpoint,
    decode_checkpoint,
    encode_checkpoint,
    reject_json_constant,
)
from streamtrain.checkpoint.incremental import DELTA_OF, PendingWindow
from streamtrain.distributed.ownership import Ownership
from streamtrain.window.partitions import PartitionItems, empty_partition, split_by_partition
from streamtrain.window.storage import ITEM_COLUMNS

FORMAT_NAME: Final = "streamtrain.sharded-checkpoint"  # the manifest's format tag
FORMAT_VERSION: Final = 1  # of the manifest and the shard index alike
SHARD_FORMAT: Final = "streamtrain.shard"
SHARD_MAGIC: Final = b"\x89STS\r\n\x1a\n"
MANIFEST_NAME: Final = "manifest.json"
COMMON_NAME: Final = "common.stck"
DIR_NAME: Final = re.compile(r"^chk-(\d{12})-(\d+)$")
_SHARD_PREFIX = struct.Struct("<8sQ32s")
_MAX_INDEX_BYTES = 64 << 20
# the item columns a section holds: its partition is the section's own
SECTION_COLUMNS: Final = tuple((name, dtype) for name, dtype in ITEM_COLUMNS if name != "partitions")


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.stsh"


def checkpoint_dir_name(step: int, created_ms: int) -> str:
    return f"chk-{step:012d}-{created_ms}"


def canonical_json(value: Any) -> bytes:
    """The one byte string of a JSON value that digests are taken over (sorted keys, no spaces)."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"), sort_keys=True).encode("ascii")


def half_life_to_json(half_life_s: float) -> float | None:
    return None if math.isinf(half_life_s) else float(half_life_s)


def half_life_from_json(value: Any) -> float:
    return math.inf if value is None else float(value)


@dataclass(frozen=True)
class FileReceipt:
    """A file that is durable: its name in the checkpoint directory, size and SHA-256."""

    file: str
    size: int
    sha256: str
    index_sha256: str | None = None  # shards only

    def as_row(self, ok: bool = True) -> torch.Tensor:
        """int64 row for gathering receipts on rank 0: ok, size, SHA-256 and index SHA-256 as words."""
        words = [1 if ok else 0, self.size]
        for digest in (self.sha256, self.index_sha256 or "0" * 64):
            words += np.frombuffer(bytes.fromhex(digest), dtype="<i8").tolist()
        return torch.tensor(words, dtype=torch.int64)

    def parent_ref(self, checkpoint: str) -> dict[str, str]:
        """What a delta shard names this shard by, once sealed in the checkpoint directory ``checkpoint``."""
        return {
            "checkpoint": checkpoint,
            "file": self.file,
            "sha256": self.sha256,
            "index_sha256": str(self.index_sha256),
        }

    @classmethod
    def from_row(cls, row: Sequence[int], file: str) -> tuple[bool, FileReceipt]:
        words = np.asarray(list(row), dtype="<i8")
        sha = words[2:6].tobytes().hex()
        index_sha = words[6:10].tobytes().hex()
        return bool(words[0]), cls(file=file, size=int(words[1]), sha256=sha, index_sha256=index_sha)


# ----------------------------------------------------------------------------------------
# sections: one partition's items


def section_state(part: PartitionItems) -> dict[str, Any]:
    """The state tree a section blob holds for one partition."""
    return {"partition": part.partition, "next_offset": part.next_offset, "values": part.values, **part.columns}


def section_items(state: Mapping[str, Any], channels: int, where: str) -> PartitionItems:
    """One partition's items back from a section's state; ValueError when it does not hold them."""
    try:
        columns = {name: np.asarray(state[name], dtype=dtype).reshape(-1) for name, dtype in SECTION_COLUMNS}
        values = np.asarray(state["values"], dtype=np.float32).reshape(-1, channels)
        partition = int(state["partition"])
        next_offset = None if state["next_offset"] is None else int(state["next_offset"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: section does not hold a window partition: {exc}") from exc
    n = columns["lengths"].shape[0]
    if any(column.shape[0] != n for column in columns.values()):
        raise ValueError(f"{where}: section columns have different lengths")
    if int(columns["lengths"].sum()) != values.shape[0]:
        raise ValueError(f"{where}: section lengths do not add up to its readings")
    return PartitionItems(partition=partition, next_offset=next_offset, values=values, columns=columns)


def delta_section_state(part: PartitionItems, left_seq: np.ndarray) -> dict[str, Any]:
    """The state tree a delta shard's section holds for one partition: what entered it, what left."""
    return {
        "partition": part.partition,
        "next_offset": part.next_offset,
        "entered": {"values": part.values, **part.columns},
        "left_seq": left_seq,
    }


def delta_section_items(state: Mapping[str, Any], channels: int, where: str) -> tuple[PartitionItems, np.ndarray]:
    """A delta section's entered items and the arrival numbers of the items that left; ValueError
    when it does not hold them."""
    try:
        entered = {**state["entered"], "partition": state["partition"], "next_offset": state["next_offset"]}
        left_seq = np.asarray(state["left_seq"], dtype=np.int64).reshape(-1)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: section does not hold a window partition's changes: {exc}") from exc
    return section_items(entered, channels, where), left_seq


def window_meta(window_state: Mapping[str, Any]) -> dict[str, Any]:
    """A window state's settings and ledger, as a shard index records them (JSON values)."""
    reference_ts = window_state.get("reference_ts")
    return {
        "channels": int(window_state["channels"]),
        "capacity": int(window_state["capacity"]),
        "half_life_s": half_life_to_json(float(window_state["half_life_s"])),
        "reference_ts": None if reference_ts is None else float(reference_ts),
        "accepted_total": int(window_state.get("accepted_total", 0)),
        "rejected_total": {str(k): int(v) for k, v in dict(window_state.get("rejected_total") or {}).items()},
        "held_out_total": int(window_state.get("held_out_total", 0)),
        "version": int(window_state.get("version", 0)),
    }


# ----------------------------------------------------------------------------------------
# writing


def _blob_entry(chunks: list[Chunk], start: int) -> dict[str, Any]:
    digest = hashlib.sha256()
    for chunk in chunks:
        for piece in chunk_pieces(chunk):
            digest.update(piece)
    return {"start": start, "length": sum(chunk_length(c) for c in chunks), "sha256": digest.hexdigest()}


def write_shard(
    directory: Path | str,
    *,
    step: int,
    rank: int,
    ownership: Ownership,
    topic: str,
    window_state: Mapping[str, Any] | PendingWindow,
    rank_state: Mapping[str, Any] | None = None,
    partitioned_state: Mapping[str, Any] | None = None,
    created_at: float | None = None,
) -> FileReceipt:
    """Write this rank's shard into the checkpoint ``directory``; returns its receipt.

    ``window_state`` is :meth:`RecencyWindow.state_dict`, or a window a
    :class:`~streamtrain.checkpoint.incremental.WindowChain` (``by_partition``) built: a
    base is written as that state, a delta as each partition's changes since the shard it
    names (``delta_of`` in the index). Its items and offsets must belong to partitions
    this rank owns under ``ownership`` (ValueError otherwise: state of someone else's
    partition would be restored twice). ``rank_state`` (the sampler's progress, ...) is
    restored only under the same ownership. The window's own key RNG state goes there too.
    ``partitioned_state`` (DP: the DP window) follows partitions: it is read back from
    every shard after a rescale. It is written whole in a delta shard too (never as a
    change on the shard it builds on), so the newest link alone restores it.
    """
    directory = Path(directory)
    created_at = time.time() if created_at is None else float(created_at)
    delta = isinstance(window_state, PendingWindow) and window_state.kind == "delta"
    if isinstance(window_state, PendingWindow):
        sections = _delta_sections(window_state) if delta else _base_sections(window_state.state)
        window_state = window_state.state
    else:
        sections = _base_sections(window_state)
    foreign = sorted({partition for partition, *_ in sections if ownership.owner(partition) != rank})
    if foreign:
        raise ValueError(
            f"rank {rank} of {ownership.world_size} holds state of partitions {foreign[:8]} that it does not own "
            f"(partition p belongs to rank p mod {ownership.world_size}); ingest must only consume owned partitions"
        )
    blobs: list[list[Chunk]] = []
    table: list[dict[str, Any]] = []
    start = 0
    for partition, next_offset, state, items in sections:
        blob = encode_checkpoint(state, step=step, created_at=created_at)
        entry = _blob_entry(blob, start)
        table.append({"partition": partition, **entry, "items": items, "next_offset": next_offset})
        blobs.append(blob)
        start += entry["length"]
    local = {"window_rng_state": window_state.get("rng_state"), **dict(rank_state or {})}
    local_chunks = encode_checkpoint(local, step=step, created_at=created_at)
    partitioned_chunks: list[Chunk] = []
    partitioned_entry: dict[str, Any] = {}
    if partitioned_state is not None:  # whole, in a delta shard too: small, and it changes every step
        partitioned_chunks = encode_checkpoint(dict(partitioned_state), step=step, created_at=created_at)
        local_length = _blob_entry(local_chunks, start)["length"]
        partitioned_entry = {"partitioned_state": _blob_entry(partitioned_chunks, start + local_length)}
    record = {
        "format": SHARD_FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "created_at": created_at,
        "rank": int(rank),
        "topic": topic,
        "ownership": ownership.as_dict(),
        "window": window_meta(window_state),
        "sections": table,
        "rank_state": _blob_entry(local_chunks, start),
        **partitioned_entry,
    }
    if delta:
        record["delta_of"] = dict(window_state[DELTA_OF])
    index = canonical_json(record)
    prefix = _SHARD_PREFIX.pack(SHARD_MAGIC, len(index), hashlib.sha256(index).digest())

    def shard_bytes() -> Iterable[Chunk]:
        yield prefix
        yield index
        for blob in blobs:
            yield from blob
        yield from local_chunks
        yield from partitioned_chunks

    written = write_atomically(directory / shard_name(rank), shard_bytes(), sha256=True)
    assert written.sha256 is not None
    return FileReceipt(
        file=shard_name(rank), size=written.size, sha256=written.sha256, index_sha256=hashlib.sha256(index).hexdigest()
    )


# (partition, its next offset, the section's state tree, the items the partition holds at the cut)
_Section = tuple[int, int | None, dict[str, Any], int]


def _base_sections(window_state: Mapping[str, Any]) -> list[_Section]:
    return [
        (part.partition, part.next_offset, section_state(part), len(part)) for part in split_by_partition(window_state)
    ]


def _delta_sections(window: PendingWindow) -> list[_Section]:
    """A delta window's changes by partition: every partition it holds items or an offset of,
    or that items left."""
    state = window.state
    if window.partitions is None or window.left_partitions is None:
        raise ValueError(
            "a shard's delta needs the partitions of its items: build it with WindowChain(by_partition=True)"
        )
    channels = int(state["channels"])
    entered = {
        part.partition: part
        for part in split_by_partition(
            {**state["entered"], "channels": channels, "next_offsets": state["next_offsets"]}
        )
    }
    left_seq = np.asarray(state["left_seq"], dtype=np.int64)
    held = np.bincount(window.partitions.astype(np.int64))
    partitions = set(entered) | set(np.unique(window.left_partitions).tolist()) | set(np.flatnonzero(held).tolist())
    offsets = {int(p): int(o) for p, o in dict(state["next_offsets"]).items()}
    sections: list[_Section] = []
    for partition in sorted(partitions):
        part = entered.get(partition) or empty_partition(partition, offsets.get(partition), channels)
        left = left_seq[window.left_partitions == partition]
        items = int(held[partition]) if partition < held.size else 0
        sections.append((partition, part.next_offset, delta_section_state(part, left), items))
    return sections


def shard_present(root: Path | str, parent: Mapping[str, Any]) -> bool:
    """Whether the shard a delta would name (``{"checkpoint", "file", "sha256", "index_sha256"}``)
    is still in a sealed checkpoint under ``root``, with the index it had (its prefix says)."""
    directory = Path(root) / str(parent["checkpoint"])
    try:
        if not (directory / MANIFEST_NAME).exists():
            return False
        with open(directory / str(parent["file"]), "rb") as file:
            prefix = file.read(_SHARD_PREFIX.size)
    except OSError:
        return False
    if len(prefix) < _SHARD_PREFIX.size:
        return False
    magic, _, digest = _SHARD_PREFIX.unpack(prefix)
    return bool(magic == SHARD_MAGIC and digest.hex() == parent["index_sha256"])


def write_common(
    directory: Path | str, state: Mapping[str, Any], *, step: int, created_at: float | None = None
) -> FileReceipt:
    """Write the state every rank shares (model, optimizer, norm, trainer counters): rank 0, once."""
    created_at = time.time() if created_at is None else float(created_at)
    chunks = encode_checkpoint(state, step=step, created_at=created_at)
    written = write_atomically(Path(directory) / COMMON_NAME, chunks, sha256=True)
    assert written.sha256 is not None
    return FileReceipt(file=COMMON_NAME, size=written.size, sha256=written.sha256)


# ----------------------------------------------------------------------------------------
# reading


def check_file_size(path: Path, size: int) -> None:
    """CorruptCheckpoint unless ``path`` exists with the size the manifest (or a receipt) gives."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "missing: the manifest lists it, the directory does not hold it") from None
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    if actual != size:
        raise CorruptCheckpoint(path, f"{actual} bytes, the manifest says {size} (truncated or overwritten)")


def read_shard_index(path: Path, expected: FileReceipt | Mapping[str, Any]) -> dict[str, Any]:
    """Read and verify a shard's prefix and index against the manifest (or a receipt).

    The index comes back as recorded, plus ``_data_start``: the offset of its first section.
    """
    size = expected.size if isinstance(expected, FileReceipt) else int(expected["size"])
    index_sha = expected.index_sha256 if isinstance(expected, FileReceipt) else expected.get("index_sha256")
    check_file_size(path, size)
    try:
        with open(path, "rb") as file:
            prefix = file.read(_SHARD_PREFIX.size)
            if len(prefix) < _SHARD_PREFIX.size:
                raise CorruptCheckpoint(path, "shorter than the shard prefix (truncated)")
            magic, length, digest = _SHARD_PREFIX.unpack(prefix)
            if magic != SHARD_MAGIC:
                raise CorruptCheckpoint(path, f"magic bytes {magic!r} are not {SHARD_MAGIC!r}: not a streamtrain shard")
            if length > min(_MAX_INDEX_BYTES, size):
                raise CorruptCheckpoint(path, f"index length {length} is impossible for a {size}-byte shard")
            index = file.read(length)
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    if hashlib.sha256(index).digest() != digest:
        raise CorruptCheckpoint(path, "SHA-256 mismatch in the shard index (bit rot or partial overwrite)")
    if index_sha is not None and hashlib.sha256(index).hexdigest() != index_sha:
        raise CorruptCheckpoint(path, "the shard index is not the one the manifest sealed (SHA-256 mismatch)")
    try:
        record = json.loads(index, parse_constant=reject_json_constant)
        if record.get("format") != SHARD_FORMAT or record.get("version") != FORMAT_VERSION:
            raise ValueError(f"format {record.get('format')!r} version {record.get('version')!r}")
        data_start = _SHARD_PREFIX.size + length
        end = data_start
        for entry in [*record["sections"], record["rank_state"], *_optional_blobs(record)]:
            if int(entry["start"]) != end - data_start or int(entry["length"]) < 0:
                raise ValueError(f"section table entry {entry!r} does not follow the one before")
            end += int(entry["length"])
        if end != size:
            raise ValueError(f"sections end at byte {end}, the shard has {size}")
        record["_data_start"] = data_start
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(path, f"shard index is malformed: {exc}") from exc
    return record


def _optional_blobs(index: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The index entries of the blobs a shard may hold after its rank-local state."""
    return [index["partitioned_state"]] if "partitioned_state" in index else []


def read_shard_blob(path: Path, data_start: int, entry: Mapping[str, Any]) -> LoadedCheckpoint:
    """One section (or the rank-local state) of a shard, verified against its index entry."""
    try:
        data = read_range(path, data_start + int(entry["start"]), int(entry["length"]))
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorruptCheckpoint(path, f"SHA-256 mismatch in the section at byte {int(entry['start'])} (bit rot)")
    return decode_checkpoint(data, path)
