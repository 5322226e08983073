"""Security: who gets in, how much they may send, what the service writes and what it says.

See docs/security.md for the threat model these tests pin down.
"""

from __future__ import annotations

import hmac
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

import streamtrain.serve.app as app_module
from streamtrain.checkpoint.store import CheckpointStore, read_checkpoint
from streamtrain.config import SettingsError, load_settings
from streamtrain.runtime.service import Service
from streamtrain.serve.app import create_app
from streamtrain.serve.batcher import PredictBatcher

torch.set_num_threads(1)

TOKEN = "s3cret-admin-token-Zq8v"
SMALL = {"d_model": 16, "n_heads": 2, "n_layers": 1, "token_budget": 512, "max_len": 32, "max_predict_batch": 4}


def make_service(tmp_path: Path, **overrides: Any) -> Service:
    values = {"kafka_bootstrap": "127.0.0.1:9", "checkpoint_dir": tmp_path / "ckpt", **SMALL, **overrides}
    service = Service(load_settings(**values))
    service.trainer.publish()
    return service


@pytest.fixture()
def client(tmp_path: Path) -> Iterator[TestClient]:
    service = make_service(tmp_path, admin_token=TOKEN, max_request_bytes=4096)
    with TestClient(create_app(service), raise_server_exceptions=False) as test_client:
        yield test_client


# ---------------------------------------------------------------------------------------
# admin routes


def admin_paths(app: Any) -> list[tuple[str, str]]:
    return [(method.upper(), path) for path, operations in app.openapi()["paths"].items()
            if path.startswith("/v1/admin") for method in operations]  # fmt: skip


def test_every_admin_route_needs_the_bearer_token(client: TestClient) -> None:
    routes = admin_paths(client.app)
    assert ("POST", "/v1/admin/checkpoint") in routes
    wrong = [
        "Bearer wrong",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Basic {TOKEN}",
        TOKEN,
        "Bearer ",
        f"bearer{TOKEN}",
    ]
    for method, path in routes:
        missing = client.request(method, path)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        for header in wrong:
            answer = client.request(method, path, headers={"Authorization": header})
            assert answer.status_code in (401, 403), (header, answer.status_code)
            assert TOKEN not in answer.text
    ok = client.post("/v1/admin/checkpoint", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["path"].endswith(".stck")
    also_ok = client.post(
        "/v1/admin/checkpoint", headers={"authorization": f"bearer {TOKEN}"}
    )  # scheme is case-insensitive
    assert also_ok.status_code == 200


@pytest.mark.parametrize("token", [None, ""])
def test_admin_routes_do_not_exist_without_a_token(tmp_path: Path, token: str | None) -> None:
    service = make_service(tmp_path, admin_token=token)
    with TestClient(create_app(service)) as test_client:
        assert admin_paths(test_client.app) == []
        assert test_client.post("/v1/admin/checkpoint", headers={"Authorization": "Bearer "}).status_code == 404
        assert "/v1/admin" not in test_client.get("/openapi.json").text


def test_the_token_is_compared_in_constant_time(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decision goes through hmac.compare_digest on the full byte strings."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    assert client.post("/v1/admin/checkpoint", headers={"Authorization": "Bearer nope"}).status_code == 403
    assert client.post("/v1/admin/checkpoint", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert calls == [(b"nope", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


# ---------------------------------------------------------------------------------------
# request size and predict limits


def test_bodies_over_the_limit_answer_413_declared_or_streamed(client: TestClient) -> None:
    big = b'{"instances": [{"values": [' + b"1.0," * 2000 + b"1.0]}]}"
    declared = client.post("/v1/predict", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        for start in range(0, len(big), 512):
            yield big[start : start + 512]

    streamed = client.post("/v1/predict", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    lying = client.post(
        "/v1/predict", content=big, headers={"content-type": "application/json", "content-length": "10"}
    )
    assert lying.status_code in (400, 413, 422)  # never parsed past the declared length, never a 500
    admin = client.post("/v1/admin/checkpoint", content=big, headers={"Authorization": f"Bearer {TOKEN}"})
    assert admin.status_code == 413
    small = client.post("/v1/predict", json={"instances": [{"values": [1.0, 2.0]}]})
    assert small.status_code == 200


def test_predict_limits_are_enforced(client: TestClient) -> None:
    s = client.app.state.service.settings
    cases = {
        "too many instances": {"instances": [{"values": [1.0]}] * (s.max_predict_batch + 1)},
        "no instance": {"instances": []},
        "too long": {"instances": [{"values": [0.5] * (s.max_len + 1)}]},
        "wrong channels": {"instances": [{"values": [[0.5, 0.5]]}]},
        "not numbers": {"instances": [{"values": ["1"]}]},
    }
    for name, body in cases.items():
        answer = client.post("/v1/predict", json=body)
        assert answer.status_code == 422, (name, answer.text)
    at_limit = client.post("/v1/predict", json={"instances": [{"values": [0.5] * s.max_len}] * s.max_predict_batch})
    assert at_limit.status_code == 200 and len(at_limit.json()["predictions"]) == s.max_predict_batch


def test_predictions_beyond_concurrency_and_queue_get_503_not_a_pile_up(client: TestClient) -> None:
    batcher: PredictBatcher = client.app.state.predict_batcher
    s = client.app.state.service.settings
    assert batcher._admit == s.predict_concurrency + s.predict_queue
    with batcher._cond:  # the workers and the queue are full
        batcher._inside += batcher._admit
    try:
        busy = client.post("/v1/predict", json={"instances": [{"values": [1.0]}]})
        assert busy.status_code == 503 and "overloaded" in busy.json()["detail"]
    finally:
        with batcher._cond:
            batcher._inside -= batcher._admit
    assert client.post("/v1/predict", json={"instances": [{"values": [1.0]}]}).status_code == 200


# ---------------------------------------------------------------------------------------
# checkpoints


class _Explodes:
    """Unpickling this runs code: it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_checkpoints_are_never_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = make_service(tmp_path)
    good = service.checkpoint()
    assert good is not None
    marker = tmp_path / "pwned"
    # newer files that a pickle-based loader would execute
    hostile = [
        tmp_path / "ckpt" / "ckpt-000000999999-1700000000000.stck",
        tmp_path / "ckpt" / "ckpt-000000999998-1700000000000.stck",
    ]
    hostile[0].write_bytes(pickle.dumps(_Explodes(marker)))
    torch.save({"model": _Explodes(marker)}, hostile[1])

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a checkpoint was unpickled")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    restored = make_service(tmp_path)
    loaded = restored.restore()
    assert loaded is not None and loaded.path == good  # the hostile files were skipped as corrupt
    assert restored.metrics.registry.get_sample_value("streamtrain_checkpoints_corrupt_total") == 2
    assert not marker.exists()


def test_checkpoint_files_are_private_to_the_service_user(tmp_path: Path) -> None:
    previous = os.umask(0)  # even with a permissive umask
    try:
        service = make_service(tmp_path)
        path = service.checkpoint()
    finally:
        os.umask(previous)
    assert path is not None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_checkpoint(path).step == 0
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_planted_link_is_not_followed_when_writing(tmp_path: Path) -> None:
    """O_EXCL temp files: a symlink planted under the next temp name is never written through."""
    service = make_service(tmp_path)
    store: CheckpointStore = service.store
    store.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    clock = 1_700_000_000.0
    store._clock = lambda: clock  # noqa: SLF001 - fix the name the next save will use
    planted = store.directory / f".ckpt-{0:012d}-{int(clock * 1000)}.stck.{os.getpid()}.tmp"
    planted.symlink_to(victim)
    assert service.checkpoint() is None  # refused, counted, retried later
    assert victim.read_text() == "keep me"
    assert service.metrics.registry.get_sample_value("streamtrain_checkpoint_failures_total") == 1


# ---------------------------------------------------------------------------------------
# secrets


def test_settings_never_show_the_token(tmp_path: Path) -> None:
    settings = load_settings(admin_token=TOKEN, checkpoint_dir=tmp_path)
    assert TOKEN not in repr(settings) and TOKEN not in str(settings)
    assert TOKEN not in str(settings.public_dict()) and settings.public_dict()["admin_token"] == "***"


def test_a_mistyped_token_is_not_echoed_in_the_error() -> None:
    with pytest.raises(SettingsError) as error:
        load_settings(admin_token=8675309123)
    assert "8675309123" not in str(error.value)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_serve(tmp_path: Path, **settings: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    env.update({f"STREAMTRAIN_{k.upper()}": v for k, v in settings.items()})
    return subprocess.Popen([sys.executable, "-m", "streamtrain.cli", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def test_no_secret_reaches_logs_or_responses(tmp_path: Path) -> None:
    port = _free_port()
    process = run_serve(
        tmp_path, admin_token=TOKEN, http_host="127.0.0.1", http_port=str(port), log_level="DEBUG",
        kafka_bootstrap="127.0.0.1:9", checkpoint_dir=str(tmp_path / "ckpt"), **{k: str(v) for k, v in SMALL.items()},
    )  # fmt: skip
    bodies = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None and time.monotonic() < deadline, "service did not come up"
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            for header in (f"Bearer {TOKEN}", f"Bearer {TOKEN}-wrong", f"Bearer {TOKEN[:-2]}"):
                bodies.append(http.post("/v1/admin/checkpoint", headers={"Authorization": header}).text)
            for path in ("/readyz", "/v1/model", "/v1/window", "/metrics", "/openapi.json"):
                bodies.append(http.get(path).text)
    finally:
        process.send_signal(signal.SIGTERM)
        try:  # an empty window keeps the trainer waiting for data; its shutdown is not under test here
            output, _ = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate(timeout=30)
    log = output.decode(errors="replace")
    assert "settings:" in log and "'admin_token': '***'" in log  # it did log its settings, masked
    assert TOKEN[:-2] not in log, "a secret (or most of one) reached the log"
    assert not [b for b in bodies if TOKEN[:-2] in b], "a response carried the secret"


def test_dp_refuses_a_seeded_shuffle_in_one_line(tmp_path: Path) -> None:
    process = run_serve(tmp_path, dp="on", shuffle="seeded", checkpoint_dir=str(tmp_path / "ckpt"), http_port="0")
    output, _ = process.communicate(timeout=120)
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    assert process.returncode not in (0, None)
    assert len(lines) == 1, lines
    assert "SHUFFLE" in lines[0] and "crypto" in lines[0], lines[0]
