"""``streamtrain serve`` end to end: the real broker, the real process, the real HTTP API."""

from __future__ import annotations

import math
import random
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from kafka_helpers import wait_for
from service_process import ServiceProcess

from streamtrain.checkpoint.incremental import parent_of
from streamtrain.checkpoint.store import CheckpointStore, read_checkpoint_link
from streamtrain.tools.simulate import run_simulation
from streamtrain.tools.simulation_config import SimulationConfig

pytestmark = pytest.mark.integration


def simulate(bootstrap: str, topic: str, count: int, seed: int = 0, **extra) -> int:
    config = SimulationConfig(
        bootstrap=bootstrap,
        topic=topic,
        rate=0,
        count=count,
        sensors=8,
        length_median=24,
        length_sigma=0.5,
        max_len=128,
        process="ar",
        seed=seed,
        progress_interval_s=60,
        **extra,
    )
    report = run_simulation(config)
    assert report.delivery_errors == 0
    return report.sent - report.malformed


def token_counters(metrics_text: str) -> tuple[float, float]:
    """(padding, real) tokens trained so far, from the Prometheus exposition."""
    values = {}
    for line in metrics_text.splitlines():
        for name in ("streamtrain_train_padding_tokens_total", "streamtrain_train_tokens_total"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values["streamtrain_train_padding_tokens_total"], values["streamtrain_train_tokens_total"]


@pytest.fixture()
def learning_service(kafka_bootstrap, make_topic, tmp_path):
    topic = make_topic(partitions=2)
    service = ServiceProcess(
        kafka_bootstrap,
        topic,
        tmp_path / "ckpt",
        tmp_path / "serve.log",
        max_len=128,
        window_capacity=20000,
        half_life_s="inf",
        admin_token="s3cret-token",
        checkpoint_interval_s=300,
        compile="on",  # the defaults a new user gets: compiled forwards, bf16 where its matmuls are faster
        amp="auto",
    )
    with service:
        valid = simulate(kafka_bootstrap, topic, count=4000, malformed_share=0.05)
        service.valid_sent = valid
        service.wait_ready()
        yield service


@pytest.mark.expected_seconds(120)
def test_serves_learns_and_answers(learning_service: ServiceProcess) -> None:
    s = learning_service
    window = wait_for(lambda: (w := s.get("/v1/window"))["size"] == s.valid_sent and w, 60, "window holds the stream")
    assert window["accepted_total"] == s.valid_sent
    assert sum(window["rejected_total"].values()) == window["seen_total"] - s.valid_sent > 0

    # training progresses and beats the naive last-value forecast on a learnable stream
    first = s.get("/v1/model")["training"]["live_step"]
    pad_before, real_before = token_counters(s.client.get("/metrics").text)  # warm-up passes were tiny
    report = wait_for(
        lambda: (
            (m := s.get("/v1/model"))["training"]["live_step"] >= first + 40
            and m["training"]["forecast_loss"] < 0.9 * m["training"]["naive_last_value_loss"]
            and m
        ),
        150,
        "the forecast beating the last-value baseline",
    )
    assert report["version"] >= 1 and report["dp"] is None
    pad, real = token_counters(s.client.get("/metrics").text)
    # length buckets: a pass of PASS_MAX_ITEMS (768) items sorts only its own lengths (6.1-6.6% padding
    # measured on this stream; budget batches of these lengths in arrival order pad ~59%, simulated)
    assert (pad - pad_before) / (pad - pad_before + real - real_before) <= 0.08

    # compiled as a new user's service is: both forwards, in the background, while it served
    log = s.log_path
    wait_for(lambda: all(f"{f} forward compiled in" in log.read_text() for f in ("training", "predict")), 300,
             f"both forwards compiled (log {log})")  # fmt: skip
    assert "running eager" not in log.read_text()

    # no-shuffle inference (the compiled forward): answers do not depend on order or company
    rng = np.random.default_rng(1)
    instances = [
        {"values": np.round(np.cumsum(rng.standard_normal(int(n))), 3).tolist()} for n in rng.integers(1, 100, 24)
    ]

    def ask(batch):
        body = s.client.post("/v1/predict", json={"instances": batch})
        assert body.status_code == 200, body.text
        return body.json()

    # Answers are compared within one model version (training publishes meanwhile): every
    # full-request answer is kept as the reference of its version, and each order is asked
    # again until a reference of the same version exists. Every check must be made.
    references: dict[int, list[dict]] = {}

    def reference_for(version: int) -> list[dict] | None:
        if version not in references:
            full = ask(instances)
            references[full["model_version"]] = full["predictions"]
        return references.get(version)

    checks = {
        "reversed": list(range(len(instances)))[::-1],
        "sorted": sorted(range(len(instances)), key=lambda i: len(instances[i]["values"])),
        "shuffled": random.Random(3).sample(range(len(instances)), len(instances)),
        "alone": [5],
    }
    compared: list[str] = []
    for name, order in checks.items():
        for _ in range(30):
            answer = ask([instances[i] for i in order])
            base = reference_for(answer["model_version"])
            if base is None:
                continue  # a publish between the two requests: ask again
            for position, i in enumerate(order):
                got, want = answer["predictions"][position], base[i]
                assert np.allclose(got["next"], want["next"], atol=1e-5), name
                assert math.isclose(got["anomaly_score"], want["anomaly_score"], rel_tol=1e-5, abs_tol=1e-5), name
            compared.append(name)
            break
    assert compared == list(checks), f"compared within one model version: {compared} of {list(checks)}"

    # in company of other requests: concurrent requests share forwards (serve/batcher.py)
    chunks = [list(range(k, len(instances), 6)) for k in range(6)] + [list(range(len(instances)))] * 2

    def ask_apart(indices):
        with httpx.Client(base_url=str(s.client.base_url), timeout=30) as client:
            body = client.post("/v1/predict", json={"instances": [instances[i] for i in indices]})
            assert body.status_code == 200, body.text
            return indices, body.json()

    # Every instance is in one chunk and in both full requests; within one model version
    # (training publishes every 0.5 s, so compare per version) its answers must agree.
    compared_instances = 0
    for attempt in range(5):
        seen: dict[tuple[int, int], list[float]] = {}
        with ThreadPoolExecutor(len(chunks)) as pool:
            for indices, answer in pool.map(ask_apart, chunks):
                for position, i in enumerate(indices):
                    key = (answer["model_version"], i)
                    got = answer["predictions"][position]["next"]
                    if key in seen:
                        assert np.allclose(got, seen[key], atol=1e-5), (attempt, key)
                        compared_instances += 1
                    else:
                        seen[key] = got
        if compared_instances:
            break
    assert compared_instances >= len(instances), compared_instances

    # every bad-input class is a 422 that names the instance, never a 500
    bad_bodies = [
        {"instances": []},
        {"instances": [{"values": []}]},
        {"instances": [{"values": [1.0, "x"]}]},
        {"instances": [{"values": [[1.0, 2.0]]}]},
        {"instances": [{"values": [0.0] * 129}]},
        {"instances": [{"values": [1.0]}] * 257},
        {"instances": [{"values": [1.0]}, {"nothing": 1}]},
        {"instances": "no"},
        {},
    ]
    for body in bad_bodies:
        response = s.client.post("/v1/predict", json=body)
        assert response.status_code == 422, (body, response.text)
    for raw in (b'{"instances": [{"values": [1.0, NaN]}]}', b'{"instances": [{"values": [Infinity]}]}', b"{nope"):
        response = s.client.post("/v1/predict", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 422, (raw, response.text)
    nan_answer = s.client.post(
        "/v1/predict",
        content=b'{"instances": [{"values": [1.0]}, {"values": [NaN]}]}',
        headers={"content-type": "application/json"},
    )
    assert "instances[1]" in nan_answer.json()["detail"] and "non_finite" in nan_answer.json()["detail"]
    too_big = s.client.post(
        "/v1/predict", content=b"[" + b"1," * (5 << 20) + b"1]", headers={"content-type": "application/json"}
    )
    assert too_big.status_code == 413

    # admin: bearer token, 401 without, 403 wrong
    assert s.client.post("/v1/admin/checkpoint").status_code == 401
    assert s.client.post("/v1/admin/checkpoint", headers={"Authorization": "Bearer wrong"}).status_code == 403
    ok = s.client.post("/v1/admin/checkpoint", headers={"Authorization": "Bearer s3cret-token"})
    assert ok.status_code == 200 and ok.json()["path"].endswith(".stck")


@pytest.mark.expected_seconds(75)
def test_sigkill_and_restart_restore_window_and_step_exactly(kafka_bootstrap, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=2)
    settings = dict(max_len=128, window_capacity=50000, half_life_s="inf", checkpoint_interval_s=1)
    first = ServiceProcess(kafka_bootstrap, topic, tmp_path / "ckpt", tmp_path / "serve1.log", **settings).start()
    sent = simulate(kafka_bootstrap, topic, count=1500, seed=1)
    first.wait_ready()
    wait_for(lambda: first.get("/v1/model")["training"]["live_step"] >= 5, 60, "some training")
    time.sleep(2.5)  # a checkpoint covers this state
    sent += simulate(kafka_bootstrap, topic, count=1500, seed=2)  # more arrive, some maybe not checkpointed
    time.sleep(0.5)
    chain = first.get("/v1/window")["checkpoints"]
    first.kill()
    assert chain["written"]["delta"] >= 1, chain  # the checkpoints after the first are deltas on it
    step_before = CheckpointStore(tmp_path / "ckpt").latest_step  # the last completed checkpoint
    assert step_before is not None and step_before >= 5
    newest = read_checkpoint_link(CheckpointStore(tmp_path / "ckpt").list()[0].path)  # the file alone
    restores_a_chain = parent_of(newest.state["window"]) is not None

    second = ServiceProcess(kafka_bootstrap, topic, tmp_path / "ckpt", tmp_path / "serve2.log", **settings).start()
    try:
        restored = second.get("/v1/model")
        assert restored["step"] >= step_before  # never back past the last completed checkpoint
        if restores_a_chain:  # the window came back as a base and its deltas
            assert "window deltas" in (tmp_path / "serve2.log").read_text()
        window = wait_for(lambda: (w := second.get("/v1/window"))["size"] >= sent and w, 90, "the whole stream")
        time.sleep(2)
        window = second.get("/v1/window")
        # a uniform window larger than the stream: it holds every event exactly once
        assert window["size"] == sent
        assert window["accepted_total"] == sent
        assert window["evicted_total"] == 0
        # the ledger counts each covered message once; this process's counters only what it read
        assert window["seen_total"] == window["accepted_total"] + sum(window["rejected_total"].values())
        consumed = [
            line
            for line in second.client.get("/metrics").text.splitlines()
            if line.startswith("streamtrain_events_consumed_total ")
        ]
        assert len(consumed) == 1 and float(consumed[0].split()[1]) <= window["seen_total"]
    finally:
        second.terminate()


@pytest.mark.expected_seconds(35)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_exits_0_after_the_final_checkpoint(kafka_bootstrap, make_topic, tmp_path, sig) -> None:
    """One process, stopped as Kubernetes (SIGTERM) or a terminal (SIGINT) stops it: status 0, not -15/143."""
    topic = make_topic(partitions=2)
    checkpoint_dir = tmp_path / "ckpt"
    service = ServiceProcess(
        kafka_bootstrap,
        topic,
        checkpoint_dir,
        tmp_path / "serve.log",
        max_len=128,
        window_capacity=50000,
        half_life_s="inf",
        checkpoint_interval_s=3600,
    ).start()
    sent = simulate(kafka_bootstrap, topic, count=300, seed=3)
    wait_for(lambda: service.get("/v1/window")["size"] == sent, 60, "the window to hold the stream")
    assert CheckpointStore(checkpoint_dir).latest_step is None  # no periodic checkpoint before the stop
    status = service.terminate(sig=sig)
    log = (tmp_path / "serve.log").read_text()
    assert status == 0, log[-3000:]
    final = CheckpointStore(checkpoint_dir).load_latest()
    assert final is not None, log[-3000:]
    assert len(final.state["window"]["lengths"]) == sent  # written at the stop: it covers the whole stream
    assert "stopped after the final checkpoint" in log


def test_a_final_checkpoint_that_cannot_be_written_exits_1_and_says_so(kafka_bootstrap, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=1)
    checkpoint_dir = tmp_path / "ckpt"
    service = ServiceProcess(
        kafka_bootstrap,
        topic,
        checkpoint_dir,
        tmp_path / "serve.log",
        checkpoint_interval_s=3600,
    ).start()
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    checkpoint_dir.write_text("a file where the checkpoint directory was\n")  # every write fails, root or not
    status = service.terminate()
    log = (tmp_path / "serve.log").read_text()
    assert status == 1, log[-3000:]
    said = [line for line in log.splitlines() if line.startswith("streamtrain: stopped without a final checkpoint (")]
    assert len(said) == 1 and str(checkpoint_dir) in said[0], log[-3000:]
    assert "stopped after the final checkpoint" not in log
