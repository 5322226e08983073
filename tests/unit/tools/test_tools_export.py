"""``streamtrain export``: every format answers as the service does.

The service's predictions (:func:`streamtrain.model.inference.predict_arrays`, what /v1/predict and
OIP infer run) are the reference. The ONNX file runs in onnxruntime, the TorchScript and
the ExportedProgram in torch, on variable-length batches whose padding holds NaN and
huge numbers; all must agree to 1e-5, and so must the model files of a Triton repository.
Every model here has a random, non-zero forecast head (an untrained model's zero head makes
``next`` the last reading, which a mistranslated forecast path matches too), and an export
of the same bundle with the head dropped must fail each check. The bundle of the admin
route round-trips exactly, a checkpoint directory exports the model a restored service
would publish, and the Triton repository has the layout and the config Triton reads
(parsed with Triton's own ModelConfig protobuf, shipped in tritonclient).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import tritonclient
from broken_models import head_dropped, randomize_head
from fastapi.testclient import TestClient
from google.protobuf import text_format

from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.cli import main as cli_main
from streamtrain.config import load_settings
from streamtrain.model.forecasters import Forecaster
from streamtrain.model.inference import InferenceModel, PredictionArrays, predict_arrays
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.runtime.service import Service
from streamtrain.serve.app import create_app
from streamtrain.tools.export import (
    ExportError,
    ModelBundle,
    bundle_from_checkpoint,
    decode_bundle,
    encode_bundle,
    export_onnx,
    export_program,
    export_torchscript,
    triton_config,
    write_triton_repository,
)
from streamtrain.training.publishing import PublishedModel

torch.set_num_threads(1)

TOKEN = "export-admin-token-0123"
LENGTHS = [1, 7, 30, 2, 15, 30, 4, 9]


def published_model(channels: int = 3, n_classes: int = 4, seed: int = 0, version: int = 5) -> PublishedModel:
    torch.manual_seed(seed)
    model = SensorModel(channels, n_classes=n_classes, d_model=16, n_heads=2, n_layers=2, max_len=32)
    model = randomize_head(model, seed).eval()  # the body reaches `next`: not the last reading
    norm = RunningNorm(channels)
    rng = np.random.default_rng(seed)
    data = torch.from_numpy(rng.normal(4.0, 2.5, size=(12, 20, channels)).astype(np.float32))
    norm.update(data, torch.ones(12, 20, dtype=torch.bool))
    return PublishedModel(model=model, norm=norm, version=version, step=42, tokens_trained=1000, loss=0.5,
                          published_at=1_764_412_345.5)  # fmt: skip


def padded(channels: int, lengths: list[int], seed: int = 1) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(values with garbage padding, lengths, the real rows)."""
    rng = np.random.default_rng(seed)
    rows = [rng.normal(4.0, 2.5, size=(n, channels)).astype(np.float32) for n in lengths]
    values = np.full((len(lengths), max(lengths), channels), np.nan, dtype=np.float32)
    values[:, ::3] = 3e38  # huge and NaN padding: never looked at
    for i, row in enumerate(rows):
        values[i, : len(row)] = row
    return values, np.asarray(lengths, dtype=np.int64), rows


def service_answers(published: Any, rows: list[np.ndarray]) -> PredictionArrays:
    return predict_arrays(published.model, published.norm, rows, token_budget=64)


def assert_matches(outputs: list[np.ndarray], reference: PredictionArrays, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(outputs[0], reference.next, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(outputs[1], reference.anomaly_score, rtol=1e-5, atol=atol)
    if reference.probs is not None:
        np.testing.assert_allclose(outputs[2], reference.probs, rtol=1e-5, atol=atol)
    else:
        assert len(outputs) == 2


#: An exported model as a function: (values, lengths) -> its outputs as arrays.
Runner = Callable[[np.ndarray, np.ndarray], list[np.ndarray]]


def onnx_runner(path: Path) -> Runner:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda values, lengths: session.run(None, {"values": values, "lengths": lengths})


def torchscript_runner(path: Path) -> Runner:
    loaded = torch.jit.load(str(path))

    def run(values: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        with torch.inference_mode():
            return [t.numpy() for t in loaded(torch.from_numpy(values), torch.from_numpy(lengths))]

    return run


def program_runner(path: Path) -> Runner:
    module = torch.export.load(str(path)).module()
    return lambda values, lengths: [
        t.detach().numpy() for t in module(torch.from_numpy(values), torch.from_numpy(lengths))
    ]


def triton_model_file(bundle: ModelBundle, root: Path, backend: str) -> Path:
    model_dir = write_triton_repository(bundle, root, backend)  # type: ignore[arg-type]
    return model_dir / str(bundle.version) / ("model.pt" if backend == "pytorch" else "model.onnx")


#: Every export form, written into a folder and loaded as the runtime that serves it would.
EXPORTS: dict[str, Callable[[ModelBundle, Path], Runner]] = {
    "onnx": lambda b, folder: onnx_runner(export_onnx(b, folder / "model.onnx")),
    "torchscript": lambda b, folder: torchscript_runner(export_torchscript(b, folder / "model.pt")),
    "exported_program": lambda b, folder: program_runner(export_program(b, folder / "model.pt2")),
    "triton_pytorch": lambda b, folder: torchscript_runner(triton_model_file(b, folder / "repo", "pytorch")),
    "triton_onnxruntime": lambda b, folder: onnx_runner(triton_model_file(b, folder / "repo", "onnxruntime")),
}


def assert_export_answers_as_the_service(
    run: Runner, reference: ModelBundle, cases: list[tuple[list[int], int]]
) -> None:
    """For each (lengths, seed): the export on garbage-padded values answers as the service on the rows."""
    for lengths, seed in cases:
        values, length_array, rows = padded(reference.model.channels, lengths, seed)
        assert_matches(run(values, length_array), service_answers(reference, rows))


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return decode_bundle(encode_bundle(published_model()))


def test_the_bundle_round_trips_exactly() -> None:
    published = published_model()
    restored = decode_bundle(encode_bundle(published))
    assert (restored.version, restored.step, restored.published_at) == (5, 42, published.published_at)
    assert restored.model.config == published.model.config
    for (name, a), (_, b) in zip(
        published.model.state_dict().items(), restored.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert restored.norm.state_dict().keys() == published.norm.state_dict().keys()
    assert torch.equal(restored.norm.std, published.norm.std) and restored.norm.count == published.norm.count
    _, _, rows = padded(3, LENGTHS)
    a, b = service_answers(published, rows), service_answers(restored, rows)
    assert np.array_equal(a.next, b.next) and np.array_equal(a.probs, b.probs)


@pytest.mark.parametrize("garbage", [b"", b"12345678", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx"])
def test_a_foreign_bundle_is_refused(garbage: bytes) -> None:
    with pytest.raises(ExportError, match="not a streamtrain model bundle"):
        decode_bundle(garbage)
    import safetensors.torch

    with pytest.raises(ExportError, match="not a streamtrain model bundle"):
        decode_bundle(safetensors.torch.save({"x": torch.zeros(2)}, metadata={"format": "other"}))


def test_predict_runs_the_exported_module(bundle: ModelBundle) -> None:
    """The service's predict is InferenceModel on padded batches: the same numbers for one padded batch."""
    values, lengths, rows = padded(3, LENGTHS)
    with torch.inference_mode():
        direct = bundle.inference_model()(torch.from_numpy(values), torch.from_numpy(lengths))
    assert_matches([t.numpy() for t in direct], service_answers(bundle, rows))


def test_onnx_in_onnxruntime_matches_the_service(bundle: ModelBundle, tmp_path: Path) -> None:
    path = export_onnx(bundle, tmp_path / "streamtrain.onnx")
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["values", "lengths"]
    assert [o.name for o in session.get_outputs()] == ["next", "anomaly_score", "probs"]
    values_shape = session.get_inputs()[0].shape
    assert isinstance(values_shape[0], str) and isinstance(values_shape[1], str) and values_shape[2] == 3
    assert {p.key: p.value for p in model.metadata_props}["streamtrain_version"] == "5"
    run = onnx_runner(path)
    cases = [(LENGTHS, 1), ([3], 2), ([32, 1, 5], 3), ([6] * 20, 4), ([1], 5), ([2, 1], 6)]  # batch, length vary
    assert_export_answers_as_the_service(run, bundle, cases)
    # normalization is inside the graph: raw data units in, data units out
    values, lengths, _ = padded(3, [2, 1], 6)
    assert np.abs(run(values, lengths)[0].mean() - 4.0) < 3.0


def test_torchscript_matches_the_service(bundle: ModelBundle, tmp_path: Path) -> None:
    path = export_torchscript(bundle, tmp_path / "model.pt")
    loaded = torch.jit.load(str(path))
    assert [a.name for a in loaded.forward.schema.arguments][1:] == ["values", "lengths"]
    cases = [(LENGTHS, 1), ([2], 5), ([32, 1, 5], 6), ([1, 1], 7)]
    assert_export_answers_as_the_service(torchscript_runner(path), bundle, cases)


def test_a_linear_forecaster_with_coefficients_per_position_exports_as_it_serves(tmp_path: Path) -> None:
    """The linear forecaster serves each origin position its own row of coefficients (a
    position gather on the dynamic length axis): ONNX answers as the service on every length."""
    coefficients = np.random.default_rng(0).normal(scale=0.1, size=(3, 4, 6))
    published = dataclasses.replace(published_model(), forecaster=Forecaster("linear", coefficients))
    bundle = decode_bundle(encode_bundle(published))
    assert bundle.forecaster.kind == "linear" and np.array_equal(bundle.forecaster.coefficients, coefficients)
    values, lengths, _ = padded(3, [7, 1, 3, 5, 2], 4)
    with torch.inference_mode():
        served = [t.numpy() for t in bundle.inference_model()(torch.from_numpy(values), torch.from_numpy(lengths))]
    network = decode_bundle(encode_bundle(published_model()))
    with torch.inference_mode():
        plain = network.inference_model()(torch.from_numpy(values), torch.from_numpy(lengths))[0].numpy()
    assert not np.allclose(served[0], plain)  # the linear forecast serves, not the network's
    run = EXPORTS["onnx"](bundle, tmp_path)
    for got, expected in zip(run(values, lengths), served, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_exported_program_matches_the_service(tmp_path: Path) -> None:
    bundle = decode_bundle(encode_bundle(published_model(channels=1, n_classes=0, seed=3)))
    path = export_program(bundle, tmp_path / "model.pt2")
    assert_export_answers_as_the_service(program_runner(path), bundle, [(LENGTHS, 7), ([1], 8), ([2, 1], 9)])


@pytest.mark.parametrize("form", list(EXPORTS))
def test_each_export_check_fails_on_an_export_that_drops_the_head(
    bundle: ModelBundle, form: str, tmp_path: Path
) -> None:
    """The exports are compared on what the head adds: an export without it answers differently."""
    dropped = dataclasses.replace(bundle, model=head_dropped(bundle.model))
    run = EXPORTS[form](dropped, tmp_path)
    assert_export_answers_as_the_service(run, dropped, [(LENGTHS, 1)])  # it is a faithful export of what it was given
    with pytest.raises(AssertionError):
        assert_export_answers_as_the_service(run, bundle, [(LENGTHS, 1)])


def _model_config_proto() -> Any:
    """Triton's ModelConfig message from the file tritonclient ships (its package needs grpc)."""
    path = Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ModelConfig


@pytest.mark.parametrize("backend", ["pytorch", "onnxruntime"])
def test_triton_repository_layout_and_config(bundle: ModelBundle, backend: str, tmp_path: Path) -> None:
    model_dir = write_triton_repository(bundle, tmp_path / "repo", backend)  # type: ignore[arg-type]
    file = "model.pt" if backend == "pytorch" else "model.onnx"
    assert sorted(str(p.relative_to(tmp_path / "repo")) for p in (tmp_path / "repo").rglob("*") if p.is_file()) == [
        "streamtrain/5/" + file, "streamtrain/config.pbtxt"
    ]  # fmt: skip
    config = text_format.Parse((model_dir / "config.pbtxt").read_text(), _model_config_proto()())
    assert config.name == "streamtrain" and config.backend == backend and config.max_batch_size == 0
    assert [(i.name, list(i.dims)) for i in config.input] == [("values", [-1, -1, 3]), ("lengths", [-1])]
    names = ["next", "anomaly_score", "probs"]
    if backend == "pytorch":  # the PyTorch backend maps outputs by position: <name>__<index>
        names = [f"{n}__{i}" for i, n in enumerate(names)]
    assert [(o.name, list(o.dims)) for o in config.output] == list(zip(names, [[-1, 3], [-1], [-1, 4]], strict=True))
    # the file Triton loads answers as the service (Triton runs it in libtorch / onnxruntime)
    runner = torchscript_runner if backend == "pytorch" else onnx_runner
    assert_export_answers_as_the_service(runner(model_dir / "5" / file), bundle, [(LENGTHS, 1), ([1], 2)])
    # a second version goes beside the first; another model shape is refused
    later = ModelBundle(bundle.model, bundle.norm, version=6, step=50, published_at=None)
    write_triton_repository(later, tmp_path / "repo", backend)  # type: ignore[arg-type]
    assert (model_dir / "6" / file).is_file() and (model_dir / "5" / file).is_file()
    other = decode_bundle(encode_bundle(published_model(channels=2)))
    with pytest.raises(ExportError, match="another model shape"):
        write_triton_repository(other, tmp_path / "repo", backend)  # type: ignore[arg-type]


def test_triton_config_without_classes() -> None:
    bundle = decode_bundle(encode_bundle(published_model(channels=1, n_classes=0)))
    config = text_format.Parse(triton_config(bundle, "onnxruntime"), _model_config_proto()())
    assert [o.name for o in config.output] == ["next", "anomaly_score"]


# ---------------------------------------------------------------------------------------
# sources: the admin route and a checkpoint directory, through the CLI


SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 1, "token_budget": 256, "max_len": 32, "channels": 2, "n_classes": 2}


def make_service(tmp_path: Path, **overrides: Any) -> Service:
    service = Service(load_settings(kafka_bootstrap="127.0.0.1:9", checkpoint_dir=tmp_path / "ckpt",
                                    admin_token=TOKEN, **{**SMALL, **overrides}))  # fmt: skip
    data = torch.from_numpy(np.random.default_rng(0).normal(2.0, 3.0, size=(8, 10, 2)).astype(np.float32))
    service.trainer.norm.update(data, torch.ones(8, 10, dtype=torch.bool))
    randomize_head(service.trainer.model)  # `next` shows the weights, not only the last reading
    service.trainer.publish()
    service.trainer.publish()
    return service


def test_the_admin_route_hands_out_kept_versions(tmp_path: Path) -> None:
    service = make_service(tmp_path)
    with TestClient(create_app(service), raise_server_exceptions=False) as api:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert api.get("/v1/admin/models/1").status_code == 401
        assert api.get("/v1/admin/models/1", headers={"Authorization": "Bearer nope"}).status_code == 403
        missing = api.get("/v1/admin/models/9", headers=auth)
        assert missing.status_code == 404 and "kept: 1, 2" in missing.json()["detail"]
        assert api.get("/v1/admin/models/latest", headers=auth).status_code == 404
        for name, version in (("1", 1), ("serving", 2)):
            response = api.get(f"/v1/admin/models/{name}", headers=auth)
            assert response.status_code == 200 and response.headers["content-type"] == "application/octet-stream"
            bundle = decode_bundle(response.content)
            assert bundle.version == version
            _, _, rows = padded(2, LENGTHS)
            kept = service.trainer.registry.get(version)
            np.testing.assert_array_equal(service_answers(bundle, rows).next, service_answers(kept, rows).next)


def test_export_from_a_checkpoint_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    service = make_service(tmp_path)
    trainer = service.trainer
    CheckpointStore(tmp_path / "ckpt").save({"window": service.window.state_dict(), "trainer": trainer.state_dict()},
                                            step=trainer.step)  # fmt: skip
    for name in list(os.environ):
        if name.startswith("STREAMTRAIN_"):
            monkeypatch.delenv(name)
    out = tmp_path / "exported.onnx"
    assert cli_main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--format", "onnx", "--out", str(out)]) == 0
    assert "wrote onnx of version 3" in capsys.readouterr().out  # what a restored service publishes first
    values, lengths, rows = padded(2, LENGTHS)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert_matches(session.run(None, {"values": values, "lengths": lengths}), service_answers(trainer.published, rows))
    restored = bundle_from_checkpoint(tmp_path / "ckpt")
    assert restored.version == 3 and restored.step == trainer.step
    # refusals: one line, exit 2
    assert cli_main(["export", "--checkpoint-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert (
        cli_main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--version", "1", "--out", str(tmp_path / "r")])
        == 2
    )
    assert "holds version 3, not 1" in capsys.readouterr().err
    assert cli_main(["export", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "r")]) == 2
    assert "admin token" in capsys.readouterr().err


def test_a_dp_checkpoint_exports_with_the_public_norm(tmp_path: Path) -> None:
    model = SensorModel(1, d_model=16, n_heads=2, n_layers=1, max_len=16)
    state = {"model": model.state_dict(), "model_config": dict(model.config), "dp": {}, "step": 7, "version": 4,
             "tokens_trained": 0}  # fmt: skip
    CheckpointStore(tmp_path).save({"window": {}, "trainer": state}, step=7)
    settings = load_settings(dp_norm_mean=(2.0,), dp_norm_std=(4.0,))
    bundle = bundle_from_checkpoint(tmp_path, settings)
    assert bundle.version == 5 and bundle.norm.frozen
    network = InferenceModel(bundle.model, bundle.norm)
    assert network.mean.tolist() == [2.0] and network.std.tolist() == [4.0]
