"""Atomic, verified checkpoints that never unpickle.

The trainer restarts from what it last wrote: model, optimizer, normalization statistics,
RNG states and the window with the Kafka offsets it reflects. A crash mid-write, a full
disk or a flipped bit must cost at most one checkpoint, and reading one must never run
code from the file, so the format holds only tensors (safetensors) and plain JSON.

One checkpoint is one file, ``ckpt-{step:012d}-{unix_ms}.stck``::

    offset   size   field
    0        8      MAGIC, PNG-style (catches text-mode mangling and foreign files)
    8        8      header length H, unsigned little-endian
    16       8      payload length P, unsigned little-endian
    24       32     SHA-256 of bytes [56, 56 + H + P): header and payload together
    56       H      header, UTF-8 JSON: format, version, step, created_at, skeleton
    56 + H   P      payload, safetensors: every tensor, array and bytes leaf of the state

The skeleton is the state with every bulky leaf replaced by a reference into the payload
(see `flatten_state`); the digest covers it too, so no bit of a checkpoint goes unchecked.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import math
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from safetensors import SafetensorError

logger = logging.getLogger(__name__)

FORMAT_NAME = "streamtrain.checkpoint"
FORMAT_VERSION = 1
MAGIC = b"\x89STK\r\n\x1a\n"
CHECKPOINT_SUFFIX = ".stck"

# magic, header length, payload length, SHA-256 of header + payload
_PREFIX = struct.Struct("<8sQQ32s")
_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)-(\d+)\.stck$")
_TEMP_NAME = re.compile(r"^\.ckpt-\d+-\d+\.stck\.(\d+)\.tmp$")
# Integers beyond 2**53 lose precision in most JSON readers; they travel as decimal strings.
_JSON_SAFE_INT = 2**53

Skeleton = Any
"""JSON-able description of a state tree; tensors appear as references into the payload."""

_SAFETENSORS_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
    }
)
# numpy dtypes that map one-to-one onto a safetensors dtype (native byte order only)
_NUMPY_TYPED = frozenset(
    np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
    )
)


class CorruptCheckpoint(Exception):
    """A checkpoint file that cannot be trusted; `reason` says which check failed."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"checkpoint {path} is unusable: {reason}")
        self.path = Path(path)
        self.reason = reason


class CheckpointWriteError(Exception):
    """Writing a checkpoint failed (unwritable or full directory); nothing partial is left."""

    def __init__(self, directory: Path, step: int, cause: OSError) -> None:
        super().__init__(
            f"could not write the step-{step} checkpoint to {directory}: {cause}. "
            "Free space on that volume or make the directory writable by the service user "
            "(STREAMTRAIN_CHECKPOINT_DIR)."
        )
        self.directory = directory
        self.step = step
        self.cause = cause


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint file as its name describes it (not yet verified)."""

    path: Path
    step: int
    created_at: float  # Unix seconds, millisecond precision (from the file name)
    size_bytes: int


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint: its state tree, as it was saved."""

    state: dict[str, Any]
    step: int
    path: Path
    created_at: float  # Unix seconds


# ----------------------------------------------------------------------------------------
# state tree <-> tensors + JSON skeleton


def flatten_state(tree: Any) -> tuple[dict[str, torch.Tensor], Skeleton]:
    """Split a state tree into safetensors-ready tensors and a JSON-able skeleton.

    Leaves: torch tensors (any dense dtype, any device; they come back on the CPU,
    detached, as plain tensors), numpy arrays and scalars (dtype kept; object arrays of
    str or of other leaves), None, bool, int (any size), float (inf and nan too), str,
    bytes. Containers: dict (any keys of those scalar types, order kept; an OrderedDict
    keeps its ``_metadata``, which ``Module.load_state_dict`` reads), list, tuple.
    Subclasses of int, float, str, list, tuple and dict come back as the base type.
    """
    flattener = _Flattener()
    skeleton = flattener.encode(tree, ())
    return flattener.tensors, skeleton


def unflatten_state(tensors: Mapping[str, torch.Tensor], skeleton: Skeleton) -> Any:
    """Rebuild the tree `flatten_state` split; ValueError if the two do not fit together."""
    unflattener = _Unflattener(tensors)
    tree = unflattener.decode(skeleton)
    unused = set(tensors) - unflattener.used
    if unused:
        raise ValueError(
            f"the payload holds {len(unused)} tensors the skeleton never names "
            f"(e.g. {sorted(unused)[:3]}); the header and payload come from different saves"
        )
    return tree


def _format_path(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{key!r}]" for key in path)


class _Flattener:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[tuple[str, int]] = set()
        self._open_containers: set[int] = set()

    def encode(self, node: Any, path: tuple[Any, ...]) -> Skeleton:
        if node is None or type(node) in (bool, str):
            return node
        if isinstance(node, torch.Tensor):
            return self._encode_tensor(node, path)
        if isinstance(node, np.ndarray):
            return self._encode_array(node, path)
        if isinstance(node, np.generic):
            return {"$npscalar": self._encode_array(np.asarray(node), path)}
        if isinstance(node, int):
            value = int(node)
            return value if -_JSON_SAFE_INT <= value <= _JSON_SAFE_INT else {"$int": str(value)}
        if isinstance(node, float):
            value = float(node)
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(node, str):
            return str(node)
        if isinstance(node, (bytes, bytearray)):
            data = torch.from_numpy(np.frombuffer(node, dtype=np.uint8).copy())
            return {"$bytes": self._add(data)}
        if isinstance(node, (dict, list, tuple)):
            return self._encode_container(node, path)
        raise TypeError(
            f"{_format_path(path)} is a {type(node).__qualname__}, which a checkpoint cannot "
            "hold: states are dicts/lists/tuples of tensors, numpy arrays, numbers, str, bytes "
            "and None. Convert it first (e.g. its state_dict(), or a dict of its fields)."
        )

    def _encode_container(self, node: dict | list | tuple, path: tuple[Any, ...]) -> Skeleton:
        if id(node) in self._open_containers:
            raise ValueError(f"{_format_path(path)} contains itself; a checkpoint state must be a tree")
        self._open_containers.add(id(node))
        try:
            if isinstance(node, list):
                return [self.encode(item, path + (index,)) for index, item in enumerate(node)]
            if isinstance(node, tuple):
                return {"$tuple": [self.encode(item, path + (index,)) for index, item in enumerate(node)]}
            items = [[self._encode_key(key, path), self.encode(value, path + (key,))] for key, value in node.items()]
            metadata = getattr(node, "_metadata", None)
            if isinstance(node, collections.OrderedDict) and isinstance(metadata, dict):
                return {"$dict": items, "metadata": self.encode(metadata, path + ("_metadata",))}
            return {"$dict": items}
        finally:
            self._open_containers.discard(id(node))

    def _encode_key(self, key: Any, path: tuple[Any, ...]) -> Skeleton:
        if not _is_scalar_key(key):
            raise TypeError(
                f"{_format_path(path)} has a key of type {type(key).__qualname__}; checkpoint "
                "dict keys must be None, bool, int, float, str, bytes or tuples of those"
            )
        return self.encode(key, path)

    def _add(self, tensor: torch.Tensor) -> str:
        name = str(len(self.tensors))
        self.tensors[name] = tensor
        return name

    def _encode_tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> Skeleton:
        if tensor.layout != torch.strided:
            raise TypeError(f"{_format_path(path)} is a {tensor.layout} tensor; call .to_dense() before saving it")
        plain = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
        if plain.numel():
            # safetensors refuses tensors that share memory (tied weights, views of one array)
            storage = (str(plain.device), plain.untyped_storage().data_ptr())
            if storage in self._storages:
                plain = plain.clone()
                storage = (str(plain.device), plain.untyped_storage().data_ptr())
            self._storages.add(storage)
        if plain.dtype in _SAFETENSORS_DTYPES:
            return {"$tensor": self._add(plain)}
        # complex128, float8 variants, ...: raw bytes, dtype and shape alongside
        try:
            raw = plain.reshape(-1).view(torch.uint8) if plain.numel() else torch.empty(0, dtype=torch.uint8)
        except RuntimeError as exc:
            raise TypeError(
                f"{_format_path(path)} has dtype {plain.dtype}, which cannot be saved as bytes: {exc}"
            ) from exc
        return {
            "$tensor": self._add(raw),
            "dtype": str(plain.dtype).removeprefix("torch."),
            "shape": list(plain.shape),
        }

    def _encode_array(self, array: np.ndarray, path: tuple[Any, ...]) -> Skeleton:
        if array.dtype == np.dtype(object):
            return self._encode_object_array(array, path)
        if array.dtype.fields is not None or array.dtype.hasobject:
            raise TypeError(
                f"{_format_path(path)} is a structured numpy array ({array.dtype}); save its fields as separate arrays"
            )
        contiguous = np.asarray(array, order="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d
        if not contiguous.flags.writeable:
            contiguous = contiguous.copy()  # torch.from_numpy refuses to wrap read-only memory quietly
        if array.dtype in _NUMPY_TYPED:
            return {"$ndarray": self._add(torch.from_numpy(contiguous))}
        # byte-swapped, datetime, fixed-width str/bytes, void: raw bytes, dtype string alongside
        raw = contiguous.reshape(-1).view(np.uint8) if contiguous.nbytes else np.empty(0, np.uint8)
        return {"$ndarray": self._add(torch.from_numpy(raw)), "dtype": array.dtype.str, "shape": list(array.shape)}

    def _encode_object_array(self, array: np.ndarray, path: tuple[Any, ...]) -> Skeleton:
        items = array.reshape(-1).tolist()
        shape = list(array.shape)
        if set(map(type, items)) <= {str}:
            # sensor ids: one UTF-8 blob plus per-item lengths in code points, so loading decodes once
            blob = "".join(items).encode("utf-8", "surrogatepass")
            lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
            encoded_blob = self._add(torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy()))
            return {"$strarray": encoded_blob, "lengths": self._add(torch.from_numpy(lengths)), "shape": shape}
        return {"$objarray": [self.encode(item, path + (index,)) for index, item in enumerate(items)], "shape": shape}


def _is_scalar_key(key: Any) -> bool:
    if isinstance(key, tuple):
        return all(_is_scalar_key(item) for item in key)
    return key is None or isinstance(key, (bool, int, float, str, bytes))


class _Unflattener:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.used: set[str] = set()

    def decode(self, node: Skeleton) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(item) for item in node]
        if not isinstance(node, dict):
            raise ValueError(f"skeleton node of type {type(node).__name__} is not part of the format")
        tags = [key for key in node if key.startswith("$")]
        if len(tags) != 1 or tags[0] not in self._DECODERS:
            raise ValueError(f"skeleton node with keys {sorted(node)} has no single known $tag")
        return self._DECODERS[tags[0]](self, node)

    def _tensor(self, name: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not isinstance(name, str) or name not in self.tensors:
            raise ValueError(f"skeleton names tensor {name!r}, which the payload does not hold")
        if name in self.used:
            raise ValueError(f"skeleton names tensor {name!r} twice")
        self.used.add(name)
        tensor = self.tensors[name]
        if dtype is not None and tensor.dtype != dtype:
            raise ValueError(f"payload tensor {name!r} is {tensor.dtype}, expected {dtype}")
        return tensor

    def _decode_tensor(self, node: dict) -> torch.Tensor:
        if "dtype" not in node:
            return self._tensor(node["$tensor"])
        raw = self._tensor(node["$tensor"], torch.uint8)
        dtype = getattr(torch, node["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {node['dtype']!r}")
        shape = [int(size) for size in node["shape"]]
        if raw.numel() == 0:
            return torch.empty(shape, dtype=dtype)
        return raw.view(dtype).reshape(shape)

    def _decode_array(self, node: dict) -> np.ndarray:
        if "dtype" not in node:
            return self._tensor(node["$ndarray"]).numpy()
        raw = self._tensor(node["$ndarray"], torch.uint8).numpy()
        dtype = np.dtype(node["dtype"])
        if dtype.hasobject:
            raise ValueError(f"raw numpy dtype {node['dtype']!r} would hold Python objects")
        shape = tuple(int(size) for size in node["shape"])
        if raw.size == 0:
            return np.zeros(shape, dtype=dtype)
        return raw.view(dtype).reshape(shape)

    def _decode_npscalar(self, node: dict) -> np.generic:
        array = self.decode(node["$npscalar"])
        if not isinstance(array, np.ndarray) or array.shape != ():
            raise ValueError("$npscalar must wrap a 0-d array")
        return array[()]

    def _decode_strarray(self, node: dict) -> np.ndarray:
        blob = self._tensor(node["$strarray"], torch.uint8).numpy()
        lengths = self._tensor(node["lengths"], torch.int64).numpy()
        text = blob.tobytes().decode("utf-8", "surrogatepass")
        ends = np.cumsum(lengths)
        if (lengths < 0).any() or (ends[-1] if len(ends) else 0) != len(text):
            raise ValueError("string array lengths do not add up to its text")
        starts = (ends - lengths).tolist()
        return _object_array([text[start:end] for start, end in zip(starts, ends.tolist())], node["shape"])

    def _decode_objarray(self, node: dict) -> np.ndarray:
        return _object_array([self.decode(item) for item in node["$objarray"]], node["shape"])

    def _decode_dict(self, node: dict) -> dict:
        items = [(self.decode(key), self.decode(value)) for key, value in node["$dict"]]
        if "metadata" not in node:
            return dict(items)
        ordered = collections.OrderedDict(items)
        ordered._metadata = self.decode(node["metadata"])  # type: ignore[attr-defined]
        return ordered

    def _decode_int(self, node: dict) -> int:
        return int(node["$int"])

    def _decode_float(self, node: dict) -> float:
        if node["$float"] not in ("inf", "-inf", "nan"):
            raise ValueError(f"$float holds {node['$float']!r}; only inf, -inf and nan travel tagged")
        return float(node["$float"])

    def _decode_bytes(self, node: dict) -> bytes:
        return self._tensor(node["$bytes"], torch.uint8).numpy().tobytes()

    def _decode_tuple(self, node: dict) -> tuple:
        return tuple(self.decode(item) for item in node["$tuple"])

    _DECODERS: dict[str, Callable[[_Unflattener, dict], Any]] = {
        "$tensor": _decode_tensor,
        "$ndarray": _decode_array,
        "$npscalar": _decode_npscalar,
        "$strarray": _decode_strarray,
        "$objarray": _decode_objarray,
        "$dict": _decode_dict,
        "$int": _decode_int,
        "$float": _decode_float,
        "$bytes": _decode_bytes,
        "$tuple": _decode_tuple,
    }


def _object_array(items: list[Any], shape: list[int]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape([int(size) for size in shape])


# ----------------------------------------------------------------------------------------
# one checkpoint file <-> bytes


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
    if not data:
        raise CorruptCheckpoint(path, "empty file")
    if len(data) < _PREFIX.size:
        raise CorruptCheckpoint(path, f"{len(data)} bytes is shorter than the {_PREFIX.size}-byte prefix (truncated)")
    magic, header_length, payload_length, expected_digest = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptCheckpoint(path, f"magic bytes {magic!r} are not {MAGIC!r}: not a streamtrain checkpoint")
    expected_size = _PREFIX.size + header_length + payload_length
    if len(data) < expected_size:
        raise CorruptCheckpoint(
            path, f"truncated: the prefix announces {expected_size} bytes, the file has {len(data)}"
        )
    if len(data) > expected_size:
        raise CorruptCheckpoint(path, f"{len(data) - expected_size} trailing bytes after the announced {expected_size}")
    body = memoryview(data)[_PREFIX.size :]
    if hashlib.sha256(body).digest() != expected_digest:
        raise CorruptCheckpoint(
            path, "SHA-256 mismatch: the contents changed after writing (bit rot or partial overwrite)"
        )
    try:
        header = json.loads(bytes(body[:header_length]), parse_constant=_reject_json_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(path, f"header is not valid JSON: {exc}") from exc
    step, created_at = _check_header(header, path)
    try:
        tensors = safetensors.torch.load(bytes(body[header_length:]))
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


def read_checkpoint(path: Path | str) -> LoadedCheckpoint:
    """Read, verify and decode one checkpoint file; its name must agree with its header."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptCheckpoint(path, f"unreadable: {exc}") from exc
    loaded = decode_checkpoint(data, path)
    name = _CHECKPOINT_NAME.match(path.name)
    if name is not None and int(name.group(1)) != loaded.step:
        raise CorruptCheckpoint(path, f"file name says step {int(name.group(1))}, header says step {loaded.step}")
    return loaded


def _reject_json_constant(constant: str) -> None:
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
    if type(created_at) not in (int, float) or not math.isfinite(created_at):
        raise CorruptCheckpoint(path, f"header created_at {created_at!r} is not a finite number")
    if "skeleton" not in header:
        raise CorruptCheckpoint(path, "header has no skeleton")
    return step, float(created_at)


# ----------------------------------------------------------------------------------------
# a directory of checkpoints


_FileSignature = tuple[int, int, int]  # size, mtime_ns, inode: changes whenever the file does


class CheckpointStore:
    """A directory of the last `keep` good checkpoints, written atomically, read verified.

    `save` never leaves a partial file under a checkpoint name (temp file, fsync, rename,
    fsync of the directory) and raises CheckpointWriteError on any OS failure so the caller
    can count it and retry. `load_latest` falls back past corrupt files, logging each and
    calling ``on_corrupt(path, reason)`` once per file. Thread-safe; do not call it from a
    signal handler (set a flag there and save from the training loop).
    """

    def __init__(
        self,
        directory: Path | str,
        keep: int = 3,
        on_corrupt: Callable[[Path, str], None] | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: a checkpoint store must keep at least 1 checkpoint; pass keep >= 1")
        self.directory = Path(directory)
        self.keep = keep
        self.on_corrupt = on_corrupt
        self._clock = clock
        self._lock = threading.Lock()
        # verdicts of files already read: name -> (signature, reason or None when valid)
        self._verdicts: dict[str, tuple[_FileSignature, str | None]] = {}

    # -- writing ---------------------------------------------------------------------------

    def save(self, state: Mapping[str, Any], step: int) -> Path:
        """Write `state` as the checkpoint of `step`, then prune; returns the new file."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: a checkpoint step must be a non-negative int")
        if not isinstance(state, Mapping):
            raise TypeError(f"state is a {type(state).__qualname__}; a checkpoint state must be a dict")
        created_at = float(self._clock())
        chunks = encode_checkpoint(state, step=step, created_at=created_at)
        with self._lock:
            final = self.directory / f"ckpt-{step:012d}-{int(created_at * 1000)}{CHECKPOINT_SUFFIX}"
            temp = self.directory / f".{final.name}.{os.getpid()}.tmp"
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                signature = self._write_file(temp, chunks)
                os.replace(temp, final)
                self._fsync_directory()
            except OSError as exc:
                _remove_quietly(temp)
                raise CheckpointWriteError(self.directory, step, exc) from exc
            except BaseException:
                _remove_quietly(temp)
                raise
            self._verdicts[final.name] = (signature, None)
            try:
                self._prune(just_written=final)
            except OSError as exc:  # the checkpoint itself is safely written; pruning retries next save
                logger.warning("could not prune checkpoint directory %s: %s", self.directory, exc)
        logger.info("wrote checkpoint %s (step %d, %d bytes)", final, step, sum(map(len, chunks)))
        return final

    @staticmethod
    def _write_file(path: Path, chunks: list[bytes]) -> _FileSignature:
        # O_EXCL: never write through a file or link someone else placed here; 0600: private
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        try:
            file = open(fd, "wb", closefd=True)
        except BaseException:
            os.close(fd)
            raise
        with file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
            return _signature(os.fstat(file.fileno()))

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # file systems that cannot sync a directory
                raise
        finally:
            os.close(fd)

    def _prune(self, just_written: Path) -> None:
        """Delete what is older than the `keep` newest good checkpoints, and stale temp files.

        Files newer than those (corrupt ones, or ones from a run at higher steps) stay, and
        so does the file just written even if its step sorts below them.
        """
        valid: list[Path] = []
        doomed: list[Path] = []
        for info in self._scan():
            if len(valid) >= self.keep:
                doomed.append(info.path)
            elif info.path == just_written or self._is_valid(info.path):
                valid.append(info.path)
        if valid and valid[0] != just_written:
            logger.warning(
                "saved %s, but %s sorts after it (higher step); load_latest will prefer that one. "
                "Give each run its own checkpoint directory.",
                just_written.name,
                valid[0].name,
            )
        for path in doomed:
            if path != just_written:
                self._remove(path)
        for path in self._stale_temp_files():
            self._remove(path)

    def _remove(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not delete old checkpoint file %s: %s", path, exc)
        self._verdicts.pop(path.name, None)

    def _stale_temp_files(self) -> list[Path]:
        stale = []
        for entry in os.scandir(self.directory):
            match = _TEMP_NAME.match(entry.name)
            # ours (we hold the lock, so no save is in flight) or from a process that is gone
            if match and (int(match.group(1)) == os.getpid() or not _process_alive(int(match.group(1)))):
                stale.append(Path(entry.path))
        return stale

    # -- reading ---------------------------------------------------------------------------

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies, or None; corrupt ones are logged and skipped."""
        with self._lock:
            try:
                infos = self._scan()
            except OSError as exc:
                logger.warning(
                    "cannot list checkpoint directory %s (%s); starting without a checkpoint", self.directory, exc
                )
                return None
            for info in infos:
                loaded = self._read(info.path)
                if loaded is not None:
                    logger.info("loaded checkpoint %s (step %d)", info.path, loaded.step)
                    return loaded
            return None

    def read(self, path: Path | str) -> LoadedCheckpoint | None:
        """Read and verify one checkpoint file of this store; None (logged and reported once) when corrupt."""
        with self._lock:
            return self._read(Path(path))

    def list(self) -> list[CheckpointInfo]:
        """Checkpoint files by name, newest first (step, then time); not verified."""
        with self._lock:
            return self._scan()

    @property
    def latest_step(self) -> int | None:
        """Step of the newest checkpoint that verifies (reads each file at most once)."""
        with self._lock:
            for info in self._scan():
                if self._is_valid(info.path):
                    return info.step
            return None

    def _scan(self) -> list[CheckpointInfo]:
        infos = []
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        for entry in entries:
            match = _CHECKPOINT_NAME.match(entry.name)
            if match is None:
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:
                continue
            infos.append(
                CheckpointInfo(
                    path=Path(entry.path),
                    step=int(match.group(1)),
                    created_at=int(match.group(2)) / 1000,
                    size_bytes=size,
                )
            )
        infos.sort(key=lambda info: (info.step, info.created_at), reverse=True)
        return infos

    def _is_valid(self, path: Path) -> bool:
        try:
            signature = _signature(path.stat())
        except OSError:
            return False
        verdict = self._verdicts.get(path.name)
        if verdict is not None and verdict[0] == signature:
            return verdict[1] is None
        return self._read(path) is not None

    def _read(self, path: Path) -> LoadedCheckpoint | None:
        """Read and verify `path`; None (reported once) when it is corrupt."""
        try:
            signature = _signature(path.stat())
        except OSError as exc:
            self._report_corrupt(path, f"unreadable: {exc}", None)
            return None
        verdict = self._verdicts.get(path.name)
        if verdict is not None and verdict[0] == signature and verdict[1] is not None:
            return None  # known corrupt, already reported
        try:
            loaded = read_checkpoint(path)
        except CorruptCheckpoint as exc:
            self._report_corrupt(path, exc.reason, signature)
            return None
        self._verdicts[path.name] = (signature, None)
        return loaded

    def _report_corrupt(self, path: Path, reason: str, signature: _FileSignature | None) -> None:
        if signature is not None:
            self._verdicts[path.name] = (signature, reason)
        logger.warning("skipping corrupt checkpoint %s: %s; falling back to an older one", path, reason)
        if self.on_corrupt is not None:
            try:
                self.on_corrupt(path, reason)
            except Exception:
                logger.exception("on_corrupt callback failed for %s", path)


def _signature(stat: os.stat_result) -> _FileSignature:
    return (stat.st_size, stat.st_mtime_ns, stat.st_ino)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not remove temporary checkpoint file %s: %s", path, exc)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True
