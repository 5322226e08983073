"""Run ``streamtrain serve`` as a real process for end-to-end tests (and kill it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from kafka_helpers import free_port, wait_for

FAST_MODEL = {
    "D_MODEL": "32",
    "N_HEADS": "2",
    "N_LAYERS": "1",
    "TOKEN_BUDGET": "2048",
    "MIN_WINDOW_ITEMS": "32",
    "PUBLISH_INTERVAL_S": "0.5",
    "HOLDOUT_SHARE": "0",  # the audits compare the window with every event sent (see conftest.py)
    "WARMUP_STEPS": "5",
    "LEARNING_RATE": "0.003",
    # float32 and eager: compiling takes tens of seconds of a core per service start; one test
    # (test_service.py's learning service) runs the defaults, compiled and on bf16 where it is faster
    "COMPILE": "off",
    "AMP": "off",
}


_STARTED: list[subprocess.Popen[bytes]] = []


def track(process: subprocess.Popen[bytes]) -> None:
    """Have :func:`kill_leftovers` stop ``process`` if the test that started it does not."""
    _STARTED.append(process)


def kill_leftovers() -> None:
    """SIGKILL every service process a test started and did not stop (failed tests too)."""
    for process in _STARTED:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    _STARTED.clear()


class ServiceProcess:
    """One ``streamtrain serve`` subprocess with its own port, topic and checkpoint dir."""

    def __init__(self, bootstrap: str, topic: str, checkpoint_dir: Path, log_path: Path, **settings: Any) -> None:
        self.port = free_port()
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
        merged = {
            **FAST_MODEL,
            "KAFKA_BOOTSTRAP": bootstrap,
            "TOPIC": topic,
            "GROUP_ID": f"g-{topic}",
            "HTTP_HOST": "127.0.0.1",
            "HTTP_PORT": str(self.port),
            "CHECKPOINT_DIR": str(checkpoint_dir),
            **{k.upper(): str(v) for k, v in settings.items()},
        }
        env.update({f"STREAMTRAIN_{k}": v for k, v in merged.items()})
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def start(self) -> ServiceProcess:
        self.spawn()
        self.wait_healthy()
        return self

    def spawn(self) -> ServiceProcess:
        """Start the process without waiting for it (ranks of one group must all be started first)."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.process = subprocess.Popen(
            [sys.executable, "-m", "streamtrain.cli", "serve"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        track(self.process)
        return self

    def wait_healthy(self, timeout_s: float = 120) -> None:
        """Until /healthz answers (a start beside other services and brokers on two cores took over
        60 s); a process that never does is stopped, not left to run beside the next tests."""
        try:
            wait_for(self._healthy, timeout_s, f"service health on :{self.port} (log {self.log_path})", interval=0.2)
        except BaseException:
            if self.process is not None and self.process.poll() is None:
                self.terminate(timeout_s=10)
            raise

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"service exited with {self.process.returncode}: {self.log_path.read_text()[-3000:]}")
        try:
            return self.client.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        response.raise_for_status()
        return response.json()

    def wait_ready(self, timeout_s: float = 90) -> None:
        wait_for(lambda: self.client.get("/readyz").status_code == 200, timeout_s, "readiness", interval=0.3)

    def kill(self) -> None:
        """SIGKILL: no shutdown hook, no last checkpoint."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def terminate(self, timeout_s: float = 60, sig: signal.Signals = signal.SIGTERM) -> int:
        """Stop it with ``sig`` (SIGKILL after ``timeout_s``); its exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.client.close()
        return self.process.returncode

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.terminate()


def wait_until(condition: Any, timeout_s: float, what: str) -> Any:
    return wait_for(condition, timeout_s, what, interval=0.25)


def elapsed(start: float) -> float:
    return time.monotonic() - start
