"""Open Inference Protocol v2 routes, driven by the real clients against a real server.

tritonclient's ``InferenceServerClient`` (JSON and the binary tensor data extension) talks
to a uvicorn server on a free port that serves the real app over a real
:class:`~streamtrain.runtime.service.Service` (ingest never started; the model is published by
hand). Its answers must equal ``/v1/predict``'s to 1e-6 for the same instances, keep the
request's order, and come from the version asked for. Refusals are ``{"error": ...}`` with
400 (413, 503 where the protocol's transport says so), never 500, and they apply the same
value rules as ``/v1/predict`` and Kafka events (a property test compares them).
KServe's client runs against the real ``streamtrain serve`` process in
tests/integration/test_oip_service.py.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
import tritonclient.http as triton
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from streamtrain.config import load_settings
from streamtrain.events import EventError, parse_values
from streamtrain.model.inference import predict_arrays
from streamtrain.runtime.service import Service
from streamtrain.serve import oip
from streamtrain.serve.app import create_app
from streamtrain.serve.batcher import Overloaded

torch.set_num_threads(1)

CHANNELS, CLASSES, MAX_LEN = 2, 3, 24
SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 1, "token_budget": 256, "max_predict_batch": 16}


def make_service(tmp_path: Path, **overrides: Any) -> Service:
    """A service with two published versions that answer differently, and a non-trivial norm."""
    values = {
        "kafka_bootstrap": "127.0.0.1:9", "checkpoint_dir": tmp_path / "ckpt", "channels": CHANNELS,
        "n_classes": CLASSES, "max_len": MAX_LEN, **SMALL,
        "holdout_share": 0.0,  # no holdout to choose on: each version serves its own network
        **overrides,
    }  # fmt: skip
    service = Service(load_settings(**values))
    trainer = service.trainer
    rng = np.random.default_rng(0)
    data = torch.from_numpy(rng.normal(1.5, 3.0, size=(16, 12, service.settings.channels)).astype(np.float32))
    trainer.norm.update(data, torch.ones(16, 12, dtype=torch.bool))
    trainer.publish()
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    trainer.publish()
    return service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """The app under uvicorn on a free port, in a thread."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(service), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with RunningServer(make_service(tmp_path_factory.mktemp("oip"))) as running:
        yield running


@pytest.fixture()
def client(server: RunningServer) -> Iterator[triton.InferenceServerClient]:
    triton_client = triton.InferenceServerClient(url=server.url, network_timeout=60.0, connection_timeout=10.0)
    yield triton_client
    triton_client.close()


def padded_batch(rng: np.random.Generator, lengths: list[int], pad: float = np.nan) -> tuple[np.ndarray, np.ndarray]:
    """A [batch, max length, C] float32 batch whose padding holds ``pad`` (never looked at)."""
    values = np.full((len(lengths), max(lengths), CHANNELS), pad, dtype=np.float32)
    for i, n in enumerate(lengths):
        values[i, :n] = rng.normal(1.5, 3.0, size=(n, CHANNELS))
    return values, np.asarray(lengths, dtype=np.int64)


def v1_predict(server: RunningServer, values: np.ndarray, lengths: np.ndarray) -> dict[str, Any]:
    instances = [{"values": values[i, :n].tolist()} for i, n in enumerate(lengths)]
    answer = httpx.post(f"http://{server.url}/v1/predict", json={"instances": instances}, timeout=60).json()
    predictions = answer["predictions"]
    return {
        "version": answer["model_version"],
        "next": np.array([p["next"] for p in predictions]),
        "anomaly_score": np.array([p["anomaly_score"] for p in predictions]),
        "probs": np.array([p["probs"] for p in predictions]),
    }


def triton_inputs(values: np.ndarray, lengths: np.ndarray | None, binary: bool, lengths_type: str = "INT64") -> list:
    tensor = triton.InferInput("values", list(values.shape), "FP32")
    tensor.set_data_from_numpy(values, binary_data=binary)
    inputs = [tensor]
    if lengths is not None:
        length_tensor = triton.InferInput("lengths", list(lengths.shape), lengths_type)
        length_tensor.set_data_from_numpy(
            lengths.astype(np.int32 if lengths_type == "INT32" else np.int64), binary_data=binary
        )
        inputs.append(length_tensor)
    return inputs


def assert_same(result: Any, reference: dict[str, Any]) -> None:
    for name in ("next", "anomaly_score", "probs"):
        np.testing.assert_allclose(result.as_numpy(name), reference[name], rtol=1e-6, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------------------
# the real client


def test_health_metadata_and_readiness_through_tritonclient(client: triton.InferenceServerClient,
                                                             server: RunningServer) -> None:  # fmt: skip
    assert client.is_server_live()
    assert not client.is_server_ready()  # like /readyz: Kafka is not connected in this test
    assert client.is_model_ready("streamtrain")
    assert client.is_model_ready("streamtrain", "1") and client.is_model_ready("streamtrain", "2")
    assert not client.is_model_ready("streamtrain", "7") and not client.is_model_ready("other")
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    metadata = client.get_model_metadata("streamtrain")
    assert metadata["name"] == "streamtrain" and metadata["versions"] == ["1", "2"]
    assert metadata["inputs"] == [
        {"name": "values", "datatype": "FP32", "shape": [-1, -1, CHANNELS]},
        {"name": "lengths", "datatype": "INT64", "shape": [-1]},
    ]
    assert metadata["outputs"] == [
        {"name": "next", "datatype": "FP32", "shape": [-1, CHANNELS]},
        {"name": "anomaly_score", "datatype": "FP32", "shape": [-1]},
        {"name": "probs", "datatype": "FP32", "shape": [-1, CLASSES]},
    ]
    assert client.get_model_metadata("streamtrain", "1")["versions"] == ["1"]
    with pytest.raises(InferenceServerException, match="no kept version '9'"):
        client.get_model_metadata("streamtrain", "9")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("lengths_type", ["INT64", "INT32"])
def test_infer_equals_v1_predict_with_padding(client: triton.InferenceServerClient, server: RunningServer,
                                              binary: bool, lengths_type: str) -> None:  # fmt: skip
    rng = np.random.default_rng(1)
    values, lengths = padded_batch(rng, [9, 1, 24, 4, 13, 2], pad=0.0 if not binary else np.nan)
    reference = v1_predict(server, values, lengths)
    outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("next", "anomaly_score", "probs")]
    asked = time.time()
    result = client.infer("streamtrain", triton_inputs(values, lengths, binary, lengths_type), outputs=outputs,
                          request_id="req-7")  # fmt: skip
    answered = time.time()
    assert_same(result, reference)
    answer = result.get_response()
    assert answer["model_version"] == str(reference["version"]) and answer["id"] == "req-7"
    assert answer["model_name"] == "streamtrain"
    # the age of the version that answered, taken while the request was served
    published_at = server.service.trainer.registry.get(reference["version"]).published_at
    assert asked - published_at - 1e-3 <= answer["parameters"]["model_age_s"] <= answered - published_at + 1e-3
    assert result.as_numpy("next").dtype == np.float32 and result.as_numpy("probs").shape == (6, CLASSES)


def test_without_outputs_every_output_comes_back_binary(
    client: triton.InferenceServerClient, server: RunningServer
) -> None:
    rng = np.random.default_rng(2)
    values, lengths = padded_batch(rng, [5, 5, 5], pad=0.0)
    reference = v1_predict(server, values, lengths)
    result = client.infer("streamtrain", triton_inputs(values, None, binary=True))  # no lengths: all rows full
    assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])
    assert_same(result, reference)


def test_order_rule_rows_answer_in_request_order(client: triton.InferenceServerClient) -> None:
    rng = np.random.default_rng(3)
    values, lengths = padded_batch(rng, [3, 17, 1, 8, 24, 6, 11], pad=0.0)
    whole = client.infer("streamtrain", triton_inputs(values, lengths, binary=True))
    order = rng.permutation(len(lengths))
    shuffled = client.infer("streamtrain", triton_inputs(values[order], lengths[order], binary=True))
    alone = [client.infer("streamtrain", triton_inputs(values[i : i + 1, : lengths[i]], lengths[i : i + 1], True))
             for i in range(len(lengths))]  # fmt: skip
    for name in ("next", "anomaly_score", "probs"):
        np.testing.assert_allclose(shuffled.as_numpy(name), whole.as_numpy(name)[order], atol=1e-5)
        np.testing.assert_allclose(np.concatenate([a.as_numpy(name) for a in alone]), whole.as_numpy(name), atol=1e-5)


def test_a_kept_version_answers_with_its_own_model(client: triton.InferenceServerClient, server: RunningServer) -> None:
    rng = np.random.default_rng(4)
    values, lengths = padded_batch(rng, [6, 2, 10], pad=0.0)
    registry = server.service.trainer.registry
    for version in registry.versions():
        published = registry.get(version)
        expected = predict_arrays(published.served, published.norm, [values[i, :n] for i, n in enumerate(lengths)], 256)
        result = client.infer("streamtrain", triton_inputs(values, lengths, binary=True), model_version=str(version))
        assert result.get_response()["model_version"] == str(version)
        np.testing.assert_allclose(result.as_numpy("next"), expected.next, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(result.as_numpy("anomaly_score"), expected.anomaly_score, rtol=1e-6, atol=1e-6)
    one = client.infer("streamtrain", triton_inputs(values, lengths, True), model_version="1").as_numpy("next")
    two = client.infer("streamtrain", triton_inputs(values, lengths, True), model_version="2").as_numpy("next")
    assert np.abs(one - two).max() > 1e-3  # the versions really differ


def test_compressed_requests_and_client_errors(client: triton.InferenceServerClient, server: RunningServer) -> None:
    rng = np.random.default_rng(5)
    values, lengths = padded_batch(rng, [4, 7], pad=0.0)
    reference = v1_predict(server, values, lengths)
    for algorithm in ("gzip", "deflate"):
        result = client.infer(
            "streamtrain", triton_inputs(values, lengths, True), request_compression_algorithm=algorithm
        )
        assert_same(result, reference)
    values[1, 3, 0] = np.inf
    with pytest.raises(InferenceServerException, match=r"values\[1\]: non_finite") as caught:
        client.infer("streamtrain", triton_inputs(values, lengths, True))
    assert caught.value.status() == "400"
    with pytest.raises(InferenceServerException, match="unknown model 'other'"):
        client.infer("other", triton_inputs(values, lengths, True))


# ---------------------------------------------------------------------------------------
# refusals: {"error": ...}, 400 (413/503), never 500


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    service = make_service(tmp_path_factory.mktemp("oip-api"), max_request_bytes=64 * 1024)
    with TestClient(create_app(service), raise_server_exceptions=False) as test_client:
        yield test_client


def values_input(values: np.ndarray, **extra: Any) -> dict[str, Any]:
    return {"name": "values", "datatype": "FP32", "shape": list(values.shape), "data": values.ravel().tolist(), **extra}


def binary_body(header: dict[str, Any], *chunks: bytes) -> tuple[bytes, dict[str, str]]:
    head = orjson.dumps(header)
    return head + b"".join(chunks), {oip.HEADER_LENGTH: str(len(head))}


GOOD = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
REFUSALS: list[tuple[str, dict[str, Any] | bytes, dict[str, str], str]] = [
    ("not json", b"\xff\x00garbage", {}, "not UTF-8 JSON"),
    ("json list", b"[1, 2]", {}, "expected a JSON object"),
    ("no inputs", {"inputs": []}, {}, "inputs"),
    ("shape not ints", {"inputs": [{**values_input(GOOD), "shape": ["2", 3, 2]}]}, {}, "shape.0"),
    ("negative dim", {"inputs": [{**values_input(GOOD), "shape": [-2, 3, 2]}]}, {}, "shape.0"),
    ("unknown input", {"inputs": [values_input(GOOD), {**values_input(GOOD), "name": "x"}]}, {}, "unknown input"),
    ("twice", {"inputs": [values_input(GOOD), values_input(GOOD)]}, {}, "given twice"),
    ("fp64", {"inputs": [{**values_input(GOOD), "datatype": "FP64"}]}, {}, "datatype 'FP64'; expected FP32"),
    ("count", {"inputs": [{**values_input(GOOD), "shape": [2, 3, 3]}]}, {}, "do not fill shape"),
    ("2-d", {"inputs": [{**values_input(GOOD), "shape": [6, 2]}]}, {}, "[batch, length, channels]"),
    ("channels", {"inputs": [{**values_input(GOOD), "shape": [2, 2, 3]}]}, {}, "bad_channels"),
    (
        "strings",
        {"inputs": [{**values_input(GOOD), "data": ["1"] * 12}]},
        {},
        "values[0]: schema: 'values' must hold only numbers",
    ),
    ("bools", {"inputs": [{**values_input(GOOD), "data": [0.0] * 6 + [True] * 6}]}, {}, "values[1]: schema"),
    (
        "words and nulls",
        {"inputs": [{**values_input(GOOD), "data": [0.0] * 6 + ["abc", None] + [0.0] * 4}]},
        {},
        "values[1]: schema: 'values' must hold only numbers",
    ),
    ("huge int", {"inputs": [{**values_input(GOOD), "data": [0.0] * 11 + [10**400]}]}, {}, "values[1]: non_finite"),
    (
        "nan",
        {"inputs": [{**values_input(GOOD), "data": [0.0] * 7 + [float("nan")] + [0.0] * 4}]},
        {},
        r"values[1]: non_finite",
    ),
    (
        "float32 overflow",
        {"inputs": [{**values_input(GOOD), "data": [1e39] + [0.0] * 11}]},
        {},
        r"values[0]: non_finite",
    ),
    (
        "empty row",
        {"inputs": [values_input(GOOD), {"name": "lengths", "datatype": "INT64", "shape": [2], "data": [3, 0]}]},
        {},
        "values[1]: empty",
    ),
    (
        "past length",
        {"inputs": [values_input(GOOD), {"name": "lengths", "datatype": "INT32", "shape": [2], "data": [4, 1]}]},
        {},
        "lengths[0]: 4 is longer",
    ),
    (
        "lengths float",
        {"inputs": [values_input(GOOD), {"name": "lengths", "datatype": "INT64", "shape": [2], "data": [1.0, 1]}]},
        {},
        "only integers",
    ),
    (
        "lengths past int32",
        {"inputs": [values_input(GOOD), {"name": "lengths", "datatype": "INT32", "shape": [2], "data": [2**31, 1]}]},
        {},
        "inputs[1] (lengths).data: a value is out of INT32 range",
    ),
    (
        "lengths shape",
        {"inputs": [values_input(GOOD), {"name": "lengths", "datatype": "INT64", "shape": [1], "data": [1]}]},
        {},
        "lengths: shape must be [batch] = [2]",
    ),
    ("too long", {"inputs": [values_input(np.zeros((1, MAX_LEN + 1, 2), np.float32))]}, {}, "values[0]: too_long"),
    ("batch", {"inputs": [values_input(np.zeros((17, 1, 2), np.float32))]}, {}, "expected 1..16 instances"),
    ("zero batch", {"inputs": [values_input(np.zeros((0, 1, 2), np.float32))]}, {}, "expected 1..16 instances"),
    ("output", {"inputs": [values_input(GOOD)], "outputs": [{"name": "logits"}]}, {}, "unknown output"),
    (
        "classification",
        {"inputs": [values_input(GOOD)], "outputs": [{"name": "probs", "parameters": {"class_count": 2}}]},
        {},
        "classification extension",
    ),
    (
        "binary flag",
        {"inputs": [values_input(GOOD)], "parameters": {"binary_data_output": "yes"}},
        {},
        "parameters.binary_data_output must be true or false",
    ),
    (
        "output twice",
        {"inputs": [values_input(GOOD)], "outputs": [{"name": "next"}, {"name": "next"}]},
        {},
        "outputs[1] (next): output asked for twice",
    ),
    (
        "output shm",
        {"inputs": [values_input(GOOD)], "outputs": [{"name": "next", "parameters": {"shared_memory_region": "r"}}]},
        {},
        "outputs[0] (next): the shared-memory extension is not supported",
    ),
    (
        "output binary flag",
        {"inputs": [values_input(GOOD)], "outputs": [{"name": "next", "parameters": {"binary_data": 1}}]},
        {},
        "outputs[0] (next): parameters.binary_data must be true or false",
    ),
    ("shm", {"inputs": [values_input(GOOD, parameters={"shared_memory_region": "r"})]}, {}, "shared-memory"),
    ("header length", b'{"inputs": []}', {oip.HEADER_LENGTH: "999"}, "Inference-Header-Content-Length"),
    ("header length text", b'{"inputs": []}', {oip.HEADER_LENGTH: "-1"}, "Inference-Header-Content-Length"),
    ("encoding", b'{"inputs": []}', {"content-encoding": "br"}, "Content-Encoding 'br'"),
    ("bad gzip", b"not gzip at all", {"content-encoding": "gzip"}, "not valid gzip"),
    ("deflate sent as gzip", zlib.compress(b'{"inputs": []}'), {"content-encoding": "gzip"}, "not valid gzip"),
    ("truncated gzip", gzip.compress(b'{"inputs": []}')[:-12], {"content-encoding": "gzip"}, "truncated"),
]


@pytest.mark.parametrize(("body", "headers", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_are_400_with_an_error_naming_the_problem(api: TestClient, body: Any, headers: dict[str, str],
                                                           message: str) -> None:  # fmt: skip
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = api.post("/v2/models/streamtrain/infer", content=content, headers=headers)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    assert message in response.json()["error"], response.json()


BINARY_REFUSALS = [
    ("past the end", GOOD.nbytes, GOOD.tobytes()[:-4], "runs past the end"),
    ("left over", GOOD.nbytes, GOOD.tobytes() + b"\0\0\0\0", "4 bytes of binary data"),
    ("not an int", "48", GOOD.tobytes(), "non-negative integer"),
]


@pytest.mark.parametrize(
    ("size", "payload", "message"), [r[1:] for r in BINARY_REFUSALS], ids=[r[0] for r in BINARY_REFUSALS]
)
def test_binary_refusals(api: TestClient, size: Any, payload: bytes, message: str) -> None:
    header = {
        "inputs": [{"name": "values", "datatype": "FP32", "shape": [2, 3, 2], "parameters": {"binary_data_size": size}}]
    }
    content, headers = binary_body(header, payload)
    response = api.post("/v2/models/streamtrain/infer", content=content, headers=headers)
    assert response.status_code == 400 and message in response.json()["error"], response.text


def test_binary_refusals_in_these_words(api: TestClient) -> None:
    def refusal(parameters: dict[str, Any], payload: bytes, data: Any = None, shape: list[int] | None = None) -> Any:
        values = {"name": "values", "datatype": "FP32", "shape": shape or [2, 3, 2], "parameters": parameters}
        content, headers = binary_body({"inputs": [values if data is None else {**values, "data": data}]}, payload)
        response = api.post("/v2/models/streamtrain/infer", content=content, headers=headers)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert refusal({"binary_data_size": 8}, GOOD.tobytes()) == (
        "inputs[0] (values): binary_data_size 8 does not fit shape [2, 3, 2] of FP32 (48 bytes)"
    )
    assert refusal({"binary_data_size": 48}, GOOD.tobytes(), data=GOOD.ravel().tolist()) == (
        "inputs[0] (values): give either data or binary_data_size, not both"
    )
    # an empty tensor's binary part is 0 bytes, which is a size: the batch is what is refused
    assert refusal({"binary_data_size": 0}, b"", shape=[0, 3, 2]) == (
        "values: expected 1..16 instances (the batch dimension), got 0"
    )


def test_a_full_batch_is_answered(api: TestClient) -> None:
    full = np.arange(16 * 2 * 2, dtype=np.float32).reshape(16, 2, 2)  # max_predict_batch instances
    response = api.post("/v2/models/streamtrain/infer", json={"inputs": [values_input(full)]})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["shape"][0] == 16


def test_readings_past_float32_range_are_refused_before_a_later_row_s_words_and_warn_nothing() -> None:
    """With a non-number anywhere, the data is read one element at a time; a reading beyond float32
    is still inf there (its row refused as non_finite, before a later row's schema problem), and the
    overflow is expected, so numpy warns nothing."""
    data = [1e39] + [0.0] * 5 + [None] + [0.0] * 5
    request = oip.OIPInferRequest.model_validate({"inputs": [{**values_input(GOOD), "data": data}]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inputs = oip.read_inputs(request, b"")
        fast = oip.read_inputs(
            oip.OIPInferRequest.model_validate({"inputs": [values_input(GOOD.astype(np.float64) * 1e38)]}), b""
        )
    assert inputs.values.dtype == np.float32 and np.isinf(inputs.values[0, 0, 0])
    assert np.isinf(fast.values).sum() == 8  # 4e38 and up
    with pytest.raises(oip.OIPProblem) as refused:
        oip.split_instances(inputs, 2, MAX_LEN, max_batch=16)
    assert refused.value.message.startswith("values[0]: non_finite")


def test_binary_and_json_data_mix_and_nested_json_data(api: TestClient) -> None:
    lengths = np.array([3, 1], dtype=np.int32)
    header = {"inputs": [{"name": "values", "datatype": "FP32", "shape": [2, 3, 2], "data": GOOD.tolist()},  # nested
                         {"name": "lengths", "datatype": "INT32", "shape": [2], "parameters": {"binary_data_size": 8}}],
              "outputs": [{"name": "anomaly_score", "parameters": {"binary_data": True}},
                          {"name": "next"}]}  # fmt: skip
    content, headers = binary_body(header, lengths.tobytes())
    response = api.post("/v2/models/streamtrain/infer", content=content, headers=headers)
    assert response.status_code == 200 and response.headers["content-type"] == "application/octet-stream"
    head_size = int(response.headers[oip.HEADER_LENGTH])
    answer = json.loads(response.content[:head_size])
    assert [o["name"] for o in answer["outputs"]] == ["anomaly_score", "next"]
    scores = np.frombuffer(response.content[head_size:], dtype="<f4")
    expected = api.post(
        "/v1/predict", json={"instances": [{"values": GOOD[0].tolist()}, {"values": GOOD[1, :1].tolist()}]}
    )
    predictions = expected.json()["predictions"]
    np.testing.assert_allclose(scores, [p["anomaly_score"] for p in predictions], rtol=1e-6)
    np.testing.assert_allclose(
        np.reshape(answer["outputs"][1]["data"], (2, 2)), [p["next"] for p in predictions], rtol=1e-6
    )


def test_refusals_in_these_words(api: TestClient) -> None:
    """Pydantic's words (at most five problems, each with its path) and ours, in full."""
    overflow = {"inputs": [{**values_input(GOOD[:, :2]), "data": [[[1.0, 2.0]] * 2, [[3e38, 3e38], [-3e38, -3e38]]]}]}
    cases: list[tuple[bytes, str]] = [
        (json.dumps({"inputs": [{**values_input(GOOD), "shape": ["2", 3, 2]}]}).encode(),
         "inputs.0.shape.0: Input should be a valid integer"),
        (b'{"inputs": 5}', "inputs: Input should be a valid list"),
        (b'{"inputs": [{}, {}, {}]}',  # nine problems: the first five, in pydantic's order
         "inputs.0.name: Field required; inputs.0.shape: Field required; inputs.0.datatype: Field required; "
         "inputs.1.name: Field required; inputs.1.shape: Field required"),
        (json.dumps({"inputs": [values_input(GOOD)], "parameters": {"binary_data_output": "yes"}}).encode(),
         "parameters.binary_data_output must be true or false"),
        (b"\xff\x00garbage", "body: the inference request is not UTF-8 JSON"),
        (b"[1, 2]", "body: expected a JSON object (the inference request), got list"),
        (json.dumps(overflow).encode(), "values[1]: non_finite: the forecast overflows for these readings; "
         "they lie far outside the range the model works in"),
        (json.dumps({"inputs": [values_input(GOOD), {"name": "lengths", "datatype": "FP32", "shape": [2],
                                                     "data": [1.0, 1.0]}]}).encode(),
         "inputs[1] (lengths): datatype 'FP32'; expected INT32 or INT64"),
        (json.dumps({"inputs": [{"name": "lengths", "datatype": "INT64", "shape": [2], "data": [1, 2]}]}).encode(),
         "inputs: the input 'values' (FP32 [batch, length, channels]) is required"),
        (json.dumps({"inputs": [{**values_input(GOOD), "data": [[0.0, 1.0], 2.0] + [0.0] * 10}]}).encode(),
         "inputs[0] (values).data: schema: mixes arrays and numbers at one nesting level"),
        (json.dumps({"inputs": [{**values_input(GOOD), "data": None}]}).encode(),
         "inputs[0] (values): no data (give data, or binary_data_size with the binary extension)"),
    ]  # fmt: skip
    for content, message in cases:
        response = api.post("/v2/models/streamtrain/infer", content=content)
        assert response.status_code == 400 and response.json() == {"error": message}, response.text


def test_inflating_stops_one_byte_past_the_limit_and_the_limit_itself_is_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limit = 1000
    assert oip.decode_body(gzip.compress(b"x" * limit), "gzip", limit) == b"x" * limit
    asked: list[int] = []
    real = zlib.decompressobj

    class Recording:
        def __init__(self, wbits: int) -> None:
            self.inner = real(wbits)

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            asked.append(max_length)
            return self.inner.decompress(data, max_length)

        @property
        def eof(self) -> bool:
            return self.inner.eof

    monkeypatch.setattr(oip.zlib, "decompressobj", Recording)
    with pytest.raises(oip.OIPProblem, match="over 1000 bytes once inflated") as caught:
        oip.decode_body(gzip.compress(b"x" * 10**6), "gzip", limit)  # a bomb: a megabyte from a kilobyte
    assert caught.value.status == 413 and asked == [limit + 1]  # never more than one byte past the limit


def test_a_header_length_of_the_whole_body_leaves_no_binary_part(api: TestClient) -> None:
    content = json.dumps({"inputs": [values_input(GOOD)]}).encode()
    response = api.post("/v2/models/streamtrain/infer", content=content, headers={oip.HEADER_LENGTH: str(len(content))})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"  # no output asked for as binary
    assert [o["name"] for o in response.json()["outputs"]] == ["next", "anomaly_score", "probs"]


def test_readiness_refusals_name_the_model_and_the_problem(api: TestClient) -> None:
    assert api.get("/v2/models/streamtrain/versions/2/ready").json() == {"name": "streamtrain", "ready": True}
    response = api.get("/v2/models/streamtrain/versions/7/ready")
    assert response.status_code == 400
    assert response.json() == {
        "name": "streamtrain", "ready": False, "error": "model 'streamtrain' has no kept version '7' (kept: 1, 2)"
    }  # fmt: skip
    response = api.get("/v2/models/other/ready")
    assert response.status_code == 400
    assert response.json() == {
        "name": "other", "ready": False, "error": "unknown model 'other'; this server serves 'streamtrain'"
    }  # fmt: skip


def test_the_openapi_infer_request_schema_has_its_definitions_inlined(api: TestClient) -> None:
    """An OpenAPI request body cannot point into the model's ``$defs``: they are copied in."""
    nested = oip.OIPInferRequest.model_json_schema()
    assert "$defs" in nested  # the tensors are definitions of their own, so there is something to inline
    body = api.get("/openapi.json").json()["paths"]["/v2/models/{model_name}/infer"]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert "$ref" not in json.dumps(schema) and "$defs" not in schema
    inlined = oip._inline_schema(oip.OIPInferRequest)  # the document's schema is built once, at import
    assert inlined["properties"]["inputs"]["items"] == nested["$defs"]["OIPTensorIn"]
    assert "$ref" not in json.dumps(inlined) and inlined["required"] == ["inputs"]
    for items, name in ((schema["properties"]["inputs"]["items"], "OIPTensorIn"),
                        (schema["properties"]["outputs"]["anyOf"][0]["items"], "OIPRequestedOutput")):  # fmt: skip
        definition = nested["$defs"][name]  # the document drops its null defaults, nothing else
        assert items == {**definition, "properties": {
            field: {k: v for k, v in spec.items() if not (k == "default" and v is None)}
            for field, spec in definition["properties"].items()
        }}  # fmt: skip


def test_integers_past_float64_precision_read_as_the_event_rules_read_them() -> None:
    """All-integer data goes through float64 to float32, as ``parse_values`` reads a Kafka event: an
    integer past 2**53 rounds twice, and a direct int64 cast would round it to another float32."""
    integers = [2**60 + 2**36 + 1, -(2**60 + 2**36 + 1), 3, 2**62 + 2**38 + 7]
    request = oip.OIPInferRequest.model_validate(
        {"inputs": [{"name": "values", "datatype": "FP32", "shape": [1, 4, 1], "data": integers}]}
    )
    (row,) = oip.split_instances(oip.read_inputs(request, b""), 1, 8, max_batch=4)
    expected = parse_values(integers, 1, 8)
    np.testing.assert_array_equal(row, expected)
    assert not np.array_equal(np.array(integers).astype(np.float32).reshape(4, 1), expected)  # the case is real


def test_a_one_class_head_still_answers_probs(tmp_path: Path) -> None:
    service = make_service(tmp_path, n_classes=1)
    with TestClient(create_app(service), raise_server_exceptions=False) as one_class:
        metadata = one_class.get("/v2/models/streamtrain").json()
        assert [(o["name"], o["shape"]) for o in metadata["outputs"]][-1] == ("probs", [-1, 1])
        answer = one_class.post("/v2/models/streamtrain/infer", json={"inputs": [values_input(GOOD)]}).json()
        assert [o["name"] for o in answer["outputs"]] == ["next", "anomaly_score", "probs"], answer
        assert answer["outputs"][2]["shape"] == [2, 1] and answer["outputs"][2]["data"] == [1.0, 1.0]


def test_unknown_model_version_and_size_limits(api: TestClient) -> None:
    body = {"inputs": [values_input(GOOD)]}
    for path, message in (("/v2/models/other/infer", "unknown model 'other'"),
                          ("/v2/models/streamtrain/versions/3/infer", "no kept version '3' (kept: 1, 2)"),
                          ("/v2/models/streamtrain/versions/x1/infer", "no kept version 'x1'"),
                          ("/v2/models/streamtrain/versions/²/infer", "no kept version")):  # fmt: skip
        response = api.post(path, json=body)
        assert response.status_code == 400 and message in response.json()["error"], (path, response.text)
    huge = b'{"inputs": [' + b" " * (70 * 1024) + b"]}"
    response = api.post("/v2/models/streamtrain/infer", content=huge)
    assert response.status_code == 413 and response.json() == {"error": "request body too large"}
    bomb = gzip.compress(huge)
    response = api.post("/v2/models/streamtrain/infer", content=bomb, headers={"content-encoding": "gzip"})
    assert response.status_code == 413 and "once inflated" in response.json()["error"]
    fine = zlib.compress(json.dumps(body).encode())
    assert (
        api.post("/v2/models/streamtrain/infer", content=fine, headers={"content-encoding": "deflate"}).status_code
        == 200
    )


def test_overloaded_and_unpublished_are_503_with_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = Service(load_settings(kafka_bootstrap="127.0.0.1:9", checkpoint_dir=tmp_path / "c", **SMALL))
    body = {"inputs": [{"name": "values", "datatype": "FP32", "shape": [1, 2, 1], "data": [0.5, 0.25]}]}
    with TestClient(create_app(service), raise_server_exceptions=False) as api:
        response = api.post("/v2/models/streamtrain/infer", json=body)
        assert response.status_code == 503
        assert response.json() == {"error": "no model published yet: the window is still filling"}
        ready = api.get("/v2/models/streamtrain/ready")
        assert ready.status_code == 400
        assert ready.json() == {
            "name": "streamtrain", "ready": False, "error": "no model published yet: the window is still filling"
        }  # fmt: skip
        assert api.get("/v2/models/streamtrain").json()["versions"] == []
        response = api.post("/v2/models/streamtrain/versions/1/infer", json=body)
        assert response.status_code == 400
        assert response.json() == {"error": "model 'streamtrain' has no kept version '1' (kept: none yet)"}
        service.trainer.publish()
        assert api.get("/v2/models/streamtrain/ready").json() == {"name": "streamtrain", "ready": True}
        # no classification head: no probs, neither in the metadata nor in an answer
        assert [o["name"] for o in api.get("/v2/models/streamtrain").json()["outputs"]] == ["next", "anomaly_score"]
        answer = api.post("/v2/models/streamtrain/infer", json=body).json()
        assert [o["name"] for o in answer["outputs"]] == ["next", "anomaly_score"], answer
        response = api.post("/v2/models/streamtrain/infer", json={**body, "outputs": [{"name": "probs"}]})
        assert response.status_code == 400
        refusal = "outputs[0] (probs): unknown output; this model answers next, anomaly_score"
        assert response.json() == {"error": refusal}

        async def full(*_: Any) -> Any:
            raise Overloaded("too many predictions in flight (34)")

        monkeypatch.setattr(api.app.state.predict_batcher, "submit", full)
        response = api.post("/v2/models/streamtrain/infer", json=body)
        assert response.status_code == 503 and "overloaded" in response.json()["error"]


def test_metrics_count_infer_and_label_kept_versions(api: TestClient) -> None:
    before = api.get("/metrics").text
    api.post("/v2/models/streamtrain/infer", json={"inputs": [values_input(GOOD)]})
    api.post("/v2/models/streamtrain/infer", json={"inputs": []})
    text = api.get("/metrics").text

    def count(exposition: str, code: str) -> float:
        line = f'streamtrain_predict_requests_total{{code="{code}"}} '
        return next((float(x.split()[-1]) for x in exposition.splitlines() if x.startswith(line)), 0.0)

    assert count(text, "200") == count(before, "200") + 1 and count(text, "400") == count(before, "400") + 1
    assert 'streamtrain_model_info{version="1"} 0.0' in text and 'streamtrain_model_info{version="2"} 1.0' in text
    age = float(next(x for x in text.splitlines() if x.startswith("streamtrain_model_age_seconds ")).split()[1])
    assert 0 <= age < 3600
    answer = api.post("/v1/predict", json={"instances": [{"values": [[0.1, 0.2]]}]}).json()
    assert answer["model_version"] == 2 and 0 <= answer["model_age_s"] < 3600


def test_model_info_stays_bounded_by_the_kept_versions(tmp_path: Path) -> None:
    service = make_service(tmp_path, model_versions_keep=3)
    for _ in range(6):
        service.trainer.publish()
    text = service.metrics.exposition().decode()
    series = [line for line in text.splitlines() if line.startswith("streamtrain_model_info{")]
    assert series == [f'streamtrain_model_info{{version="{v}"}} {1.0 if v == 8 else 0.0}' for v in (6, 7, 8)]


# ---------------------------------------------------------------------------------------
# the value rules are those of /v1/predict and Kafka events

number = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False), st.integers(-(2**24), 2**24),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e39, -3.5e38]),
)  # fmt: skip
element = st.one_of(number, number, number, st.booleans(), st.just("1.5"))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(steps=st.integers(0, 7), channels=st.sampled_from([1, 3]), data=st.data())
def test_oip_applies_the_event_value_rules(steps: int, channels: int, data: st.DataObject) -> None:
    """One row through the OIP reader: accepted exactly when parse_values accepts it, the
    same numbers, and refused with the same reason."""
    max_len = 5
    flat = data.draw(st.lists(element, min_size=steps * channels, max_size=steps * channels))
    nested = flat if channels == 1 else [flat[i : i + channels] for i in range(0, len(flat), channels)]
    try:
        expected: np.ndarray | str = parse_values(nested, channels, max_len)
    except EventError as err:
        expected = err.reason
    request = oip.OIPInferRequest.model_validate(
        {"inputs": [{"name": "values", "datatype": "FP32", "shape": [1, steps, channels], "data": flat}]}
    )
    try:
        (row,) = oip.split_instances(oip.read_inputs(request, b""), channels, max_len, max_batch=4)
    except oip.OIPProblem as problem:
        assert isinstance(expected, str), (nested, problem.message)
        assert f": {expected}:" in problem.message, (expected, problem.message)
        return
    assert not isinstance(expected, str), (nested, expected)
    np.testing.assert_array_equal(row, expected)
