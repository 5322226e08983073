"""Training-thread helpers."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from streamtrain.training.publishing import lower_thread_priority


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux only")
def test_lower_thread_priority_affects_the_calling_thread_and_its_children_only() -> None:
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def trainer() -> None:
        tid = threading.get_native_id()
        seen["before"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["lowered"] = lower_thread_priority(5)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)
        started = threading.Thread(target=child)  # e.g. the prefetch thread
        started.start()
        started.join()

    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=trainer)
    thread.start()
    thread.join()
    assert seen["lowered"] is True
    assert seen["after"] == min(19, seen["before"] + 5)
    assert seen["child"] == seen["after"]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
    assert lower_thread_priority(0) is False
