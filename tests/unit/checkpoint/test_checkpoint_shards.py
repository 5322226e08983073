"""Shard files: a rank writes only what it owns, and reading one never unpickles."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sharded_cluster import (
    TOPIC,
    Cluster,
    Topic,
    two_checkpoints,
)

from streamtrain.checkpoint.format import CorruptCheckpoint, decode_checkpoint, encode_checkpoint
from streamtrain.checkpoint.incremental import PendingWindow
from streamtrain.checkpoint.manifest import read_manifest
from streamtrain.checkpoint.rescale import restore_share
from streamtrain.checkpoint.shards import (
    FORMAT_VERSION,
    SHARD_FORMAT,
    SHARD_MAGIC,
    FileReceipt,
    canonical_json,
    check_file_size,
    delta_section_items,
    read_shard_blob,
    read_shard_index,
    section_items,
    shard_present,
    window_meta,
    write_common,
    write_shard,
)
from streamtrain.distributed.ownership import Ownership


def test_a_rank_cannot_save_partitions_it_does_not_own(tmp_path: Path) -> None:
    topic = Topic(partitions=2)
    topic.produce(20)
    one = Cluster(1, 1000, math.inf)
    one.consume(topic)
    with pytest.raises(ValueError, match=r"partitions \[1\] that it does not own"):
        write_shard(
            tmp_path, step=0, rank=0, ownership=Ownership(2, 2), topic=TOPIC, window_state=one.windows[0].state_dict()
        )


def test_nothing_is_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, newer = two_checkpoints(tmp_path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a checkpoint read tried to unpickle")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    share = restore_share(read_manifest(newer), rank=0, world_size=1, partition_count=3, topic=TOPIC)
    assert len(share.window_state["lengths"]) == 200


# ------------------------------------------------------------------ a shard's prefix and index, by hand
PREFIX = struct.Struct("<8sQ32s")  # as shards.py's docstring lays a shard out: magic, index length, its SHA-256
INDEX = {
    "format": SHARD_FORMAT,
    "version": FORMAT_VERSION,
    "sections": [{"start": 0, "length": 3}, {"start": 3, "length": 0}],
    "rank_state": {"start": 3, "length": 2},
}


def shard_file(
    path: Path,
    index: dict[str, Any] | bytes = INDEX,
    data: bytes = b"abcde",
    *,
    magic: bytes = SHARD_MAGIC,
    length: int | None = None,
    digest: bytes | None = None,
) -> dict[str, Any]:
    """Write a shard of ``index`` and ``data``; what a manifest would say of it."""
    raw = index if isinstance(index, bytes) else json.dumps(index).encode()
    prefix = PREFIX.pack(magic, len(raw) if length is None else length, digest or hashlib.sha256(raw).digest())
    path.write_bytes(prefix + raw + data)
    return {"size": path.stat().st_size, "index_sha256": hashlib.sha256(raw).hexdigest()}


def refusal(path: Path, expected: Any) -> str:
    with pytest.raises(CorruptCheckpoint) as err:
        read_shard_index(path, expected)
    assert err.value.path == path
    return err.value.reason


def test_a_sound_shard_index_is_read_with_where_its_data_starts(tmp_path: Path) -> None:
    path = tmp_path / "shard-00000.stsh"
    sealed = shard_file(path)
    raw = json.dumps(INDEX).encode()
    for expected in (sealed, {"size": sealed["size"], "index_sha256": None}, {"size": sealed["size"]}):
        assert read_shard_index(path, expected) == {**INDEX, "_data_start": PREFIX.size + len(raw)}
    receipt = FileReceipt(path.name, sealed["size"], "0" * 64, sealed["index_sha256"])
    assert read_shard_index(path, receipt)["_data_start"] == PREFIX.size + len(raw)
    with_blob = {**INDEX, "partitioned_state": {"start": 5, "length": 1}}
    sealed = shard_file(path, with_blob, b"abcdef")
    assert read_shard_index(path, sealed)["partitioned_state"] == {"start": 5, "length": 1}


def test_each_check_of_a_shard_index_names_the_file_and_what_failed(tmp_path: Path) -> None:
    path = tmp_path / "shard-00001.stsh"
    path.write_bytes(b"\x89STS")
    assert refusal(path, {"size": 4}) == "shorter than the shard prefix (truncated)"
    sealed = shard_file(path, magic=b"PK\x03\x04\x00\x00\x00\x00")
    assert refusal(path, sealed) == (
        f"magic bytes {b'PK' + bytes([3, 4, 0, 0, 0, 0])!r} are not {SHARD_MAGIC!r}: not a streamtrain shard"
    )
    sealed = shard_file(path, length=10**6)
    assert refusal(path, sealed) == f"index length 1000000 is impossible for a {sealed['size']}-byte shard"
    sealed = shard_file(path)
    size = sealed["size"]
    sealed = shard_file(path, length=size)  # as long as the whole file: possible to ask, short to read
    assert refusal(path, sealed) == "SHA-256 mismatch in the shard index (bit rot or partial overwrite)"
    sealed = shard_file(path, digest=bytes(32))
    assert refusal(path, sealed) == "SHA-256 mismatch in the shard index (bit rot or partial overwrite)"
    sealed = shard_file(path)
    for other in ({**sealed, "index_sha256": "0" * 64}, FileReceipt(path.name, sealed["size"], "0" * 64, "1" * 64)):
        assert refusal(path, other) == "the shard index is not the one the manifest sealed (SHA-256 mismatch)"
    directory = tmp_path / "a-directory"
    directory.mkdir()
    reason = refusal(directory, {"size": directory.stat().st_size})
    assert reason == f"unreadable: [Errno 21] Is a directory: '{directory}'"


@pytest.mark.parametrize(
    ("index", "data", "why"),
    [
        (b'{"format": NaN}', b"", "bare NaN is not part of the format"),
        ({**INDEX, "version": 2}, b"abcde", "format 'streamtrain.shard' version 2"),
        ({**INDEX, "format": "streamtrain.checkpoint"}, b"abcde", "format 'streamtrain.checkpoint' version 1"),
        (
            {**INDEX, "rank_state": {"start": 4, "length": 1}},
            b"abcde",
            "section table entry {'start': 4, 'length': 1} does not follow the one before",
        ),
        (
            {**INDEX, "sections": [{"start": 0, "length": -1}]},
            b"abcde",
            "section table entry {'start': 0, 'length': -1} does not follow the one before",
        ),
        (INDEX, b"abcdef", "sections end at byte {end}, the shard has {size}"),
        ({"format": SHARD_FORMAT, "version": FORMAT_VERSION}, b"", "'sections'"),
    ],
    ids=["nan", "version", "format", "gap", "negative", "trailing", "no-sections"],
)
def test_a_malformed_shard_index_is_refused_with_what_is_wrong(
    tmp_path: Path, index: Any, data: bytes, why: str
) -> None:
    path = tmp_path / "shard-00002.stsh"
    sealed = shard_file(path, index, data)
    raw = index if isinstance(index, bytes) else json.dumps(index).encode()
    end = PREFIX.size + len(raw) + 5
    why = why.replace("{end}", str(end)).replace("{size}", str(sealed["size"]))
    assert refusal(path, sealed) == "shard index is malformed: " + why


def test_a_shard_of_another_size_than_sealed_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "shard-00003.stsh"
    sealed = shard_file(path)
    assert refusal(path, {**sealed, "size": sealed["size"] + 1}) == (
        f"{sealed['size']} bytes, the manifest says {sealed['size'] + 1} (truncated or overwritten)"
    )
    assert refusal(tmp_path / "gone.stsh", sealed) == "missing: the manifest lists it, the directory does not hold it"
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(CorruptCheckpoint) as err:
        check_file_size(tmp_path / "a-file" / "below-it", 1)
    assert err.value.reason.startswith("unreadable: [Errno 20] Not a directory")


def test_a_section_is_read_against_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "shard-00004.stsh"
    payload = b"".join(bytes(chunk) for chunk in encode_checkpoint({"x": 1}, step=0, created_at=0.0))
    path.write_bytes(b"header" + payload)
    entry = {"start": 0, "length": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    assert read_shard_blob(path, 6, entry).state == {"x": 1}
    with pytest.raises(CorruptCheckpoint) as err:
        read_shard_blob(path, 5, entry)
    assert (err.value.path, err.value.reason) == (path, "SHA-256 mismatch in the section at byte 0 (bit rot)")
    with pytest.raises(CorruptCheckpoint) as err:
        read_shard_blob(tmp_path, 0, entry)
    assert err.value.path == tmp_path and err.value.reason.startswith("unreadable: ")
    garbage = b"not a checkpoint at all"
    path.write_bytes(b"header" + garbage)
    with pytest.raises(CorruptCheckpoint) as err:  # its digest matches; decoding it fails, naming the shard
        read_shard_blob(path, 6, {"start": 0, "length": len(garbage), "sha256": hashlib.sha256(garbage).hexdigest()})
    assert err.value.path == path


def test_a_receipt_travels_as_an_int64_row_and_back(tmp_path: Path) -> None:
    receipt = FileReceipt(
        "shard-00001.stsh", 2**40 + 3, hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    )
    row = receipt.as_row()
    assert row.dtype == torch.int64 and row.shape == (10,) and int(row[0]) == 1
    assert FileReceipt.from_row(row.tolist(), receipt.file) == (True, receipt)
    failed = receipt.as_row(ok=False)
    assert int(failed[0]) == 0 and FileReceipt.from_row(failed, receipt.file)[0] is False
    common = FileReceipt("common.stck", 7, hashlib.sha256(b"c").hexdigest())  # no index: zeros on the wire
    assert common.as_row()[6:].tolist() == [0, 0, 0, 0]
    assert FileReceipt.from_row(common.as_row(), common.file)[1].index_sha256 == "0" * 64


def test_a_parent_shard_is_present_only_sealed_whole_with_the_index_named(tmp_path: Path) -> None:
    directory = tmp_path / "chk-000000000001-1"
    directory.mkdir()
    sealed = shard_file(directory / "shard-00000.stsh")
    parent = {"checkpoint": directory.name, "file": "shard-00000.stsh", "index_sha256": sealed["index_sha256"]}
    assert not shard_present(tmp_path, parent)  # no manifest: not sealed
    (directory / "manifest.json").write_text("{}")
    assert shard_present(tmp_path, parent)
    assert not shard_present(tmp_path, {**parent, "index_sha256": "0" * 64})  # another index
    assert not shard_present(tmp_path, {**parent, "file": "shard-00009.stsh"})  # gone
    shard_file(directory / "shard-00000.stsh", magic=b"NOTSHARD")
    assert not shard_present(tmp_path, parent)  # the index's digest, but not a shard
    (directory / "shard-00000.stsh").write_bytes(b"\x89STS")
    assert not shard_present(tmp_path, parent)  # shorter than a prefix


def test_canonical_json_is_ascii_sorted_and_refuses_what_json_is_not() -> None:
    assert canonical_json({"b": "é", "a": [1, 2.5]}) == b'{"a":[1,2.5],"b":"\\u00e9"}'
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        canonical_json({"x": math.nan})


# ------------------------------------------------------------------ sections and the index's window record
def section(lengths: list[int], channels: int = 2, next_offset: int | None = 7) -> dict[str, Any]:
    n = len(lengths)
    return {
        "partition": 3,
        "next_offset": next_offset,
        "values": np.arange(sum(lengths) * channels, dtype=np.float64).tolist(),  # as any JSON-ish sequence
        "keys": [0.5] * n,
        "ts": list(range(n)),
        "labels": [1] * n,
        "lengths": lengths,
        "offsets": list(range(n)),
        "seq": list(range(n)),
        "sensor_ids": ["s"] * n,
    }


def test_a_section_comes_back_as_its_partitions_items_in_the_window_dtypes() -> None:
    part = section_items(section([2, 1]), 2, "shard 0 section 3")
    assert (part.partition, part.next_offset) == (3, 7)
    assert part.values.dtype == np.float32 and part.values.shape == (3, 2)
    assert {name: column.dtype for name, column in part.columns.items()} == {
        "keys": np.float64, "ts": np.float64, "labels": np.int64, "lengths": np.int64,
        "offsets": np.int64, "seq": np.int64, "sensor_ids": object,
    }  # fmt: skip
    assert all(column.shape == (2,) for column in part.columns.values())
    assert section_items(section([1], next_offset=None), 2, "w").next_offset is None
    nested = {**section([2]), "lengths": [[2]], "seq": [[0]]}  # any shape is read flat
    assert section_items(nested, 2, "w").columns["lengths"].shape == (1,)
    entered, left = delta_section_items(
        {"partition": 3, "next_offset": 9, "entered": section([1]), "left_seq": [[4, 5]]}, 2, "w"
    )
    assert entered.next_offset == 9 and left.dtype == np.int64 and left.tolist() == [4, 5]


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({**section([1]), "keys": "abc"}, "section does not hold a window partition: could not convert"),
        ({k: v for k, v in section([1]).items() if k != "seq"}, "section does not hold a window partition: 'seq'"),
        ({**section([2, 1]), "keys": [0.5]}, "section columns have different lengths"),
        ({**section([2, 1]), "lengths": [2, 2]}, "section lengths do not add up to its readings"),
    ],
)
def test_a_section_that_does_not_hold_a_partition_is_refused_with_where_it_is(state: dict, why: str) -> None:
    with pytest.raises(ValueError) as err:
        section_items(state, 2, "shard 1 section 3")
    assert str(err.value).startswith(f"shard 1 section 3: {why}")


def test_a_delta_section_that_does_not_hold_changes_is_refused_with_where_it_is() -> None:
    with pytest.raises(ValueError) as err:
        delta_section_items({"partition": 3, "next_offset": 1, "entered": section([1])}, 2, "shard 1 delta")
    assert str(err.value) == "shard 1 delta: section does not hold a window partition's changes: 'left_seq'"
    with pytest.raises(ValueError, match=r"^shard 1 delta: section lengths do not add up"):
        delta_section_items(
            {"partition": 3, "next_offset": 1, "entered": {**section([1]), "lengths": [5]}, "left_seq": []},
            2,
            "shard 1 delta",
        )


def test_the_window_record_of_an_index_defaults_what_an_older_state_lacks() -> None:
    state = {"channels": 2, "capacity": 10, "half_life_s": math.inf}
    assert window_meta(state) == {
        "channels": 2, "capacity": 10, "half_life_s": None, "reference_ts": None,
        "accepted_total": 0, "rejected_total": {}, "held_out_total": 0, "version": 0,
    }  # fmt: skip
    full = {
        **state, "half_life_s": 30, "reference_ts": 5, "accepted_total": 3, "rejected_total": {1: 2},
        "held_out_total": 6, "version": 4,
    }  # fmt: skip
    assert window_meta(full) == {
        "channels": 2, "capacity": 10, "half_life_s": 30.0, "reference_ts": 5.0,
        "accepted_total": 3, "rejected_total": {"1": 2}, "held_out_total": 6, "version": 4,
    }  # fmt: skip


def test_a_shard_records_when_it_was_written_and_under_which_ownership(tmp_path: Path) -> None:
    topic = Topic(partitions=2)
    topic.produce(20)
    one = Cluster(1, 1000, math.inf)
    one.consume(topic)
    ownership = Ownership(1, 2)
    receipt = write_shard(
        tmp_path, step=0, rank=0, ownership=ownership, topic=TOPIC, window_state=one.windows[0].state_dict(),
        created_at=1234.5,
    )  # fmt: skip
    index = read_shard_index(tmp_path / receipt.file, receipt)
    assert index["created_at"] == 1234.5 and index["ownership"] == ownership.as_dict()


def test_a_rank_holding_many_foreign_partitions_is_told_the_first_eight(tmp_path: Path) -> None:
    topic = Topic(partitions=20)
    topic.produce(200)
    one = Cluster(1, 1000, math.inf)
    one.consume(topic)
    with pytest.raises(ValueError) as err:
        write_shard(
            tmp_path, step=0, rank=0, ownership=Ownership(2, 20), topic=TOPIC, window_state=one.windows[0].state_dict()
        )
    assert str(err.value).startswith(
        "rank 0 of 2 holds state of partitions [1, 3, 5, 7, 9, 11, 13, 15] that it does not own (partition p "
        "belongs to rank p mod 2); ingest must only consume owned partitions"
    )


@pytest.mark.parametrize(
    ("partitions", "left_partitions"),
    [(None, None), (np.zeros(0, np.int32), None), (None, np.zeros(0, np.int32))],
    ids=["neither", "no-left", "no-items"],
)
def test_a_delta_without_the_partitions_of_its_items_is_refused(
    tmp_path: Path, partitions: Any, left_partitions: Any
) -> None:
    """DistributedCheckpointer refuses such a chain first; write_shard says so on its own too."""
    window = PendingWindow({}, "delta", np.zeros(0, np.int64), None, partitions, left_partitions)
    with pytest.raises(ValueError) as err:
        write_shard(tmp_path, step=1, rank=0, ownership=Ownership(1, 1), topic=TOPIC, window_state=window)
    assert str(err.value) == (
        "a shard's delta needs the partitions of its items: build it with WindowChain(by_partition=True)"
    )


def test_the_shared_state_is_written_once_with_its_receipt_and_the_time_it_was_cut(tmp_path: Path) -> None:
    before = time.time()
    receipt = write_common(tmp_path, {"trainer": {"step": 3}}, step=3)
    path = tmp_path / receipt.file
    assert receipt.size == path.stat().st_size and receipt.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert receipt.index_sha256 is None
    loaded = decode_checkpoint(path.read_bytes(), path)
    assert loaded.state == {"trainer": {"step": 3}} and loaded.step == 3 and before <= loaded.created_at <= time.time()
    given = write_common(tmp_path, {"x": 1}, step=0, created_at=12.5)
    assert decode_checkpoint((tmp_path / given.file).read_bytes()).created_at == 12.5
