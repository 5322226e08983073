"""State trees <-> tensors and a JSON skeleton: what a checkpoint holds, never a pickle.

A state tree (a trainer's, a window's) is split into the tensors a safetensors payload
holds and a JSON skeleton that holds everything else, with every bulky leaf replaced by
a reference into the payload (``{"$tensor": "0"}``, ``{"$ndarray": "1"}``, ...).
Decoding builds only the types this module names (dicts, lists, tuples, numbers, str,
bytes, None, tensors, numpy arrays); a skeleton node it does not know is refused, so
reading a checkpoint never runs code from the file. Round trips are exact: dtypes,
shapes, bits (nan, -0.0), integer size, dict key order and a state_dict's ``_metadata``.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

from streamtrain.window.storage import OBJECT_PIECE_ITEMS, ItemReadings, SensorCodes

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


PayloadTensor = torch.Tensor | ItemReadings
"""What a payload holds: tensors, and a window's readings where they lie (written piece by piece)."""


def flatten_state(tree: Any) -> tuple[dict[str, PayloadTensor], Skeleton]:
    """Split a state tree into safetensors-ready tensors and a JSON-able skeleton.

    Leaves: torch tensors (any dense dtype, any device, not quantized; they come back on
    the CPU, detached, as plain tensors), numpy arrays and scalars (dtype kept; object arrays of
    str or of other leaves; str arrays whose items repeat keep each string once, with a
    code per item), :class:`~streamtrain.window.storage.SensorCodes` (they come back as
    the object array of the ids they name), :class:`~streamtrain.window.storage.ItemReadings`
    (they come back as the float32 array of the readings back to back), None, bool, int (any size), float (inf and nan
    too), str, bytes. Containers: dict (any keys of those scalar types, order kept; an OrderedDict
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


def skeleton_entry(skeleton: Skeleton, *keys: str) -> Any:
    """The subtree ``state[keys[0]][keys[1]]...`` decoded from a skeleton alone, without its payload.

    For a subtree that holds no tensors (a model's configuration): ValueError when a key is
    missing, a node on the way is not a dict, or the subtree names a tensor.
    """
    node = skeleton
    for key in keys:
        pairs = node.get("$dict") if isinstance(node, dict) else None
        if not isinstance(pairs, list):
            raise ValueError(f"{_format_path(keys)}: {key!r} is not under a dict")
        found = [pair[1] for pair in pairs if isinstance(pair, list) and len(pair) == 2 and pair[0] == key]
        if not found:
            raise ValueError(f"{_format_path(keys)}: no {key!r}")
        node = found[0]
    return unflatten_state({}, node)


def _format_path(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{key!r}]" for key in path)


class _Flattener:
    def __init__(self) -> None:
        self.tensors: dict[str, PayloadTensor] = {}
        self._storages: set[tuple[str, int]] = set()
        self._open_containers: set[int] = set()

    def encode(self, node: Any, path: tuple[Any, ...]) -> Skeleton:
        if node is None or type(node) in (bool, str):
            return node
        if isinstance(node, torch.Tensor):
            return self._encode_tensor(node, path)
        if isinstance(node, np.ndarray):
            return self._encode_array(node, path)
        if isinstance(node, SensorCodes):
            return self._encode_sensor_codes(node)
        if isinstance(node, ItemReadings):
            return {"$ndarray": self._add(node)}
        if isinstance(node, np.generic):
            return {"$npscalar": self._encode_array(np.asarray(node), path)}
        if isinstance(node, int):
            integer = int(node)
            return integer if -_JSON_SAFE_INT <= integer <= _JSON_SAFE_INT else {"$int": str(integer)}
        if isinstance(node, float):
            number = float(node)
            return number if math.isfinite(number) else {"$float": repr(number)}
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

    def _add(self, tensor: PayloadTensor) -> str:
        name = str(len(self.tensors))
        self.tensors[name] = tensor
        return name

    def _encode_tensor(self, tensor: torch.Tensor, path: tuple[Any, ...]) -> Skeleton:
        if tensor.layout != torch.strided:
            raise TypeError(f"{_format_path(path)} is a {tensor.layout} tensor; call .to_dense() before saving it")
        if tensor.is_quantized:  # its bytes alone would come back as a tensor without scale or zero point
            raise TypeError(
                f"{_format_path(path)} is a quantized tensor ({tensor.dtype}); save its dequantize(), or its "
                "int_repr() with its q_scale() and q_zero_point()"
            )
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
        flat = array.reshape(-1)
        shape = list(array.shape)
        strings = _distinct_strings(flat)
        if strings is None:
            items = flat.tolist()
            return {"$objarray": [self.encode(item, path + (i,)) for i, item in enumerate(items)], "shape": shape}
        # sensor ids: one UTF-8 blob plus per-string lengths in code points, so loading decodes once;
        # ids that repeat (a window's: a fleet's sensors) are each stored once, with a code per item
        if 2 * len(strings) > flat.size:
            return {**self._encode_strings([item for piece in _pieces(flat) for item in piece]), "shape": shape}
        index = {string: code for code, string in enumerate(strings)}
        codes = np.empty(flat.size, dtype=np.int32 if len(strings) < 2**31 else np.int64)
        at = 0
        for piece in _pieces(flat):
            codes[at : at + len(piece)] = np.fromiter(
                map(index.__getitem__, piece), dtype=codes.dtype, count=len(piece)
            )
            at += len(piece)
        return {**self._encode_strings(list(strings)), "codes": self._add(torch.from_numpy(codes)), "shape": shape}

    def _encode_sensor_codes(self, column: SensorCodes) -> Skeleton:
        """An object array of the ids ``column`` codes, each id used stored once (as for repeated strings)."""
        codes = np.asarray(column.codes).reshape(-1)
        used = np.zeros(len(column.strings), dtype=bool)
        for start in range(0, codes.size, 1 << 20):  # bincount holds the interpreter: a million codes at a time
            used |= np.bincount(codes[start : start + (1 << 20)], minlength=used.size) > 0
        renumber = np.cumsum(used, dtype=np.int32) - 1
        strings = column.strings[used].tolist()
        if not set(map(type, strings)) <= {str}:
            raise TypeError(f"sensor codes name {set(map(type, strings)) - {str}} entries; they must be str")
        new_codes = renumber[codes] if codes.size else np.zeros(0, dtype=np.int32)
        return {
            **self._encode_strings(strings),
            "codes": self._add(torch.from_numpy(np.ascontiguousarray(new_codes, dtype=np.int32))),
            "shape": list(column.shape),
        }

    def _encode_strings(self, strings: list[str]) -> dict[str, str]:
        blob = "".join(strings).encode("utf-8", "surrogatepass")
        lengths = np.fromiter(map(len, strings), dtype=np.int64, count=len(strings))
        encoded_blob = self._add(torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy()))
        return {"$strarray": encoded_blob, "lengths": self._add(torch.from_numpy(lengths))}


# Python objects an object array's items are worked on at a time: a pass over one holds the
# interpreter a few milliseconds, so a checkpoint of millions never stalls the other threads long
_PIECE_ITEMS = OBJECT_PIECE_ITEMS


def _pieces(flat: np.ndarray) -> Iterator[list[Any]]:
    """The items of a 1-D object array as lists of at most ``_PIECE_ITEMS``."""
    for start in range(0, flat.size, _PIECE_ITEMS):
        yield flat[start : start + _PIECE_ITEMS].tolist()


def _distinct_strings(flat: np.ndarray) -> dict[str, None] | None:
    """The distinct items of a 1-D object array, in order of first appearance; None unless all are str."""
    distinct: dict[str, None] = {}
    for piece in _pieces(flat):
        if not set(map(type, piece)) <= {str}:
            return None
        distinct.update(dict.fromkeys(piece))
    return distinct


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
        return cast(np.generic, array[()])  # indexing a 0-d array with () gives its scalar

    def _decode_strarray(self, node: dict) -> np.ndarray:
        blob = self._tensor(node["$strarray"], torch.uint8).numpy()
        lengths = self._tensor(node["lengths"], torch.int64).numpy()
        text = blob.tobytes().decode("utf-8", "surrogatepass")
        ends = np.cumsum(lengths)
        if (lengths < 0).any() or (ends[-1] if len(ends) else 0) != len(text):
            raise ValueError("string array lengths do not add up to its text")
        starts = (ends - lengths).tolist()
        strings = _object_array([text[start:end] for start, end in zip(starts, ends.tolist())], [len(starts)])
        if "codes" not in node:
            return strings.reshape([int(size) for size in node["shape"]])
        codes = self._tensor(node["codes"]).numpy()
        if codes.dtype not in (np.int32, np.int64) or (
            codes.size and not 0 <= codes.min() <= codes.max() < len(strings)
        ):
            raise ValueError(f"string array codes must be int32/int64 indices into its {len(strings)} strings")
        return strings[codes].reshape([int(size) for size in node["shape"]])

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
