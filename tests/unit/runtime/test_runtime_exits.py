"""Leaving at once: the reason logged, every handler and stream flushed, even ones that fail."""

from __future__ import annotations

import logging
import sys

import pytest

from streamtrain.runtime import exits


class Flushing(logging.Handler):
    def __init__(self, fails: bool, seen: list[str]) -> None:
        super().__init__()
        self.fails, self.seen = fails, seen

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"emit {record.levelname} {record.getMessage()}")

    def flush(self) -> None:
        self.seen.append("flush handler")
        if self.fails:
            raise OSError("the log disk is gone")


class Stream:
    def __init__(self, name: str, fails: bool, seen: list[str]) -> None:
        self.name, self.fails, self.seen = name, fails, seen

    def flush(self) -> None:
        self.seen.append(f"flush {self.name}")
        if self.fails:
            raise ValueError("I/O operation on closed file")


@pytest.mark.parametrize("fails", [False, True], ids=["flushes", "flushes-fail"])
def test_the_reason_is_logged_and_everything_flushed_before_the_exit(monkeypatch, fails: bool) -> None:
    seen: list[str] = []
    root = logging.getLogger()
    handlers = [Flushing(fails, seen), Flushing(False, seen)]
    monkeypatch.setattr(root, "handlers", handlers)
    monkeypatch.setattr(exits.log, "propagate", True)
    monkeypatch.setattr(sys, "stdout", Stream("stdout", fails, seen))
    monkeypatch.setattr(sys, "stderr", Stream("stderr", False, seen))
    monkeypatch.setattr(exits.os, "_exit", lambda code: seen.append(f"exit {code}"))
    exits.leave_now(3, "the collective group broke")
    assert seen == [
        "emit CRITICAL the collective group broke",
        "emit CRITICAL the collective group broke",
        "flush handler",
        "flush handler",
        "flush stdout",
        "flush stderr",
        "exit 3",
    ]
