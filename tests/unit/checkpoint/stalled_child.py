"""A child process that stalls in the middle of writing a checkpoint, killed there (SIGKILL).

The child's code prints ``stalled <kind> <step>`` and sleeps inside the write it stalls;
the caller checks what is on disk at that moment and then kills it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any


def kill_when_stalled(code: str, directory: Path, kill_at: str, temp_files: str) -> int:
    """Run ``code`` (argv: ``directory``, ``kill_at``, this folder), SIGKILL it once it stalls in a
    write of the kind ``kill_at`` while files matching ``temp_files`` are on disk; the step it stalled at."""
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(directory), kill_at, str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line[:2] == ["stalled", kill_at], line
        assert list(directory.glob(temp_files)), "the child stalls inside the write"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    return int(line[2])


def stall_writes(module: Any, stall_after: Callable[[Path, int], str | None]) -> None:
    """In the child: make ``module.write_atomically`` stall after chunk ``i`` of ``path`` when
    ``stall_after(path, i)`` gives a line (``<kind> <step>``): it prints ``stalled <line>``, sleeps."""
    write = module.write_atomically

    def stalling_write(path: Path, chunks: Iterable[bytes], **kwargs: Any) -> Any:
        def stalled() -> Iterator[bytes]:
            for i, chunk in enumerate(chunks):
                yield chunk
                line = stall_after(path, i)
                if line is not None:
                    print("stalled", line, flush=True)
                    time.sleep(60)

        return write(path, stalled(), **kwargs)

    module.write_atomically = stalling_write
