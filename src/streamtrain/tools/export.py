"""``streamtrain export``: hand a published model to another server.

A version comes from a running service (``GET /v1/admin/models/{version}``, a safetensors
bundle: the model's tensors, its normalization statistics and a JSON description, never
a pickle) or from a checkpoint directory, and is written as

* a Triton model repository, ``streamtrain/config.pbtxt`` + ``streamtrain/<version>/model.pt``
  (TorchScript, PyTorch backend) or ``.../model.onnx`` (ONNX Runtime backend);
* a single ONNX file with dynamic batch and length axes;
* a ``torch.export`` ExportedProgram (``.pt2``) for PyTorch's own runtimes.

Every format holds one module, :class:`streamtrain.model.inference.InferenceModel`: input
normalization, the network and the output heads, from ``values [batch, length,
channels]`` and ``lengths [batch]`` to ``next``, ``anomaly_score`` and ``probs``. The
service's predictions run through the same module, so an export answers as the service
does (the tests compare them to 1e-5 on padded, variable-length batches).
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import safetensors.torch
import torch
import torch.fx.experimental._config  # noqa: F401 - _size_oblivious reads it

from streamtrain.checkpoint.sharded_store import load_latest_common
from streamtrain.model.forecasters import NETWORK, Forecaster, ServedModel
from streamtrain.model.inference import InferenceModel
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm

BUNDLE_FORMAT = "streamtrain.model"
BUNDLE_VERSION = 1
MODEL_NAME = "streamtrain"
INPUT_NAMES = ("values", "lengths")
TritonBackend = Literal["pytorch", "onnxruntime"]


class ExportError(Exception):
    """The export cannot be done; the message says what to change."""


@dataclass(frozen=True)
class ModelBundle:
    """One published version, as everything outside the service needs it."""

    model: SensorModel
    norm: RunningNorm
    version: int
    step: int
    published_at: float | None
    forecaster: Forecaster = NETWORK  # what the version serves beside (or instead of) the network's forecast

    def inference_model(self) -> InferenceModel:
        served = self.model if self.forecaster.kind == "network" else ServedModel(self.model, self.forecaster)
        return InferenceModel(served, self.norm).eval()

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.inference_model().output_names


# ---------------------------------------------------------------------- the bundle
def encode_bundle(published: Any) -> bytes:
    """A published version (model, norm, version, step, published_at) as safetensors bytes."""
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in published.model.state_dict().items()}
    norm_state = published.norm.state_dict()
    tensors["norm.mean"] = norm_state.pop("mean").contiguous()
    tensors["norm.m2"] = norm_state.pop("m2").contiguous()
    forecaster: Forecaster = published.forecaster
    if forecaster.coefficients is not None:
        tensors["forecaster.coefficients"] = torch.as_tensor(forecaster.coefficients, dtype=torch.float64).contiguous()
    metadata = {
        "forecaster": forecaster.kind,
        "format": BUNDLE_FORMAT,
        "format_version": str(BUNDLE_VERSION),
        "model_config": json.dumps(published.model.config),
        "norm": json.dumps(norm_state),
        "version": str(int(published.version)),
        "step": str(int(published.step)),
        "published_at": json.dumps(published.published_at),
    }
    return safetensors.torch.save(tensors, metadata=metadata)


def _bundle_metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise ExportError("not a streamtrain model bundle: too short")
    (length,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, ValueError):
        raise ExportError("not a streamtrain model bundle: the safetensors header is not JSON") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or metadata.get("format") != BUNDLE_FORMAT:
        raise ExportError(f"not a streamtrain model bundle (format {BUNDLE_FORMAT!r} expected)")
    if metadata.get("format_version") != str(BUNDLE_VERSION):
        raise ExportError(
            f"model bundle format version {metadata.get('format_version')!r}; this streamtrain reads {BUNDLE_VERSION}"
        )
    return metadata


def _build(config: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> SensorModel:
    model = SensorModel.from_config(config)
    model.load_state_dict(dict(weights))
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model.eval()


def decode_bundle(data: bytes) -> ModelBundle:
    metadata = _bundle_metadata(data)
    try:
        tensors = safetensors.torch.load(data)
        config = json.loads(metadata["model_config"])
        model = _build(config, {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
        norm = RunningNorm(int(config["channels"]))
        norm.load_state_dict({**json.loads(metadata["norm"]), "mean": tensors["norm.mean"], "m2": tensors["norm.m2"]})
        coefficients = tensors.get("forecaster.coefficients")
        forecaster = Forecaster.from_state(
            {"kind": metadata.get("forecaster", "network"), "coefficients": coefficients}
        )
        return ModelBundle(
            model=model,
            norm=norm,
            forecaster=forecaster,
            version=int(metadata["version"]),
            step=int(metadata["step"]),
            published_at=json.loads(metadata["published_at"]),
        )
    except (KeyError, ValueError, RuntimeError) as err:
        raise ExportError(f"model bundle is damaged: {type(err).__name__}: {err}") from None


def fetch_bundle(url: str, version: str, token: str, timeout_s: float = 60.0) -> ModelBundle:
    """Version ``version`` (a number or ``serving``) from a running service's admin route."""
    import httpx

    address = f"{url.rstrip('/')}/v1/admin/models/{version}"
    try:
        response = httpx.get(address, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
    except httpx.HTTPError as err:
        raise ExportError(f"cannot reach {address}: {err}") from None
    if response.status_code == 404 and "application/json" in response.headers.get("content-type", ""):
        detail = response.json().get("detail", "")
        if detail == "Not Found":
            detail = "no such route: the service has no admin token configured (STREAMTRAIN_ADMIN_TOKEN)"
        raise ExportError(f"{address}: 404 {detail}")
    if response.status_code in (401, 403):
        raise ExportError(f"{address}: {response.status_code}: the admin token was not accepted (--admin-token)")
    if response.status_code != 200:
        raise ExportError(f"{address}: HTTP {response.status_code}: {response.text[:300]}")
    return decode_bundle(response.content)


def bundle_from_checkpoint(directory: Path | str, settings: Any = None) -> ModelBundle:
    """The model of the newest valid checkpoint in ``directory``.

    Its version is the one a service restored from that checkpoint publishes first (the
    version counter saved with it, plus one). A DP checkpoint has no normalization
    statistics (DP mode normalizes with public constants): they come from ``settings``
    (``DP_NORM_MEAN`` / ``DP_NORM_STD``; identity when unset).
    """
    path = Path(directory)
    if not path.is_dir():
        raise ExportError(f"checkpoint directory {path} does not exist")
    loaded = load_latest_common(path)  # one-file or sharded (scaled out), whichever is newest
    if loaded is None:
        raise ExportError(f"no valid checkpoint in {path}")
    trainer = loaded.state["trainer"]
    config = dict(trainer["model_config"])
    model = _build(config, trainer["model"])
    channels = int(config["channels"])
    if "norm" in trainer:
        norm = RunningNorm(channels)
        norm.load_state_dict(trainer["norm"])
    else:
        mean = getattr(settings, "dp_norm_mean", None) or (0.0,) * channels
        std = getattr(settings, "dp_norm_std", None) or (1.0,) * channels
        norm = RunningNorm.from_public(mean, std)
    return ModelBundle(
        model=model,
        norm=norm,
        version=int(trainer.get("version", 0)) + 1,
        step=int(trainer["step"]),
        published_at=None,
    )


# ---------------------------------------------------------------------- the formats
def example_inputs(bundle: ModelBundle, batch: int = 2, length: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded example (values, lengths) with distinct lengths, for tracing."""
    length = max(1, min(length, bundle.model.max_len))
    values = torch.randn(batch, length, bundle.model.channels, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([max(1, length - i) for i in range(batch)], dtype=torch.int64)
    return values, lengths


def _dynamic_shapes(bundle: ModelBundle) -> dict[str, dict[int, Any]]:
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    if bundle.model.max_len < 2:
        return {"values": {0: batch}, "lengths": {0: batch}}
    length = torch.export.Dim("length", min=1, max=bundle.model.max_len)
    return {"values": {0: batch, 1: length}, "lengths": {0: batch}}


def _size_oblivious() -> contextlib.AbstractContextManager[Any]:
    """Trace sizes without specializing on 0 and 1.

    Slices of ``length - 1`` steps make the tracer ask whether that size is 1 (for
    broadcasting) and refuse a dynamic length; the operands always have the same shape,
    so the answer does not change the computation, and batches of length 1 and 2 must
    stay servable (the tests run them).
    """
    config = getattr(torch.fx.experimental, "_config", None)
    if config is None or not hasattr(config, "backed_size_oblivious"):
        return contextlib.nullcontext()
    return config.patch(backed_size_oblivious=True)


def export_program(bundle: ModelBundle, path: Path | str) -> Path:
    """A ``torch.export`` ExportedProgram (``torch.export.load`` reads it back)."""
    path = Path(path)
    with _size_oblivious():
        program = torch.export.export(
            bundle.inference_model(), example_inputs(bundle), dynamic_shapes=_dynamic_shapes(bundle), strict=False
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    return path


def export_torchscript(bundle: ModelBundle, path: Path | str) -> Path:
    """TorchScript by tracing (what Triton's PyTorch backend loads); checked on a second shape."""
    path = Path(path)
    network = bundle.inference_model()
    values, lengths = example_inputs(bundle, batch=3, length=5)
    check = example_inputs(bundle, batch=2, length=3)
    with warnings.catch_warnings():
        # The model's argument checks read shapes as Python values: true at trace time,
        # and not part of the computation.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\..*deprecated", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\..*deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*torch\.jit\..*deprecated", category=UserWarning)
        traced = torch.jit.trace(network, (values, lengths), check_inputs=[check])
    path.parent.mkdir(parents=True, exist_ok=True)
    traced.save(str(path))
    return path


def export_onnx(bundle: ModelBundle, path: Path | str, opset: int | None = None) -> Path:
    """One ONNX file: inputs values [batch, length, C] float32 and lengths [batch] int64,
    outputs next, anomaly_score (and probs), normalization inside the graph."""
    try:
        import onnx
        import onnxscript  # noqa: F401 - torch's ONNX exporter needs it
    except ImportError as err:
        raise ExportError(f"ONNX export needs the export extra (pip install 'streamtrain[export]'): {err}") from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    network = bundle.inference_model()
    options: dict[str, Any] = {} if opset is None else {"opset_version": opset}
    # The exporter prints its progress; the CLI prints one line of its own.
    with _size_oblivious(), contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(
            network,
            example_inputs(bundle),
            str(path),
            input_names=list(INPUT_NAMES),
            output_names=list(network.output_names),
            dynamic_shapes=_dynamic_shapes(bundle),
            dynamo=True,
            external_data=False,
            verbose=False,
            **options,
        )
    model = onnx.load(str(path))
    model.doc_string = f"streamtrain model version {bundle.version} (step {bundle.step})"
    onnx.helper.set_model_props(
        model, {"streamtrain_version": str(bundle.version), "streamtrain_step": str(bundle.step)}
    )
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def triton_output_names(bundle: ModelBundle, backend: TritonBackend) -> list[str]:
    """Triton's PyTorch backend names outputs by position (``<name>__<index>``); ONNX keeps names."""
    names = list(bundle.output_names)
    return [f"{name}__{i}" for i, name in enumerate(names)] if backend == "pytorch" else names


def triton_config(bundle: ModelBundle, backend: TritonBackend) -> str:
    """``config.pbtxt``: no Triton batching (rows differ in length; the batch axis is explicit)."""
    channels, classes = bundle.model.channels, bundle.model.n_classes
    output_dims = {"next": f"-1, {channels}", "anomaly_score": "-1", "probs": f"-1, {classes}"}

    def tensor(name: str, data_type: str, dims: str) -> str:
        return f'  {{\n    name: "{name}"\n    data_type: {data_type}\n    dims: [ {dims} ]\n  }}'

    inputs = [tensor("values", "TYPE_FP32", f"-1, -1, {channels}"), tensor("lengths", "TYPE_INT64", "-1")]
    outputs = [
        tensor(triton_name, "TYPE_FP32", output_dims[name])
        for name, triton_name in zip(bundle.output_names, triton_output_names(bundle, backend), strict=True)
    ]
    return (
        f'name: "{MODEL_NAME}"\n'
        f'backend: "{backend}"\n'
        "max_batch_size: 0\n"
        "input [\n" + ",\n".join(inputs) + "\n]\n"
        "output [\n" + ",\n".join(outputs) + "\n]\n"
    )


def write_triton_repository(bundle: ModelBundle, root: Path | str, backend: TritonBackend = "pytorch") -> Path:
    """``root/streamtrain/config.pbtxt`` and ``root/streamtrain/<version>/model.pt|model.onnx``.

    Exporting further versions into the same repository adds version folders; the config
    is the same for every version of one model shape (a different shape is refused).
    """
    if backend not in ("pytorch", "onnxruntime"):
        raise ExportError(f"Triton backend {backend!r}: use pytorch or onnxruntime")
    model_dir = Path(root) / MODEL_NAME
    config = triton_config(bundle, backend)
    config_path = model_dir / "config.pbtxt"
    if config_path.exists() and config_path.read_text() != config:
        raise ExportError(f"{config_path} describes another model shape or backend; export into an empty repository")
    version_dir = model_dir / str(bundle.version)
    if backend == "pytorch":
        export_torchscript(bundle, version_dir / "model.pt")
    else:
        export_onnx(bundle, version_dir / "model.onnx")
    config_path.write_text(config)
    return model_dir


def describe(bundle: ModelBundle) -> str:
    age = "" if bundle.published_at is None else f", published at {bundle.published_at:.3f}"
    params = sum(p.numel() for p in bundle.model.parameters())
    return f"version {bundle.version} (step {bundle.step}{age}; {params:,} parameters; config {bundle.model.config})"
