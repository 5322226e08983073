"""A background thread that keeps the next batches ready, and measures how long the trainer waits.

Planning and collating are mostly numpy and torch calls on whole arrays, which release
the GIL, so one producer thread overlaps them with the training step without a second
process. A
thread also reads the live window: a DataLoader worker process would see a copy of the
window frozen at fork time (see :mod:`streamtrain.data.dataset`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from streamtrain.data._validate import require_int

T = TypeVar("T")

_POLL_SECONDS = 0.1  # how often a blocked producer re-checks for close(); it sleeps meanwhile


class _End:
    """Queue marker: the source is exhausted."""


class _Failure:
    """Queue marker: the source raised; the consumer re-raises the same exception."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Generic[T]):
    """Iterate ``iterable`` in a daemon thread, at most ``depth`` items ahead.

    ``data_wait_seconds`` adds up the time the consumer blocked waiting for an item: near
    zero means the trainer never waits for data. An exception in the source is raised
    in the consumer at the point it would have happened. ``close()`` (or leaving the
    ``with`` block) stops the producer, which closes the source iterator in its own thread.
    """

    def __init__(self, iterable: Iterable[T], depth: int = 2, name: str = "streamtrain-prefetch") -> None:
        self.depth = require_int(depth, "Prefetcher depth", 1)
        self.data_wait_seconds = 0.0
        self.items_delivered = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, args=(iter(iterable),), name=name, daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        """Block until there is room or close() was called; False when closed."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(_End())
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, not swallowed
            self._put(_Failure(error))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        started = time.perf_counter()
        item = self._queue.get()
        self.data_wait_seconds += time.perf_counter() - started
        if isinstance(item, _End):
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        self.items_delivered += 1
        return item  # type: ignore[return-value]

    def close(self, timeout: float = 5.0) -> None:
        """Stop the producer and wait for it (up to ``timeout`` seconds)."""
        self._finished = True
        self._stop.set()
        while True:  # unblock a producer waiting for room
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:  # and a consumer waiting in another thread: it gets StopIteration
            self._queue.put_nowait(_End())
        except queue.Full:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def buffered(self) -> int:
        """Items produced and waiting for the consumer (at most ``depth``)."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
