"""The HTTP server's stop signals: one stop asked twice (SIGTERM and SIGINT, as a terminal's
Ctrl-C and scripts/run-local.sh send it) shuts down gracefully; Ctrl-C twice forces the exit."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import uvicorn

from streamtrain.cli import _http_server


def server() -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    return _http_server(uvicorn.Config(app))


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_one_stop_asked_by_both_signals_shuts_down_gracefully(first: int) -> None:
    stop = server()
    stop.handle_exit(first, None)
    stop.handle_exit(signal.SIGINT if first == signal.SIGTERM else signal.SIGTERM, None)
    assert stop.should_exit and not stop.force_exit


def test_a_second_ctrl_c_forces_the_exit() -> None:
    stop = server()
    stop.handle_exit(signal.SIGINT, None)
    assert stop.should_exit and not stop.force_exit
    stop.handle_exit(signal.SIGINT, None)
    assert stop.force_exit
