"""The checkpoint blob format: the documented layout, and crafted files refused without unpickling."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import math
import os
import pickle
import struct
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from mapped_files import mapped_file, needs_proc_maps

from streamtrain.checkpoint import format as format_module
from streamtrain.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAGIC,
    CorruptCheckpoint,
    decode_checkpoint,
    encode_checkpoint,
    read_checkpoint_file,
    read_digest,
)
from streamtrain.checkpoint.store import CheckpointStore, read_checkpoint

torch.set_num_threads(1)

PREFIX = struct.Struct("<8sQQ32s")  # the layout the module docstring documents


def frame(header: dict[str, Any], payload: bytes) -> bytes:
    """Build a checkpoint file by hand from the documented layout."""
    header_bytes = json.dumps(header).encode()
    digest = hashlib.sha256(header_bytes + payload).digest()
    return PREFIX.pack(MAGIC, len(header_bytes), len(payload), digest) + header_bytes + payload


_unpickled: list[str] = []


def _record_unpickling() -> None:
    _unpickled.append("code ran")


class _Evil:
    def __reduce__(self):
        return (_record_unpickling, ())


@pytest.fixture
def forbid_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("checkpoint loading tried to unpickle")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    _unpickled.clear()


def _valid_header(**overrides: Any) -> dict[str, Any]:
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": 4, "created_at": 1.0, "skeleton": {"$dict": []}}
    header.update(overrides)
    return header


def _torch_save_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2), "evil": _Evil()}, buffer)
    return buffer.getvalue()


EVIL_PICKLE = pickle.dumps({"evil": _Evil()})


GOOD_PAYLOAD = safetensors.torch.save({"0": torch.ones(2)})


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        pytest.param(_torch_save_bytes(), "magic bytes", id="torch.save file"),
        pytest.param(EVIL_PICKLE, "magic bytes", id="bare pickle"),
        pytest.param(
            frame(_valid_header(skeleton={"$tensor": "0"}), EVIL_PICKLE), "not valid safetensors", id="pickle payload"
        ),
        pytest.param(frame(_valid_header(format="torch.save"), EVIL_PICKLE), "unsupported format", id="unknown format"),
        pytest.param(frame(_valid_header(version=2), GOOD_PAYLOAD), "unsupported format", id="unknown version"),
        pytest.param(
            frame(_valid_header(skeleton={"$pickle": "0"}), GOOD_PAYLOAD), "no single known", id="unknown tag"
        ),
        pytest.param(
            frame(
                _valid_header(skeleton={"$ndarray": "0", "dtype": "|O", "shape": [1]}),
                safetensors.torch.save({"0": torch.zeros(8, dtype=torch.uint8)}),
            ),
            "Python objects",
            id="object dtype smuggled as raw bytes",
        ),
        pytest.param(
            frame(_valid_header(skeleton={"$tensor": "1"}), GOOD_PAYLOAD), "does not hold", id="missing tensor"
        ),
        pytest.param(frame(_valid_header(skeleton=None), GOOD_PAYLOAD), "never names", id="unused tensor"),
        pytest.param(
            frame(_valid_header(skeleton=[1]), safetensors.torch.save({})), "expected a dict", id="non-dict state"
        ),
    ],
)
def test_crafted_files_are_refused_without_unpickling(
    tmp_path: Path, forbid_unpickling: None, data: bytes, reason: str
) -> None:
    path = tmp_path / "ckpt-000000000004-1000.stck"
    path.write_bytes(data)
    with pytest.raises(CorruptCheckpoint, match=reason):
        read_checkpoint(path)
    reports: list[str] = []
    assert CheckpointStore(tmp_path, on_corrupt=lambda p, why: reports.append(why)).load_latest() is None
    assert len(reports) == 1 and reason in reports[0]
    assert _unpickled == []


def test_a_crafted_valid_file_still_loads_without_pickle(tmp_path: Path, forbid_unpickling: None) -> None:
    path = tmp_path / "ckpt-000000000004-1000.stck"
    path.write_bytes(frame(_valid_header(skeleton={"$dict": [["w", {"$tensor": "0"}]]}), GOOD_PAYLOAD))
    loaded = read_checkpoint(path)
    assert loaded.step == 4 and torch.equal(loaded.state["w"], torch.ones(2))


EVERY_DTYPE = {
    "bool": torch.tensor([True, False, True]),
    "u8": torch.arange(5, dtype=torch.uint8),
    "i16": torch.tensor([-3, 7], dtype=torch.int16),
    "u32": torch.tensor([1, 2**32 - 1], dtype=torch.uint32),
    "i64": torch.arange(-4, 4).reshape(2, 4),
    "f16": torch.tensor([0.5, -1.0], dtype=torch.float16),
    "bf16": torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16),
    "f32": torch.tensor(3.25),  # 0-d
    "f64": torch.tensor([[1e300]], dtype=torch.float64),
    "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
    "empty": torch.zeros(0, 3),
}


def test_the_payload_is_what_any_safetensors_reader_reads(tmp_path: Path) -> None:
    """Written from each tensor's own memory, read into a buffer per tensor: still plain safetensors."""
    chunks = encode_checkpoint({"t": dict(EVERY_DTYPE)}, step=1, created_at=0.0)
    data = b"".join(chunks)
    header_length, payload_length = PREFIX.unpack_from(data)[1:3]
    payload = data[PREFIX.size + header_length :]
    assert len(payload) == payload_length
    data_start = PREFIX.size + header_length + 8 + struct.unpack_from("<Q", payload)[0]
    assert data_start % 8 == 0  # the table padded: every tensor's bytes aligned in the file, where they are mapped
    by_safetensors = safetensors.torch.load(payload)
    for i, tensor in enumerate(EVERY_DTYPE.values()):  # named in the order flatten_state met them
        assert by_safetensors[str(i)].dtype == tensor.dtype and torch.equal(by_safetensors[str(i)], tensor)
    path = tmp_path / "ckpt-000000000001-1000.stck"
    path.write_bytes(data)
    loaded = read_checkpoint(path).state["t"]
    for name, tensor in EVERY_DTYPE.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    # and a file whose payload safetensors itself wrote (every checkpoint before this reader) reads the same
    header = _valid_header(
        step=1, skeleton={"$dict": [[name, {"$tensor": str(i)}] for i, name in enumerate(EVERY_DTYPE)]}
    )
    payload = safetensors.torch.save({str(i): tensor for i, tensor in enumerate(EVERY_DTYPE.values())})
    path.write_bytes(frame(header, payload))
    loaded = read_checkpoint(path).state
    assert all(torch.equal(loaded[name], tensor) for name, tensor in EVERY_DTYPE.items())


def test_a_file_read_in_many_pieces_is_hashed_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_module, "_PIECE_BYTES", 64)  # the readings in ~100 pieces, hashed on a second thread
    values = torch.arange(1600, dtype=torch.float32)
    path = tmp_path / "ckpt-000000000001-1000.stck"
    path.write_bytes(b"".join(encode_checkpoint({"values": values}, step=1, created_at=0.0)))
    loaded = read_checkpoint(path).state["values"]
    assert torch.equal(loaded, values)
    loaded[0] = -1.0  # writable, and its own memory
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # inside the last piece
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="SHA-256 mismatch"):
        read_checkpoint(path)


@pytest.mark.parametrize(
    ("table", "reason"),
    [
        (
            {
                "0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "1": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
            },
            "not where the one before ends",
        ),
        (
            {
                "0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "1": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            "not where the one before ends",
        ),
        ({"0": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "do not hold"),
        ({"0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, "end at byte"),
        ({"0": {"dtype": "PICKLE", "shape": [2], "data_offsets": [0, 8]}}, "PICKLE"),
    ],
    ids=["gap", "overlap", "shape and size disagree", "trailing bytes", "unknown dtype"],
)
def test_a_tensor_table_that_does_not_tile_its_data_is_refused(
    tmp_path: Path, table: dict[str, Any], reason: str
) -> None:
    encoded = json.dumps(table).encode()
    payload = struct.pack("<Q", len(encoded)) + encoded + bytes(16)
    path = tmp_path / "ckpt-000000000004-1000.stck"
    path.write_bytes(frame(_valid_header(skeleton={"$dict": []}), payload))  # a valid digest over it all
    with pytest.raises(CorruptCheckpoint, match=f"not valid safetensors.*{reason}"):
        read_checkpoint(path)


# every refusal, by its whole reason and the path it names (the mutation run) ---------------------


def raw_frame(header_bytes: bytes, payload: bytes = b"") -> bytes:
    digest = hashlib.sha256(header_bytes + payload).digest()
    return PREFIX.pack(MAGIC, len(header_bytes), len(payload), digest) + header_bytes + payload


EMPTY_STATE_PAYLOAD = safetensors.torch.save({})
VALID = frame(_valid_header(), EMPTY_STATE_PAYLOAD)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty file"),
        (VALID + b"xy", f"2 trailing bytes after the announced {len(VALID)}"),
        (
            VALID[:-1] + bytes([VALID[-1] ^ 1]),
            "SHA-256 mismatch: the contents changed after writing (bit rot or partial overwrite)",
        ),
        (raw_frame(b"[1]"), "header is not a JSON object"),
        (raw_frame(b'{"format": NaN}'), "header is not valid JSON: bare NaN is not part of the format"),
        (
            frame(_valid_header(format="torch.save", version=7), EMPTY_STATE_PAYLOAD),
            "unsupported format 'torch.save' version 7; this streamtrain reads 'streamtrain.checkpoint' version 1",
        ),
        (frame(_valid_header(step=-1), EMPTY_STATE_PAYLOAD), "header step -1 is not a non-negative integer"),
        (frame(_valid_header(step=True), EMPTY_STATE_PAYLOAD), "header step True is not a non-negative integer"),
        (frame(_valid_header(step=1.0), EMPTY_STATE_PAYLOAD), "header step 1.0 is not a non-negative integer"),
        (frame(_valid_header(created_at="1"), EMPTY_STATE_PAYLOAD), "header created_at '1' is not a finite number"),
        (frame(_valid_header(created_at=True), EMPTY_STATE_PAYLOAD), "header created_at True is not a finite number"),
        (
            raw_frame(json.dumps(_valid_header(created_at=0.5)).replace("0.5", "1e999").encode(), EMPTY_STATE_PAYLOAD),
            "header created_at inf is not a finite number",
        ),
        (
            frame({key: value for key, value in _valid_header().items() if key != "skeleton"}, EMPTY_STATE_PAYLOAD),
            "header has no skeleton",
        ),
        (frame(_valid_header(skeleton=[]), EMPTY_STATE_PAYLOAD), "state is a list, expected a dict"),
    ],
    ids=[
        "empty",
        "trailing",
        "digest",
        "header-array",
        "bare-nan",
        "format",
        "negative-step",
        "bool-step",
        "float-step",
        "text-time",
        "bool-time",
        "infinite-time",
        "no-skeleton",
        "list-state",
    ],  # fmt: skip
)
def test_each_refusal_names_the_file_and_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(CorruptCheckpoint) as refused:
        decode_checkpoint(data, "some/ckpt.stck")
    assert (refused.value.path, refused.value.reason) == (Path("some/ckpt.stck"), reason)
    assert str(refused.value) == f"checkpoint some/ckpt.stck is unusable: {reason}"


def test_bytes_without_a_path_are_named_as_bytes() -> None:
    with pytest.raises(CorruptCheckpoint) as refused:
        decode_checkpoint(b"")
    assert refused.value.path == Path("<bytes>") and str(refused.value) == "checkpoint <bytes> is unusable: empty file"


def test_a_file_that_shrinks_while_it_is_read_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size checked first (fstat) said the whole file was there; the reads then came back short."""
    path = tmp_path / "ckpt.stck"
    path.write_bytes(VALID[:-3])
    fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*fstat(fd)[:6], len(VALID), *fstat(fd)[7:])))
    with pytest.raises(CorruptCheckpoint) as refused:
        read_checkpoint_file(path)
    assert (refused.value.path, refused.value.reason) == (path, "truncated while it was read")


def test_the_header_refuses_values_json_cannot_hold() -> None:
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        encode_checkpoint({}, step=1, created_at=math.nan)


def test_any_mapping_is_a_state_and_a_top_level_state_dict_keeps_its_metadata() -> None:
    module_state = collections.OrderedDict(w=torch.ones(2))
    module_state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    loaded = decode_checkpoint(b"".join(encode_checkpoint(module_state, step=2, created_at=5.0)))
    assert isinstance(loaded.state, collections.OrderedDict) and loaded.state._metadata == {"": {"version": 1}}
    proxy = decode_checkpoint(b"".join(encode_checkpoint(types.MappingProxyType({"a": 1}), step=2, created_at=5.0)))
    assert proxy.state == {"a": 1} and (proxy.step, proxy.created_at) == (2, 5.0)


def test_read_digest_reads_the_prefix_of_checkpoints_only(tmp_path: Path) -> None:
    good, foreign, short = tmp_path / "good", tmp_path / "foreign", tmp_path / "short"
    good.write_bytes(VALID)
    foreign.write_bytes(b"\x00" * len(VALID))
    short.write_bytes(VALID[:40])
    assert read_digest(good) == PREFIX.unpack(VALID[: PREFIX.size])[3].hex()
    for path in (foreign, short):
        with pytest.raises(OSError) as refused:
            read_digest(path)
        assert str(refused.value) == f"{path} does not start with a checkpoint prefix"


# what the mutation run of the rewritten reader and writer asked (2026-12-03) ----------------------


def test_the_payload_is_byte_for_byte_what_safetensors_writes() -> None:
    """Tensors by alignment (widest first), the table's JSON compact: the same bytes as safetensors,
    and every tensor's bytes start at a multiple of its item size."""
    tensors = {  # names in the opposite order of their widths
        "a": torch.tensor([True, False, True]),
        "b": torch.tensor([-3, 7, 9], dtype=torch.int16),
        "c": torch.tensor([0.5, 1.5, 2.5], dtype=torch.float32),
        "d": torch.tensor([1e300, -2.0], dtype=torch.float64),
        "e": torch.tensor([4.0], dtype=torch.float32),
    }
    payload = b"".join(bytes(chunk) for chunk in format_module._payload_chunks(tensors))
    assert payload == safetensors.torch.save(tensors)
    everything = {str(i): tensor for i, tensor in enumerate(EVERY_DTYPE.values())}
    payload = b"".join(bytes(chunk) for chunk in format_module._payload_chunks(everything))
    table = json.loads(payload[8 : 8 + struct.unpack_from("<Q", payload)[0]])
    for name, entry in table.items():
        assert entry["data_offsets"][0] % everything[name].dtype.itemsize == 0, (name, entry)


def test_decoding_a_bytearray_keeps_its_memory_and_bytes_are_never_written() -> None:
    values = torch.arange(6, dtype=torch.float32)
    data = b"".join(bytes(chunk) for chunk in encode_checkpoint({"values": values}, step=1, created_at=0.0))
    untouched = bytes(bytearray(data))  # a copy of its own
    from_bytes = decode_checkpoint(data).state["values"]
    from_bytes[0] = -1.0
    assert data == untouched  # the tensors of bytes are views of a copy, never of the immutable bytes
    shared = bytearray(data)
    from_bytearray = decode_checkpoint(shared).state["values"]
    assert torch.equal(from_bytearray, values)
    shared[-4:] = struct.pack("<f", 42.0)  # the last reading, in the caller's buffer
    assert from_bytearray[-1].item() == 42.0


def _payload_with_table(table_bytes: bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    announced = len(table_bytes) if length is None else length
    return struct.pack("<Q", announced) + table_bytes + data


TABLE_ONE_F32 = json.dumps({"0": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"abc", "shorter than its header length"),
        (b"\xff" * 8 + bytes(8), "a 18446744073709551615-byte tensor table in a 16-byte payload"),
        (_payload_with_table(b"{}", bytes(4), length=10), "a 10-byte tensor table in a 14-byte payload"),
        (_payload_with_table(b'{"__metadata__":{"a":NaN}}'), "bare NaN is not part of the format"),
        (_payload_with_table(b"[]      "), "the tensor table is not a JSON object"),
        (
            _payload_with_table(
                json.dumps(
                    {
                        "0": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                        "1": {"dtype": "F32", "shape": [3], "data_offsets": [4, 12]},
                    }
                ).encode(),
                bytes(12),
            ),
            "tensor '1': 8 bytes do not hold torch.float32 of shape [3]",
        ),
        (
            _payload_with_table(TABLE_ONE_F32, bytes(12)),
            f"the tensors end at byte {8 + len(TABLE_ONE_F32) + 8} of a {8 + len(TABLE_ONE_F32) + 12}-byte payload",
        ),
    ],
    ids=["no-table-length", "table-length-past-2^63", "table-past-payload", "nan", "table-array", "size", "end"],
)
def test_each_tensor_table_refusal_names_the_bytes_and_its_reason(payload: bytes, reason: str) -> None:
    data = raw_frame(json.dumps(_valid_header()).encode(), payload)
    with pytest.raises(CorruptCheckpoint) as refused:
        decode_checkpoint(data, "some/ckpt.stck")
    assert (refused.value.path, refused.value.reason) == (
        Path("some/ckpt.stck"),
        f"payload is not valid safetensors: {reason}",
    )


def test_a_payload_with_safetensors_metadata_reads(tmp_path: Path) -> None:
    payload = safetensors.torch.save({"0": torch.ones(2)}, metadata={"written by": "safetensors"})
    path = tmp_path / "ckpt-000000000004-1000.stck"
    path.write_bytes(frame(_valid_header(skeleton={"$dict": [["w", {"$tensor": "0"}]]}), payload))
    for loaded in (read_checkpoint_file(path), decode_checkpoint(path.read_bytes())):
        assert torch.equal(loaded.state["w"], torch.ones(2))


def _pretend_size(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*fstat(fd)[:6], size, *fstat(fd)[7:])))


def test_a_file_cut_inside_its_header_while_it_is_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.stck"
    path.write_bytes(VALID[: PREFIX.size + 3])
    _pretend_size(monkeypatch, len(VALID))
    with pytest.raises(CorruptCheckpoint) as refused:
        read_checkpoint_file(path)
    assert (refused.value.path, refused.value.reason) == (path, "truncated while it was read")


class _ShortReads(io.RawIOBase):
    """A file whose ``readinto`` returns at most 5 bytes a call, as a pipe or a network file may."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._file.readinto(memoryview(buffer)[:5]) or 0

    def read(self, size: int = -1) -> bytes:
        return self._file.read(size)

    def fileno(self) -> int:
        return self._file.fileno()

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
        super().close()


def test_short_reads_are_continued_until_each_piece_is_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = torch.arange(40, dtype=torch.float64)
    path = tmp_path / "ckpt-000000000001-1000.stck"
    path.write_bytes(b"".join(encode_checkpoint({"values": values}, step=1, created_at=0.0)))
    monkeypatch.setattr(format_module, "open", lambda file, *args, **kwargs: _ShortReads(file), raising=False)
    assert torch.equal(read_checkpoint_file(path).state["values"], values)


def test_reading_a_checkpoint_warns_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt-000000000001-1000.stck"
    path.write_bytes(b"".join(encode_checkpoint({"t": dict(EVERY_DTYPE)}, step=1, created_at=0.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_checkpoint_file(path)
        decode_checkpoint(path.read_bytes())


class _RecordingSha256:
    """hashlib.sha256 that notes the thread and the bytes of each update (slowly, so pieces queue up)."""

    def __init__(self, data: bytes = b"") -> None:
        self._sha256 = hashlib.sha256(data)
        self.threads: list[str] = []
        self.hashed = bytearray(data)

    def update(self, data: bytes | memoryview) -> None:
        time.sleep(0.001)
        self.threads.append(threading.current_thread().name)
        self.hashed += data
        self._sha256.update(data)

    def digest(self) -> bytes:
        return self._sha256.digest()


def test_the_file_is_hashed_in_order_on_one_named_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_module, "_PIECE_BYTES", 64)  # ~100 pieces queued for the hasher
    values = torch.arange(1600, dtype=torch.float32)
    path = tmp_path / "ckpt-000000000001-1000.stck"
    path.write_bytes(b"".join(encode_checkpoint({"values": values}, step=1, created_at=0.0)))
    made: list[_RecordingSha256] = []

    def recording_sha256(data: bytes = b"") -> _RecordingSha256:
        made.append(_RecordingSha256(data))
        return made[-1]

    monkeypatch.setattr(format_module, "hashlib", types.SimpleNamespace(sha256=recording_sha256))
    assert torch.equal(read_checkpoint_file(path).state["values"], values)
    (digest,) = made
    assert bytes(digest.hashed) == path.read_bytes()[PREFIX.size :]
    assert set(digest.threads) == {"checkpoint-sha256_0"}


def _mapping_small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_module, "MAP_MIN_BYTES", 4096)
    monkeypatch.setattr(format_module, "_MAPPED_PIECE_BYTES", 1000)  # each mapped tensor hashed in many pieces


@needs_proc_maps
def test_a_large_tensor_is_mapped_from_the_file_and_outlives_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors of MAP_MIN_BYTES or more are the file's pages (copy-on-write), the others memory of their own;
    a pruned file stays readable through its mapping."""
    _mapping_small_tensors(monkeypatch)
    state = {
        "values": torch.arange(10_000, dtype=torch.float32),  # 40 kB
        "seq": torch.arange(3_000, dtype=torch.int64),  # 24 kB, before the values in the payload
        "small": torch.arange(10, dtype=torch.int64),
    }
    path = tmp_path / "ckpt-000000000001-1000.stck"
    path.write_bytes(b"".join(encode_checkpoint(state, step=1, created_at=0.0)))
    written = path.read_bytes()
    loaded = read_checkpoint_file(path).state
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    assert mapped_file(loaded["values"].data_ptr()) == str(path)
    assert mapped_file(loaded["seq"].data_ptr()) == str(path)
    assert mapped_file(loaded["small"].data_ptr()) is None
    loaded["seq"][0] = -1  # a write takes a page of the process's own: the file never changes
    assert path.read_bytes() == written
    path.unlink()  # a checkpoint pruned (CHECKPOINT_KEEP) while a window still holds its readings
    assert mapped_file(loaded["values"].data_ptr()) == f"{path} (deleted)"
    assert torch.equal(loaded["values"], state["values"])
    assert loaded["seq"][0] == -1 and torch.equal(loaded["seq"][1:], state["seq"][1:])


@needs_proc_maps
def test_a_damaged_tensor_that_would_be_mapped_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _mapping_small_tensors(monkeypatch)
    values = torch.arange(10_000, dtype=torch.float32)
    older, newer = tmp_path / "ckpt-000000000001-1000.stck", tmp_path / "ckpt-000000000002-1000.stck"
    for step, path in enumerate((older, newer), start=1):
        path.write_bytes(b"".join(encode_checkpoint({"values": values + step}, step=step, created_at=0.0)))
    data = bytearray(newer.read_bytes())
    data[-20_000] ^= 0x01  # inside the values, half way
    newer.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="SHA-256 mismatch"):
        read_checkpoint_file(newer)
    refused: list[tuple[Path, str]] = []
    loaded = CheckpointStore(tmp_path, on_corrupt=lambda path, reason: refused.append((path, reason))).load_latest()
    assert loaded is not None and loaded.path == older and torch.equal(loaded.state["values"], values + 1)
    assert mapped_file(loaded.state["values"].data_ptr()) == str(older)
    assert [(path, "SHA-256" in reason) for path, reason in refused] == [(newer, True)]


@needs_proc_maps
def test_a_file_whose_tensors_lie_unaligned_is_read_not_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written before the table was padded for the file: a tensor may start at any byte there."""
    _mapping_small_tensors(monkeypatch)
    values = torch.arange(10_000, dtype=torch.float32)
    payload = safetensors.torch.save({"0": values})
    path = tmp_path / "ckpt-000000000004-1000.stck"
    for pad in range(4):
        header = _valid_header(skeleton={"$dict": [["v", {"$tensor": "0"}]]}, pad=" " * pad)
        data = frame(header, payload)
        data_start = len(data) - values.nbytes
        path.write_bytes(data)
        loaded = read_checkpoint_file(path).state["v"]
        assert torch.equal(loaded, values)
        assert (mapped_file(loaded.data_ptr()) == str(path)) == (data_start % 4 == 0), data_start
