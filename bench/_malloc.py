"""Run the benched service on the malloc it is deployed with (the image preloads jemalloc)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

JEMALLOC_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "jemalloc.sh"
CHOICES = ("auto", "jemalloc", "glibc")


def malloc_env(choice: str) -> tuple[str, dict[str, str]]:
    """The malloc the service will run on, and the environment that makes it so.

    ``jemalloc`` preloads it (``deploy/jemalloc.sh`` finds or fetches it) or stops the bench;
    ``auto`` preloads it when it can be had and otherwise says so and runs on glibc's.
    """
    if choice == "glibc":
        return "glibc", {}
    found = subprocess.run([str(JEMALLOC_SCRIPT)], capture_output=True, text=True)
    if found.returncode == 0:
        return "jemalloc", {"LD_PRELOAD": found.stdout.strip()}
    if choice == "jemalloc":
        sys.exit(f"--malloc jemalloc: {found.stderr.strip()} (or pass --malloc glibc)")
    print(f"malloc: glibc's ({found.stderr.strip()})", file=sys.stderr)
    return "glibc", {}
