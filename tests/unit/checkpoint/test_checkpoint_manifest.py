"""The manifest: it lists the cut, and verifying against it catches any flipped bit."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sharded_cluster import (
    TOPIC,
    damage_common,
    damage_section,
    receipts,
    resealed,
    two_checkpoints,
)

import streamtrain.checkpoint.manifest as manifest_module
from streamtrain.checkpoint.files import file_sha256
from streamtrain.checkpoint.format import CorruptCheckpoint
from streamtrain.checkpoint.manifest import (
    _check_chain,
    read_common,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from streamtrain.checkpoint.rescale import restore_share
from streamtrain.checkpoint.shards import FORMAT_NAME, FORMAT_VERSION, FileReceipt
from streamtrain.distributed.ownership import Ownership


def test_manifest_lists_the_cut(tmp_path: Path) -> None:
    topic, _, newer = two_checkpoints(tmp_path)
    record = json.loads((newer / "manifest.json").read_text())
    assert record["ownership"] == {"rule": "modulo", "version": 1, "world_size": 2, "partition_count": 3}
    assert record["topic"] == TOPIC and record["step"] == 9
    assert [s["partitions"] for s in record["shards"]] == [[0, 2], [1]]
    assert sum(s["items"] for s in record["shards"]) == 200
    assert record["next_offsets"] == {str(p): len(e) for p, e in enumerate(topic.events)}
    assert record["window"] == {"channels": 1, "capacity": 10_000, "half_life_s": None}  # both shares
    for entry in [record["common"], *record["shards"]]:
        assert len(entry["sha256"]) == 64 and (newer / entry["file"]).stat().st_size == entry["size"]


def test_verify_catches_a_flip_in_a_section_no_reader_needed(tmp_path: Path) -> None:
    _, _, newer = two_checkpoints(tmp_path)
    manifest = read_manifest(newer)
    damage_section(newer)
    restore_share(manifest, rank=0, world_size=2, partition_count=3, topic=TOPIC)  # rank 0 never reads shard 1
    with pytest.raises(CorruptCheckpoint, match="SHA-256"):
        verify_checkpoint(newer)
    with pytest.raises(CorruptCheckpoint, match="SHA-256"):
        restore_share(manifest, rank=1, world_size=2, partition_count=3, topic=TOPIC)


def chained(record: dict[str, Any], **shard: object) -> None:
    """Make shard 0 a delta of a named checkpoint (then ``shard`` overrides its entries)."""
    digest = "a" * 64
    parent = {"checkpoint": "chk-000000000001-1", "file": "shard-0.stck", "sha256": digest, "index_sha256": digest}
    record["shards"][0].update({"delta_of": parent, "chain": ["chk-000000000001-1"], **shard})


def set_in(path: list[Any], value: object) -> Callable[[dict[str, Any]], object]:
    def edit(record: dict[str, Any]) -> None:
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


TAMPERED = [
    (set_in(["shards", 1, "rank"], 0), "manifest is malformed: shards [0, 0] are not ranks 0..1"),
    (set_in(["shards", 0, "file"], "../shard-0.stck"), "manifest is malformed: file entry"),
    (set_in(["shards", 0, "file"], "a\\b"), "manifest is malformed: file entry"),
    (set_in(["shards", 0, "file"], ".."), "manifest is malformed: file entry"),
    (set_in(["shards", 0, "file"], "."), "manifest is malformed: file entry"),
    (set_in(["shards", 0, "file"], ""), "manifest is malformed: file entry"),
    (set_in(["shards", 0, "file"], 7), "manifest is malformed: file entry"),
    (set_in(["common", "size"], -1), "manifest is malformed: file entry"),
    (set_in(["common", "sha256"], "ab"), "manifest is malformed: file entry"),
    (
        set_in(["shards", 1, "partitions"], [1, 2]),
        "manifest is malformed: partition 2 is in the shards of ranks 0 and 1",
    ),
    (
        set_in(["shards", 1, "partitions"], [3]),
        "manifest is malformed: partition 3 is outside the 3 partitions recorded",
    ),
    (set_in(["window", "half_life_s"], "soon"), "manifest is malformed: could not convert string to float: 'soon'"),
    (lambda r: chained(r, chain=[]), "has a malformed delta_of"),
    (lambda r: chained(r, delta_of=None), "has a malformed delta_of"),
    (lambda r: chained(r, chain=[3]), "that is not distinct checkpoint names"),
    (lambda r: chained(r, chain=["elsewhere"]), "that is not distinct checkpoint names"),
    (lambda r: chained(r, chain=["chk-000000000001-1"] * 2), "that is not distinct checkpoint names"),
    (lambda r: chained(r, chain=["chk-000000000002-2"]), "which its chain"),
    (lambda r: chained(r) or r["shards"][0]["delta_of"].update(file="../x"), "which its chain"),
    (lambda r: chained(r) or r["shards"][0]["delta_of"].update(sha256="ab"), "names its parent by malformed digests"),
    (lambda r: chained(r) or r["shards"][0]["delta_of"].update(index_sha256="ab"), "by malformed digests"),
]


@pytest.mark.parametrize(("edit", "says"), TAMPERED)
def test_a_resealed_manifest_that_breaks_a_rule_is_refused_by_name(
    tmp_path: Path, edit: Callable[[dict[str, Any]], object], says: str
) -> None:
    _, _, newer = two_checkpoints(tmp_path)
    resealed(newer, edit)
    with pytest.raises(CorruptCheckpoint) as refused:
        read_manifest(newer)
    assert refused.value.reason.startswith(says) or says in refused.value.reason, refused.value.reason
    assert refused.value.path == newer


def test_a_delta_chain_that_follows_the_rules_is_read_back() -> None:
    record: dict[str, Any] = {"shards": [{"file": "shard-0.stck"}]}
    chained(record)
    _check_chain(record["shards"][0])  # no refusal
    _check_chain({"file": "shard-0.stck"})  # a base shard: nothing to check


def test_the_manifest_s_own_refusals_in_full(tmp_path: Path) -> None:
    _, older, newer = two_checkpoints(tmp_path)
    (newer / "manifest.json").write_text("[1, 2]")
    with pytest.raises(CorruptCheckpoint) as refused:
        read_manifest(newer)
    assert refused.value.reason == "manifest is malformed: not a JSON object"
    (newer / "manifest.json").write_text('{"format": NaN}')
    with pytest.raises(CorruptCheckpoint, match="malformed"):
        read_manifest(newer)
    record = json.loads((older / "manifest.json").read_text())
    resealed(older, set_in(["version"], 99))
    with pytest.raises(CorruptCheckpoint) as refused:
        read_manifest(older)
    reads = f"this streamtrain reads {FORMAT_NAME!r} version {FORMAT_VERSION}"
    assert refused.value.reason == f"manifest format {record['format']!r} version 99; {reads}"
    record["step"] = 123  # not resealed
    (older / "manifest.json").write_text(json.dumps(record))
    with pytest.raises(CorruptCheckpoint) as refused:
        read_manifest(older)
    assert refused.value.reason == "manifest SHA-256 mismatch: it changed after writing (bit rot or an edit)"
    (older / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpoint) as refused:
        read_manifest(older)
    assert refused.value.path == older
    assert refused.value.reason == "no manifest: the checkpoint was never completed (or is being deleted)"


MISMATCH = "SHA-256 mismatch against the manifest (bit rot or partial overwrite)"


def test_sealing_again_writes_the_same_record_sorted_and_indented(tmp_path: Path) -> None:
    _, _, newer = two_checkpoints(tmp_path)
    before = json.loads((newer / "manifest.json").read_text())
    _, ownership, common, shards = receipts(newer)
    write_manifest(newer, step=9, topic=TOPIC, ownership=ownership, common=common, shards=shards, created_at=1234.5)
    text = (newer / "manifest.json").read_text()
    record = json.loads(text)
    assert text == json.dumps(record, indent=1, sort_keys=True, allow_nan=False)
    assert record["created_at"] == 1234.5 and list(record["next_offsets"]) == ["0", "1", "2"]
    assert {k: v for k, v in record.items() if k not in ("created_at", "sha256")} == {
        k: v for k, v in before.items() if k not in ("created_at", "sha256")
    }
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_manifest(newer, step=9, topic=TOPIC, ownership=ownership, common=common, shards=shards,
                       created_at=float("nan"))  # fmt: skip


def test_sealing_refuses_shards_of_another_count_or_step_in_full(tmp_path: Path) -> None:
    _, _, newer = two_checkpoints(tmp_path)
    _, ownership, common, shards = receipts(newer)
    with pytest.raises(ValueError) as refused:
        write_manifest(newer, step=9, topic=TOPIC, ownership=ownership, common=common, shards=shards[:1])
    assert str(refused.value) == "a checkpoint of 2 ranks needs 2 shards, got 1"
    with pytest.raises(CorruptCheckpoint) as corrupt:
        write_manifest(newer, step=10, topic=TOPIC, ownership=ownership, common=common, shards=shards)
    assert corrupt.value.path == newer / shards[0].file and corrupt.value.reason == "shard says rank 0 step 9"
    with pytest.raises(CorruptCheckpoint) as corrupt:
        write_manifest(newer, step=9, topic=TOPIC, ownership=ownership, common=common, shards=shards[::-1])
    assert corrupt.value.path == newer / shards[1].file and corrupt.value.reason == "shard says rank 1 step 9"


def test_a_damaged_or_unreadable_file_is_named_with_the_check_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, older, newer = two_checkpoints(tmp_path)
    damage_common(newer)
    manifest = read_manifest(newer)
    for check in (verify_checkpoint, lambda d: read_common(read_manifest(d))):
        with pytest.raises(CorruptCheckpoint) as refused:
            check(newer)
        assert refused.value.path == newer / "common.stck" and refused.value.reason == MISMATCH
    assert manifest.step == 9
    shard = older / "shard-00001.stsh"

    def unreadable(path: Path) -> tuple[int, str]:
        if path == shard:
            raise PermissionError(13, "Permission denied")
        return file_sha256(path)

    monkeypatch.setattr(manifest_module, "file_sha256", unreadable)
    with pytest.raises(CorruptCheckpoint) as refused:
        verify_checkpoint(older)
    assert refused.value.path == shard and refused.value.reason == "unreadable: [Errno 13] Permission denied"


def test_common_state_of_another_step_is_refused(tmp_path: Path) -> None:
    _, older, _ = two_checkpoints(tmp_path)
    moved = tmp_path / "renamed"  # not a checkpoint's directory name: the name's step is not checked
    shutil.copytree(older, moved)
    resealed(moved, set_in(["step"], 123))
    with pytest.raises(CorruptCheckpoint) as refused:
        read_common(read_manifest(moved))
    assert refused.value.path == moved / "common.stck"
    assert refused.value.reason.startswith("holds step ") and refused.value.reason.endswith(", the manifest says 123")


def test_what_the_manifest_records_is_read_back(tmp_path: Path) -> None:
    _, older, newer = two_checkpoints(tmp_path)
    record = json.loads((newer / "manifest.json").read_text())
    manifest = read_manifest(newer)
    assert manifest.created_at == record["created_at"] and manifest.step == 9
    assert manifest.next_offsets == {int(p): o for p, o in record["next_offsets"].items()} and manifest.next_offsets
    resealed(older, lambda r: r.pop("next_offsets"))
    assert read_manifest(older).next_offsets == {}
    resealed(older, set_in(["common", "size"], 0))  # an empty file is a size like any other
    assert read_manifest(older).common["size"] == 0


def test_a_manifest_in_a_directory_of_another_step_or_unreadable_is_refused(tmp_path: Path) -> None:
    _, older, newer = two_checkpoints(tmp_path)
    step = read_manifest(newer).step
    resealed(newer, set_in(["step"], step + 1))
    with pytest.raises(CorruptCheckpoint) as refused:
        read_manifest(newer)
    assert refused.value.path == newer
    assert refused.value.reason == f"directory says step {step}, manifest says {step + 1}"
    (older / "manifest.json").unlink()
    (older / "manifest.json").mkdir()
    with pytest.raises(CorruptCheckpoint) as refused:
        read_manifest(older)
    assert refused.value.path == older and refused.value.reason.startswith("manifest unreadable: [Errno 21]")


def test_common_state_unreadable_or_undecodable_names_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, older, newer = two_checkpoints(tmp_path)
    garbage = b"not a checkpoint at all"
    (newer / "common.stck").write_bytes(garbage)
    resealed(newer, lambda r: r["common"].update(size=len(garbage), sha256=hashlib.sha256(garbage).hexdigest()))
    with pytest.raises(CorruptCheckpoint) as refused:
        read_common(read_manifest(newer))
    assert refused.value.path == newer / "common.stck"

    def unreadable(path: Path, start: int, length: int) -> bytearray:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(manifest_module, "read_range", unreadable)
    with pytest.raises(CorruptCheckpoint) as refused:
        read_common(read_manifest(older))
    assert refused.value.path == older / "common.stck"
    assert refused.value.reason == "unreadable: [Errno 13] Permission denied"


def test_sealing_lists_every_partition_s_next_offset_and_refuses_shards_that_disagree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, newer = two_checkpoints(tmp_path)
    _, ownership, common, shards = receipts(newer)
    real = manifest_module.read_shard_index

    def with_partitions(path: Path, receipt: FileReceipt) -> dict[str, Any]:
        index = real(path, receipt)
        if index["rank"] == 0:  # partitions 10 and 2, offsets in the other order
            index["sections"] = [
                {**index["sections"][0], "partition": 10, "next_offset": 5},
                {**index["sections"][0], "partition": 2, "next_offset": 7000},
            ]
        return index

    monkeypatch.setattr(manifest_module, "read_shard_index", with_partitions)
    wide = Ownership(world_size=2, partition_count=11)
    write_manifest(newer, step=9, topic=TOPIC, ownership=wide, common=common, shards=shards)
    written = json.loads((newer / "manifest.json").read_text())["next_offsets"]
    assert written == {"1": written["1"], "2": 7000, "10": 5} and read_manifest(newer).next_offsets[10] == 5

    def disagreeing(path: Path, receipt: FileReceipt) -> dict[str, Any]:
        index = real(path, receipt)
        if index["rank"] == 1:
            index["window"] = {**index["window"], "channels": 3}
        return index

    monkeypatch.setattr(manifest_module, "read_shard_index", disagreeing)
    with pytest.raises(ValueError) as refused:
        write_manifest(newer, step=9, topic=TOPIC, ownership=ownership, common=common, shards=shards)
    assert str(refused.value) == (
        "shards disagree on the window settings: rank 0 {'channels': 1, 'half_life_s': None, 'capacity': 5000}, "
        "rank 1 {'channels': 3, 'half_life_s': None}"
    )
