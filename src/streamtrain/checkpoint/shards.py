"""Sharded checkpoints for N ranks: one shard per rank, shared state once, a manifest last.

A checkpoint is a consistent cut: every rank cuts it at the same training step (the
lockstep agreement decides when). It is one directory under ``CHECKPOINT_DIR``::

    chk-{step:012d}-{unix_ms}/
        shard-00000.stsh    rank 0's window, by partition, and its rank-local state
        shard-00001.stsh    rank 1's ...
        common.stck         model, optimizer, normalization, trainer state (rank 0 writes it)
        manifest.json       written LAST, by rank 0, once every shard is durable

A checkpoint without ``manifest.json``, or whose manifest names a file that is missing,
has another size or another SHA-256, is not valid; restore falls back to the previous
complete one. Pruning deletes the manifest first, so a half-deleted checkpoint is never
taken for a complete one. Every file is written to a temporary name, fsynced, renamed
and its directory fsynced; nothing is ever unpickled (safetensors and JSON only, through
:func:`streamtrain.checkpoint.store.encode_checkpoint`, whose SHA-256 covers every byte).

Shard file, ``.stsh``::

    offset   size   field
    0        8      SHARD_MAGIC
    8        8      index length I, unsigned little-endian
    16       32     SHA-256 of the index
    48       I      index, UTF-8 JSON: the shard's metadata and a table of sections
    48 + I   ...    sections back to back, each one encode_checkpoint blob

A section holds one partition's window items (readings, keys, sensor ids, offsets, ...)
with the partition's next offset and its dead-letter acknowledgements; one more section
holds the rank-local state (the window's key RNG, the sampler's progress), which only
a restart with the same ownership takes back. The index gives each section's position,
length and SHA-256, so a reader seeks straight to the partitions it owns (as Flink's
key-group offsets let a subtask read only its key groups); the manifest records each
shard's whole-file SHA-256 and the SHA-256 of its index, which commits to every section.

Rescale: state belongs to partitions, never to ranks. A rank restoring under another
world size reads, from every shard, the sections of the partitions it now owns
(:func:`restore_share`), so nothing is lost and nothing is read twice; its window then
keeps the top keys under its capacity share. A restore whose topic differs is refused;
a topic that grew partitions is handled on purpose (the new ones have no state and are
read from the consumer group's committed or earliest offsets).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

from streamtrain.checkpoint.store import (
    CheckpointStore,
    CorruptCheckpoint,
    LoadedCheckpoint,
    decode_checkpoint,
    encode_checkpoint,
)
from streamtrain.distributed.launch import Collectives, Ownership
from streamtrain.window import gather_tokens

log = logging.getLogger(__name__)

FORMAT_NAME: Final = "streamtrain.sharded-checkpoint"
FORMAT_VERSION: Final = 1
SHARD_FORMAT: Final = "streamtrain.shard"
SHARD_MAGIC: Final = b"\x89STS\r\n\x1a\n"
MANIFEST_NAME: Final = "manifest.json"
COMMON_NAME: Final = "common.stck"
_SHARD_PREFIX = struct.Struct("<8sQ32s")
_DIR_NAME = re.compile(r"^chk-(\d{12})-(\d+)$")
_TEMP_SUFFIX = ".tmp"
_MAX_INDEX_BYTES = 64 << 20
_LN2 = math.log(2.0)

# window columns a section carries, with their dtypes
_ITEM_COLUMNS: Final = (
    ("lengths", np.int64),
    ("ts", np.float64),
    ("labels", np.int64),
    ("keys", np.float64),
    ("offsets", np.int64),
    ("seq", np.int64),
)


class CheckpointMismatch(Exception):
    """A valid checkpoint that this service must not restore (another topic, fewer partitions)."""


# ----------------------------------------------------------------------------------------
# files


def _write_atomically(path: Path, chunks: Iterable[bytes]) -> tuple[int, str]:
    """Write ``chunks`` to ``path`` (temp file, fsync, rename, fsync dir); (size, SHA-256 hex)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}{_TEMP_SUFFIX}")
    digest = hashlib.sha256()
    size = 0
    try:
        fd = os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        with open(fd, "wb", closefd=True) as file:
            for chunk in chunks:
                file.write(chunk)
                digest.update(chunk)
                size += len(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
        _fsync_directory(path.parent)
    except BaseException:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    return size, digest.hexdigest()


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that cannot sync a directory
            raise
    finally:
        os.close(fd)


def _file_sha256(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"), sort_keys=True).encode("ascii")


def _half_life_to_json(half_life_s: float) -> float | None:
    return None if math.isinf(half_life_s) else float(half_life_s)


def _half_life_from_json(value: Any) -> float:
    return math.inf if value is None else float(value)


# ----------------------------------------------------------------------------------------
# a window state split by partition


@dataclass
class Section:
    """One partition's share of a window: its items, next offset and dead-letter state."""

    partition: int
    next_offset: int | None
    values: np.ndarray  # float32 [tokens, C]
    sensor_ids: np.ndarray  # object [n] of str
    columns: dict[str, np.ndarray]  # _ITEM_COLUMNS
    dead_letters: Any = None
    accepted_total: int | None = None
    source_rank: int = 0  # the old rank whose shard held it (set when read back)

    @property
    def items(self) -> int:
        return int(self.columns["lengths"].shape[0])

    def state(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "next_offset": self.next_offset,
            "dead_letters": self.dead_letters,
            "accepted_total": self.accepted_total,
            "values": self.values,
            "sensor_ids": self.sensor_ids,
            **self.columns,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], channels: int, where: str) -> Section:
        try:
            columns = {name: np.asarray(state[name], dtype=dtype).reshape(-1) for name, dtype in _ITEM_COLUMNS}
            values = np.asarray(state["values"], dtype=np.float32).reshape(-1, channels)
            sensor_ids = np.asarray(state["sensor_ids"], dtype=object).reshape(-1)
            partition = int(state["partition"])
            next_offset = None if state["next_offset"] is None else int(state["next_offset"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: section does not hold a window partition: {exc}") from exc
        n = columns["lengths"].shape[0]
        if any(column.shape[0] != n for column in columns.values()) or sensor_ids.shape[0] != n:
            raise ValueError(f"{where}: section columns have different lengths")
        if int(columns["lengths"].sum()) != values.shape[0]:
            raise ValueError(f"{where}: section lengths do not add up to its readings")
        accepted = state.get("accepted_total")
        return cls(
            partition=partition,
            next_offset=next_offset,
            values=values,
            sensor_ids=sensor_ids,
            columns=columns,
            dead_letters=state.get("dead_letters"),
            accepted_total=None if accepted is None else int(accepted),
        )


def split_window_state(
    window_state: Mapping[str, Any],
    *,
    dead_letters: Mapping[int, Any] | None = None,
    accepted_by_partition: Mapping[int, int] | None = None,
) -> list[Section]:
    """Cut a :meth:`RecencyWindow.state_dict` into one :class:`Section` per partition.

    A partition appears when it has items or a next offset (all its events dead-lettered
    or evicted still moves its offset). Ascending partition order.
    """
    channels = int(window_state["channels"])
    lengths = np.asarray(window_state["lengths"], dtype=np.int64).reshape(-1)
    values = np.asarray(window_state["values"], dtype=np.float32).reshape(-1, channels)
    if int(lengths.sum()) != values.shape[0]:
        raise ValueError("window state is inconsistent: lengths do not add up to its readings")
    partitions = np.asarray(window_state["partitions"], dtype=np.int64).reshape(-1)
    n = lengths.shape[0]
    seq = window_state.get("seq")
    columns = {
        "lengths": lengths,
        "ts": np.asarray(window_state["ts"], dtype=np.float64).reshape(-1),
        "labels": np.asarray(window_state["labels"], dtype=np.int64).reshape(-1),
        "keys": np.asarray(window_state["keys"], dtype=np.float64).reshape(-1),
        "offsets": np.asarray(window_state["offsets"], dtype=np.int64).reshape(-1),
        "seq": np.arange(n, dtype=np.int64) if seq is None else np.asarray(seq, dtype=np.int64).reshape(-1),
    }
    sensor_ids = np.asarray(window_state["sensor_ids"], dtype=object).reshape(-1)
    next_offsets = {int(p): int(o) for p, o in dict(window_state.get("next_offsets") or {}).items()}
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    order = np.argsort(partitions, kind="stable")
    sorted_partitions = partitions[order]
    dead_letters = dict(dead_letters or {})
    accepted = dict(accepted_by_partition or {})
    sections = []
    for partition in sorted(set(sorted_partitions.tolist()) | set(next_offsets)):
        lo, hi = np.searchsorted(sorted_partitions, [partition, partition + 1])
        index = order[lo:hi]
        sections.append(
            Section(
                partition=int(partition),
                next_offset=next_offsets.get(int(partition)),
                values=gather_tokens(values, starts[index], lengths[index]).reshape(-1, channels),
                sensor_ids=sensor_ids[index],
                columns={name: column[index] for name, column in columns.items()},
                dead_letters=dead_letters.get(int(partition)),
                accepted_total=accepted.get(int(partition)),
            )
        )
    return sections


# ----------------------------------------------------------------------------------------
# writing


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

    @classmethod
    def from_row(cls, row: Sequence[int], file: str) -> tuple[bool, FileReceipt]:
        words = np.asarray(list(row), dtype="<i8")
        sha = words[2:6].tobytes().hex()
        index_sha = words[6:10].tobytes().hex()
        return bool(words[0]), cls(file=file, size=int(words[1]), sha256=sha, index_sha256=index_sha)


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}.stsh"


def checkpoint_dir_name(step: int, created_ms: int) -> str:
    return f"chk-{step:012d}-{created_ms}"


def write_shard(
    directory: Path | str,
    *,
    step: int,
    rank: int,
    ownership: Ownership,
    topic: str,
    window_state: Mapping[str, Any],
    dead_letters: Mapping[int, Any] | None = None,
    accepted_by_partition: Mapping[int, int] | None = None,
    rank_state: Mapping[str, Any] | None = None,
    created_at: float | None = None,
) -> FileReceipt:
    """Write this rank's shard into the checkpoint ``directory``; returns its receipt.

    ``window_state`` is :meth:`RecencyWindow.state_dict`; its items and offsets must
    belong to partitions this rank owns under ``ownership`` (ValueError otherwise: state
    of someone else's partition would be restored twice). ``dead_letters`` maps a
    partition to its dead-letter acknowledgement state (JSON-able or tensors; opaque here)
    and moves with the partition. ``rank_state`` (the sampler's progress, ...) is restored
    only under the same ownership. The window's own key RNG state goes there too.
    """
    directory = Path(directory)
    created_at = time.time() if created_at is None else float(created_at)
    sections = split_window_state(window_state, dead_letters=dead_letters, accepted_by_partition=accepted_by_partition)
    foreign = sorted({s.partition for s in sections if ownership.owner(s.partition) != rank})
    if foreign:
        raise ValueError(
            f"rank {rank} of {ownership.world_size} holds state of partitions {foreign[:8]} that it does not own "
            f"(partition p belongs to rank p mod {ownership.world_size}); ingest must only consume owned partitions"
        )
    blobs: list[list[bytes]] = []
    table: list[dict[str, Any]] = []
    start = 0
    for section in sections:
        chunks = encode_checkpoint(section.state(), step=step, created_at=created_at)
        length = sum(len(c) for c in chunks)
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        table.append(
            {
                "partition": section.partition,
                "start": start,
                "length": length,
                "sha256": digest.hexdigest(),
                "items": section.items,
                "next_offset": section.next_offset,
            }
        )
        blobs.append(chunks)
        start += length
    local = {"window_rng_state": window_state.get("rng_state"), **dict(rank_state or {})}
    local_chunks = encode_checkpoint(local, step=step, created_at=created_at)
    local_digest = hashlib.sha256()
    for chunk in local_chunks:
        local_digest.update(chunk)
    local_entry = {"start": start, "length": sum(len(c) for c in local_chunks), "sha256": local_digest.hexdigest()}
    reference_ts = window_state.get("reference_ts")
    index = _json_bytes(
        {
            "format": SHARD_FORMAT,
            "version": FORMAT_VERSION,
            "step": int(step),
            "created_at": created_at,
            "rank": int(rank),
            "topic": topic,
            "ownership": ownership.as_dict(),
            "window": {
                "channels": int(window_state["channels"]),
                "capacity": int(window_state["capacity"]),
                "half_life_s": _half_life_to_json(float(window_state["half_life_s"])),
                "reference_ts": None if reference_ts is None else float(reference_ts),
                "accepted_total": int(window_state.get("accepted_total", 0)),
                "rejected_total": {str(k): int(v) for k, v in dict(window_state.get("rejected_total") or {}).items()},
                "version": int(window_state.get("version", 0)),
            },
            "sections": table,
            "rank_state": local_entry,
        }
    )
    prefix = _SHARD_PREFIX.pack(SHARD_MAGIC, len(index), hashlib.sha256(index).digest())

    def chunks() -> Iterable[bytes]:
        yield prefix
        yield index
        for blob in blobs:
            yield from blob
        yield from local_chunks

    size, sha = _write_atomically(directory / shard_name(rank), chunks())
    return FileReceipt(file=shard_name(rank), size=size, sha256=sha, index_sha256=hashlib.sha256(index).hexdigest())


def write_common(
    directory: Path | str, state: Mapping[str, Any], *, step: int, created_at: float | None = None
) -> FileReceipt:
    """Write the state every rank shares (model, optimizer, norm, trainer counters): rank 0, once."""
    created_at = time.time() if created_at is None else float(created_at)
    size, sha = _write_atomically(
        Path(directory) / COMMON_NAME, encode_checkpoint(state, step=step, created_at=created_at)
    )
    return FileReceipt(file=COMMON_NAME, size=size, sha256=sha)


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
        index = _read_shard_index(directory / receipt.file, receipt)
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
        "next_offsets": dict(sorted(next_offsets.items(), key=lambda kv: int(kv[0]))),
    }
    manifest["sha256"] = _manifest_digest(manifest)
    path = directory / MANIFEST_NAME
    _write_atomically(path, [json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode("ascii")])
    return path


def _manifest_digest(record: Mapping[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON without its own digest: no bit goes unchecked."""
    return hashlib.sha256(_json_bytes({k: v for k, v in record.items() if k != "sha256"})).hexdigest()


# ----------------------------------------------------------------------------------------
# reading


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
    def world_size(self) -> int:
        return self.ownership.world_size

    @property
    def partition_count(self) -> int:
        return self.ownership.partition_count


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
        record = json.loads(raw, parse_constant=_reject_constant)
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
        int(window["channels"]), int(window["capacity"]), _half_life_from_json(window["half_life_s"])
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
    name = _DIR_NAME.match(directory.name)
    if name is not None and int(name.group(1)) != manifest.step:
        raise CorruptCheckpoint(directory, f"directory says step {int(name.group(1))}, manifest says {manifest.step}")
    return manifest


def _reject_constant(constant: str) -> None:
    raise ValueError(f"bare {constant} is not part of the format")


def _is_plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _check_file(path: Path, size: int) -> None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "missing: the manifest lists it, the directory does not hold it") from None
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    if actual != size:
        raise CorruptCheckpoint(path, f"{actual} bytes, the manifest says {size} (truncated or overwritten)")


def _read_shard_index(path: Path, expected: FileReceipt | Mapping[str, Any]) -> dict[str, Any]:
    """Read and verify a shard's prefix and index against the manifest (or a receipt)."""
    size = expected.size if isinstance(expected, FileReceipt) else int(expected["size"])
    index_sha = expected.index_sha256 if isinstance(expected, FileReceipt) else expected.get("index_sha256")
    _check_file(path, size)
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
        record = json.loads(index, parse_constant=_reject_constant)
        if record.get("format") != SHARD_FORMAT or record.get("version") != FORMAT_VERSION:
            raise ValueError(f"format {record.get('format')!r} version {record.get('version')!r}")
        data_start = _SHARD_PREFIX.size + length
        end = data_start
        for entry in [*record["sections"], record["rank_state"]]:
            if int(entry["start"]) != end - data_start or int(entry["length"]) < 0:
                raise ValueError(f"section table entry {entry!r} does not follow the one before")
            end += int(entry["length"])
        if end != size:
            raise ValueError(f"sections end at byte {end}, the shard has {size}")
        record["_data_start"] = data_start
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(path, f"shard index is malformed: {exc}") from exc
    return record


def _read_blob(path: Path, data_start: int, entry: Mapping[str, Any]) -> LoadedCheckpoint:
    try:
        with open(path, "rb") as file:
            file.seek(data_start + int(entry["start"]))
            data = file.read(int(entry["length"]))
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorruptCheckpoint(path, f"SHA-256 mismatch in the section at byte {int(entry['start'])} (bit rot)")
    return decode_checkpoint(data, path)


def verify_checkpoint(directory: Path | str) -> Manifest:
    """Check every byte of a checkpoint against its manifest (whole-file SHA-256s)."""
    manifest = read_manifest(directory)
    for entry in [manifest.common, *manifest.shards]:
        path = manifest.directory / entry["file"]
        _check_file(path, int(entry["size"]))
        try:
            _, sha = _file_sha256(path)
        except OSError as exc:
            raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
        if sha != entry["sha256"]:
            raise CorruptCheckpoint(path, "SHA-256 mismatch against the manifest (bit rot or partial overwrite)")
    return manifest


def read_common(manifest: Manifest) -> LoadedCheckpoint:
    """The shared state (model, optimizer, ...), verified against the manifest."""
    entry = manifest.common
    path = manifest.directory / entry["file"]
    _check_file(path, int(entry["size"]))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CorruptCheckpoint(path, "SHA-256 mismatch against the manifest (bit rot or partial overwrite)")
    loaded = decode_checkpoint(data, path)
    if loaded.step != manifest.step:
        raise CorruptCheckpoint(path, f"holds step {loaded.step}, the manifest says {manifest.step}")
    return loaded


# ----------------------------------------------------------------------------------------
# restoring a rank's share


@dataclass
class RestoredShare:
    """What one rank takes back from a checkpoint (under possibly another world size)."""

    step: int
    path: Path
    common: dict[str, Any]  # model, optimizer, norm, trainer state (empty for legacy without it)
    window_state: dict[str, Any]  # for RecencyWindow.load_state_dict
    next_offsets: dict[int, int]  # partition -> next offset, for the partitions it now owns
    owned_partitions: list[int]
    new_partitions: list[int]  # owned, but not in the checkpoint: read from committed/earliest offsets
    topology_changed: bool  # world size or partition count differ from the checkpoint's
    rank_state: dict[str, Any] | None  # the rank-local state, only when the topology is unchanged
    dead_letters: dict[int, Any] = field(default_factory=dict)
    source_ranks: list[int] = field(default_factory=list)  # old ranks whose shards this share read
    loaded: LoadedCheckpoint | None = None  # a one-file checkpoint as read (restored from one)


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
    else), verifies each against the shard index and the index against the manifest.
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
    sections: list[Section] = []
    shard_meta: dict[int, dict[str, Any]] = {}
    rank_state: dict[str, Any] | None = None
    for entry in manifest.shards:
        old_rank = int(entry["rank"])
        if unchanged and old_rank != rank:
            continue  # same ownership: only this rank's own shard holds its partitions
        if not unchanged and not owned_set.intersection(int(p) for p in entry["partitions"]):
            continue  # holds none of them (the manifest's lists are disjoint, checked on reading it)
        path = manifest.directory / str(entry["file"])
        index = _read_shard_index(path, entry)
        if int(index["rank"]) != old_rank or int(index["step"]) != manifest.step or index["topic"] != manifest.topic:
            raise CorruptCheckpoint(
                path, f"shard says rank {index['rank']} step {index['step']}, the manifest disagrees"
            )
        if [int(e["partition"]) for e in index["sections"]] != [int(p) for p in entry["partitions"]]:
            raise CorruptCheckpoint(path, "the shard's partitions are not the ones the manifest lists")
        window = index["window"]
        shard_meta[old_rank] = window
        for section_entry in index["sections"]:
            partition = int(section_entry["partition"])
            if partition not in owned_set:
                continue
            loaded = _read_blob(path, index["_data_start"], section_entry)
            try:
                section = Section.from_state(loaded.state, int(window["channels"]), str(path))
            except ValueError as exc:
                raise CorruptCheckpoint(path, str(exc)) from exc
            if section.partition != partition or section.items != int(section_entry["items"]):
                raise CorruptCheckpoint(path, f"section of partition {partition} does not match its index entry")
            section.source_rank = old_rank
            sections.append(section)
        if unchanged:
            rank_state = dict(_read_blob(path, index["_data_start"], index["rank_state"]).state)
    common = read_common(manifest).state if load_common else {}
    window_state = _merge_sections(
        sections, shard_meta or {-1: _empty_meta(manifest.window)}, unchanged=unchanged, rank_state=rank_state
    )
    if rank_state is not None:
        rank_state.pop("window_rng_state", None)
    next_offsets = {s.partition: s.next_offset for s in sections if s.next_offset is not None}
    return RestoredShare(
        step=manifest.step,
        path=manifest.directory,
        common=common,
        window_state=window_state,
        next_offsets=next_offsets,
        owned_partitions=owned,
        new_partitions=[p for p in owned if p >= manifest.partition_count],
        topology_changed=not unchanged,
        rank_state=rank_state,
        dead_letters={s.partition: s.dead_letters for s in sections if s.dead_letters is not None},
        source_ranks=sorted(shard_meta),
    )


def _merge_sections(
    sections: Sequence[Section],
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
    half_life_s = _half_life_from_json(metas[0]["half_life_s"])
    decay = 0.0 if math.isinf(half_life_s) else _LN2 / half_life_s
    references = [float(m["reference_ts"]) for m in metas if m["reference_ts"] is not None]
    reference = min(references) if references else None
    ordered = sorted(sections, key=lambda s: s.partition)
    columns = {
        name: np.concatenate([s.columns[name] for s in ordered]) if ordered else np.zeros(0, dtype=dtype)
        for name, dtype in _ITEM_COLUMNS
    }
    if not unchanged and ordered and decay > 0.0:
        # key = λ·(ts − L) − ln E: the same event under the common reference L' gets key + λ·(L − L')
        shifts = []
        for section in ordered:
            old_reference = shard_meta[section.source_rank]["reference_ts"]
            shift = 0.0 if old_reference is None or reference is None else decay * (float(old_reference) - reference)
            shifts.append(np.full(section.items, shift))
        columns["keys"] = columns["keys"] + np.concatenate(shifts)
    partitions = (
        np.concatenate([np.full(s.items, s.partition, dtype=np.int32) for s in ordered])
        if ordered
        else np.zeros(0, np.int32)
    )
    n = partitions.shape[0]
    rejected_total: dict[str, int] = {}
    if unchanged:
        meta = metas[0]
        accepted_total = int(meta["accepted_total"])
        rejected_total = {str(k): int(v) for k, v in dict(meta.get("rejected_total") or {}).items()}
        version = int(meta["version"])
    else:
        # the ledger of refused messages is kept per rank, not per partition: after a
        # rescale it starts again from the items restored
        # arrival order across shards is unknown: renumber by event time (then partition, offset)
        order = np.lexsort((columns["offsets"], partitions, columns["ts"]))
        seq = np.empty(n, dtype=np.int64)
        seq[order] = np.arange(n, dtype=np.int64)
        columns["seq"] = seq
        known = [s.accepted_total for s in ordered]
        accepted_total = int(sum(known)) if ordered and all(a is not None for a in known) else n  # type: ignore[misc]
        version = max(int(m["version"]) for m in metas)
    return {
        "capacity": int(metas[0]["capacity"]),
        "half_life_s": half_life_s,
        "channels": channels,
        "reference_ts": reference,
        "values": np.concatenate([s.values for s in ordered]) if ordered else np.zeros((0, channels), np.float32),
        "lengths": columns["lengths"],
        "ts": columns["ts"],
        "labels": columns["labels"],
        "keys": columns["keys"],
        "sensor_ids": np.concatenate([s.sensor_ids for s in ordered]) if ordered else np.zeros(0, dtype=object),
        "partitions": partitions,
        "offsets": columns["offsets"],
        "seq": columns["seq"],
        "next_offsets": {str(s.partition): s.next_offset for s in ordered if s.next_offset is not None},
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
    sections = split_window_state(window_state)
    held = [s.partition for s in sections]
    if partition_count is None:
        partition_count = max(held) + 1 if held else 0
    if held and max(held) >= partition_count:
        raise CheckpointMismatch(
            f"checkpoint {loaded.path.name} holds partition {max(held)}, the topic has {partition_count} partitions; "
            "the topic was recreated: use a fresh CHECKPOINT_DIR"
        )
    ownership = Ownership(world_size=world_size, partition_count=partition_count)
    owned = ownership.partitions_of(rank)
    mine = [s for s in sections if s.partition in set(owned)]
    unchanged = world_size == 1
    meta = {
        "channels": int(window_state["channels"]),
        "capacity": int(window_state["capacity"]),
        "half_life_s": _half_life_to_json(float(window_state["half_life_s"])),
        "reference_ts": window_state.get("reference_ts"),
        "accepted_total": int(window_state.get("accepted_total", 0)),
        "rejected_total": dict(window_state.get("rejected_total") or {}),
        "version": int(window_state.get("version", 0)),
    }
    rank_state = {"window_rng_state": window_state.get("rng_state")} if unchanged else None
    merged = _merge_sections(mine, {0: meta}, unchanged=unchanged, rank_state=rank_state)
    return RestoredShare(
        step=loaded.step,
        path=loaded.path,
        common={key: value for key, value in state.items() if key != "window"},
        window_state=merged,
        next_offsets={s.partition: s.next_offset for s in mine if s.next_offset is not None},
        owned_partitions=owned,
        new_partitions=[p for p in owned if p not in set(held)],
        topology_changed=not unchanged,
        rank_state={} if unchanged else None,
        source_ranks=[0],
        loaded=loaded,
    )


# ----------------------------------------------------------------------------------------
# a directory of sharded checkpoints


@dataclass(frozen=True)
class CheckpointDirInfo:
    """A checkpoint directory as its name describes it (not yet verified)."""

    path: Path
    step: int
    created_ms: int
    complete: bool  # it has a manifest (not yet read)

    @property
    def order(self) -> tuple[int, int]:
        return (self.step, self.created_ms)


class ShardedCheckpointStore:
    """The sharded checkpoints under one root (``CHECKPOINT_DIR``), newest first.

    Writing goes through :class:`DistributedCheckpointer` (all ranks together); this
    class lists, reads and prunes. Only rank 0 prunes, and only right after sealing a
    checkpoint, when no other checkpoint can be in flight.
    """

    def __init__(
        self,
        root: Path | str,
        keep: int = 3,
        on_corrupt: Callable[[Path, str], None] | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint")
        self.root = Path(root)
        self.keep = keep
        self.on_corrupt = on_corrupt
        self._reported: set[tuple[str, str]] = set()

    def directory_for(self, step: int, created_ms: int) -> Path:
        return self.root / checkpoint_dir_name(step, created_ms)

    def create_directory(self, step: int, created_ms: int) -> Path:
        """Make (or find) the directory of one checkpoint; every rank calls it."""
        path = self.directory_for(step, created_ms)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def scan(self) -> list[CheckpointDirInfo]:
        """Checkpoint directories by name, newest first (step, then creation time)."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        infos = []
        for entry in entries:
            match = _DIR_NAME.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            complete = os.path.exists(os.path.join(entry.path, MANIFEST_NAME))
            infos.append(CheckpointDirInfo(Path(entry.path), int(match.group(1)), int(match.group(2)), complete))
        infos.sort(key=lambda info: info.order, reverse=True)
        return infos

    def manifests(self) -> list[Manifest]:
        """The manifests that parse, newest first; the rest are reported once and skipped."""
        found = []
        for info in self.scan():
            if not info.complete:
                continue
            try:
                found.append(read_manifest(info.path))
            except CorruptCheckpoint as err:
                self.report_corrupt(err)
        return found

    def report_corrupt(self, err: CorruptCheckpoint) -> None:
        key = (str(err.path), err.reason)
        if key in self._reported:
            return
        self._reported.add(key)
        log.warning("skipping checkpoint %s: %s; falling back to an older one", err.path, err.reason)
        if self.on_corrupt is not None:
            try:
                self.on_corrupt(err.path, err.reason)
            except Exception:  # noqa: BLE001
                log.exception("on_corrupt callback failed for %s", err.path)

    def delete(self, path: Path) -> None:
        """Delete one checkpoint directory, its manifest FIRST (then it is no longer complete)."""
        manifest = path / MANIFEST_NAME
        if manifest.exists():
            manifest.unlink()
            _fsync_directory(path)
        shutil.rmtree(path)

    def prune(self, just_written: Path) -> list[Path]:
        """Keep the ``keep`` newest complete checkpoints; delete older ones and older leftovers.

        Incomplete directories older than the one just written are failed attempts and go
        too; anything newer than it is left alone (and logged), as is ``just_written``.
        """
        infos = self.scan()
        written = next((info for info in infos if info.path == just_written), None)
        if written is None:
            return []
        deleted = []
        kept = 0
        for info in infos:
            if info.path == just_written:
                kept += 1
                continue
            if info.order > written.order:
                if info.complete:
                    kept += 1
                log.warning(
                    "checkpoint %s sorts after the one just written (%s); restore will prefer it. "
                    "Give each run its own checkpoint directory.",
                    info.path.name,
                    just_written.name,
                )
                continue
            if info.complete and kept < self.keep:
                kept += 1
                continue
            try:
                self.delete(info.path)
                deleted.append(info.path)
            except OSError as exc:
                log.warning("could not delete old checkpoint %s: %s", info.path, exc)
        return deleted


# ----------------------------------------------------------------------------------------
# all ranks together


@dataclass(frozen=True)
class SaveResult:
    """The outcome of one collective checkpoint, the same on every rank (but next_offsets)."""

    ok: bool  # the manifest is durable: the checkpoint is complete
    step: int
    path: Path
    next_offsets: dict[int, int]  # this rank's partitions: commit them to the group once ok
    error: str | None
    seconds: float


class DistributedCheckpointer:
    """Cuts and restores sharded checkpoints with every rank, in lockstep.

    ``save`` must be called by every rank at the same step (the lockstep agreement
    decides when): each writes its shard, rank 0 also the shared state; the receipts are
    gathered; rank 0 seals the checkpoint with the manifest and tells everyone. A rank
    that fails to write makes the whole checkpoint fail (no manifest), on every rank alike.

    ``restore`` walks the complete checkpoints newest first, as rank 0 lists them, until
    one loads on every rank; a corrupt one anywhere makes every rank fall back together,
    so no two ranks ever restore different steps.
    """

    def __init__(self, store: ShardedCheckpointStore, collectives: Collectives, *, topic: str) -> None:
        self.store = store
        self.collectives = collectives
        self.topic = topic

    @property
    def rank(self) -> int:
        return self.collectives.rank

    def save(
        self,
        *,
        step: int,
        partition_count: int,
        window_state: Mapping[str, Any],
        common_state: Mapping[str, Any] | None,
        dead_letters: Mapping[int, Any] | None = None,
        accepted_by_partition: Mapping[int, int] | None = None,
        rank_state: Mapping[str, Any] | None = None,
        veto: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> SaveResult:
        """Cut this rank's part of the checkpoint of ``step``; every rank calls it together.

        ``veto`` (a reason) makes this rank refuse the checkpoint while still taking part
        in its collectives, e.g. when its dead letters are not acknowledged: then no
        manifest is written and every rank gets ``ok=False``.
        """
        started = time.perf_counter()
        c = self.collectives
        if c.rank == 0 and common_state is None:
            raise ValueError("rank 0 writes the shared state: pass common_state")
        # rank 0's clock names the directory; the partition count is the largest any rank saw,
        # and at least covers every partition a window holds state of
        partition_count = max(int(partition_count), _partitions_held(window_state))
        proposal = c.all_gather_rows(
            torch.tensor([int(clock() * 1000), int(step), int(partition_count)], dtype=torch.int64)
        )
        created_ms = int(proposal[0, 0])
        if bool((proposal[:, 1] != step).any()):
            raise RuntimeError(
                f"ranks cut a checkpoint at different steps {proposal[:, 1].tolist()}; they must run in lockstep"
            )
        partition_count = int(proposal[:, 2].max())
        ownership = Ownership(world_size=c.world_size, partition_count=partition_count)
        created_at = created_ms / 1000
        directory = self.store.directory_for(step, created_ms)
        error: str | None = None
        receipt = FileReceipt(file=shard_name(c.rank), size=0, sha256="0" * 64, index_sha256="0" * 64)
        common_receipt: FileReceipt | None = None
        try:
            if veto is not None:
                raise RuntimeError(veto)
            self.store.create_directory(step, created_ms)
            receipt = write_shard(
                directory,
                step=step,
                rank=c.rank,
                ownership=ownership,
                topic=self.topic,
                window_state=window_state,
                dead_letters=dead_letters,
                accepted_by_partition=accepted_by_partition,
                rank_state=rank_state,
                created_at=created_at,
            )
            if c.rank == 0:
                common_receipt = write_common(directory, common_state or {}, step=step, created_at=created_at)
        except Exception as err:  # noqa: BLE001 - the others must hear about it, not wait for us
            error = (
                f"rank {c.rank} could not write its part of checkpoint {directory.name}: {type(err).__name__}: {err}"
            )
            log.error("%s", error)
        rows = c.all_gather_rows(receipt.as_row(ok=error is None))
        sealed = False
        if c.rank == 0:
            receipts = []
            failed = []
            for rank, row in enumerate(rows.tolist()):
                ok, shard_receipt = FileReceipt.from_row(row, shard_name(rank))
                receipts.append(shard_receipt)
                if not ok:
                    failed.append(rank)
            if failed or common_receipt is None:
                error = error or f"ranks {failed} could not write their shards of {directory.name}"
            else:
                try:
                    write_manifest(
                        directory,
                        step=step,
                        topic=self.topic,
                        ownership=ownership,
                        common=common_receipt,
                        shards=receipts,
                        created_at=created_at,
                    )
                    sealed = True
                except Exception as err:  # noqa: BLE001
                    error = f"could not seal checkpoint {directory.name}: {type(err).__name__}: {err}"
                    log.error("%s", error)
        sealed = bool(c.broadcast_ints([1 if sealed else 0])[0])
        if sealed and c.rank == 0:
            try:
                self.store.prune(directory)
            except OSError as exc:
                log.warning("could not prune checkpoints in %s: %s", self.store.root, exc)
        if not sealed and error is None:
            error = f"checkpoint {directory.name} was not sealed (another rank failed; see its log)"
        offsets = {int(p): int(o) for p, o in dict(window_state.get("next_offsets") or {}).items()}
        return SaveResult(
            ok=sealed,
            step=step,
            path=directory,
            next_offsets=offsets if sealed else {},
            error=None if sealed else error,
            seconds=time.perf_counter() - started,
        )

    def restore(
        self,
        *,
        partition_count: int | None,
        legacy: CheckpointStore | None = None,
    ) -> RestoredShare | None:
        """This rank's share of the newest checkpoint that loads on every rank, or None.

        Sharded checkpoints and, with ``legacy``, the one-file checkpoints of a service
        that ran as one process (a :class:`~streamtrain.checkpoint.store.CheckpointStore` in the
        same directory) are candidates together, newest first by (step, creation time):
        whichever world size wrote the newest, it is the one restored. A candidate that
        does not verify on some rank is skipped by every rank alike.

        ``partition_count``: the topic's partition count as this rank knows it, or None
        to take each checkpoint's (ownership does not depend on the count). CheckpointMismatch
        (on every rank) when the newest complete checkpoint belongs to another topic, or
        to a topic with more partitions: a configuration error, not damage, which falling
        back to an older checkpoint would not cure.
        """
        c = self.collectives
        known = c.max_int(-1 if partition_count is None else int(partition_count))
        count = None if known < 0 else known
        candidates: list[tuple[int, int, int]] = []  # (step, created_ms, kind): kind 0 sharded, 1 one-file
        if c.rank == 0:
            candidates = [(m.step, _created_ms(m), 0) for m in self.store.manifests()]
            if candidates and legacy is not None:
                candidates += [(info.step, int(round(info.created_at * 1000)), 1) for info in legacy.list()]
            candidates.sort(reverse=True)
        if c.broadcast_ints([len(candidates)])[0] == 0:
            # no sharded checkpoint: the one-file store's own newest-valid rule, unchanged
            return None if legacy is None else self._restore_legacy(legacy.load_latest, count)
        position = 0
        while True:
            proposal = list(candidates[position]) if c.rank == 0 and position < len(candidates) else [-1, -1, -1]
            step, created_ms, kind = c.broadcast_ints(proposal)
            if step < 0:
                return None
            status, share, reason = 0, None, ""
            try:
                if kind == 0:
                    manifest = read_manifest(self.store.directory_for(step, created_ms))
                    share = restore_share(
                        manifest, rank=c.rank, world_size=c.world_size, partition_count=count, topic=self.topic
                    )
                else:
                    share = self._read_legacy(legacy, step, created_ms, count)  # type: ignore[arg-type]
                    status = 0 if share is not None else 1
            except CheckpointMismatch as err:
                status, reason = 2, str(err)
            except CorruptCheckpoint as err:
                self.store.report_corrupt(err)
                status = 1
            verdict = c.max_int(status)
            if verdict == 0:
                assert share is not None
                log.info(
                    "restored step %d from %s: %d items of partitions %s%s",
                    share.step,
                    share.path.name,
                    len(share.window_state["lengths"]),
                    share.owned_partitions,
                    " (rescaled)" if share.topology_changed else "",
                )
                return share
            if verdict == 2:
                raise CheckpointMismatch(reason or f"another rank refused checkpoint step {step}; see rank 0's log")
            position += 1

    def _read_legacy(
        self, legacy: CheckpointStore, step: int, created_ms: int, partition_count: int | None
    ) -> RestoredShare | None:
        """This rank's share of the one-file checkpoint named by (step, created_ms); None when it is corrupt."""
        c = self.collectives
        info = next((i for i in legacy.list() if (i.step, int(round(i.created_at * 1000))) == (step, created_ms)), None)
        loaded = None if info is None else legacy.read(info.path)  # reports a corrupt file itself
        if loaded is None:
            return None
        return share_from_single_file(loaded, rank=c.rank, world_size=c.world_size, partition_count=partition_count)

    def _restore_legacy(
        self, legacy: Callable[[], LoadedCheckpoint | None], partition_count: int | None
    ) -> RestoredShare | None:
        c = self.collectives
        loaded = legacy()
        step = -1 if loaded is None else loaded.step
        if c.max_int(step) != step or (c.world_size > 1 and -c.max_int(-step) != step):
            raise RuntimeError(
                "ranks found different one-file checkpoints; CHECKPOINT_DIR must be one shared directory"
            )
        if loaded is None:
            return None
        share = share_from_single_file(loaded, rank=c.rank, world_size=c.world_size, partition_count=partition_count)
        log.info("restored one-file checkpoint %s as rank %d of %d", loaded.path.name, c.rank, c.world_size)
        return share


def _partitions_held(window_state: Mapping[str, Any]) -> int:
    """1 + the largest partition a window state holds items or an offset of (0 for none)."""
    partitions = np.asarray(window_state.get("partitions", []), dtype=np.int64).reshape(-1)
    offsets = [int(p) for p in dict(window_state.get("next_offsets") or {})]
    held = partitions.tolist() + offsets
    return max(held) + 1 if held else 0


def load_latest_common(root: Path | str) -> LoadedCheckpoint | None:
    """The shared state (``{"trainer": ...}``) of the newest valid checkpoint of either kind.

    For readers that need only the model (``streamtrain export``): a sharded checkpoint's
    common state verified against its manifest, or a one-file checkpoint (whose state also
    holds the window). Newest by (step, creation time); damaged ones are skipped.
    """
    sharded = ShardedCheckpointStore(root)
    legacy = CheckpointStore(root)
    candidates: list[tuple[int, int, Any]] = [(m.step, _created_ms(m), m) for m in sharded.manifests()]
    candidates += [(i.step, int(round(i.created_at * 1000)), i) for i in legacy.list()]
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    for _, _, candidate in candidates:
        if isinstance(candidate, Manifest):
            try:
                return read_common(candidate)
            except CorruptCheckpoint as err:
                sharded.report_corrupt(err)
                continue
        loaded = legacy.read(candidate.path)
        if loaded is not None:
            return loaded
    return None


def _created_ms(manifest: Manifest) -> int:
    match = _DIR_NAME.match(manifest.directory.name)
    return int(match.group(2)) if match else int(manifest.created_at * 1000)
