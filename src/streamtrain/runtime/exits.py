"""Leaving the process at once, from any thread, once the reason is in the log."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

log = logging.getLogger(__name__)


def leave_now(code: int, why: str) -> NoReturn:
    """Log ``why`` (critical), flush every log handler and the standard streams, ``os._exit(code)``.

    For states no normal shutdown may follow: a broken collective group (gloo's teardown can
    abort), a DP process that fenced itself (nothing after the fence may reach a release).
    """
    log.critical("%s", why)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
