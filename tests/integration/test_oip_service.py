"""The Open Inference Protocol and ``streamtrain export`` against the real ``streamtrain serve``.

One service process learns from a simulated stream on the real broker (2 channels, 3
classes). Then, on the same padded, variable-length batch:

* tritonclient (JSON and binary) and KServe's ``InferenceRESTClient`` (JSON and binary)
  answer what ``/v1/predict`` answers, to 1e-6;
* ``streamtrain export --url`` fetches the serving version through the admin route and
  writes an ONNX file and a Triton repository; onnxruntime and TorchScript answer what the
  service answers, to 1e-5.

The publish interval is long, so one version serves throughout and every answer comes
from it (the answers say which). KServe's SDK cannot share .venv with the project's pins
(it requires psutil<6 and protobuf<7); it runs in its own venv under .gl/, built on first
use from kserve_client/requirements.txt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import tritonclient.http as triton
from kafka.admin import KafkaAdminClient, NewTopic
from service_process import ServiceProcess

from streamtrain.tools.simulate import run_simulation
from streamtrain.tools.simulation_config import SimulationConfig

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KSERVE_CLIENT = Path(__file__).with_name("kserve_client")
KSERVE_VENV = REPO / ".gl" / "kserve-client"
TOKEN = "oip-admin-token-5z"
CHANNELS, CLASSES = 2, 3


def kserve_python() -> Path:
    """The kserve venv's interpreter, (re)built when missing or built from another lock."""
    requirements = KSERVE_CLIENT / "requirements.txt"
    python = KSERVE_VENV / "bin" / "python"
    stamp = KSERVE_VENV / "streamtrain-requirements.txt"
    if python.exists() and stamp.exists() and stamp.read_text() == requirements.read_text():
        return python
    uv = Path(sys.executable).with_name("uv")  # scripts/bootstrap.sh installs it (the test extra pins it)
    if uv.exists():  # seconds, and cached across clones; pip takes about a minute
        subprocess.run([str(uv), "venv", "-q", "--clear", "--python", sys.executable, str(KSERVE_VENV)],
                       check=True, timeout=300)  # fmt: skip
        install = [str(uv), "pip", "install", "-q", "--python", str(python), "-r", str(requirements)]
    else:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(KSERVE_VENV)], check=True, timeout=300)
        install = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(requirements)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"installing KServe's client failed:\n{done.stderr[-3000:]}"
    stamp.write_text(requirements.read_text())
    return python


@pytest.fixture(scope="module")
def service(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    workdir = tmp_path_factory.mktemp("oip-service")
    topic = f"it-oip-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=15000)
    admin.create_topics([NewTopic(topic, 2, 1), NewTopic(f"{topic}.dlq", 2, 1)], timeout_ms=15000)
    process = ServiceProcess(
        kafka_bootstrap, topic, workdir / "ckpt", workdir / "serve.log",
        channels=CHANNELS, n_classes=CLASSES, max_len=64, admin_token=TOKEN,
        publish_interval_s=3600, checkpoint_interval_s=3600,
    )  # fmt: skip
    try:
        with process:
            report = run_simulation(SimulationConfig(
                bootstrap=kafka_bootstrap, topic=topic, rate=0, count=600, sensors=8, length_median=16,
                length_sigma=0.5, max_len=64, channels=CHANNELS, n_classes=CLASSES, process="ar", seed=3,
                progress_interval_s=60,
            ))  # fmt: skip
            assert report.delivery_errors == 0
            process.wait_ready()
            yield process
    finally:
        try:
            admin.delete_topics([topic, f"{topic}.dlq"], timeout_ms=15000)
        finally:
            admin.close()


@pytest.fixture(scope="module")
def batch() -> tuple[np.ndarray, np.ndarray]:
    """Variable lengths, NaN in the padding (never looked at)."""
    rng = np.random.default_rng(11)
    lengths = np.array([12, 1, 40, 5, 64, 2, 17], dtype=np.int64)
    values = np.full((len(lengths), lengths.max(), CHANNELS), np.nan, dtype=np.float32)
    for i, n in enumerate(lengths):
        values[i, :n] = rng.normal(0.0, 1.0, size=(n, CHANNELS))
    return values, lengths


def v1_predict(service: ServiceProcess, values: np.ndarray, lengths: np.ndarray) -> dict[str, Any]:
    instances = [{"values": values[i, :n].tolist()} for i, n in enumerate(lengths)]
    response = service.client.post("/v1/predict", json={"instances": instances})
    assert response.status_code == 200, response.text
    answer = response.json()
    predictions = answer["predictions"]
    return {
        "version": answer["model_version"],
        "age": answer["model_age_s"],
        "next": np.array([p["next"] for p in predictions]),
        "anomaly_score": np.array([p["anomaly_score"] for p in predictions]),
        "probs": np.array([p["probs"] for p in predictions]),
    }


def assert_same(outputs: dict[str, Any], reference: dict[str, Any], tolerance: float = 1e-6) -> None:
    for name in ("next", "anomaly_score", "probs"):
        np.testing.assert_allclose(
            np.asarray(outputs[name]), reference[name], rtol=tolerance, atol=tolerance, err_msg=name
        )


@pytest.mark.expected_seconds(20)
def test_tritonclient_json_and_binary_equal_v1_predict(
    service: ServiceProcess, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    values, lengths = batch
    reference = v1_predict(service, values, lengths)
    client = triton.InferenceServerClient(url=f"127.0.0.1:{service.port}", network_timeout=60.0)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("streamtrain")
        metadata = client.get_model_metadata("streamtrain")
        assert str(reference["version"]) in metadata["versions"]
        assert metadata["inputs"][0] == {"name": "values", "datatype": "FP32", "shape": [-1, -1, CHANNELS]}
        for binary in (False, True):
            inputs = [triton.InferInput("values", list(values.shape), "FP32"),
                      triton.InferInput("lengths", list(lengths.shape), "INT64")]  # fmt: skip
            inputs[0].set_data_from_numpy(values if binary else np.nan_to_num(values), binary_data=binary)
            inputs[1].set_data_from_numpy(lengths, binary_data=binary)
            outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("next", "anomaly_score", "probs")]
            result = client.infer("streamtrain", inputs, outputs=outputs)
            assert result.get_response()["model_version"] == str(reference["version"])
            assert_same({n: result.as_numpy(n) for n in ("next", "anomaly_score", "probs")}, reference)
    finally:
        client.close()
    metrics = service.client.get("/metrics").text
    assert f'streamtrain_model_info{{version="{reference["version"]}"}} 1.0' in metrics


@pytest.mark.timeout(1500)
def test_kserve_client_json_and_binary_equal_v1_predict(
    service: ServiceProcess, batch: tuple[np.ndarray, np.ndarray]
) -> None:
    values, lengths = batch
    python = kserve_python()
    reference = v1_predict(service, values, lengths)
    spec = {"base_url": f"http://127.0.0.1:{service.port}", "values": np.nan_to_num(values).tolist(),
            "lengths": lengths.tolist()}  # fmt: skip
    done = subprocess.run([str(python), str(KSERVE_CLIENT / "infer.py")], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    assert answer["live"] is True and answer["model_ready"] is True
    for mode in ("json", "binary"):
        assert answer[mode]["id"] == f"kserve-{mode}" and answer[mode]["parameters"]["model_age_s"] >= 0
        assert_same(answer[mode]["outputs"], reference)
    assert v1_predict(service, values, lengths)["version"] == reference["version"]


@pytest.mark.expected_seconds(65)
def test_export_from_the_running_service_answers_as_it_does(service: ServiceProcess,
                                                            batch: tuple[np.ndarray, np.ndarray],
                                                            tmp_path: Path) -> None:  # fmt: skip
    values, lengths = batch
    reference = v1_predict(service, values, lengths)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")},
        "STREAMTRAIN_ADMIN_TOKEN": TOKEN,
    }
    url = f"http://127.0.0.1:{service.port}"

    def export(fmt: str, out: Path, *extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "streamtrain.cli", "export", "--url", url, "--format", fmt,
                               "--out", str(out), *extra],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    assert f"version {reference['version']}" in export("onnx", tmp_path / "model.onnx")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_out = dict(zip(("next", "anomaly_score", "probs"), session.run(None, {"values": values, "lengths": lengths})))
    assert_same(onnx_out, reference, tolerance=1e-5)

    export("triton-pytorch", tmp_path / "repo", "--version", str(reference["version"]))
    model_dir = tmp_path / "repo" / "streamtrain"
    assert (model_dir / "config.pbtxt").is_file()
    traced = torch.jit.load(str(model_dir / str(reference["version"]) / "model.pt"))
    with torch.inference_mode():
        script_out = [t.numpy() for t in traced(torch.from_numpy(values), torch.from_numpy(lengths))]
    assert_same(dict(zip(("next", "anomaly_score", "probs"), script_out)), reference, tolerance=1e-5)

    wrong = subprocess.run([sys.executable, "-m", "streamtrain.cli", "export", "--url", url,
                            "--out", str(tmp_path / "x")],
                           env={**env, "STREAMTRAIN_ADMIN_TOKEN": "wrong"},
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert wrong.returncode == 2 and "not accepted" in wrong.stderr
