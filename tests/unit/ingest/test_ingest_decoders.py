"""The decode worker: same answers as in-thread decoding, and a broken worker loses nothing."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import types
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import orjson
import pytest

from streamtrain.events import EventLimits, decode_batch
from streamtrain.ingest import decoders
from streamtrain.ingest.decoders import Decoder

LIMITS = EventLimits(max_len=16)
NOW = time.time()
RAWS = [orjson.dumps({"sensor_id": f"s{i}", "ts": NOW, "values": [float(i)] * (1 + i % 5)}) for i in range(50)] + [
    b"bad"
]
ARGS = (RAWS, LIMITS, NOW, [0] * len(RAWS), list(range(len(RAWS))))


def same(a, b) -> bool:
    return (
        np.array_equal(a.events.values, b.events.values)
        and np.array_equal(a.events.offsets, b.events.offsets)
        and a.rejections == b.rejections
    )


def test_worker_process_decodes_like_the_ingest_thread() -> None:
    decoder = Decoder(1)
    try:
        future = decoder.submit(*ARGS)
        assert future is not None
        assert same(decoder.result(future, ARGS), decode_batch(*ARGS))
    finally:
        decoder.close()


def test_no_workers_decodes_in_thread() -> None:
    decoder = Decoder(0)
    assert decoder.submit(*ARGS) is None
    assert same(decoder.result(None, ARGS), decode_batch(*ARGS))


def test_a_killed_worker_falls_back_without_losing_the_batch() -> None:
    decoder = Decoder(1)
    try:
        decoder.result(decoder.submit(*ARGS), ARGS)  # start the worker
        for pid in list(decoder._pool._processes):  # noqa: SLF001 - the test kills the worker on purpose
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        future = decoder.submit(*ARGS)
        assert same(decoder.result(future, ARGS), decode_batch(*ARGS))
        # and the next batch gets a fresh worker
        assert same(decoder.result(decoder.submit(*ARGS), ARGS), decode_batch(*ARGS))
    finally:
        decoder.close()


def test_ctrl_c_leaves_the_worker_to_the_service() -> None:
    """Ctrl-C at a terminal reaches every process of the group: the worker must not die of it
    (a traceback per worker, and the next batches decoded in-thread), the service stops it."""
    decoder = Decoder(1)
    try:
        decoder.result(decoder.submit(*ARGS), ARGS)  # start the worker
        workers = list(decoder._pool._processes.values())  # noqa: SLF001 - the test signals the worker itself
        for worker in workers:
            os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(worker.is_alive() for worker in workers)
        future = decoder.submit(*ARGS)
        assert future is not None
        assert same(future.result(timeout=30), decode_batch(*ARGS))
    finally:
        decoder.close()


def test_the_cli_module_imports_without_torch() -> None:
    """A spawned decode worker imports the ``streamtrain`` script, hence ``streamtrain.cli``, again:
    with torch in that import every service start paid ~2 s more of a core for its worker."""
    probe = "import sys, streamtrain.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout


class StandInPool:
    """Records how the decoder builds, uses and stops its pool; ``fail`` is what ``submit`` raises."""

    made: list[StandInPool] = []
    fail: BaseException | None = None

    def __init__(self, workers, *, mp_context, initializer) -> None:
        self.workers, self.mp_context, self.initializer = workers, mp_context, initializer
        self.submitted: list[tuple] = []
        self.shutdowns: list[dict] = []
        StandInPool.made.append(self)

    def submit(self, fn, *args):
        if StandInPool.fail is not None:
            raise StandInPool.fail
        self.submitted.append((fn, *args))
        future = Future()
        future.set_result(fn(*args))
        return future

    def shutdown(self, **how) -> None:
        self.shutdowns.append(how)


@pytest.fixture
def stand_in_pool(monkeypatch):
    monkeypatch.setattr(decoders, "ProcessPoolExecutor", StandInPool)
    monkeypatch.setattr(StandInPool, "made", [])
    monkeypatch.setattr(StandInPool, "fail", None)
    return StandInPool


def test_the_pool_spawns_its_workers_with_the_exit_with_parent_initializer(stand_in_pool) -> None:
    decoder = Decoder(3)
    decoder.start(LIMITS)
    [pool] = stand_in_pool.made
    assert pool.workers == 3
    assert pool.mp_context.get_start_method() == "spawn"  # never forked from a process running threads
    assert pool.initializer is decoders._exit_with_parent
    # start() submits an empty batch so the worker imports now, not at the first real batch
    assert pool.submitted == [(decode_batch, [], LIMITS, 0.0, [], [])]
    decoder.submit(*ARGS)
    assert len(stand_in_pool.made) == 1  # one pool for every batch while it works


@pytest.mark.parametrize("error", [BrokenProcessPool("gone"), RuntimeError("cannot schedule"), OSError("no fds")])
def test_an_unavailable_worker_is_said_once_and_replaced_at_the_next_batch(stand_in_pool, caplog, error) -> None:
    decoder = Decoder(1)
    decoder.start(LIMITS)
    stand_in_pool.fail = error
    with caplog.at_level(logging.WARNING, logger=decoders.__name__):
        assert decoder.submit(*ARGS) is None  # the caller decodes in its own thread
    assert [r.getMessage() for r in caplog.records] == [
        f"decode worker unavailable ({error}); decoding in the ingest thread"
    ]
    [broken] = stand_in_pool.made
    assert broken.shutdowns == [{"wait": False, "cancel_futures": True}]  # never waits on a broken worker
    stand_in_pool.fail = None
    future = decoder.submit(*ARGS)
    assert len(stand_in_pool.made) == 2 and future is not None
    assert same(decoder.result(future, ARGS), decode_batch(*ARGS))


@pytest.mark.parametrize("error", [BrokenProcessPool("worker died"), OSError("pipe closed")])
def test_a_batch_whose_worker_fails_is_decoded_in_thread_and_said(stand_in_pool, caplog, error) -> None:
    decoder = Decoder(1)
    decoder.start(LIMITS)
    failed: Future = Future()
    failed.set_exception(error)
    with caplog.at_level(logging.WARNING, logger=decoders.__name__):
        assert same(decoder.result(failed, ARGS), decode_batch(*ARGS))
    assert [r.getMessage() for r in caplog.records] == [
        f"decode worker failed ({error}); decoding this batch in the ingest thread"
    ]
    assert stand_in_pool.made[0].shutdowns == [{"wait": False, "cancel_futures": True}]
    decoder.submit(*ARGS)
    assert len(stand_in_pool.made) == 2  # the next batch gets a fresh worker


def test_close_waits_for_the_worker_and_cancels_what_is_queued(stand_in_pool) -> None:
    decoder = Decoder(1)
    decoder.close()  # nothing started: nothing to stop
    assert stand_in_pool.made == []
    decoder.start(LIMITS)
    decoder.close()
    decoder.close()  # a second close stops nothing twice
    assert stand_in_pool.made[0].shutdowns == [{"wait": True, "cancel_futures": True}]


def test_a_reset_without_a_pool_stops_nothing(stand_in_pool) -> None:
    decoder = Decoder(1)
    failed: Future = Future()
    failed.set_exception(BrokenProcessPool("never started"))
    assert same(decoder.result(failed, ARGS), decode_batch(*ARGS))
    assert stand_in_pool.made == []


class Recorded:
    """What ``_exit_with_parent`` does, recorded in this process instead of a worker's."""

    def __init__(self, monkeypatch, parent) -> None:
        self.signals: list[tuple] = []
        self.waited: list[list] = []
        self.exits: list[int] = []
        self.threads: list[dict] = []
        # the module's own names for these, not the process-wide functions: nothing else is touched
        monkeypatch.setattr(decoders, "signal", types.SimpleNamespace(
            signal=lambda *args: self.signals.append(args), SIGINT=signal.SIGINT, SIG_IGN=signal.SIG_IGN
        ))  # fmt: skip
        monkeypatch.setattr(decoders, "multiprocessing", types.SimpleNamespace(
            parent_process=lambda: parent, connection=types.SimpleNamespace(wait=self.waited.append)
        ))  # fmt: skip
        monkeypatch.setattr(decoders, "os", types.SimpleNamespace(_exit=self.exits.append))
        monkeypatch.setattr(decoders, "threading", types.SimpleNamespace(Thread=self.thread))

    def thread(self, **how):
        self.threads.append(how)
        return types.SimpleNamespace(start=how["target"])  # runs the watch at once, in this thread


def test_a_worker_ignores_ctrl_c_and_exits_when_its_parent_is_gone(monkeypatch) -> None:
    parent = types.SimpleNamespace(sentinel=41)
    recorded = Recorded(monkeypatch, parent)
    decoders._exit_with_parent()
    assert recorded.signals == [(signal.SIGINT, signal.SIG_IGN)]
    [thread] = recorded.threads
    assert thread["name"] == "exit-with-parent" and thread["daemon"] is True
    assert recorded.waited == [[41]]  # blocks on the parent's sentinel...
    assert recorded.exits == [0]  # ...and ends the worker at once when it turns readable


def test_outside_a_worker_the_initializer_only_ignores_ctrl_c(monkeypatch) -> None:
    recorded = Recorded(monkeypatch, None)
    decoders._exit_with_parent()
    assert recorded.signals == [(signal.SIGINT, signal.SIG_IGN)]
    assert recorded.threads == recorded.waited == recorded.exits == []
