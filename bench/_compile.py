"""Benches measure the service in its steady state: after its forwards have compiled (COMPILE=on)."""

from __future__ import annotations

import time
from typing import Any


def wait_for_compiled(service: Any, app: Any, timeout_s: float = 900.0) -> float:
    """Block until the trainer's and the predict forward's background compilation has ended
    (at once with COMPILE=off); the seconds waited. Raises when it takes over ``timeout_s``."""
    started = time.perf_counter()
    for forward in (getattr(service.trainer, "forward", None), getattr(app.state, "inference", None)):
        compiled = getattr(forward, "compiled", None)
        if compiled is not None and not compiled.wait(max(0.0, timeout_s - (time.perf_counter() - started))):
            raise RuntimeError(f"the {compiled.name} did not compile within {timeout_s:.0f} s")
    return time.perf_counter() - started
