"""Event-to-trained latency at 5k events/s, and publish-to-serving delay.

A :class:`streamtrain.runtime.service.Service` runs in this process against the local broker on a
unique topic, with its HTTP app served by uvicorn on a thread. ``--producers`` producer
processes send ``--rate`` events/s between them, paced in 20 ms ticks, from pre-encoded
bodies (lognormal lengths, ``--length-median``, sigma 0.8, clipped to 4..512) into which
only the timestamp is spliced (median 48, the length mix of the other benches): ``ts`` is
the wall clock when the event's tick is sent, plus a per-event microsecond slot so every
event's ``ts`` is unique and identifies it.

Observed inside the service, by wrapping methods on the instances:

* ``window.insert_batch``: when each event reached the window (ingest delay);
* ``trainer.train_step``: wall time at the end of each step and the ``ts`` of its batch;
  an event's *event-to-trained latency* is the end of the first step whose batch held it
  minus its ``ts``. The events measured are those sent in the measured interval (after
  ``--warmup-s``, for ``--measure-s``); the producers go on for ``--tail-s`` after it so
  its late events meet a steady pipeline. A CPU trainer cannot train every event at
  5k events/s, so two p50s are reported with the share trained: over the events trained
  before the run ended (survivors only, an optimistic figure), and over every measured
  event with the untrained ones counted as never trained (``inf`` when under half were
  trained: then no finite median exists);
* ``trainer.sampler``: which items each bounded pass took as *fresh* (new since the last
  pass) rather than as replay, to split the latency by path;
* ``trainer.registry.add``: which step each model version includes.

The trainer's and the ingest thread's share of the cores over the measured interval, from
the kernel's per-thread scheduler clocks (``/proc/self/task/*/schedstat``: time on a CPU,
and time runnable but waiting for one); ``train_cpus=auto`` in the default configs gives the
trainer a CPU of its own (``TRAIN_CPUS``).

*Publish-to-serving*: a poller sends a one-instance ``POST /v1/predict`` every 0.1 s and
records the ``model_version`` answered; for every optimizer step, the delay is the time
from the step's end until the first answer whose version includes that step.

Each ``--configs`` run (service settings, e.g. ``pass_max_items=256,pass_fresh_share=0.9``;
runs separated by ``;``) gets a fresh service and topic. Needs the broker
(``deploy/kafka.sh up``). Run: ``python bench/latency.py [--configs ...] [--json]``.

``--gil`` (needs ``py-spy``, in the ``bench`` extra, and the right to trace this process) also
samples, over the measured interval, which thread holds the interpreter lock (``py-spy record
--gil``: 100 samples a second, only the holder's stack) and reports each holder's share of the
wall clock: the trainer needs the lock between its kernels, so time others hold it is time the
trainer may wait (docs/performance.md, "Who holds the interpreter lock").

``--in-process --quality`` sends the feeder's batches through the quality monitor first (the
holdout's split, prequential scoring), as ingest does: everything ingest does in this
interpreter but Kafka's client and the decoding.

``--in-process`` needs no broker (the GPU machine has none): a feeder thread inserts the
same events (same lengths, same unique ``ts``, same 20 ms ticks) straight into the
service's window, and only the trainer and the HTTP app run (no Kafka, no ingest thread,
no prequential scoring), so the ingest delay is ~0 and the figure is the trainer's part
of the latency. ``--device cuda`` (any service setting: ``--configs``) trains on a GPU.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compile import wait_for_compiled  # noqa: E402
from _table import Row, emit  # noqa: E402

BENCH = "latency"
TICK_S = 0.02
DEFAULT_CONFIGS = "default;train_cpus=auto;pass_max_items=256,pass_fresh_share=0.9,token_budget=2048"
TS_SLOTS = 1000  # microsecond slots per millisecond: ts = floor(now, 1 ms) + slot * 1 us


# ---------------------------------------------------------------------- producers
def lognormal_lengths(n: int, median: float, rng: np.random.Generator) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), 0.8, n)), 4, 512).astype(np.int64)


def encoded_templates(count: int, median: float, seed: int) -> list[tuple[bytes, bytes, bytes]]:
    """(key, body before ts, body after ts) for ``count`` events of noisy sinusoids."""
    rng = np.random.default_rng(seed)
    out = []
    for i, length in enumerate(lognormal_lengths(count, median, rng).tolist()):
        sensor = f"sensor-{i % 64}"
        step = np.arange(length)
        signal = np.sin(rng.uniform(0.1, 0.8) * step + rng.uniform(0, 6.3)) + 0.1 * rng.standard_normal(length)
        values = np.round(signal, 3)
        tail = b',"values":[' + ",".join(map(str, values.tolist())).encode() + b"]}"
        out.append((sensor.encode(), b'{"sensor_id":"' + sensor.encode() + b'","ts":', tail))
    return out


def paced_ticks(
    per_tick: float, start_at: float, duration_s: float, stop: threading.Event | None = None
) -> Iterator[tuple[int, float]]:
    """(events due, millisecond timestamp base) every ``TICK_S`` from ``start_at`` for ``duration_s``
    (wall clock), carrying the fractional remainder from tick to tick; ends early on ``stop``."""
    owed, tick = 0.0, 0
    time.sleep(max(0.0, start_at - time.time()))
    while stop is None or not stop.is_set():
        due = start_at + tick * TICK_S
        if due >= start_at + duration_s:
            break
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)
        owed += per_tick
        n, owed = int(owed), owed - int(owed)
        yield n, math.floor(time.time() * 1000.0) / 1000.0
        tick += 1


def produce(
    bootstrap: str, topic: str, rate: float, start_at: float, duration_s: float, index: int, producers: int,
    median: float, results: Any,
) -> None:  # fmt: skip
    """One producer process: ``rate`` events/s from ``start_at`` for ``duration_s`` (wall clock)."""
    from kafka import KafkaProducer

    templates = encoded_templates(2048, median, seed=index)
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=512 << 10, acks=1)
    per_tick = rate * TICK_S
    if per_tick * producers > TS_SLOTS:
        raise ValueError(f"rate {rate}/s per producer needs more than {TS_SLOTS} ts slots per tick; add producers")
    sent = 0
    for n, base in paced_ticks(per_tick, start_at, duration_s):
        for j in range(n):
            key, head, tail = templates[(sent + j) % len(templates)]
            ts = b"%.6f" % (base + (j * producers + index) * 1e-6)
            producer.send(topic, key=key, value=head + ts + tail)
        sent += n
    elapsed = time.time() - start_at
    producer.flush(30)
    producer.close(10)
    results.put((index, sent, elapsed))


def feed(window: Any, rate: float, start_at: float, duration_s: float, median: float, results: list[Any],
         stop: threading.Event, observe: Any = None) -> None:  # fmt: skip
    """In-process stand-in for the producers: ``rate`` events/s into ``window``, ts as they stamp it;
    through ``observe`` first when given (the quality monitor, as ingest does: holdout, scoring)."""
    import json

    from streamtrain.events import EventBatch, SensorEvent

    templates = []
    for _, head, tail in encoded_templates(2048, median, seed=0):  # the producers' events, decoded once
        body = json.loads(head + b"0" + tail)
        templates.append((body["sensor_id"], np.asarray(body["values"], dtype=np.float32)[:, None]))
    per_tick = rate * TICK_S
    if per_tick > TS_SLOTS:
        raise ValueError(f"rate {rate}/s needs more than {TS_SLOTS} ts slots per tick")
    sent = 0
    for n, base in paced_ticks(per_tick, start_at, duration_s, stop):
        events = []
        for j in range(n):
            sensor, values = templates[(sent + j) % len(templates)]
            events.append(SensorEvent(sensor, base + j * 1e-6, values))
        if events:
            batch = EventBatch.from_events(events)
            to_window = batch if observe is None else observe(batch)
            if len(to_window):
                window.insert_batch(to_window, held_out=len(batch) - len(to_window))
            else:
                window.advance_offsets({}, held_out=len(batch))
        sent += n
    results.append((0, sent, time.time() - start_at))


# ---------------------------------------------------------------------- observation
@dataclass
class Observations:
    inserts: list[tuple[float, np.ndarray]] = field(default_factory=list)
    steps: list[tuple[float, int, np.ndarray, int, int]] = field(
        default_factory=list
    )  # end, step, ts, real, padded tokens
    fresh_ts: list[np.ndarray] = field(default_factory=list)
    publishes: list[tuple[int, int, float]] = field(default_factory=list)  # version, step, published_at
    answers: list[tuple[float, int]] = field(default_factory=list)  # answered at, model_version


class RecordingSampler:
    """Wraps the trainer's PassSampler; records the ts of the items a pass took as fresh."""

    def __init__(self, inner: Any, fresh_ts: list[np.ndarray]) -> None:
        self.inner = inner
        self.fresh_ts = fresh_ts

    def select(self, snapshot: Any, **kwargs: Any) -> Any:
        selection = self.inner.select(snapshot, **kwargs)
        self.fresh_ts.append(snapshot.ts[selection.fresh].copy())
        return selection

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def instrument(service: Any, seen: Observations) -> None:
    window, trainer = service.window, service.trainer
    insert, step, register = window.insert_batch, trainer.train_step, trainer.registry.add

    def recording_insert(batch: Any, *args: Any, **kwargs: Any) -> Any:
        report = insert(batch, *args, **kwargs)
        seen.inserts.append((time.time(), batch.ts.copy()))
        return report

    def recording_step(batch: Any) -> Any:
        report = step(batch)
        if report.applied:
            seen.steps.append(
                (time.time(), report.step, batch.ts.numpy().copy(), report.real_tokens, report.padded_tokens)
            )
        return report

    def recording_register(published: Any, *, serve: bool = True) -> None:
        # every version registered: a held-back candidate's refreshed version too
        register(published, serve=serve)
        seen.publishes.append((published.version, published.step, published.published_at))

    window.insert_batch = recording_insert
    trainer.train_step = recording_step
    trainer.registry.add = recording_register  # type: ignore[method-assign]
    trainer.sampler = trainer.dataset.sampler = RecordingSampler(trainer.sampler, seen.fresh_ts)


def poll_predictions(port: int, stop: threading.Event, seen: Observations, interval_s: float = 0.1) -> None:
    import httpx

    body = b'{"instances":[{"values":[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8]}]}'
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        while not stop.wait(interval_s):
            try:
                response = client.post("/v1/predict", content=body, headers={"content-type": "application/json"})
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                seen.answers.append((time.time(), int(response.json()["model_version"])))


def thread_clocks() -> dict[str, tuple[float, float]]:
    """Seconds on a CPU and seconds runnable but waiting for one, of each named thread of this
    process so far (Linux ``/proc/self/task/*/schedstat``; empty elsewhere)."""
    clocks: dict[str, tuple[float, float]] = {}
    for thread in threading.enumerate():
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()
            on_cpu, waiting = int(fields[0]) / 1e9, int(fields[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
        before = clocks.get(thread.name, (0.0, 0.0))
        clocks[thread.name] = (before[0] + on_cpu, before[1] + waiting)
    return clocks


def clock_threads(begin: float, end: float, into: dict[str, tuple[float, float]]) -> threading.Thread:
    """Fill ``into`` with each thread's cores on a CPU and cores runnable-but-waiting over the
    wall-clock interval [begin, end) (a thread alive at both ends)."""

    def run() -> None:
        time.sleep(max(0.0, begin - time.time()))
        first = thread_clocks()
        time.sleep(max(0.0, end - time.time()))
        last, span = thread_clocks(), max(1e-9, end - begin)
        for name, (on_cpu, waiting) in last.items():
            if name in first:
                into[name] = ((on_cpu - first[name][0]) / span, (waiting - first[name][1]) / span)

    clock = threading.Thread(target=run, name="bench-thread-clock", daemon=True)
    clock.start()
    return clock


#: who holds the interpreter lock, by the first of these found in a sampled stack (in this order)
LOCK_HOLDERS = (
    ("the holdout's split", ("HoldoutSplitter.split",)),
    ("ingest's apply: scoring, window, holdout buffer", ("Ingestor._apply",)),
    ("kafka-python: poll and its network thread", ("KafkaConsumer.poll", "NetworkSelector.run_forever")),
    ("the trainer's thread", ("ModelTrainer._run",)),
    ("HTTP, predict and the bench's poller", ("Server.run", "PredictBatcher", "poll_predictions")),
)


def py_spy() -> str | None:
    """py-spy beside this interpreter (a virtual environment's bin/) or on the PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def sample_lock_holders(begin: float, end: float, into: dict[str, float], rate: int = 100) -> threading.Thread:
    """Fill ``into`` with each holder's share of the wall clock in [begin, end), from ``py-spy
    record --gil`` on this process (raw stacks, one line per stack with its sample count)."""

    def run() -> None:
        time.sleep(max(0.0, begin - time.time()))
        seconds = max(1, round(end - begin))
        with tempfile.NamedTemporaryFile(suffix=".txt") as out:
            command = [
                str(py_spy()), "record", "--gil", "--nonblocking", "-r", str(rate), "-d", str(seconds),
                "-f", "raw", "-o", out.name, "-p", str(os.getpid()),
            ]  # fmt: skip
            subprocess.run(command, check=True, capture_output=True)
            samples = rate * seconds
            for line in Path(out.name).read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                holder = next((name for name, marks in LOCK_HOLDERS if any(m in stack for m in marks)), "other")
                into[holder] = into.get(holder, 0.0) + int(count) / samples

    sampler = threading.Thread(target=run, name="bench-lock-sampler", daemon=True)
    sampler.start()
    return sampler


# ---------------------------------------------------------------------- one run
@dataclass
class RunResult:
    label: str  # the settings that define the run
    produced_rate: float
    latencies: np.ndarray  # first-trained latency of each measured event that was trained
    fresh_path: np.ndarray  # bool, same order: first trained as a fresh item of its pass
    ingested: int  # measured events that reached the window
    ingest_delay: np.ndarray
    serving_delay: np.ndarray
    publish_delay: np.ndarray
    steps_per_s: float
    tokens_per_s: float
    padding_share: float
    compile_s: float = 0.0  # waited for the forwards to compile before the first event (COMPILE=on)
    thread_cores: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (on a CPU, runnable)
    lock_holders: dict[str, float] = field(default_factory=dict)  # holder -> share of the wall clock (--gil)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Any, timeout_s: float, what: str, service: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"waited {timeout_s:.0f}s for {what}: window {len(service.window)} items, "
                f"readiness {service.readiness()}, ingest error {service.ingest.last_error}"
            )
        time.sleep(0.05)


def run_once(args: argparse.Namespace, overrides: dict[str, str]) -> RunResult:
    import uvicorn

    from streamtrain.config import load_settings
    from streamtrain.ingest.topics import ensure_topics
    from streamtrain.runtime.service import Service
    from streamtrain.serve.app import create_app

    topic = f"bench-latency-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-latency-") as workdir:
        settings = load_settings(
            kafka_bootstrap=args.bootstrap, topic=topic, group_id=f"g-{topic}", checkpoint_dir=Path(workdir),
            http_host="127.0.0.1", **overrides,
        )  # fmt: skip
        if args.in_process:
            return run_in_process(args, overrides, settings)
        # The topic exists before anyone produces: a producer's metadata request must not
        # auto-create it with the broker's default partition count.
        ensure_topics(args.bootstrap, {topic: settings.topic_partitions, settings.dlq_topic: settings.topic_partitions})
        service = Service(settings)
        seen = Observations()
        instrument(service, seen)
        port = free_port()
        app = create_app(service)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        server_thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
        compile_s = wait_for_compiled(service, app)  # the steady state: compiled before the first event
        service.start()
        server_thread.start()
        wait_until(lambda: service.ingest.connected, 60, "the ingest consumer to connect", service)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        start_at = time.time() + args.producer_start_s
        # Producers keep sending after the measured interval, so late events of the interval
        # meet a steady pipeline (fresh events keep arriving) rather than a replay-only drain.
        duration = args.warmup_s + args.measure_s + args.tail_s
        cores: dict[str, tuple[float, float]] = {}
        clock_threads(start_at + args.warmup_s, start_at + args.warmup_s + args.measure_s, cores)
        holders: dict[str, float] = {}
        sampler = (
            sample_lock_holders(start_at + args.warmup_s, start_at + args.warmup_s + args.measure_s, holders)
            if args.gil
            else None
        )
        per_producer = args.rate / args.producers
        processes = [
            context.Process(
                target=produce,
                args=(
                    args.bootstrap,
                    topic,
                    per_producer,
                    start_at,
                    duration,
                    i,
                    args.producers,
                    args.length_median,
                    results,
                ),
            )
            for i in range(args.producers)
        ]
        stop_polling = threading.Event()
        poller = threading.Thread(target=poll_predictions, args=(port, stop_polling, seen), daemon=True)
        try:
            for process in processes:
                process.start()
            wait_until(lambda: service.published is not None, args.producer_start_s + args.warmup_s + 30,
                       "a first published model", service)  # fmt: skip
            poller.start()
            reports = [results.get(timeout=duration + 120) for _ in processes]
        finally:
            stop_polling.set()
            for process in processes:
                process.join(30)
            server.should_exit = True
            service.stop(final_checkpoint=False)
            server_thread.join(10)
    if not seen.steps:
        raise RuntimeError(
            f"no training step in the run: window {len(service.window)} items, trainer running "
            f"{service.trainer.running}, last error {service.trainer.last_error}, "
            f"ingest error {service.ingest.last_error}"
        )
    produced_rate = sum(sent for _, sent, _ in reports) / max(elapsed for _, _, elapsed in reports)
    shown = dict.fromkeys(("pass_max_items", "pass_fresh_share", *overrides))  # ordered, no repeats
    label = ", ".join(f"{name}={getattr(settings, name)}" for name in shown)
    begin = start_at + args.warmup_s
    result = analyse(seen, begin, begin + args.measure_s, label, produced_rate)
    if sampler is not None:
        sampler.join(30)
    return replace(result, compile_s=compile_s, thread_cores=cores, lock_holders=holders)


def run_in_process(args: argparse.Namespace, overrides: dict[str, str], settings: Any) -> RunResult:
    """:func:`run_once` with a feeder thread in place of Kafka, the producers and ingest."""
    import uvicorn

    from streamtrain.runtime.service import Service
    from streamtrain.serve.app import create_app

    service = Service(settings)
    seen = Observations()
    instrument(service, seen)
    port = free_port()
    app = create_app(service)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    server_thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    compile_s = wait_for_compiled(service, app)  # the steady state: compiled before the first event
    service.trainer.start()
    server_thread.start()
    start_at = time.time() + 1.0
    duration = args.warmup_s + args.measure_s + args.tail_s
    cores: dict[str, tuple[float, float]] = {}
    clock_threads(start_at + args.warmup_s, start_at + args.warmup_s + args.measure_s, cores)
    reports: list[Any] = []
    stop_feeding, stop_polling = threading.Event(), threading.Event()
    feeder = threading.Thread(
        target=feed,
        args=(service.window, args.rate, start_at, duration, args.length_median, reports, stop_feeding,
              service.trainer.quality.observe if args.quality and service.trainer.quality is not None else None),
        name="feeder", daemon=True,
    )  # fmt: skip
    poller = threading.Thread(target=poll_predictions, args=(port, stop_polling, seen), daemon=True)
    try:
        feeder.start()
        wait_until(lambda: service.published is not None, 1.0 + args.warmup_s + 30, "a first published model", service)
        poller.start()
        feeder.join(duration + 120)
    finally:
        stop_feeding.set()
        stop_polling.set()
        server.should_exit = True
        service.stop(final_checkpoint=False)
        server_thread.join(10)
    if not seen.steps or not reports:
        raise RuntimeError(f"no training step or no feed: trainer error {service.trainer.last_error}")
    produced_rate = sum(sent for _, sent, _ in reports) / max(elapsed for _, _, elapsed in reports)
    shown = dict.fromkeys(("pass_max_items", "pass_fresh_share", *overrides))
    label = ", ".join(f"{name}={getattr(settings, name)}" for name in shown) + ", in-process"
    label += ", through the quality monitor" if args.quality else ""
    begin = start_at + args.warmup_s
    result = analyse(seen, begin, begin + args.measure_s, label, produced_rate)
    return replace(result, compile_s=compile_s, thread_cores=cores)


def analyse(seen: Observations, begin: float, end: float, label: str, produced_rate: float) -> RunResult:
    in_interval = lambda ts: (ts >= begin) & (ts < end)  # noqa: E731

    insert_ts = np.concatenate([ts for _, ts in seen.inserts]) if seen.inserts else np.zeros(0)
    insert_at = np.concatenate([np.full(ts.size, at) for at, ts in seen.inserts]) if seen.inserts else np.zeros(0)
    measured = in_interval(insert_ts)
    ingest_delay = insert_at[measured] - insert_ts[measured]

    step_ts = np.concatenate([ts for _, _, ts, _, _ in seen.steps])
    step_end = np.concatenate([np.full(ts.size, end_at) for end_at, _, ts, _, _ in seen.steps])
    unique_ts, first = np.unique(step_ts, return_index=True)  # steps are in time order: first = first trained
    latency = step_end[first] - unique_ts
    keep = in_interval(unique_ts)
    fresh = np.concatenate(seen.fresh_ts) if seen.fresh_ts else np.zeros(0)
    fresh_path = np.isin(unique_ts[keep], fresh)

    # Publish-to-serving: each step in the interval -> first polled answer whose version includes it.
    version_step = {version: step for version, step, _ in seen.publishes}
    answers = sorted(seen.answers)
    answer_at = np.array([at for at, _ in answers])
    answer_step = np.array([version_step.get(v, -1) for _, v in answers])
    # The earliest answer at or after index i that includes step k: suffix max of steps answered.
    serving, publishing = [], []
    publishes = sorted(seen.publishes, key=lambda p: p[1])
    for done_at, step, _, _, _ in seen.steps:
        if not begin <= done_at < end:
            continue
        start = int(np.searchsorted(answer_at, done_at))
        hits = np.flatnonzero(answer_step[start:] >= step)
        if hits.size:
            serving.append(answer_at[start + hits[0]] - done_at)
        published = next((at for _, s, at in publishes if s >= step), None)
        if published is not None:
            publishing.append(published - done_at)

    steps_in = [s for s in seen.steps if begin <= s[0] < end]
    return RunResult(
        label=label,
        produced_rate=produced_rate,
        latencies=latency[keep],
        fresh_path=fresh_path,
        ingested=int(measured.sum()),
        ingest_delay=ingest_delay,
        serving_delay=np.asarray(serving),
        publish_delay=np.asarray(publishing),
        steps_per_s=len(steps_in) / (end - begin),
        tokens_per_s=sum(s[3] for s in steps_in) / (end - begin),
        padding_share=1.0 - sum(s[3] for s in steps_in) / max(1, sum(s[4] for s in steps_in)),
    )


def quantile(values: np.ndarray, q: float) -> float:
    """The q-quantile of the sample (an observed value: inf stays inf, no interpolation into it)."""
    return float(np.quantile(values, q, method="inverted_cdf")) if values.size else math.nan


def rows_for(result: RunResult, target_rate: float) -> list[Row]:
    tag = f"{BENCH}[{result.label}]"
    lat, fresh = result.latencies, result.fresh_path
    censored = np.concatenate([lat, np.full(max(0, result.ingested - lat.size), np.inf)])
    return [
        Row(tag, "producer events/s achieved", result.produced_rate, target_rate, ">= 5000"),
        Row(tag, "share of measured events trained before the run ended", lat.size / max(1, result.ingested)),
        Row(tag, "event-to-trained p50 s, trained events only", quantile(lat, 0.5), None, "<= 2 s"),
        Row(tag, "event-to-trained p90 s, trained events only", quantile(lat, 0.9)),
        Row(tag, "event-to-trained p50 s, all measured events (untrained = inf)", quantile(censored, 0.5)),
        Row(tag, "event-to-trained p50 s, fresh path", quantile(lat[fresh], 0.5)),
        Row(tag, "event-to-trained p50 s, replay path", quantile(lat[~fresh], 0.5)),
        Row(tag, "share of trained events on the fresh path", float(fresh.mean()) if fresh.size else math.nan),
        Row(tag, "events trained / events ingested (interval)", lat.size, result.ingested),
        Row(tag, "ingest delay p50 s (ts -> window)", quantile(result.ingest_delay, 0.5)),
        Row(tag, "ingest delay p90 s (ts -> window)", quantile(result.ingest_delay, 0.9)),
        Row(tag, "publish-to-serving p50 s", quantile(result.serving_delay, 0.5), None, "<= 5 s"),
        Row(tag, "publish-to-serving max s", quantile(result.serving_delay, 1.0), None, "<= 5 s"),
        Row(tag, "step end -> published p50 s", quantile(result.publish_delay, 0.5)),
        Row(tag, "training steps/s", result.steps_per_s),
        Row(tag, "real tokens trained/s", result.tokens_per_s),
        Row(tag, "padding share of trained batches", result.padding_share),
        Row(tag, "compile warm-up s, before the first event (COMPILE)", result.compile_s),
        *(
            Row(tag, f"{name} thread: cores {what} (measured interval)", result.thread_cores[name][i])
            for name in ("trainer", "ingest")
            if name in result.thread_cores
            for i, what in enumerate(("on a CPU", "runnable, waiting for a CPU"))
        ),
        *(
            Row(tag, f"interpreter lock held by {name}, share of wall clock", result.lock_holders[name])
            for name in [*(n for n, _ in LOCK_HOLDERS), "other"]
            if name in result.lock_holders
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("STREAMTRAIN_KAFKA_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--rate", type=float, default=5000.0, help="events/s, all producers together")
    parser.add_argument("--producers", type=int, default=2, help="producer processes")
    parser.add_argument("--length-median", type=float, default=48.0, help="median event length (sigma 0.8)")
    parser.add_argument(
        "--configs",
        default=DEFAULT_CONFIGS,
        help="runs separated by ';', each 'default' or service settings NAME=VALUE separated by ','",
    )
    parser.add_argument("--warmup-s", type=float, default=6.0, help="sent but not measured")
    parser.add_argument("--measure-s", type=float, default=20.0, help="events sent in this interval are measured")
    parser.add_argument("--tail-s", type=float, default=6.0, help="sent after the interval, not measured")
    parser.add_argument("--producer-start-s", type=float, default=3.0, help="lead time for producer processes")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="no broker: events fed straight into the window (the trainer's part of the latency)",
    )
    parser.add_argument(
        "--quality",
        action="store_true",
        help="with --in-process: the feeder's batches go through the quality monitor first, as ingest's do",
    )
    parser.add_argument("--gil", action="store_true", help="also sample who holds the interpreter lock (py-spy)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quality and not args.in_process:
        parser.error("--quality is for --in-process runs (through Kafka, ingest always goes through the monitor)")
    if args.gil and (args.in_process or py_spy() is None):
        parser.error("--gil samples a Kafka run with py-spy: install the bench extra (py-spy) and drop --in-process")

    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.ERROR)
    rows: list[Row] = []
    for config in args.configs.split(";"):
        overrides = dict(item.split("=", 1) for item in config.split(",") if item.strip() not in ("", "default"))
        rows += rows_for(run_once(args, {k.strip(): v.strip() for k, v in overrides.items()}), args.rate)
    emit(rows, args.json)


if __name__ == "__main__":
    main()
