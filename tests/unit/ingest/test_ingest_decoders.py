"""The decode worker: same answers as in-thread decoding, and a broken worker loses nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import orjson

from streamtrain.events import EventLimits, decode_batch
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
