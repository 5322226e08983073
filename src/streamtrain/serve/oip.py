"""Open Inference Protocol v2 (KServe, Triton, Seldon MLServer) beside ``/v1/predict``.

The model is served as ``streamtrain``: health, server and model metadata, readiness and
``infer`` for the serving version and for every kept version (``.../versions/{v}/infer``).
An infer request is answered by the same worker threads as ``/v1/predict``
(serve/batcher.py: requests waiting for one version merge into one forward), with the same
value rules (those of events.parse_values, reasons included) and the same order rule: row
``b`` of every output answers row ``b`` of ``values``, whatever the company.

Input ``values`` is FP32 ``[batch, length, channels]``, optional ``lengths`` INT32/INT64
``[batch]`` (without it every row is ``length`` steps long; steps past a row's length are
padding and never looked at). Outputs are FP32: ``next [batch, channels]``,
``anomaly_score [batch]`` and, with classes, ``probs [batch, n_classes]``.

The binary tensor data extension works as Triton's clients use it: the body is a JSON
header of ``Inference-Header-Content-Length`` bytes followed by the raw little-endian
bytes of every input whose ``parameters`` carry ``binary_data_size``, in input order;
outputs asked for with ``binary_data`` (or all, with ``binary_data_output``) come back
the same way. Request bodies may be gzip or deflate encoded (``Content-Encoding``).

Every refusal is ``{"error": "..."}``: 400 for a request the protocol or the value rules
refuse (unknown model or version included), 413 over ``MAX_REQUEST_BYTES``, 503 while no
model is published or the workers are full. Never 500.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from streamtrain import __version__
from streamtrain.model.inference import PredictionArrays
from streamtrain.serve.batcher import Overloaded, PredictBatcher
from streamtrain.serve.schemas import (
    OIPError,
    OIPInferRequest,
    OIPInferResponse,
    OIPLive,
    OIPModelMetadata,
    OIPReady,
    OIPServerMetadata,
)
from streamtrain.training.registry import UnknownVersion

MODEL_NAME = "streamtrain"
PLATFORM = "pytorch"
EXTENSIONS = ["binary_tensor_data"]
HEADER_LENGTH = "Inference-Header-Content-Length"

_INPUT_TYPES = {"values": ("FP32",), "lengths": ("INT32", "INT64")}
_NUMPY: dict[str, np.dtype[Any]] = {"FP32": np.dtype("<f4"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8")}
_NUMBER_TYPES = frozenset({int, float})  # bool is not a number here, as in events.parse_values


class OIPProblem(Exception):
    """A request the protocol refuses: answered ``{"error": message}`` with ``status``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": self.message})


# ---------------------------------------------------------------------- request decoding
def decode_body(raw: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The body without its Content-Encoding (gzip, deflate), at most ``limit`` bytes inflated."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return raw
    if encoding not in ("gzip", "deflate"):
        raise OIPProblem(f"Content-Encoding {content_encoding!r} is not supported; send identity, gzip or deflate")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        body = inflater.decompress(raw, limit + 1)
    except zlib.error as err:
        raise OIPProblem(f"body: not valid {encoding} data ({err})") from None
    if len(body) > limit:
        raise OIPProblem(f"body: over {limit} bytes once inflated (MAX_REQUEST_BYTES)", status=413)
    if not inflater.eof:
        raise OIPProblem(f"body: the {encoding} stream is truncated")
    return body


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON header, binary tensor data) by the Inference-Header-Content-Length header."""
    if header_length is None:
        return body, b""
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > len(body):
        raise OIPProblem(
            f"{HEADER_LENGTH}: expected the JSON header's byte count, 0..{len(body)} for this body, "
            f"got {header_length!r}"
        )
    return body[: int(text)], body[int(text) :]


def _validation_message(err: ValidationError) -> str:
    """The first five problems, each where (the field's path) and pydantic's words. Only a JSON
    object gets here (:func:`parse_header`), so every problem has a path."""
    return "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in err.errors()[:5])


def parse_header(header: bytes) -> OIPInferRequest:
    try:
        obj = orjson.loads(header)
    except orjson.JSONDecodeError:
        try:  # NaN / Infinity literals: parse them, so the value rules name the row (non_finite)
            obj = json.loads(header.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise OIPProblem("body: the inference request is not UTF-8 JSON") from None
    if not isinstance(obj, dict):
        raise OIPProblem(f"body: expected a JSON object (the inference request), got {type(obj).__name__}")
    try:
        return OIPInferRequest.model_validate(obj)
    except ValidationError as err:
        raise OIPProblem(_validation_message(err)) from None


def _flatten(data: list[Any], where: str) -> list[Any]:
    """Row-major contents of a flat or nested ``data`` array."""
    flat = data
    while flat and type(flat[0]) is list:
        if not all(type(item) is list for item in flat):
            raise OIPProblem(f"{where}.data: schema: mixes arrays and numbers at one nesting level")
        flat = list(chain.from_iterable(flat))
    return flat


def _as_float(x: Any) -> float:
    try:
        return float(x) if type(x) in _NUMBER_TYPES else 0.0
    except OverflowError:  # an integer beyond float range
        return math.inf


def _json_values(flat: list[Any]) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 contents, and where the data held something other than a number (None: nowhere).

    Beyond float32 range becomes inf; the row checks then refuse it as non_finite, and a
    non-number as schema, both naming the row, in the order of the event rules.
    """
    with np.errstate(over="ignore"):
        if set(map(type, flat)) <= _NUMBER_TYPES:
            try:
                return np.array(flat, dtype=np.float64).astype(np.float32), None
            except OverflowError:
                pass
        not_numbers = np.fromiter((type(x) not in _NUMBER_TYPES for x in flat), dtype=bool, count=len(flat))
        values = np.array([_as_float(x) for x in flat], dtype=np.float64).astype(np.float32)
    return values, (not_numbers if not_numbers.any() else None)


def _json_integers(flat: list[Any], datatype: str, where: str) -> np.ndarray:
    if not all(type(x) is int for x in flat):
        raise OIPProblem(f"{where}.data: schema: must hold only integers")
    try:
        return np.array(flat, dtype=_NUMPY[datatype])
    except OverflowError:
        raise OIPProblem(f"{where}.data: a value is out of {datatype} range") from None


@dataclass(frozen=True)
class OIPInputs:
    values: np.ndarray  # as declared, [batch, length, channels] when valid
    lengths: np.ndarray | None  # [batch] when given
    not_numbers: np.ndarray | None = None  # like values: True where JSON data held no number


def read_inputs(request: OIPInferRequest, binary: bytes) -> OIPInputs:
    """The inputs from JSON ``data`` or the binary section, shapes as declared."""
    found: dict[str, np.ndarray] = {}
    not_numbers = None
    offset = 0
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}] ({tensor.name})"
        if tensor.name not in _INPUT_TYPES:
            raise OIPProblem(f"{where}: unknown input; this model takes 'values' and optionally 'lengths'")
        if tensor.name in found:
            raise OIPProblem(f"{where}: input given twice")
        if tensor.datatype not in _INPUT_TYPES[tensor.name]:
            raise OIPProblem(
                f"{where}: datatype {tensor.datatype!r}; expected {' or '.join(_INPUT_TYPES[tensor.name])}"
            )
        parameters = tensor.parameters or {}
        if "shared_memory_region" in parameters:
            raise OIPProblem(f"{where}: the shared-memory extension is not supported; send the data in the request")
        count = math.prod(tensor.shape)
        dtype = _NUMPY[tensor.datatype]
        size = parameters.get("binary_data_size")
        if size is not None:
            if type(size) is not int or size < 0:
                raise OIPProblem(f"{where}: parameters.binary_data_size must be a non-negative integer")
            if tensor.data is not None:
                raise OIPProblem(f"{where}: give either data or binary_data_size, not both")
            if size != count * dtype.itemsize:
                raise OIPProblem(
                    f"{where}: binary_data_size {size} does not fit shape {tensor.shape} of {tensor.datatype} "
                    f"({count * dtype.itemsize} bytes)"
                )
            if offset + size > len(binary):
                raise OIPProblem(f"{where}: binary_data_size {size} runs past the end of the body")
            array = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
            offset += size
        else:
            if tensor.data is None:
                raise OIPProblem(f"{where}: no data (give data, or binary_data_size with the binary extension)")
            flat = _flatten(tensor.data, where)
            if len(flat) != count:
                raise OIPProblem(f"{where}.data: {len(flat)} elements do not fill shape {tensor.shape} ({count})")
            if tensor.datatype == "FP32":
                array, not_numbers = _json_values(flat)
                not_numbers = None if not_numbers is None else not_numbers.reshape(tensor.shape)
            else:
                array = _json_integers(flat, tensor.datatype, where)
        found[tensor.name] = array.reshape(tensor.shape)
    if offset != len(binary):
        raise OIPProblem(f"body: {len(binary) - offset} bytes of binary data after the header that no input claims")
    if "values" not in found:
        raise OIPProblem("inputs: the input 'values' (FP32 [batch, length, channels]) is required")
    return OIPInputs(found["values"], found.get("lengths"), not_numbers)


def split_instances(inputs: OIPInputs, channels: int, max_len: int, max_batch: int) -> list[np.ndarray]:
    """Each row's real steps as float32 ``[L_i, C]``, checked by the rules of /v1/predict
    and Kafka events (reasons bad_channels, empty, too_long, schema, non_finite)."""
    values, lengths = inputs.values, inputs.lengths
    if values.ndim != 3:
        raise OIPProblem(f"values: shape must be [batch, length, channels], got {list(values.shape)}")
    batch, length, width = values.shape
    if not 1 <= batch <= max_batch:
        raise OIPProblem(f"values: expected 1..{max_batch} instances (the batch dimension), got {batch}")
    if width != channels:
        raise OIPProblem(f"values: bad_channels: every step must be an array of {channels} numbers, got {width}")
    if lengths is None:
        steps = [length] * batch
    else:
        if lengths.shape != (batch,):
            raise OIPProblem(f"lengths: shape must be [batch] = [{batch}], got {list(lengths.shape)}")
        steps = lengths.tolist()
    rows = []
    for i, n in enumerate(steps):
        if n < 1:
            raise OIPProblem(f"values[{i}]: empty: 'values' has no time steps (lengths[{i}] = {n})")
        if n > length:
            raise OIPProblem(f"lengths[{i}]: {n} is longer than the values tensor's length {length}")
        if n > max_len:
            raise OIPProblem(f"values[{i}]: too_long: 'values' has {n} steps, the limit is {max_len}")
        if inputs.not_numbers is not None and inputs.not_numbers[i, :n].any():
            raise OIPProblem(f"values[{i}]: schema: 'values' must hold only numbers")
        row = values[i, :n]
        if not np.isfinite(row).all():
            raise OIPProblem(f"values[{i}]: non_finite: 'values' holds NaN or infinity, or overflows float32")
        rows.append(row)
    return rows


def requested_outputs(request: OIPInferRequest, has_probs: bool) -> list[tuple[str, bool]]:
    """(output name, as binary) in answer order."""
    available = ("next", "anomaly_score", "probs") if has_probs else ("next", "anomaly_score")
    default_binary = (request.parameters or {}).get("binary_data_output", False)
    if type(default_binary) is not bool:
        raise OIPProblem("parameters.binary_data_output must be true or false")
    if request.outputs is None:
        return [(name, default_binary) for name in available]
    chosen: list[tuple[str, bool]] = []
    for i, output in enumerate(request.outputs):
        where = f"outputs[{i}] ({output.name})"
        if output.name not in available:
            raise OIPProblem(f"{where}: unknown output; this model answers {', '.join(available)}")
        if any(name == output.name for name, _ in chosen):
            raise OIPProblem(f"{where}: output asked for twice")
        parameters = output.parameters or {}
        if parameters.get("class_count", 0):
            raise OIPProblem(f"{where}: the classification extension is not supported; ask for 'probs'")
        if "shared_memory_region" in parameters:
            raise OIPProblem(f"{where}: the shared-memory extension is not supported")
        binary = parameters.get("binary_data", default_binary)
        if type(binary) is not bool:
            raise OIPProblem(f"{where}: parameters.binary_data must be true or false")
        chosen.append((output.name, binary))
    return chosen


# ---------------------------------------------------------------------- answers
def model_age_s(published: Any) -> float:
    """Seconds since ``published`` was published (never negative)."""
    return max(0.0, time.time() - float(published.published_at))


def encode_response(
    published: Any, request_id: str | None, predictions: PredictionArrays, outputs: list[tuple[str, bool]]
) -> Response:
    tensors = {"next": predictions.next, "anomaly_score": predictions.anomaly_score, "probs": predictions.probs}
    described: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, binary in outputs:
        array = np.ascontiguousarray(tensors[name], dtype=_NUMPY["FP32"])
        entry: dict[str, Any] = {"name": name, "datatype": "FP32", "shape": list(array.shape)}
        if binary:
            raw = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = array.ravel().tolist()
        described.append(entry)
    header: dict[str, Any] = {"model_name": MODEL_NAME, "model_version": str(published.version)}
    if request_id is not None:
        header["id"] = request_id
    header["parameters"] = {"model_age_s": model_age_s(published)}
    header["outputs"] = described
    head = orjson.dumps(header)
    if not chunks:
        return Response(head, media_type="application/json")
    return Response(
        head + b"".join(chunks),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(head))},
    )


# ---------------------------------------------------------------------- routes
router = APIRouter(tags=["open inference protocol v2"])


@dataclass(frozen=True)
class _Tensor:
    name: str
    datatype: str
    shape: list[int]


def _check_model(name: str) -> None:
    if name != MODEL_NAME:
        raise OIPProblem(f"unknown model {name!r}; this server serves {MODEL_NAME!r}")


def _kept(service: Any, version: str) -> Any:
    """A kept published version by its path text; 400 naming the kept ones otherwise."""
    registry = service.trainer.registry
    if version.isascii() and version.isdigit():
        try:
            return registry.get(int(version))
        except UnknownVersion:
            pass
    kept = ", ".join(map(str, registry.versions())) or "none yet"
    raise OIPProblem(f"model {MODEL_NAME!r} has no kept version {version!r} (kept: {kept})")


def _metadata(service: Any, versions: list[int]) -> dict[str, Any]:
    settings = service.settings
    channels, classes = settings.channels, settings.n_classes
    inputs = [_Tensor("values", "FP32", [-1, -1, channels]), _Tensor("lengths", "INT64", [-1])]
    outputs = [_Tensor("next", "FP32", [-1, channels]), _Tensor("anomaly_score", "FP32", [-1])]
    if classes > 0:
        outputs.append(_Tensor("probs", "FP32", [-1, classes]))
    return {
        "name": MODEL_NAME,
        "versions": [str(v) for v in versions],
        "platform": PLATFORM,
        "inputs": [t.__dict__ for t in inputs],
        "outputs": [t.__dict__ for t in outputs],
    }


def _inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` inlined (an OpenAPI request body cannot point into them)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


_ERRORS: dict[int | str, dict[str, Any]] = {400: {"model": OIPError}}
_INFER_DOC = {
    "requestBody": {
        "required": True,
        "description": (
            "An OIP v2 inference request. Binary tensor data extension: send the JSON header, then the raw "
            f"little-endian tensor bytes, with {HEADER_LENGTH} = the header's byte count."
        ),
        "content": {"application/json": {"schema": _inline_schema(OIPInferRequest)}},
    }
}
_INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": OIPInferResponse,
        "description": "The outputs; with binary outputs, the JSON header and then the raw bytes",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    400: {"model": OIPError},
    413: {"model": OIPError},
    503: {"model": OIPError},
}


@router.get("/v2", response_model=OIPServerMetadata)
def server_metadata() -> dict[str, Any]:
    """Server name, version and the protocol extensions it speaks."""
    return {"name": MODEL_NAME, "version": __version__, "extensions": EXTENSIONS}


@router.get("/v2/health/live", response_model=OIPLive)
def live() -> dict[str, bool]:
    """200 while the process runs."""
    return {"live": True}


@router.get("/v2/health/ready", response_model=OIPReady, response_model_exclude_none=True,
            responses={400: {"model": OIPReady}})  # fmt: skip
def ready(request: Request) -> Any:
    """200 when ``/readyz`` is (Kafka connected, a model published); else 400, as the protocol says."""
    is_ready, reasons = request.app.state.service.readiness()
    if is_ready:
        return {"ready": True}
    return JSONResponse(status_code=400, content={"ready": False, "error": "; ".join(reasons)})


@router.get("/v2/models/{model_name}", response_model=OIPModelMetadata, responses=_ERRORS)
def model_metadata(model_name: str, request: Request) -> Any:
    """Name, kept versions, platform, and the inputs and outputs with datatypes and shapes (-1: any)."""
    service = request.app.state.service
    try:
        _check_model(model_name)
    except OIPProblem as problem:
        return problem.response()
    return _metadata(service, service.trainer.registry.versions())


@router.get("/v2/models/{model_name}/versions/{version}", response_model=OIPModelMetadata, responses=_ERRORS)
def version_metadata(model_name: str, version: str, request: Request) -> Any:
    """The metadata of one kept version."""
    service = request.app.state.service
    try:
        _check_model(model_name)
        published = _kept(service, version)
    except OIPProblem as problem:
        return problem.response()
    return _metadata(service, [published.version])


def _model_ready(request: Request, model_name: str, version: str | None) -> Any:
    service = request.app.state.service
    try:
        _check_model(model_name)
        if version is not None:
            _kept(service, version)
        elif service.published is None:
            raise OIPProblem("no model published yet: the window is still filling")
    except OIPProblem as problem:
        return JSONResponse(status_code=400, content={"name": model_name, "ready": False, "error": problem.message})
    return {"name": MODEL_NAME, "ready": True}


@router.get("/v2/models/{model_name}/ready", response_model=OIPReady, response_model_exclude_none=True,
            responses={400: {"model": OIPReady}})  # fmt: skip
def model_ready(model_name: str, request: Request) -> Any:
    """200 once a version serves; 400 before (and for another model name)."""
    return _model_ready(request, model_name, None)


@router.get("/v2/models/{model_name}/versions/{version}/ready", response_model=OIPReady,
            response_model_exclude_none=True, responses={400: {"model": OIPReady}})  # fmt: skip
def version_ready(model_name: str, version: str, request: Request) -> Any:
    """200 while the version is kept."""
    return _model_ready(request, model_name, version)


async def _infer(request: Request, model_name: str, version: str | None) -> Response:
    service = request.app.state.service
    settings = service.settings
    try:
        _check_model(model_name)
        if version is None:
            published = service.published  # one version for the whole request
            if published is None:
                raise OIPProblem("no model published yet: the window is still filling", status=503)
        else:
            published = _kept(service, version)
        body = decode_body(await request.body(), request.headers.get("content-encoding"), settings.max_request_bytes)
        header, binary = split_body(body, request.headers.get(HEADER_LENGTH))
        infer_request = parse_header(header)
        inputs = read_inputs(infer_request, binary)
        rows = split_instances(inputs, settings.channels, settings.max_len, settings.max_predict_batch)
        outputs = requested_outputs(infer_request, published.model.n_classes > 0)
        batcher: PredictBatcher = request.app.state.predict_batcher
        try:
            predictions: PredictionArrays = await batcher.submit(published, rows)
        except Overloaded as err:
            raise OIPProblem(f"overloaded: {err}; retry later", status=503) from None
        overflowed = np.flatnonzero(~predictions.finite_rows())
        if overflowed.size:
            raise OIPProblem(
                f"values[{int(overflowed[0])}]: non_finite: the forecast overflows for these readings; "
                "they lie far outside the range the model works in"
            )
        return encode_response(published, infer_request.id, predictions, outputs)
    except OIPProblem as problem:
        return problem.response()


@router.post("/v2/models/{model_name}/infer", response_model=OIPInferResponse,
             responses=_INFER_RESPONSES, openapi_extra=_INFER_DOC)  # fmt: skip
async def infer(model_name: str, request: Request) -> Response:
    """Inference by the serving version; one output row per input row, in order."""
    return await _infer(request, model_name, None)


@router.post("/v2/models/{model_name}/versions/{version}/infer", response_model=OIPInferResponse,
             responses=_INFER_RESPONSES, openapi_extra=_INFER_DOC)  # fmt: skip
async def infer_version(model_name: str, version: str, request: Request) -> Response:
    """Inference by a kept version (``GET /v2/models/streamtrain`` lists them)."""
    return await _infer(request, model_name, version)
