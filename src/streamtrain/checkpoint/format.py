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
unchecked, and decoding verifies the digest before it parses anything. Only tensors
(safetensors) and plain JSON are read: nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
from safetensors import SafetensorError

from streamtrain.checkpoint.codec import flatten_state, unflatten_state

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


def encode_checkpoint(state: Mapping[str, Any], *, step: int, created_at: float) -> list[bytes]:
    """The file's bytes as chunks (prefix, header, payload), so writing never joins them."""
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
    payload = safetensors.torch.save(tensors)
    digest = hashlib.sha256(header)
    digest.update(payload)
    return [_PREFIX.pack(MAGIC, len(header), len(payload), digest.digest()), header, payload]


def decode_checkpoint(data: bytes, path: Path | str = "<bytes>") -> LoadedCheckpoint:
    """Verify and decode one checkpoint's bytes; CorruptCheckpoint names the failed check."""
    path = Path(path)
    header_length, payload_length, expected_digest = _check_prefix(data[: _PREFIX.size], path, len(data))
    header_end = _PREFIX.size + header_length
    return _decode_parts(data[_PREFIX.size : header_end], data[header_end:], expected_digest, path)


def read_checkpoint_file(path: Path | str) -> LoadedCheckpoint:
    """:func:`decode_checkpoint` of a file, reading its payload into one buffer that is never copied.

    A window of millions of items makes a payload of gigabytes: reading the file whole and
    slicing the payload out of it would copy it once more.
    """
    path = Path(path)
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        header_length, payload_length, expected_digest = _check_prefix(file.read(_PREFIX.size), path, size)
        header = file.read(header_length)
        payload = file.read(payload_length)
    if len(header) + len(payload) != header_length + payload_length:
        raise CorruptCheckpoint(path, "truncated while it was read")
    return _decode_parts(header, payload, expected_digest, path)


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


def _decode_parts(header_bytes: bytes, payload: bytes, expected_digest: bytes, path: Path) -> LoadedCheckpoint:
    digest = hashlib.sha256(header_bytes)
    digest.update(payload)
    if digest.digest() != expected_digest:
        raise CorruptCheckpoint(
            path, "SHA-256 mismatch: the contents changed after writing (bit rot or partial overwrite)"
        )
    try:
        header = json.loads(header_bytes, parse_constant=reject_json_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(path, f"header is not valid JSON: {exc}") from exc
    step, created_at = _check_header(header, path)
    try:
        tensors = safetensors.torch.load(payload)
    except (SafetensorError, ValueError, KeyError) as exc:
        raise CorruptCheckpoint(path, f"payload is not valid safetensors: {exc}") from exc
    try:
        state = unflatten_state(tensors, header["skeleton"])
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, OverflowError, UnicodeError) as exc:
        # RuntimeError: torch refusing a view/reshape the skeleton asks for (RecursionError too)
        raise CorruptCheckpoint(path, f"skeleton does not fit the payload: {exc}") from exc
    if not isinstance(state, dict):
        raise CorruptCheckpoint(path, f"state is a {type(state).__name__}, expected a dict")
    return LoadedCheckpoint(state=state, step=step, path=path, created_at=created_at)


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
