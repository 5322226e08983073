"""One checkpoint blob: a state tree as tensors and JSON, with a SHA-256 over every byte.

The unit every checkpoint file is made of: the one-file store writes one per file
(``ckpt-{step:012d}-{unix_ms}.stck``), a sharded checkpoint one per partition section
and one for the shared state (``common.stck``)::

    offset   size   field
    0        8      MAGIC, PNG-style (catches text-mode mangling and foreign files)
    8        8      header length H, unsigned little-endian
    16       8      payload length P, unsigned little-endian
    24       32     SHA-256 of bytes [56, 56 + H + P): header and payload together
    56       H      header, UTF-8 JSON: format, version, step, created_at, skeleton
    56 + H   P      payload, safetensors: every tensor, array and bytes leaf of the state

The skeleton is the state with every bulky leaf replaced by a reference into the payload
(:mod:`streamtrain.checkpoint.codec`); the digest covers it too, so no bit of a blob goes
unchecked, and decoding verifies the digest before it decodes anything (it reads the
payload's tensor table first, to place each tensor). Only tensors (safetensors) and plain
JSON are read: nothing is ever unpickled. Neither side copies the payload whole: it is
written from each tensor's own memory (the tensor table padded so that every tensor lies
aligned in the file) and read into a buffer per tensor, or, for a file's large tensors,
mapped from it once verified (:func:`read_checkpoint_file`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamtrain.checkpoint.codec import PayloadTensor, flatten_state, unflatten_state
from streamtrain.checkpoint.files import Chunk, chunk_length, chunk_pieces, drop_cached
from streamtrain.window.storage import ItemReadings

FORMAT_NAME = "streamtrain.checkpoint"
FORMAT_VERSION = 1
MAGIC = b"\x89STK\r\n\x1a\n"

# magic, header length, payload length, SHA-256 of header + payload
_PREFIX = struct.Struct("<8sQQ32s")


class CorruptCheckpoint(Exception):
    """A checkpoint file that cannot be trusted; `reason` says which check failed."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"checkpoint {path} is unusable: {reason}")
        self.path = Path(path)
        self.reason = reason


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint: its state tree, as it was saved."""

    state: dict[str, Any]
    step: int
    path: Path
    created_at: float  # Unix seconds


def encode_checkpoint(state: Mapping[str, Any], *, step: int, created_at: float) -> list[Chunk]:
    """The file's bytes as chunks (prefix, header, payload), so writing never joins them.

    The payload's chunks are its tensor table and each tensor's own memory, not a copy: a
    window of gigabytes is hashed and written from where it lies, with the interpreter
    free for ingest meanwhile (hashlib and file writes release it; a serializer that builds
    the payload in one call would hold it for seconds).
    """
    tensors, skeleton = flatten_state(state if isinstance(state, dict) else dict(state))
    header = json.dumps(
        {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": step,
            "created_at": created_at,
            "skeleton": skeleton,
        },
        ensure_ascii=True,
        allow_nan=False,
        separators=(",", ":"),
    ).encode("ascii")
    payload = _payload_chunks(tensors, file_offset=_PREFIX.size + len(header))
    digest = hashlib.sha256(header)
    for chunk in payload:
        for piece in chunk_pieces(chunk):  # a window's readings are gathered once for this, once to write
            digest.update(piece)
    payload_length = sum(chunk_length(chunk) for chunk in payload)
    return [_PREFIX.pack(MAGIC, len(header), payload_length, digest.digest()), header, *payload]


def _payload_chunks(tensors: Mapping[str, PayloadTensor], file_offset: int = 0) -> list[Chunk]:
    """A safetensors payload of ``tensors`` (CPU, contiguous; or a window's readings where they
    lie), to start at byte ``file_offset`` of its file: its table, then each tensor's bytes.

    The layout ``safetensors.torch.save`` writes (tensors by alignment, then name; the
    table padded with spaces), so any safetensors reader reads it; the padding puts the
    tensors' bytes at a multiple of 8 in the file, so each lies aligned where a restore
    maps it (at ``file_offset`` 0 the bytes are exactly safetensors').
    """
    codes = {dtype: code for code, dtype in _TENSOR_DTYPES.items()}
    described = {name: _described(tensor) for name, tensor in tensors.items()}
    order = sorted(tensors, key=lambda name: (-described[name][0].itemsize, name))
    table: dict[str, dict[str, Any]] = {}
    chunks: list[Chunk] = []
    at = 0
    for name in order:
        dtype, shape, data = described[name]
        length = chunk_length(data)
        table[name] = {"dtype": codes[dtype], "shape": shape, "data_offsets": [at, at + length]}
        chunks.append(data)
        at += length
    encoded = json.dumps(table, separators=(",", ":")).encode("ascii")
    encoded += b" " * (-(file_offset + 8 + len(encoded)) % 8)
    return [struct.pack("<Q", len(encoded)), encoded, *chunks]


def _described(tensor: PayloadTensor) -> tuple[torch.dtype, list[int], Chunk]:
    """(dtype, shape, bytes) of a payload tensor."""
    if isinstance(tensor, ItemReadings):
        return torch.float32, list(tensor.shape), tensor
    data = tensor.reshape(-1).view(torch.uint8).numpy().data if tensor.numel() else memoryview(b"")
    return tensor.dtype, list(tensor.shape), data


def decode_checkpoint(data: bytes | bytearray, path: Path | str = "<bytes>") -> LoadedCheckpoint:
    """Verify and decode one checkpoint's bytes; CorruptCheckpoint names the failed check.

    The tensors are views of ``data`` when it is a bytearray (else of one copy of it).
    """
    path = Path(path)
    header_length, payload_length, expected_digest = _check_prefix(bytes(data[: _PREFIX.size]), path, len(data))
    header_end = _PREFIX.size + header_length
    view = memoryview(data if isinstance(data, bytearray) else bytearray(data))
    header, payload = view[_PREFIX.size : header_end], view[header_end:]
    digest = hashlib.sha256(header)
    digest.update(payload)
    verified = _verified_header(bytes(header), digest.digest(), expected_digest, path)
    table, data_start = _tensor_table(payload[:8], lambda size: payload[8 : 8 + size], payload_length, path)
    tensors = {
        name: _tensor(payload[data_start + start : data_start + end], entry) for name, (start, end, entry) in table
    }
    return _decode_state(verified, tensors, path)


def read_checkpoint_file(path: Path | str) -> LoadedCheckpoint:
    """:func:`decode_checkpoint` of a file: each large tensor mapped from it, each other one read
    straight into a buffer of its own.

    A window of millions of items makes a payload of gigabytes: the bytes are read once,
    hashed as they arrive (on a second thread, while the next piece is read), and become
    the tensors as they are; each tensor's memory is freed when its last user lets go.
    A tensor of :data:`MAP_MIN_BYTES` or more (a window's readings, its columns) whose
    bytes lie aligned in the file is read through a small buffer, to hash it and bring it
    into the page cache, then mapped (copy-on-write): it takes no memory of the process's
    own, its pages are the page cache's. The payload's tensor table is read first, to know
    where each tensor goes; nothing is decoded or mapped before the SHA-256 matches.
    """
    path = Path(path)
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        header_length, payload_length, expected_digest = _check_prefix(file.read(_PREFIX.size), path, size)
        with _PipelinedDigest() as digest:
            header = _read_exactly(file, header_length, path)
            digest.update(header)

            def read_hashed(size: int) -> memoryview:
                data = _read_exactly(file, size, path)
                digest.update(data)
                return data

            table: _TensorTable = []
            unreadable: CorruptCheckpoint | None = None  # reported after the digest and the header are
            try:
                table, _ = _tensor_table(read_hashed(8), read_hashed, payload_length, path)
                sizes = [(name, end - start, entry[0].itemsize) for name, (start, end, entry) in table]
            except CorruptCheckpoint as err:  # the rest is read and hashed all the same
                unreadable, sizes = err, [("", size - file.tell(), 1)]
            buffers: dict[str, memoryview] = {}
            mapped: dict[str, memoryview] = {}  # handed out once the digest matches
            passing = _PassingPieces(digest)
            for name, length, itemsize in sizes:
                offset = file.tell()
                mapping = None
                if unreadable is None and length >= MAP_MIN_BYTES and offset % itemsize == 0:
                    mapping = _mapping(file.fileno(), offset, length)
                if mapping is not None:
                    mapped[name] = mapping
                    for at in range(0, length, _MAPPED_PIECE_BYTES):  # its pages stay cached: they are mapped
                        passing.read(file, min(_MAPPED_PIECE_BYTES, length - at), path)
                    continue
                buffers[name] = buffer = _buffer(length)
                for at in range(0, length, _PIECE_BYTES):  # pieces: the hasher works on one while the next is read
                    piece = buffer[at : at + _PIECE_BYTES]
                    _read_into(file, piece, path)
                    digest.update(piece)
                    drop_cached(file.fileno(), offset + at, len(piece))  # read once: its cache pages serve the next
    verified = _verified_header(bytes(header), digest.digest(), expected_digest, path)
    if unreadable is not None:
        raise unreadable
    buffers.update(mapped)
    tensors = {name: _tensor(buffers.pop(name), entry) for name, (_, _, entry) in table}
    return _decode_state(verified, tensors, path)


class _PassingPieces:
    """Two buffers that bytes pass through on their way to the hasher: the next piece is read
    into one while the other is hashed (memory touched once, however large the tensor)."""

    def __init__(self, digest: _PipelinedDigest) -> None:
        self._digest = digest
        self._buffers: list[memoryview] = []
        self._hashed: list[Future[None] | None] = [None, None]
        self._turn = 0

    def read(self, file: io.RawIOBase, size: int, path: Path) -> None:
        """Read the next ``size`` bytes (at most ``_MAPPED_PIECE_BYTES``) of ``file`` and hash them."""
        if not self._buffers:
            self._buffers = [_buffer(_MAPPED_PIECE_BYTES), _buffer(_MAPPED_PIECE_BYTES)]
        turn, self._turn = self._turn, 1 - self._turn
        pending = self._hashed[turn]
        if pending is not None:
            pending.result()  # the piece read into it before is hashed: it may be filled again
        piece = self._buffers[turn][:size]
        _read_into(file, piece, path)
        self._hashed[turn] = self._digest.update(piece)


def _mapping(fd: int, offset: int, length: int) -> memoryview | None:
    """``length`` bytes of the file ``fd`` from ``offset``, mapped copy-on-write, or None where the
    file cannot be mapped (it is read then). A write, which the window never makes, takes a page
    of the process's own; the file is never written. The mapping outlives the file's name (a
    pruned checkpoint) and is unmapped when its last user lets go."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapping = mmap.mmap(fd, offset + length - start, access=mmap.ACCESS_COPY, offset=start)
    except (OSError, ValueError):  # a file system without mmap, the address space or map count exhausted
        return None
    return memoryview(mapping)[offset - start :]


_DIGEST_MISMATCH = "SHA-256 mismatch: the contents changed after writing (bit rot or partial overwrite)"
_PIECE_BYTES = 64 << 20
# Tensors this large are mapped from the file (read_checkpoint_file): below it, a mapping's
# page rounding and its entry in the process's map count are not worth the memory saved.
MAP_MIN_BYTES = 4 << 20
# What a mapped tensor's bytes are read and hashed through, two buffers of this size
_MAPPED_PIECE_BYTES = 8 << 20
# safetensors' dtype names, for the dtypes flatten_state puts in a payload
_TENSOR_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}
_MAX_TABLE_BYTES = 100 << 20  # as safetensors itself: a larger table is refused, not read

# (name, (start, end, (dtype, shape))) of each tensor, in payload order; offsets from the data's start
_TensorTable = list[tuple[str, tuple[int, int, tuple[torch.dtype, list[int]]]]]


def _tensor_table(
    length_bytes: bytes | memoryview, read: Callable[[int], bytes | memoryview], payload_length: int, path: Path
) -> tuple[_TensorTable, int]:
    """The safetensors payload's table of tensors, checked to tile its data exactly, and where the data starts.

    ``length_bytes`` are the payload's first 8 bytes, ``read(n)`` gives the next ``n``.
    """

    def corrupt(reason: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(path, f"payload is not valid safetensors: {reason}")

    if len(length_bytes) < 8:
        raise corrupt("shorter than its header length")
    (table_length,) = struct.unpack("<Q", length_bytes)
    if table_length > min(_MAX_TABLE_BYTES, payload_length - 8):
        raise corrupt(f"a {table_length}-byte tensor table in a {payload_length}-byte payload")
    try:
        record = json.loads(bytes(read(table_length)), parse_constant=reject_json_constant)
        if not isinstance(record, dict):
            raise ValueError("the tensor table is not a JSON object")
        record.pop("__metadata__", None)
        table: _TensorTable = []
        for name, entry in record.items():
            dtype = _TENSOR_DTYPES[entry["dtype"]]
            shape = [int(size) for size in entry["shape"]]
            start, end = (int(offset) for offset in entry["data_offsets"])
            if any(size < 0 for size in shape) or end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {name!r}: {end - start} bytes do not hold {dtype} of shape {shape}")
            table.append((str(name), (start, end, (dtype, shape))))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise corrupt(str(exc)) from exc
    table.sort(key=lambda item: item[1][:2])
    data_start = 8 + table_length
    at = 0
    for name, (start, end, _) in table:
        if start != at:
            raise corrupt(f"tensor {name!r} starts at byte {start}, not where the one before ends ({at})")
        at = end
    if data_start + at != payload_length:
        raise corrupt(f"the tensors end at byte {data_start + at} of a {payload_length}-byte payload")
    return table, data_start


def _tensor(buffer: memoryview, entry: tuple[torch.dtype, list[int]]) -> torch.Tensor:
    """A tensor over ``buffer`` (writable, not copied)."""
    dtype, shape = entry
    if not len(buffer):
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # torch.frombuffer warns about every buffer it cannot prove writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def _read_exactly(file: io.RawIOBase, size: int, path: Path) -> memoryview:
    buffer = _buffer(size)
    _read_into(file, buffer, path)
    return buffer


def _buffer(size: int) -> memoryview:
    """``size`` writable bytes, not zeroed first (``bytearray(size)`` writes every byte once more)."""
    return np.empty(size, dtype=np.uint8).data


def _read_into(file: io.RawIOBase, buffer: memoryview, path: Path) -> None:
    at = 0
    while at < len(buffer):
        got = file.readinto(buffer[at:])
        if not got:
            raise CorruptCheckpoint(path, "truncated while it was read")
        at += got


class _PipelinedDigest:
    """SHA-256 of pieces handed over in order, computed on a thread of its own (hashlib releases
    the GIL), so the next piece is read meanwhile; :meth:`digest` once the ``with`` is left."""

    def __init__(self) -> None:
        self._sha256 = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-sha256")
        self._pending: list[Future[None]] = []

    def __enter__(self) -> _PipelinedDigest:
        return self

    def update(self, piece: bytes | memoryview) -> Future[None]:
        """Hash ``piece`` after those before it; it must not change until the future is done."""
        self._pending = [future for future in self._pending if not future.done()]
        self._pending.append(self._pool.submit(self._sha256.update, piece))
        return self._pending[-1]

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)  # every piece hashed (or the read failed: the pieces are moot)
        for future in self._pending:
            future.result()

    def digest(self) -> bytes:
        return self._sha256.digest()


def _check_prefix(prefix: bytes, path: Path, size: int) -> tuple[int, int, bytes]:
    """(header length, payload length, SHA-256) from the first bytes of a ``size``-byte file, or CorruptCheckpoint."""
    if not prefix:
        raise CorruptCheckpoint(path, "empty file")
    if len(prefix) < _PREFIX.size:
        raise CorruptCheckpoint(path, f"{len(prefix)} bytes is shorter than the {_PREFIX.size}-byte prefix (truncated)")
    magic, header_length, payload_length, expected_digest = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptCheckpoint(path, f"magic bytes {magic!r} are not {MAGIC!r}: not a streamtrain checkpoint")
    expected_size = _PREFIX.size + header_length + payload_length
    if size < expected_size:
        raise CorruptCheckpoint(path, f"truncated: the prefix announces {expected_size} bytes, the file has {size}")
    if size > expected_size:
        raise CorruptCheckpoint(path, f"{size - expected_size} trailing bytes after the announced {expected_size}")
    return header_length, payload_length, expected_digest


def _verified_header(header_bytes: bytes, digest: bytes, expected_digest: bytes, path: Path) -> dict[str, Any]:
    """The header, once the digest over header and payload matches; CorruptCheckpoint otherwise."""
    if digest != expected_digest:
        raise CorruptCheckpoint(path, _DIGEST_MISMATCH)
    try:
        header = json.loads(header_bytes, parse_constant=reject_json_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(path, f"header is not valid JSON: {exc}") from exc
    _check_header(header, path)
    return header


def _decode_state(header: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> LoadedCheckpoint:
    """The state a verified header and payload hold; CorruptCheckpoint when they do not fit together."""
    step, created_at = _check_header(header, path)
    try:
        state = unflatten_state(tensors, header["skeleton"])
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, OverflowError, UnicodeError) as exc:
        # RuntimeError: torch refusing a view/reshape the skeleton asks for (RecursionError too)
        raise CorruptCheckpoint(path, f"skeleton does not fit the payload: {exc}") from exc
    if not isinstance(state, dict):
        raise CorruptCheckpoint(path, f"state is a {type(state).__name__}, expected a dict")
    return LoadedCheckpoint(state=state, step=step, path=path, created_at=created_at)


def read_header(path: Path | str) -> dict[str, Any]:
    """A checkpoint file's header (step, created_at, skeleton), read without the payload and NOT verified.

    For a look at what a checkpoint holds before it is restored (the model's shape, to
    build the model it needs); the digest covers the payload too, so only a full read
    (:func:`read_checkpoint_file`) verifies it. CorruptCheckpoint when the prefix or the
    header cannot be read as one.
    """
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            header_length, _, _ = _check_prefix(file.read(_PREFIX.size), path, size)
            header_bytes = _read_exactly(file, header_length, path)
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    try:
        header = json.loads(bytes(header_bytes), parse_constant=reject_json_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(path, f"header is not valid JSON: {exc}") from exc
    _check_header(header, path)
    return header


def read_digest(path: Path | str) -> str:
    """The SHA-256 (hex) a checkpoint file's prefix announces, read without reading the rest.

    What names a file's exact contents cheaply (a delta names its parent by it); OSError
    when the file is missing or too short to hold a prefix, or is not a checkpoint.
    """
    with open(path, "rb") as file:
        prefix = file.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
        raise OSError(f"{path} does not start with a checkpoint prefix")
    return _PREFIX.unpack(prefix)[3].hex()


def reject_json_constant(constant: str) -> None:
    """``json.loads(parse_constant=...)``: bare NaN and Infinity are not JSON, so not the format."""
    raise ValueError(f"bare {constant} is not part of the format")


def _check_header(header: Any, path: Path) -> tuple[int, float]:
    if not isinstance(header, dict):
        raise CorruptCheckpoint(path, "header is not a JSON object")
    if header.get("format") != FORMAT_NAME or header.get("version") != FORMAT_VERSION:
        raise CorruptCheckpoint(
            path,
            f"unsupported format {header.get('format')!r} version {header.get('version')!r}; "
            f"this streamtrain reads {FORMAT_NAME!r} version {FORMAT_VERSION}",
        )
    step, created_at = header.get("step"), header.get("created_at")
    if type(step) is not int or step < 0:
        raise CorruptCheckpoint(path, f"header step {step!r} is not a non-negative integer")
    if isinstance(created_at, bool) or not isinstance(created_at, (int, float)) or not math.isfinite(created_at):
        raise CorruptCheckpoint(path, f"header created_at {created_at!r} is not a finite number")
    if "skeleton" not in header:
        raise CorruptCheckpoint(path, "header has no skeleton")
    return step, float(created_at)
