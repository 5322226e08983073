"""Predict latency while the service trains, per route, against the bare model forward.

Routes: ``/v1/predict`` (JSON instances), and the Open Inference Protocol v2 route
``/v2/models/streamtrain/infer`` with JSON tensors (``oip-json``) and with the binary tensor
data extension (``oip-binary``: a JSON header, then the raw float32/int64 bytes; outputs
answered as raw bytes too). An OIP request carries the same instances as one padded
``values [32, longest, 1]`` tensor plus ``lengths [32]``. The routes are measured in
alternating phases (``--rounds``), so a slow stretch of training hits them alike.

The service runs as a real ``streamtrain serve`` process (default model and settings,
``torch_threads`` 1) on a unique topic of the local broker, fed by a ``streamtrain
simulate`` process, so the trainer thread steps all through the measurement. The load
generator sends ``--requests`` requests of 32 instances (lognormal lengths, median 48,
sigma 0.8, clipped to 4..512), ``--concurrency`` in flight at once from as many threads,
bodies pre-encoded so client work stays small, and times each request.

Baselines, on the same request batches, in this process, with the same model size and
thread count and no training going on: the bare forward
(:func:`streamtrain.model.inference.predict_arrays` with the service's predict forward,
compiled when ``COMPILE=on``) one call at a time, and the same forward called from
``--concurrency`` threads at once (what the cores can do for that many callers). The
service is measured once its forwards have compiled (its log says so); a row compares the
compiled bare forward with the eager one.
The server-side mean (the predict middleware's histogram, per phase) splits client and
network time from server time.

A floor the ratio cannot beat on this machine: with ``--concurrency`` requests always in
flight, Little's law makes latency = concurrency / throughput, and the cores cannot
finish more than ``cores / bare forward`` requests per second (perfect scaling, no
training, no HTTP). So the p50 is at least ``concurrency x bare p50 / cores``, i.e. the
ratio to the bare forward is at least ``concurrency / cores`` (4x for 8 requests on 2
cores) unless merging makes a request cheaper than its bare forward. The table prints
that floor next to the measured p50.

``--lengths fixed`` makes every instance 48 steps long (32 x 48 x 1 requests: no padding
in the OIP tensor); the default draws the lognormal mix.

``--device cuda`` puts the service and the bare forward on a GPU (with the GPU profile's
model and token budget, docs/accelerators.md); the bare forward is then the GPU forward.

``--in-process`` needs no broker (the GPU machine has none): the same FastAPI app
(:func:`streamtrain.serve.app.create_app`, with its predict batcher) over a
:class:`~streamtrain.runtime.service.Service` in this process, served by uvicorn on a thread, HTTP
over loopback as before; the trainer thread trains meanwhile on events a feeder thread
inserts straight into the window at ``--stream-rate`` (no Kafka, no ingest thread, no
prequential scoring). The load generator and the baselines are unchanged.

Needs the broker (``deploy/kafka.sh up``) unless ``--in-process``. Run:
``python bench/predict_latency.py [--in-process] [--device cpu|cuda] [--json]``.
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compile import wait_for_compiled  # noqa: E402
from _settings import add_set_option, service_settings  # noqa: E402
from _table import Row, emit  # noqa: E402

from streamtrain.config import Settings, load_settings  # noqa: E402
from streamtrain.device import describe  # noqa: E402
from streamtrain.model.inference import CompiledInference, plan_predict_batches, predict_arrays  # noqa: E402
from streamtrain.model.network import build_model  # noqa: E402
from streamtrain.model.normalization import RunningNorm  # noqa: E402

BENCH = "predict_latency"
INSTANCES = 32
#: The service's log line for each forward that compiled (or failed to): bench/_compile.py's wait, read from the log.
COMPILED = re.compile(r"forward compiled in|torch\.compile of the .* failed")
ROUTES = {"v1": "/v1/predict", "oip-json": "/v2/models/streamtrain/infer", "oip-binary": "/v2/models/streamtrain/infer"}
HEADER_LENGTH = "Inference-Header-Content-Length"


def lognormal_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    """The issue's mix: lognormal, median 48, sigma 0.8, clipped to 4..512."""
    return np.clip(np.round(rng.lognormal(math.log(48), 0.8, n)), 4, 512).astype(np.int64)


def request_batches(count: int, seed: int, fixed_length: int | None = None) -> list[list[np.ndarray]]:
    """``count`` distinct requests of 32 float32 [L, 1] instances (rounded as JSON would carry them)."""
    rng = np.random.default_rng(seed)
    return [
        [np.round(rng.standard_normal((int(n), 1)), 4).astype(np.float32)
         for n in (np.full(INSTANCES, fixed_length) if fixed_length else lognormal_lengths(INSTANCES, rng))]
        for _ in range(count)
    ]  # fmt: skip


Body = tuple[bytes, dict[str, str]]


def encode(batch: Sequence[np.ndarray]) -> Body:
    return orjson.dumps({"instances": [{"values": a[:, 0].tolist()} for a in batch]}), {
        "content-type": "application/json"
    }


def encode_oip(batch: Sequence[np.ndarray], binary: bool) -> Body:
    """One padded ``values [32, longest, 1]`` tensor and ``lengths [32]``, as tritonclient sends them."""
    lengths = np.array([len(a) for a in batch], dtype=np.int64)
    values = np.zeros((len(batch), int(lengths.max()), 1), dtype=np.float32)
    for i, a in enumerate(batch):
        values[i, : len(a)] = a
    tensors = [("values", "FP32", values), ("lengths", "INT64", lengths)]
    if not binary:
        body = {
            "inputs": [
                {"name": n, "datatype": t, "shape": list(a.shape), "data": a.ravel().tolist()} for n, t, a in tensors
            ]
        }
        return orjson.dumps(body), {"content-type": "application/json"}
    header = orjson.dumps({
        "inputs": [{"name": n, "datatype": t, "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
                   for n, t, a in tensors],
        "parameters": {"binary_data_output": True},
    })  # fmt: skip
    body = header + b"".join(a.tobytes() for _, _, a in tensors)
    return body, {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(header))}


def answered_version(content: bytes, headers: httpx.Headers) -> int:
    """The answering model version, from a /v1/predict or an OIP answer (JSON or binary)."""
    header = content[: int(headers[HEADER_LENGTH])] if HEADER_LENGTH in headers else content
    return int(orjson.loads(header)["model_version"])


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
            "STREAMTRAIN_LOG_LEVEL": "INFO",  # the log says when each forward has compiled
            **{f"STREAMTRAIN_{name.upper()}": value for name, value in overrides.items()},
        })  # fmt: skip
        self.env = env
        self.compiling = overrides.get("compile", "on") == "on"
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
        self.processes.append(subprocess.Popen(self.simulate_args, env=self.env, stdout=subprocess.DEVNULL, stderr=log))
        self._wait(lambda: self.client.get("/readyz").status_code == 200, timeout_s, "readiness")
        self._wait(lambda: self.model()["training"]["live_step"] >= 5, timeout_s, "5 training steps")
        if self.compiling:  # measured in the steady state: both forwards compiled (or failed: the log says)
            self._wait(lambda: len(COMPILED.findall(self.log.read_text())) >= 2, 900, "the forwards to compile")

    def _exited(self) -> str | None:
        """Why the service is gone, or None while it runs."""
        if self.processes[0].poll() is not None:
            return f"streamtrain serve exited: {self.log.read_text()[-2000:]}"
        return None

    def _wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            gone = self._exited()
            if gone is not None:
                raise RuntimeError(gone)
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
        """(sum of seconds, count) of streamtrain_predict_latency_seconds (every predict route)."""
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


class InProcessStack(Stack):
    """The real app over a Service in this process (uvicorn on a thread); a feeder thread
    inserts events into the window at ``stream_rate`` instead of Kafka and ingest."""

    def __init__(self, stream_rate: float, workdir: Path, overrides: dict[str, str]) -> None:
        import uvicorn

        from streamtrain.runtime.service import Service
        from streamtrain.serve.app import create_app

        self.port = _free_port()
        self.log = workdir / "serve.log"
        self.settings = load_settings(
            checkpoint_dir=workdir / "ckpt", http_host="127.0.0.1", log_level="WARNING", **overrides
        )
        self.service = Service(self.settings)
        self.stream_rate = stream_rate
        self.app = create_app(self.service)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._threads = [
            threading.Thread(target=self.server.run, name="uvicorn", daemon=True),
            threading.Thread(target=self._feed, name="feeder", daemon=True),
        ]
        self._stop = threading.Event()
        self._error: str | None = None
        self.processes = []
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)

    def _feed(self) -> None:
        """Events of the lognormal mix (noisy sinusoids, 64 sensors) at ``stream_rate``, in 20 ms ticks."""
        from streamtrain.events import EventBatch, SensorEvent

        rng = np.random.default_rng(1)
        try:
            # A first window's worth at once, so the trainer starts without waiting for the rate.
            owed, started = float(self.settings.min_window_items), time.monotonic()
            tick = 0
            while not self._stop.is_set():
                n, owed = int(owed), owed - int(owed)
                if n:
                    events = [
                        SensorEvent(f"sensor-{i % 64}", time.time(),
                                    (np.sin(rng.uniform(0.1, 0.8) * np.arange(length) + rng.uniform(0, 6.3))
                                     + 0.1 * rng.standard_normal(length)).astype(np.float32)[:, None])
                        for i, length in enumerate(lognormal_lengths(n, rng).tolist())
                    ]  # fmt: skip
                    self.service.window.insert_batch(EventBatch.from_events(events))
                tick += 1
                self._stop.wait(max(0.0, started + tick * 0.02 - time.monotonic()))
                owed += self.stream_rate * 0.02
        except Exception as err:  # noqa: BLE001 - reported by _wait
            self._error = f"feeder failed: {type(err).__name__}: {err}"

    def _exited(self) -> str | None:
        if self._error is not None:
            return self._error
        if self.service.trainer.last_error is not None:
            return f"trainer failed: {self.service.trainer.last_error}"
        return None

    def start(self, timeout_s: float = 120.0) -> None:
        self.service.trainer.start()
        for thread in self._threads:
            thread.start()
        self._wait(lambda: self._get("/healthz") is not None, timeout_s, "health")
        self._wait(lambda: self.service.published is not None, timeout_s, "a published model")
        self._wait(lambda: self.model()["training"]["live_step"] >= 5, timeout_s, "5 training steps")
        wait_for_compiled(self.service, self.app)

    def stop(self) -> None:
        self.client.close()
        self._stop.set()
        self.server.should_exit = True  # its shutdown stops the service (trainer, final checkpoint)
        for thread in self._threads:
            thread.join(60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_latencies(
    port: int, path: str, bodies: list[Body], total: int, concurrency: int
) -> tuple[list[float], set[int]]:
    local = threading.local()
    versions: set[int] = set()

    def one(i: int) -> float:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        content, headers = bodies[i % len(bodies)]
        started = time.perf_counter()
        response = client.post(path, content=content, headers=headers)
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"{path} answered {response.status_code}: {response.text[:300]}")
        versions.add(answered_version(response.content, response.headers))
        return elapsed

    return run_concurrently(one, total, concurrency), versions


# ---------------------------------------------------------------------- the bare forward
def bare_latencies(
    batches: list[list[np.ndarray]], total: int, concurrency: int, settings: Settings, compiled: bool
) -> tuple[list[float], float]:
    """Latencies of ``total`` bare forwards from ``concurrency`` callers, and the wall time of all
    (the service's model size, token budget and device; compiled as COMPILE=on compiles it)."""
    token_budget = settings.token_budget
    torch.manual_seed(0)
    model = build_model(settings).to(settings.device).eval().requires_grad_(False)
    norm = RunningNorm(settings.channels)
    forward = CompiledInference(model, enabled=compiled)  # the service's predict forward
    forward.compiled.wait()

    def one(i: int) -> float:
        started = time.perf_counter()
        predict_arrays(model, norm, batches[i % len(batches)], token_budget, forward=forward)
        return time.perf_counter() - started

    for i in range(4):
        one(i)
    started = time.perf_counter()
    latencies = [one(i) for i in range(total)] if concurrency == 1 else run_concurrently(one, total, concurrency)
    return latencies, time.perf_counter() - started


def predict_padding_share(batches: list[list[np.ndarray]], token_budget: int) -> float:
    """Share of pad positions in the micro-batches :func:`streamtrain.model.inference.predict` runs."""
    real = padded = 0
    for batch in batches:
        lengths = np.array([len(a) for a in batch], dtype=np.int64)
        for group in plan_predict_batches(lengths, token_budget):
            real += int(lengths[group].sum())
            padded += len(group) * int(lengths[group].max())
    return 1.0 - real / padded


@dataclass
class RouteRun:
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0
    server_seconds: float = 0.0
    server_count: int = 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("STREAMTRAIN_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--requests", type=int, default=160, help="HTTP requests measured per route")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurement phases per route")
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"comma separated, of {', '.join(ROUTES)}")
    parser.add_argument(
        "--lengths",
        choices=["lognormal", "fixed"],
        default="lognormal",
        help="lognormal mix (median 48) or every instance 48 steps",
    )
    parser.add_argument("--bare-calls", type=int, default=48, help="bare forward calls per baseline")
    parser.add_argument("--stream-rate", type=float, default=200.0, help="events/s the simulator sends meanwhile")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the bare forward (the service: 1)")
    add_set_option(parser)
    parser.add_argument("--device", default="cpu", help="DEVICE of the service and the bare forward (cpu, cuda, ...)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="no broker: the app over a Service in this process, events fed into its window",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    overrides = {"device": args.device, **service_settings(parser, args.set)}
    routes = [r for r in args.routes.split(",") if r]
    unknown = set(routes) - set(ROUTES)
    if unknown:
        parser.error(f"--routes: unknown {sorted(unknown)}; choose from {', '.join(ROUTES)}")

    torch.set_num_threads(args.threads)
    settings = load_settings(**overrides)  # what the service runs with (the GPU profile on a GPU)
    batches = request_batches(16, args.seed, 48 if args.lengths == "fixed" else None)
    bodies = {
        "v1": [encode(b) for b in batches],
        "oip-json": [encode_oip(b, binary=False) for b in batches],
        "oip-binary": [encode_oip(b, binary=True) for b in batches],
    }

    compiled = settings.compile == "on"
    bare_single, _ = bare_latencies(batches, args.bare_calls, 1, settings, compiled)
    bare_concurrent, bare_wall = bare_latencies(batches, args.bare_calls * 2, args.concurrency, settings, compiled)
    bare_eager = bare_latencies(batches, args.bare_calls, 1, settings, False)[0] if compiled else bare_single

    runs = {route: RouteRun() for route in routes}
    versions: set[int] = set()
    per_phase = max(args.concurrency, args.requests // max(1, args.rounds))
    with tempfile.TemporaryDirectory(prefix="bench-predict-") as workdir:
        if args.in_process:
            stack: Stack = InProcessStack(args.stream_rate, Path(workdir), overrides)
        else:
            stack = Stack(args.bootstrap, args.stream_rate, Path(workdir), overrides)
        try:
            stack.start()
            for route in routes:  # warm-up
                http_latencies(stack.port, ROUTES[route], bodies[route], args.concurrency * 2, args.concurrency)
            step_before, started = stack.model()["training"]["live_step"], time.perf_counter()
            for _ in range(args.rounds):
                for route in routes:
                    run = runs[route]
                    sum_before, count_before = stack.server_latency()
                    phase_started = time.perf_counter()
                    latencies, seen = http_latencies(
                        stack.port, ROUTES[route], bodies[route], per_phase, args.concurrency
                    )
                    run.seconds += time.perf_counter() - phase_started
                    sum_after, count_after = stack.server_latency()
                    run.latencies += latencies
                    run.server_seconds += sum_after - sum_before
                    run.server_count += count_after - count_before
                    versions |= seen
            elapsed = time.perf_counter() - started
            step_after = stack.model()["training"]["live_step"]
        finally:
            stack.stop()

    single_p50, single_p99 = percentiles(bare_single)
    concurrent_p50, concurrent_p99 = percentiles(bare_concurrent)
    cores = os.cpu_count() or 1
    floor_p50 = args.concurrency * single_p50 / cores
    floor_p99 = args.concurrency * single_p99 / cores
    shape = f"{INSTANCES} x {'48' if args.lengths == 'fixed' else 'lognormal(48)'} x 1"
    settings_tag = (
        "".join(f", {o}" for o in args.set)
        + (f", {settings.device}" if settings.device != "cpu" else "")
        + (", in-process" if args.in_process else "")
    )
    rows: list[Row] = []
    p50s: dict[str, tuple[float, float]] = {}
    for route in routes:
        run = runs[route]
        p50, p99 = percentiles(run.latencies)
        p50s[route] = (p50, p99)
        tag = f"{BENCH}[{route}, {shape}, concurrency {args.concurrency}{settings_tag}]"
        rows += [
            Row(tag, "p50 s (HTTP while training vs bare forward)", p50, single_p50),
            Row(
                tag,
                "p99 s (HTTP while training vs bare forward)",
                p99,
                single_p99,
                "<= 3x bare forward" if route == "v1" else "",
            ),
            Row(tag, f"p50 s (HTTP vs bare forward x{args.concurrency} threads)", p50, concurrent_p50),
            Row(tag, f"p99 s (HTTP vs bare forward x{args.concurrency} threads)", p99, concurrent_p99),
            *(
                []
                if settings.device != "cpu"
                else [
                    Row(
                        tag,
                        f"p50 s (HTTP vs floor: {args.concurrency} x bare / {cores} cores)",
                        p50,
                        floor_p50,
                        "<= 1.5x floor" if route == "v1" else "",
                    ),
                    Row(tag, f"p99 s (HTTP vs floor: {args.concurrency} x bare p99 / {cores} cores)", p99, floor_p99),
                ]
            ),
            Row(
                tag,
                "mean s (server side vs client side)",
                run.server_seconds / max(1, run.server_count),
                float(np.mean(run.latencies)),
            ),
            Row(
                tag,
                f"requests/s (HTTP vs bare forward x{args.concurrency} threads)",
                len(run.latencies) / run.seconds,
                len(bare_concurrent) / bare_wall,
            ),
        ]
    tag = f"{BENCH}[{shape}, concurrency {args.concurrency}{settings_tag}]"
    if "v1" in p50s:
        for route in ("oip-binary", "oip-json"):
            if route in p50s:
                target = "<= 1x /v1/predict" if route == "oip-binary" else ""
                rows.append(Row(tag, f"p50 s ({route} vs /v1/predict)", p50s[route][0], p50s["v1"][0], target))
                rows.append(Row(tag, f"p99 s ({route} vs /v1/predict)", p50s[route][1], p50s["v1"][1], target))
    rows += [
        Row(
            tag,
            f"bare forward p50 s, the service's (COMPILE={settings.compile}) vs eager",
            single_p50,
            percentiles(bare_eager)[0],
        ),
        Row(tag, "pad share of predict micro-batches", predict_padding_share(batches, settings.token_budget)),
        Row(tag, "training steps/s during the load", (step_after - step_before) / elapsed),
        Row(tag, "model versions seen", len(versions)),
    ]
    if not args.json:
        print(f"# device: {describe(torch.device(settings.device))}")
    emit(rows, args.json)


if __name__ == "__main__":
    main()
