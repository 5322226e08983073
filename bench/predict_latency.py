"""/v1/predict latency while the service trains, against the bare model forward.

The service runs as a real ``streamtrain serve`` process (default model and settings,
``torch_threads`` 1) on a unique topic of the local broker, fed by a ``streamtrain
simulate`` process, so the trainer thread steps all through the measurement. The load
generator sends ``--requests`` requests of 32 instances (lognormal lengths, median 48,
sigma 0.8, clipped to 4..512), ``--concurrency`` in flight at once from as many threads,
bodies pre-encoded so client work stays small, and times each request.

Baselines, on the same request batches, in this process, with the same model size and
thread count and no training going on: the bare forward
(:func:`streamtrain.model.predict`) one call at a time, and the same forward called
from ``--concurrency`` threads at once (what the cores can do for that many callers).
The server-side mean (the predict middleware's histogram) splits client and network
time from server time.

A floor the ratio cannot beat on this machine: with ``--concurrency`` requests always in
flight, Little's law makes latency = concurrency / throughput, and the cores cannot
finish more than ``cores / bare forward`` requests per second (perfect scaling, no
training, no HTTP). So the p50 is at least ``concurrency x bare p50 / cores``, i.e. the
ratio to the bare forward is at least ``concurrency / cores`` (4x for 8 requests on 2
cores) unless merging makes a request cheaper than its bare forward. The table prints
that floor next to the measured p50.

Needs the broker (``deploy/kafka.sh up``). Run: ``python bench/predict_latency.py [--json]``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import Row, emit  # noqa: E402

from streamtrain.config import load_settings  # noqa: E402
from streamtrain.model import RunningNorm, build_model, plan_predict_batches, predict  # noqa: E402

BENCH = "predict_latency"
INSTANCES = 32


def lognormal_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """The issue's mix: lognormal, median 48, sigma 0.8, clipped to 4..512."""
    return np.clip(np.round(rng.lognormal(math.log(48), 0.8, n)), 4, 512).astype(np.int64)


def request_batches(count: int, seed: int) -> list[list[np.ndarray]]:
    """``count`` distinct requests of 32 float32 [L, 1] instances (rounded as JSON would carry them)."""
    rng = np.random.default_rng(seed)
    return [
        [np.round(rng.standard_normal((int(n), 1)), 4).astype(np.float32) for n in lognormal_lengths(INSTANCES, rng)]
        for _ in range(count)
    ]


def encode(batch: Sequence[np.ndarray]) -> bytes:
    return orjson.dumps({"instances": [{"values": a[:, 0].tolist()} for a in batch]})


def percentiles(seconds: Sequence[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(np.asarray(seconds), [50, 99])
    return float(p50), float(p99)


def run_concurrently(call: Callable[[int], float], total: int, concurrency: int) -> list[float]:
    """``total`` calls of ``call(i)`` (returning its latency) from ``concurrency`` threads."""
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(call, range(total)))


# ---------------------------------------------------------------------- the service side
class Stack:
    """A ``streamtrain serve`` process plus a ``streamtrain simulate`` process feeding it."""

    def __init__(self, bootstrap: str, stream_rate: float, workdir: Path, overrides: dict[str, str]) -> None:
        topic = f"bench-predict-{uuid.uuid4().hex[:8]}"
        self.port = _free_port()
        self.log = workdir / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
        env.update({
            "STREAMTRAIN_KAFKA_BOOTSTRAP": bootstrap, "STREAMTRAIN_TOPIC": topic,
            "STREAMTRAIN_GROUP_ID": f"g-{topic}", "STREAMTRAIN_HTTP_HOST": "127.0.0.1",
            "STREAMTRAIN_HTTP_PORT": str(self.port), "STREAMTRAIN_CHECKPOINT_DIR": str(workdir / "ckpt"),
            "STREAMTRAIN_LOG_LEVEL": "WARNING",
            **{f"STREAMTRAIN_{name.upper()}": value for name, value in overrides.items()},
        })  # fmt: skip
        self.env = env
        self.serve_args = [sys.executable, "-m", "streamtrain.cli", "serve"]
        self.simulate_args = [
            sys.executable, "-m", "streamtrain.cli", "simulate", "--bootstrap", bootstrap, "--topic", topic,
            "--rate", str(stream_rate), "--length-median", "48", "--length-sigma", "0.8", "--sensors", "64",
        ]  # fmt: skip
        self.processes: list[subprocess.Popen[bytes]] = []
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def start(self, timeout_s: float = 120.0) -> None:
        log = open(self.log, "ab")  # noqa: SIM115 - lives as long as the process
        self.processes.append(subprocess.Popen(self.serve_args, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        self._wait(lambda: self._get("/healthz") is not None, timeout_s, "health")
        self.processes.append(
            subprocess.Popen(self.simulate_args, env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        )
        self._wait(lambda: self.client.get("/readyz").status_code == 200, timeout_s, "readiness")
        self._wait(lambda: self.model()["training"]["live_step"] >= 5, timeout_s, "5 training steps")

    def _wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.processes[0].poll() is not None:
                raise RuntimeError(f"streamtrain serve exited: {self.log.read_text()[-2000:]}")
            try:
                if condition():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        try:
            state = self.client.get("/readyz").text
        except httpx.HTTPError as err:
            state = repr(err)
        raise TimeoutError(f"waited {timeout_s}s for {what}; /readyz: {state}; log: {self.log}")

    def _get(self, path: str) -> dict | None:
        response = self.client.get(path)
        return response.json() if response.status_code == 200 else None

    def model(self) -> dict:
        return self.client.get("/v1/model").json()

    def server_latency(self) -> tuple[float, int]:
        """(sum of seconds, count) of streamtrain_predict_latency_seconds."""
        text = self.client.get("/metrics").text
        total = float(re.search(r"^streamtrain_predict_latency_seconds_sum (\S+)$", text, re.M).group(1))
        count = int(float(re.search(r"^streamtrain_predict_latency_seconds_count (\S+)$", text, re.M).group(1)))
        return total, count

    def stop(self) -> None:
        self.client.close()
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_latencies(port: int, bodies: list[bytes], total: int, concurrency: int) -> tuple[list[float], set[int]]:
    local = threading.local()
    versions: set[int] = set()

    def one(i: int) -> float:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        started = time.perf_counter()
        response = client.post("/v1/predict", content=bodies[i % len(bodies)],
                               headers={"content-type": "application/json"})
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"/v1/predict answered {response.status_code}: {response.text[:300]}")
        versions.add(orjson.loads(response.content)["model_version"])
        return elapsed

    return run_concurrently(one, total, concurrency), versions


# ---------------------------------------------------------------------- the bare forward
def bare_latencies(
    batches: list[list[np.ndarray]], total: int, concurrency: int, token_budget: int
) -> tuple[list[float], float]:
    """Latencies of ``total`` bare forwards from ``concurrency`` callers, and the wall time of all."""
    settings = load_settings()
    torch.manual_seed(0)
    model = build_model(settings).eval()
    norm = RunningNorm(settings.channels)

    def one(i: int) -> float:
        started = time.perf_counter()
        predict(model, norm, batches[i % len(batches)], token_budget)
        return time.perf_counter() - started

    for i in range(4):
        one(i)
    started = time.perf_counter()
    latencies = [one(i) for i in range(total)] if concurrency == 1 else run_concurrently(one, total, concurrency)
    return latencies, time.perf_counter() - started


def predict_padding_share(batches: list[list[np.ndarray]], token_budget: int) -> float:
    """Share of pad positions in the micro-batches :func:`streamtrain.model.predict` runs."""
    real = padded = 0
    for batch in batches:
        lengths = np.array([len(a) for a in batch], dtype=np.int64)
        for group in plan_predict_batches(lengths, token_budget):
            real += int(lengths[group].sum())
            padded += len(group) * int(lengths[group].max())
    return 1.0 - real / padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("STREAMTRAIN_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--requests", type=int, default=160, help="HTTP requests measured")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--bare-calls", type=int, default=48, help="bare forward calls per baseline")
    parser.add_argument("--stream-rate", type=float, default=200.0, help="events/s the simulator sends meanwhile")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the bare forward (the service: 1)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a service setting, e.g. --set predict_concurrency=1 (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)

    torch.set_num_threads(args.threads)
    settings = load_settings()
    batches = request_batches(16, args.seed)
    bodies = [encode(b) for b in batches]

    bare_single, _ = bare_latencies(batches, args.bare_calls, 1, settings.token_budget)
    bare_concurrent, bare_wall = bare_latencies(batches, args.bare_calls * 2, args.concurrency, settings.token_budget)

    with tempfile.TemporaryDirectory(prefix="bench-predict-") as workdir:
        stack = Stack(args.bootstrap, args.stream_rate, Path(workdir), overrides)
        try:
            stack.start()
            http_latencies(stack.port, bodies, args.concurrency * 2, args.concurrency)  # warm-up
            sum_before, count_before = stack.server_latency()
            step_before, started = stack.model()["training"]["live_step"], time.perf_counter()
            latencies, versions = http_latencies(stack.port, bodies, args.requests, args.concurrency)
            elapsed = time.perf_counter() - started
            step_after = stack.model()["training"]["live_step"]
            sum_after, count_after = stack.server_latency()
        finally:
            stack.stop()

    single_p50, single_p99 = percentiles(bare_single)
    concurrent_p50, concurrent_p99 = percentiles(bare_concurrent)
    http_p50, http_p99 = percentiles(latencies)
    server_mean = (sum_after - sum_before) / max(1, count_after - count_before)
    tag = f"{BENCH}[{INSTANCES} instances, concurrency {args.concurrency}{''.join(f', {o}' for o in args.set)}]"
    rows = [
        Row(tag, "p50 s (HTTP while training vs bare forward)", http_p50, single_p50),
        Row(tag, "p99 s (HTTP while training vs bare forward)", http_p99, single_p99, "<= 3x bare forward"),
        Row(tag, f"p50 s (HTTP vs bare forward x{args.concurrency} threads)", http_p50, concurrent_p50),
        Row(tag, f"p99 s (HTTP vs bare forward x{args.concurrency} threads)", http_p99, concurrent_p99),
        Row(tag, f"p50 s (HTTP vs floor: {args.concurrency} x bare / {os.cpu_count()} cores)", http_p50,
            args.concurrency * single_p50 / (os.cpu_count() or 1)),
        Row(tag, "mean s (server side vs client side)", server_mean, float(np.mean(latencies))),
        Row(tag, f"requests/s (HTTP vs bare forward x{args.concurrency} threads)", args.requests / elapsed,
            len(bare_concurrent) / bare_wall),
        Row(tag, "pad share of predict micro-batches", predict_padding_share(batches, settings.token_budget)),
        Row(tag, "training steps/s during the load", (step_after - step_before) / elapsed),
        Row(tag, "model versions seen", len(versions)),
    ]  # fmt: skip
    emit(rows, args.json)


if __name__ == "__main__":
    main()
