"""The decoder pool: poll batches decoded in a worker process beside the poll loop.

Decoding is :func:`streamtrain.events.decode_batch` wherever it runs, so a batch gets the
same events and rejections in the worker as in the ingest thread. Nothing is lost to the
pool: a batch whose worker is unavailable or dies is decoded in the calling thread, and
the next batch gets a fresh worker. Workers are spawned (never forked from a process that
runs threads) and end with the service, even when it is killed.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from streamtrain.events import DecodedBatch, EventLimits, decode_batch

__all__ = ["Decoder"]

log = logging.getLogger(__name__)


def _exit_with_parent() -> None:
    """Decode-worker initializer: end the worker when the service ends, even by SIGKILL.

    A pool worker blocks on its call queue, whose pipe it holds both ends of, so it never
    sees the parent die; without this, every killed service leaves a worker (and the
    multiprocessing resource tracker) behind. The parent sentinel turns readable then.
    Ctrl-C at a terminal reaches the whole process group: the worker ignores SIGINT and
    leaves shutting down to the service, which stops the pool after its final checkpoint.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class Decoder:
    """Decodes poll batches in a worker process, so JSON parsing runs beside the poll loop.

    kafka-python's own record parsing and our JSON decoding both hold the GIL; a process
    of its own lets them overlap on two cores. ``workers == 0`` decodes in the calling
    thread. A broken worker is replaced, and the batch decoded in-thread: nothing is lost.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def start(self, limits: EventLimits) -> None:
        """Start the worker now (a spawned process takes seconds to import), not at the first batch."""
        self.submit([], limits, 0.0, [], [])

    def submit(self, *args: Any) -> Future[DecodedBatch] | None:
        if self.workers <= 0:
            return None
        try:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_exit_with_parent
                )
            return self._pool.submit(decode_batch, *args)
        except (BrokenProcessPool, RuntimeError, OSError) as err:
            log.warning("decode worker unavailable (%s); decoding in the ingest thread", err)
            self._reset()
            return None

    def result(self, future: Future[DecodedBatch] | None, args: tuple[Any, ...]) -> DecodedBatch:
        if future is not None:
            try:
                return future.result()
            except (BrokenProcessPool, OSError) as err:
                log.warning("decode worker failed (%s); decoding this batch in the ingest thread", err)
                self._reset()
        return decode_batch(*args)

    def _reset(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # an idle worker exits at once
