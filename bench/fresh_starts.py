"""Fresh starts: the README's first run, again and again, on the conditions that used to stall it.

Each start does what a new user's first run meets at its worst: its own broker is
restarted with its data kept after ``sensor-events`` (and its ``.dlq``) were deleted, so
the service creates the topic again; then ``streamtrain serve --config
services/trainer/trainer.toml`` starts with an empty checkpoint directory, and
``streamtrain simulate --config services/sensor-sim/sensor-sim.toml`` (as
``scripts/run-local.sh`` runs it, 2% malformed) sends ``--events`` messages. A start
counts as ingested when ``/v1/window`` has read every one of them within
``--catch-up-s`` after the simulator finished. Before the fix, 3 in 10 such starts
stalled for good.

    python bench/fresh_starts.py                 # 20 starts: 15-30 minutes on a loaded 2-core machine
    python bench/fresh_starts.py --starts 3      # a quick look

Needs Java and the Kafka jars (``deploy/kafka.sh``); it runs its own broker on a free
port and never touches the one on 9092.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from kafka.admin import KafkaAdminClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _kafka import REPO, Broker, free_port  # noqa: E402
from _table import Row, emit  # noqa: E402

TOPIC = "sensor-events"


@dataclass
class Start:
    number: int
    ingested: bool = False
    seen: int = 0
    ready_s: float | None = None  # service start -> /readyz 200
    catch_up_s: float | None = None  # simulator done -> every message read
    restarts: dict[str, int] = field(default_factory=dict)
    log: str = ""


def delete_topics(bootstrap: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30000)
    try:
        doomed = [t for t in (TOPIC, f"{TOPIC}.dlq") if t in set(admin.list_topics())]
        if doomed:
            admin.delete_topics(doomed, timeout_ms=30000)
        deadline = time.monotonic() + 60
        while set(doomed) & set(admin.list_topics()) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        admin.close()


def one_start(number: int, broker: Broker, workdir: Path, events: int, rate: float, catch_up_s: float) -> Start:
    result = Start(number)
    delete_topics(broker.bootstrap)
    broker.restart()  # data kept, the topic gone: the service creates it again
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    env.update({
        "STREAMTRAIN_KAFKA_BOOTSTRAP": broker.bootstrap, "STREAMTRAIN_HTTP_PORT": str(port),
        "STREAMTRAIN_HTTP_HOST": "127.0.0.1", "STREAMTRAIN_CHECKPOINT_DIR": str(workdir / f"ckpt-{number}"),
    })  # fmt: skip
    log_path = workdir / f"serve-{number}.log"
    result.log = str(log_path)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    started = time.monotonic()
    with open(log_path, "ab") as log:
        service = subprocess.Popen(
            [sys.executable, "-m", "streamtrain.cli", "serve", "--config", str(REPO / "services/trainer/trainer.toml")],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if service.poll() is not None:
                raise RuntimeError(f"start {number}: the service exited ({service.returncode}); see {log_path}")
            try:
                if client.get("/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "streamtrain.cli",
                "simulate",
                "--config",
                str(REPO / "services/sensor-sim/sensor-sim.toml"),
                "--bootstrap",
                broker.bootstrap,
                "--rate",
                str(rate),
                "--malformed-share",
                "0.02",
                "--count",
                str(events),
                "--progress-interval-s",
                "3600",
            ],
            env=env,
            check=True,
            timeout=600,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        sent_at = time.monotonic()
        while time.monotonic() - sent_at < catch_up_s:
            try:
                window = client.get("/v1/window").json()
                result.seen = int(window["seen_total"])
                result.restarts = {k: v for k, v in window.get("ingest_restarts_total", {}).items() if v}
                if result.ready_s is None and client.get("/readyz").status_code == 200:
                    result.ready_s = time.monotonic() - started
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if result.seen >= events:
                result.ingested = True
                result.catch_up_s = time.monotonic() - sent_at
                break
            time.sleep(0.5)
    finally:
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(60)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait(10)
        client.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--events", type=int, default=1000, help="messages the simulator sends per start")
    parser.add_argument("--rate", type=float, default=200.0, help="simulator events/s (run-local's default)")
    parser.add_argument(
        "--catch-up-s", type=float, default=60.0, help="after the simulator: time to read every message"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the work directory (logs) here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fresh-starts-"))
    workdir.mkdir(parents=True, exist_ok=True)
    broker = Broker(workdir / "kafka")
    results: list[Start] = []
    try:
        broker.up()
        for number in range(1, args.starts + 1):
            result = one_start(number, broker, workdir, args.events, args.rate, args.catch_up_s)
            results.append(result)
            print(
                f"start {number:2d}: {'ingested' if result.ingested else 'STALLED '} {result.seen}/{args.events} read"
                + (
                    f", caught up {result.catch_up_s:.1f} s after the simulator"
                    if result.catch_up_s is not None
                    else ""
                )
                + (f", watchdog restarts {result.restarts}" if result.restarts else "")
                + ("" if result.ingested else f" (log: {result.log})"),
                file=sys.stderr,
                flush=True,
            )
    finally:
        broker.down()
    ingested = sum(r.ingested for r in results)
    catch_ups = [r.catch_up_s for r in results if r.catch_up_s is not None]
    restarts = sum(sum(r.restarts.values()) for r in results)
    rows = [
        Row("fresh_starts", "starts", float(len(results))),
        Row("fresh_starts", "ingested every message", float(ingested), target=f"= {len(results)}"),
        Row("fresh_starts", "stalled", float(len(results) - ingested), target="0"),
        Row("fresh_starts", "catch-up after the simulator, max s", max(catch_ups) if catch_ups else float("nan")),
        Row("fresh_starts", "watchdog restarts, total", float(restarts)),
    ]
    emit(rows, args.json)
    return 0 if ingested == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
