"""Soak: ingest at a set rate, continuous training and predict load, for a set time.

Runs a real ``streamtrain serve`` process against the broker, feeds it from the
simulated fleet at ``--rate`` events/s, sends ``--predict-rps`` predict requests/s, and
every ``--sample-s`` records the service's RSS (whole process tree), the consumer lag,
the p99 predict latency of that interval, training steps and every kind of error. It
writes the samples (JSON) and a PNG plot, prints a table (``--json``: one object per
line) and exits non-zero when a budget is broken: any error, RSS growth after warm-up
over ``--max-rss-growth``, or a p99 that drifts by more than ``--max-p99-drift``.

The window is the service's default, 100k events; the warm-up lasts until it is full
(1.2 x capacity / rate, at least 20 s or 10% of the run), so memory is judged on a full
window. ``--realistic`` runs the service with its default model, batching and passes
(the small model otherwise keeps a short run cheap) at 5,000 events/s of median length
48, the rate and lengths of bench/latency.py, from ``--producers`` processes.

    python bench/soak.py                                    # ~4 min: 1,000 events/s, window filled, 2 min measured
    python bench/soak.py --duration-s 60 --rate 200 --window-capacity 2000   # the CI soak's settings
    python bench/soak.py --duration-s 1800                  # the 30-minute soak, 1,000 events/s
    python bench/soak.py --duration-s 1800 --realistic      # the 30-minute soak, 5,000 events/s

Needs the broker (``deploy/kafka.sh up``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _malloc import CHOICES, malloc_env  # noqa: E402
from _settings import add_set_option, service_settings  # noqa: E402
from _table import Row, emit  # noqa: E402

from streamtrain.ingest.topics import ensure_topics  # noqa: E402
from streamtrain.tools.simulate import run_simulation  # noqa: E402
from streamtrain.tools.simulation_config import SimulationConfig  # noqa: E402

# Error counters the service exposes; in a soak on a valid stream each must stay at 0.
SERVICE_ERROR_METRICS = {
    "checkpoint_failures": ("streamtrain_checkpoint_failures_total", {}),
    "checkpoints_corrupt": ("streamtrain_checkpoints_corrupt_total", {}),
    "dead_letters_failed": ("streamtrain_dead_letters_failed_total", {}),
    "skipped_steps_loss": ("streamtrain_train_skipped_steps_total", {"reason": "non_finite_loss"}),
    "skipped_steps_grad": ("streamtrain_train_skipped_steps_total", {"reason": "non_finite_grad"}),
}


@dataclass(frozen=True)
class SoakConfig:
    bootstrap: str = "127.0.0.1:9092"
    duration_s: float = 60.0  # measured time after the service is ready, warm-up included
    warmup_s: float = 20.0
    rate: float = 200.0  # events/s into Kafka
    predict_rps: float = 20.0
    predict_batch: int = 4
    predict_clients: int = 4  # concurrent clients sharing predict_rps
    sample_s: float = 2.0
    window_capacity: int = 100_000  # the service's default; the warm-up should cover its filling
    max_len: int = 64
    length_median: float = 24.0
    producers: int = 1  # simulator processes (one is a thread of this process)
    small_model: bool = True  # False: the service's default model, batching and passes
    checkpoint_interval_s: float = 5.0
    seed: int = 0
    out_dir: Path = Path("var/soak")
    service_env: dict[str, str] = field(default_factory=dict)  # extra STREAMTRAIN_* settings
    malloc: str = "auto"  # jemalloc as the image runs it when it can be had (bench/_malloc.py); "glibc" to compare


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    lag: float
    p99_ms: float | None
    predicts: int
    errors: int
    window_size: float
    train_steps: float
    events_accepted: float
    host_load: float  # 1-minute load average: on a shared machine, read p99 next to it
    forecaster: str  # what the serving version forecasts with (network, linear, blend, last_value)


@dataclass
class SoakReport:
    config: dict[str, Any]
    samples: list[Sample]
    errors: dict[str, int]
    rss_warm_mb: float
    rss_end_mb: float
    rss_growth: float  # relative, end vs just after warm-up
    warmup_end_s: float  # WARMUP_S, or later when the forwards compiled after it (their memory is warm-up)
    p99_first_ms: float
    p99_second_ms: float
    p99_drift: float  # second-half p99 / first-half p99 (after warm-up)
    lag_max: float
    lag_end: float
    events_sent: int
    events_accepted: float
    predicts: int
    train_steps: float
    plot: Path
    data: Path
    malloc: str = "glibc"  # what the service ran on
    # per forecaster that served: (first-half p99, second-half p99, predicts in each half)
    p99_by_forecaster: dict[str, tuple[float, float, int, int]] = field(default_factory=dict)

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())


class _Service:
    """``streamtrain serve`` as a subprocess with its own port, topic and checkpoints."""

    def __init__(self, config: SoakConfig, topic: str, workdir: Path) -> None:
        with __import__("socket").socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        settings = {
            "KAFKA_BOOTSTRAP": config.bootstrap, "TOPIC": topic, "GROUP_ID": f"g-{topic}",
            "HTTP_HOST": "127.0.0.1", "HTTP_PORT": str(self.port), "CHECKPOINT_DIR": str(workdir / "ckpt"),
            "CHECKPOINT_INTERVAL_S": str(config.checkpoint_interval_s), "WINDOW_CAPACITY": str(config.window_capacity),
            "MAX_LEN": str(config.max_len), "HALF_LIFE_S": "600", "SEED": str(config.seed),
            **({"D_MODEL": "32", "N_HEADS": "2", "N_LAYERS": "1", "TOKEN_BUDGET": "2048", "MIN_WINDOW_ITEMS": "32",
                "PUBLISH_INTERVAL_S": "1"} if config.small_model else {}),
            **config.service_env,
        }  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
        env.update({f"STREAMTRAIN_{k}": v for k, v in settings.items()})
        self.malloc, preload = malloc_env(config.malloc)
        env.update(preload)
        self.log_path = workdir / "serve.log"
        self._compiled = False
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "streamtrain.cli", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"service exited with {self.process.returncode}; see {self.log_path}")
            try:
                if self.client.get("/readyz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"service not ready after {timeout_s}s; see {self.log_path}")

    def forwards_compiled(self) -> bool:
        """Whether the training and the predict forward have compiled (or fallen back to eager):
        torch.compile's one-time memory belongs to the warm-up, not to growth."""
        if not self._compiled:  # read the log until it says so, not every sample of a long run
            text = self.log_path.read_text(errors="replace")
            self._compiled = text.count(" compiled in ") + text.count("failed, running eager") >= 2
        return self._compiled

    def rss_bytes(self) -> int:
        """RSS of the service and its children (the decode worker belongs to it)."""
        try:
            root = psutil.Process(self.process.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            return 0

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = self.client.get("/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): float(s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self) -> int:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.client.close()
        return int(self.process.returncode)


def _metric(metrics: dict, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.get((name, tuple(sorted((labels or {}).items()))), 0.0)


def _serving_forecaster(metrics: dict) -> str:
    """The forecaster of ``streamtrain_model_forecaster`` set to 1 ("" before the first version)."""
    serving = [dict(labels)["forecaster"] for (name, labels), v in metrics.items()
               if name == "streamtrain_model_forecaster" and v == 1]  # fmt: skip
    return serving[0] if serving else ""


class _PredictLoad:
    """Predict requests at a fixed total rate from ``clients`` threads; latencies and failures recorded.

    Several clients, each paced at ``rps / clients`` on its own schedule, so the offered rate does not
    fall whenever one answer is slow: one sequential client measures its own latency, not the load served.
    """

    def __init__(self, base_url: str, rps: float, batch: int, max_len: int, seed: int, clients: int = 4) -> None:
        self.base_url = base_url
        self.interval = clients / rps if rps > 0 else math.inf
        self.batch, self.max_len, self.seed = batch, max_len, seed
        self.latencies: list[float] = []  # since the last take()
        self.count = 0
        self.errors: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"predict-load-{i}", daemon=True) for i in range(clients)
        ]

    def _body(self, rng: np.random.Generator) -> dict[str, Any]:
        lengths = rng.integers(1, self.max_len + 1, self.batch)
        return {
            "instances": [{"values": np.round(np.cumsum(rng.standard_normal(int(n))), 4).tolist()} for n in lengths]
        }

    def _run(self, index: int) -> None:
        rng = np.random.default_rng([self.seed, index])
        # the clients start spread over one interval, so their requests interleave
        next_at = time.monotonic() + index * self.interval / len(self._threads)
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            while not self._stop.is_set():
                body = self._body(rng)
                started = time.perf_counter()
                try:
                    response = client.post("/v1/predict", json=body)
                    failure = (
                        None
                        if response.status_code == 200 and len(response.json()["predictions"]) == self.batch
                        else f"predict_{response.status_code}"
                    )
                except httpx.HTTPError as err:
                    failure = f"predict_{type(err).__name__}"
                elapsed = time.perf_counter() - started
                with self._lock:
                    self.count += 1
                    self.latencies.append(elapsed)
                    if failure:
                        self.errors[failure] += 1
                next_at += self.interval
                self._stop.wait(max(0.0, next_at - time.monotonic()))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def take(self) -> list[float]:
        with self._lock:
            taken, self.latencies = self.latencies, []
        return taken

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def _p99_ms(latencies: list[float]) -> float | None:
    return float(np.percentile(latencies, 99) * 1000) if latencies else None


def run_soak(config: SoakConfig) -> SoakReport:
    """Run one soak and return its report (the PNG and JSON are written to ``out_dir``)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    topic = f"soak-{uuid.uuid4().hex[:8]}"
    ensure_topics(config.bootstrap, {topic: 3, f"{topic}.dlq": 3})
    workdir = Path(tempfile.mkdtemp(prefix="soak-", dir=out_dir))
    service = _Service(config, topic, workdir)
    stop_producing = threading.Event()
    simulation: dict[str, Any] = {}
    sim_config = SimulationConfig(
        bootstrap=config.bootstrap, topic=topic, rate=config.rate / config.producers, sensors=32,
        length_median=config.length_median, length_sigma=0.6 if config.small_model else 0.8, max_len=config.max_len,
        process="mixed", seed=config.seed, progress_interval_s=3600,
    )  # fmt: skip
    sent_by_helpers = multiprocessing.get_context("spawn").Queue()

    def produce() -> None:
        try:
            simulation["report"] = run_simulation(sim_config, stop=stop_producing)
        except Exception as err:  # noqa: BLE001 - reported as a soak error
            simulation["error"] = f"{type(err).__name__}: {err}"

    producer = threading.Thread(target=produce, name="producer", daemon=True)
    helpers = [
        multiprocessing.get_context("spawn").Process(
            target=_produce_in_process,
            args=(sim_config.model_copy(update={"seed": config.seed + i}), config.duration_s + 600, sent_by_helpers),
            daemon=True,
        )
        for i in range(1, config.producers)
    ]
    load = _PredictLoad(
        f"http://127.0.0.1:{service.port}",
        config.predict_rps,
        config.predict_batch,
        config.max_len,
        config.seed,
        config.predict_clients,
    )
    samples: list[Sample] = []
    compiles = config.service_env.get("COMPILE", "on") != "off"
    warmup_end_s = config.warmup_s
    errors: Counter[str] = Counter()
    all_latencies: list[tuple[float, float]] = []
    try:
        producer.start()
        for helper in helpers:
            helper.start()
        service.wait_ready()
        load.start()
        started = time.monotonic()
        next_sample = started + config.sample_s
        while time.monotonic() - started < config.duration_s:
            time.sleep(max(0.0, next_sample - time.monotonic()))
            next_sample += config.sample_s
            t = time.monotonic() - started
            if not service.alive():
                errors["service_exited"] += 1
                break
            try:
                metrics = service.metrics()
            except httpx.HTTPError:
                errors["metrics_scrape"] += 1
                continue
            if compiles and not service.forwards_compiled():
                warmup_end_s = max(warmup_end_s, t + config.sample_s)
            latencies = load.take()
            all_latencies.extend((t, x) for x in latencies)
            for name, (metric, labels) in SERVICE_ERROR_METRICS.items():
                errors[name] = int(_metric(metrics, metric, labels))
            errors["rejected_events"] = int(
                sum(v for (n, _), v in metrics.items() if n == "streamtrain_events_rejected_total")
            )
            if _metric(metrics, "streamtrain_kafka_connected") != 1:
                errors["kafka_disconnected_samples"] += 1
            samples.append(
                Sample(
                    t_s=round(t, 2),
                    rss_mb=service.rss_bytes() / 2**20,
                    lag=_metric(metrics, "streamtrain_consumer_lag_messages"),
                    p99_ms=_p99_ms(latencies),
                    predicts=len(latencies),
                    errors=sum(load.errors.values()) + errors["metrics_scrape"],
                    window_size=_metric(metrics, "streamtrain_window_size"),
                    train_steps=_metric(metrics, "streamtrain_train_steps_total"),
                    events_accepted=_metric(metrics, "streamtrain_events_accepted_total"),
                    host_load=os.getloadavg()[0],
                    forecaster=_serving_forecaster(metrics),
                )
            )
    finally:
        load.stop()
        stop_producing.set()
        producer.join(60)
        for helper in helpers:
            helper.terminate()  # SIGTERM: the helper's simulation stops, flushes and reports
        helper_sent = sum(_drain(sent_by_helpers, len(helpers)))
        for helper in helpers:
            helper.join(30)
        exit_code = service.stop()
        _delete_topics(config.bootstrap, [topic, f"{topic}.dlq"])
    errors.update(load.errors)
    report_sim = simulation.get("report")
    errors["producer_errors"] = int(report_sim.delivery_errors) if report_sim is not None else 1
    if "error" in simulation:
        errors["producer_crashed"] += 1
    if exit_code != 0:  # SIGTERM ends a service with 0 after its final checkpoint
        errors["service_exit_code"] = 1
    sent = (report_sim.sent if report_sim else 0) + helper_sent
    if warmup_end_s >= config.duration_s:
        errors["compiled_after_the_run"] += 1  # no steady phase to measure
    return _summarize(config, samples, dict(errors), all_latencies, sent, out_dir, stamp, service.malloc, warmup_end_s)


def _produce_in_process(sim_config: SimulationConfig, limit_s: float, sent: Any) -> None:
    """A helper producer process: simulate until SIGTERM (or ``limit_s``), then report what it sent."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Timer(limit_s, stop.set).start()
    report = run_simulation(sim_config, stop=stop)
    sent.put(int(report.sent))
    sent.close()
    sent.join_thread()  # the queue's feeder thread has written it before we leave
    os._exit(0)  # the timer thread must not keep the process


def _drain(queue: Any, count: int, timeout_s: float = 60.0) -> list[int]:
    out = []
    for _ in range(count):
        try:
            out.append(int(queue.get(timeout=timeout_s)))
        except Exception:  # noqa: BLE001 - a helper that did not report counts as nothing sent
            out.append(0)
    return out


def _delete_topics(bootstrap: str, topics: list[str]) -> None:
    from kafka.admin import KafkaAdminClient

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15000)
        try:
            admin.delete_topics(topics, timeout_ms=15000)
        finally:
            admin.close()
    except Exception:  # noqa: BLE001 - cleanup is best effort
        pass


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan


def _summarize(
    config: SoakConfig,
    samples: list[Sample],
    errors: dict[str, int],
    latencies: list[tuple[float, float]],
    sent: int,
    out_dir: Path,
    stamp: str,
    malloc: str,
    warmup_end_s: float,
) -> SoakReport:
    steady = [s for s in samples if s.t_s >= warmup_end_s]
    edge = max(1, min(3, len(steady) // 4))  # medians of a few samples: one GC blip is not growth
    rss_warm = _median([s.rss_mb for s in steady[:edge]])
    rss_end = _median([s.rss_mb for s in steady[-edge:]])
    middle = warmup_end_s + (config.duration_s - warmup_end_s) / 2
    first = [x for t, x in latencies if warmup_end_s <= t < middle]
    second = [x for t, x in latencies if t >= middle]
    p99_first = _p99_ms(first) or math.nan
    p99_second = _p99_ms(second) or math.nan
    by_forecaster = _p99_by_forecaster(samples, latencies, warmup_end_s, middle)
    data_path = out_dir / f"soak-{stamp}.json"
    plot_path = out_dir / f"soak-{stamp}.png"
    report = SoakReport(
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        samples=samples,
        errors={k: v for k, v in sorted(errors.items())},
        malloc=malloc,
        rss_warm_mb=rss_warm,
        rss_end_mb=rss_end,
        rss_growth=(rss_end - rss_warm) / rss_warm if rss_warm > 0 else math.nan,
        warmup_end_s=warmup_end_s,
        p99_first_ms=p99_first,
        p99_second_ms=p99_second,
        p99_drift=p99_second / p99_first if p99_first > 0 else math.nan,
        p99_by_forecaster=by_forecaster,
        lag_max=max((s.lag for s in steady), default=math.nan),
        lag_end=samples[-1].lag if samples else math.nan,
        events_sent=sent,
        events_accepted=samples[-1].events_accepted if samples else 0.0,
        predicts=sum(s.predicts for s in samples),
        train_steps=samples[-1].train_steps if samples else 0.0,
        plot=plot_path,
        data=data_path,
    )
    data_path.write_text(
        json.dumps({**asdict(report), "plot": str(plot_path), "data": str(data_path)}, indent=1, default=str)
    )
    _plot(report, config, plot_path)
    return report


def _p99_by_forecaster(
    samples: list[Sample], latencies: list[tuple[float, float]], start: float, middle: float
) -> dict[str, tuple[float, float, int, int]]:
    """Each half's p99 per forecaster that served: a predict of the network costs more than one
    of the linear forecaster, so a half served mostly by one and a half served by the other
    differ in p99 without anything drifting. A predict counts for the forecaster of the sample
    that closes its interval."""
    ends = [s.t_s for s in samples]
    split: dict[str, tuple[list[float], list[float]]] = {}
    for t, latency in latencies:
        if t < start or not samples:
            continue
        kind = samples[min(bisect.bisect_left(ends, t), len(samples) - 1)].forecaster or "none"
        split.setdefault(kind, ([], []))[t >= middle].append(latency)
    return {
        kind: (_p99_ms(first) or math.nan, _p99_ms(second) or math.nan, len(first), len(second))
        for kind, (first, second) in sorted(split.items())
    }


def _plot(report: SoakReport, config: SoakConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t_s / 60 for s in report.samples]
    panels = [
        ("RSS (MiB, service + children)", [s.rss_mb for s in report.samples]),
        ("consumer lag (messages)", [s.lag for s in report.samples]),
        ("predict p99 per interval (ms)", [math.nan if s.p99_ms is None else s.p99_ms for s in report.samples]),
        ("errors (cumulative, client side)", [s.errors for s in report.samples]),
        (f"host load, 1-min avg ({os.cpu_count()} CPUs)", [s.host_load for s in report.samples]),
    ]
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 11), sharex=True)
    for axis, (title, values) in zip(axes, panels):
        axis.plot(t, values, marker=".", linewidth=1)
        axis.axvspan(0, report.warmup_end_s / 60, color="0.9", label="warm-up")
        axis.set_ylabel(title, fontsize=8)
        axis.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel("minutes")
    figure.suptitle(
        f"streamtrain soak: {config.rate:g} ev/s, {config.predict_rps:g} predict/s, {config.duration_s / 60:.1f} min — "
        f"RSS growth {report.rss_growth:+.1%}, p99 drift {report.p99_drift:.2f}x, errors {report.error_total}",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def report_rows(report: SoakReport, max_rss_growth: float, max_p99_drift: float) -> list[Row]:
    return [
        Row("soak", f"malloc: {report.malloc}", 1),
        Row("soak", "errors", report.error_total, 0, "== 0"),
        Row("soak", "rss_growth_after_warmup", report.rss_growth, max_rss_growth, f"< {max_rss_growth:.0%}"),
        Row("soak", "rss_end_mb", report.rss_end_mb, report.rss_warm_mb),
        Row("soak", "p99_ms_second_half", report.p99_second_ms, report.p99_first_ms, f"drift < {max_p99_drift:g}x"),
        *(
            Row("soak", f"p99_ms_second_half, {kind} serving ({n1}+{n2} predicts)", second, first)
            for kind, (first, second, n1, n2) in report.p99_by_forecaster.items()
        ),
        Row("soak", "lag_max_messages", report.lag_max),
        Row("soak", "lag_end_messages", report.lag_end),
        Row("soak", "events/s sent vs asked", report.events_sent / report.config["duration_s"], report.config["rate"]),
        Row("soak", "window_capacity", report.config["window_capacity"]),
        Row("soak", "events_sent", report.events_sent),
        Row("soak", "events_accepted", report.events_accepted, report.events_sent),
        Row("soak", "predict_requests", report.predicts),
        Row("soak", "train_steps", report.train_steps),
    ]


def budget_failures(report: SoakReport, max_rss_growth: float, max_p99_drift: float) -> list[str]:
    failures = []
    if report.error_total:
        failures.append(f"errors: { ({k: v for k, v in report.errors.items() if v}) }")
    if not report.rss_growth < max_rss_growth:
        failures.append(f"RSS grew {report.rss_growth:.1%} after warm-up (budget {max_rss_growth:.0%})")
    if not report.p99_drift < max_p99_drift:
        failures.append(f"p99 drifted {report.p99_drift:.2f}x (budget {max_p99_drift:g}x)")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = SoakConfig()
    parser.add_argument("--bootstrap", default=os.environ.get("STREAMTRAIN_KAFKA_BOOTSTRAP", defaults.bootstrap))
    parser.add_argument(
        "--duration-s", type=float, default=None, help="measured seconds, warm-up included (default: warm-up + 120 s)"
    )
    parser.add_argument(
        "--warmup-s", type=float, default=None,
        help="default: until the window is full (1.2 x capacity / rate), at least 20 s or 10%% of the run",
    )  # fmt: skip
    parser.add_argument(
        "--rate", type=float, default=None, help="events per second into Kafka (default 1000; 5000 --realistic)"
    )
    parser.add_argument(
        "--realistic", action="store_true",
        help="5,000 events/s of median length 48 into the service's default model, batching and passes",
    )  # fmt: skip
    parser.add_argument("--producers", type=int, default=None, help="simulator processes (default 1; 3 --realistic)")
    parser.add_argument("--predict-rps", type=float, default=defaults.predict_rps)
    parser.add_argument("--predict-batch", type=int, default=defaults.predict_batch)
    parser.add_argument(
        "--predict-clients", type=int, default=defaults.predict_clients, help="concurrent clients sharing the rate"
    )
    parser.add_argument("--sample-s", type=float, default=None, help="default: 2 s, or duration/300 for long runs")
    parser.add_argument("--window-capacity", type=int, default=defaults.window_capacity)
    parser.add_argument("--out", type=Path, default=defaults.out_dir, help="where the PNG and JSON go")
    parser.add_argument("--max-rss-growth", type=float, default=0.05, help="budget: relative RSS growth after warm-up")
    parser.add_argument("--max-p99-drift", type=float, default=1.5, help="budget: second-half p99 / first-half p99")
    parser.add_argument(
        "--malloc",
        choices=CHOICES,
        default=defaults.malloc,
        help="the service's malloc: jemalloc preloaded as in the image (deploy/jemalloc.sh), glibc's, or auto",
    )
    add_set_option(parser)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    settings = {name.upper(): value for name, value in service_settings(parser, args.set).items()}
    rate = args.rate if args.rate is not None else (5000.0 if args.realistic else 1000.0)
    producers = args.producers if args.producers is not None else (3 if args.realistic else 1)
    fill_s = 1.2 * args.window_capacity / rate
    if args.duration_s is None:
        args.duration_s = (args.warmup_s if args.warmup_s is not None else max(fill_s, 20.0)) + 120.0
    warmup = (
        args.warmup_s
        if args.warmup_s is not None
        else max(fill_s, 20.0 if args.duration_s <= 200 else 0.1 * args.duration_s)
    )
    if warmup >= args.duration_s:
        parser.error(
            f"the warm-up ({warmup:.0f} s: the window of {args.window_capacity} fills in {fill_s:.0f} s at {rate:g}/s) "
            f"leaves nothing to measure in {args.duration_s:g} s; run longer, or set --window-capacity or --rate"
        )
    sample = args.sample_s if args.sample_s is not None else max(2.0, args.duration_s / 300)
    config = SoakConfig(
        bootstrap=args.bootstrap, duration_s=args.duration_s, warmup_s=warmup, rate=rate,
        predict_rps=args.predict_rps, predict_batch=args.predict_batch, predict_clients=args.predict_clients,
        sample_s=sample,
        window_capacity=args.window_capacity, out_dir=args.out, producers=producers,
        length_median=48.0 if args.realistic else defaults.length_median, small_model=not args.realistic,
        max_len=512 if args.realistic else defaults.max_len, malloc=args.malloc,
        service_env=settings,
    )  # fmt: skip
    report = run_soak(config)
    emit(report_rows(report, args.max_rss_growth, args.max_p99_drift), args.json)
    failures = budget_failures(report, args.max_rss_growth, args.max_p99_drift)
    if not args.json:
        print(f"plot: {report.plot}\ndata: {report.data}")
        for failure in failures:
            print(f"BUDGET BROKEN: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
