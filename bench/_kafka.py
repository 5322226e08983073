"""A private single-node broker for benchmarks that restart it (``deploy/kafka.sh``, own port and data)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """``deploy/kafka.sh`` on a free port with its own data directory; never the shared 9092 one."""

    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.env = {**os.environ, "KAFKA_PORT": str(self.port), "KAFKA_HOME_DIR": str(home)}

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, command: str) -> None:
        subprocess.run([str(REPO / "deploy" / "kafka.sh"), command], env=self.env, check=True, timeout=240,
                       stdout=subprocess.DEVNULL)  # fmt: skip

    def up(self) -> None:
        self.run("up")

    def down(self) -> None:
        self.run("down")

    def restart(self) -> None:
        """Stop and start again, data kept."""
        self.down()
        self.up()
