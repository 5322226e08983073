"""A background thread that keeps the next batches ready, and measures how long the trainer waits.

Planning and collating are mostly numpy and torch calls on whole arrays, which release
the GIL, so one producer thread overlaps them with the training step without a second
process. A
thread also reads the live window: a DataLoader worker process would see a copy of the
window frozen at fork time (see :mod:`streamtrain.data.dataset`).

On a GPU a second, small stage follows (:class:`DevicePrefetcher`): the producer thread
also pins each collated batch (``transform``), and the stage copies the next batch to
the device on a side stream while the current one trains, so a step never waits for a
transfer (:mod:`streamtrain.device` explains the stream discipline).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

import torch

from streamtrain.data._validate import require_int
from streamtrain.data.collate import Batch
from streamtrain.device import Transfer, is_cuda, side_stream
from streamtrain.runtime.cpus import leave_training_cpus

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
    ``transform`` (e.g. :func:`pin_batch`) runs on each item in the producer thread too.
    """

    def __init__(
        self,
        iterable: Iterable[Any],
        depth: int = 2,
        name: str = "streamtrain-prefetch",
        transform: Callable[[Any], T] | None = None,
    ) -> None:
        self.depth = require_int(depth, "Prefetcher depth", 1)
        self.data_wait_seconds = 0.0
        self.items_delivered = 0
        self._transform = transform
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
        leave_training_cpus()  # started by the training thread: its CPUs are the step's alone
        try:
            for item in source:
                if self._transform is not None:
                    item = self._transform(item)
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
        return self._deliver(item)

    def poll(self, timeout_s: float = 0.0) -> T | None:
        """The next item if one is ready within ``timeout_s`` (0: only if ready now), else None.

        For a consumer that must not block (a rank in lockstep steps with or without a
        batch); StopIteration and source errors as from ``next()``.
        """
        if self._finished:
            raise StopIteration
        started = time.perf_counter()
        try:
            item = self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        finally:
            self.data_wait_seconds += time.perf_counter() - started
        return self._deliver(item)

    def _deliver(self, item: object) -> T:
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


# --------------------------------------------------------------------------------------------
# The device stage
# --------------------------------------------------------------------------------------------

_ON_DEVICE = ("values", "mask", "labels")  # what the forward and the loss read; lengths and ts are host-side counters


@dataclass(frozen=True)
class StagedBatch(Batch):
    """A host batch (pinned on a GPU machine) together with its copy on the training device.

    Everything a :class:`Batch` offers reads the host tensors (counters, timestamps and the
    float64 normalization statistics stay on the host, so reading them never waits for the
    GPU). ``on_device`` is the same batch with ``values``, ``mask`` and ``labels`` on the
    device, ready on the current stream; its ``lengths`` and ``ts`` are the host tensors.
    """

    on_device: Batch | None = None


def pin_batch(batch: Batch) -> Batch:
    """``batch`` in pinned host memory (what a non-blocking copy to a GPU needs)."""
    return batch.pin_memory()


def stage_batch(batch: Batch, device: torch.device, stream: torch.cuda.Stream | None = None) -> Staging:
    """Start copying ``batch`` to ``device`` (on ``stream`` when given); :meth:`Staging.ready` finishes it."""
    return Staging(batch, Transfer({name: getattr(batch, name) for name in _ON_DEVICE}, device, stream))


class Staging:
    """A batch whose copy to the device has started; the lockstep loop stages the next one ahead."""

    def __init__(self, batch: Batch, transfer: Transfer) -> None:
        self.batch = batch
        self.transfer = transfer

    def ready(self) -> StagedBatch:
        """The staged batch, safe to use on the current stream (the host does not wait)."""
        host = self.batch
        on_device = _replace_batch(host, **self.transfer.wait())
        return StagedBatch(**{f.name: getattr(host, f.name) for f in fields(Batch)}, on_device=on_device)


def _replace_batch(batch: Batch, **tensors: torch.Tensor) -> Batch:
    return Batch(**{f.name: tensors.get(f.name, getattr(batch, f.name)) for f in fields(Batch)})


class DevicePrefetcher:
    """Batches from ``source`` (a :class:`Prefetcher`) as :class:`StagedBatch` on ``device``, one batch ahead.

    On CUDA, each ``next()`` hands over the batch whose copy was queued on the side stream
    during the previous step (the compute stream waits for that copy's event, the host
    does not), then takes the next host batch from ``source`` and queues its copy, so the
    copy runs while the step just handed over computes. ``ahead=False`` (the default off
    CUDA) copies each batch when it is asked for, keeping the CPU pipeline exactly as deep
    as ``PREFETCH_DEPTH`` says; tests set ``ahead=True`` on the CPU to exercise the
    one-ahead logic. ``data_wait_seconds`` is the time spent inside ``next()`` (waiting for
    ``source`` included): the data wait the trainer sees. An error of ``source`` while
    staging ahead is raised by the ``next()`` after the batch in hand was delivered.
    """

    def __init__(self, source: Iterable[Batch], device: torch.device | str, *, ahead: bool | None = None) -> None:
        self.device = torch.device(device)
        self.ahead = is_cuda(self.device) if ahead is None else ahead
        self.data_wait_seconds = 0.0
        self.items_delivered = 0
        self._source = source
        self._iterator = iter(source)
        self._stream = side_stream(self.device)
        self._next: Staging | None = None
        self._pending_error: BaseException | None = None
        self._exhausted = False

    def __iter__(self) -> DevicePrefetcher:
        return self

    def _stage_next(self) -> Staging | None:
        """Queue the copy of the source's next batch; None when the source is done."""
        if self._exhausted:
            return None
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._exhausted = True
            return None
        return stage_batch(batch, self.device, self._stream)

    def __next__(self) -> StagedBatch:
        started = time.perf_counter()
        try:
            if self._pending_error is not None:
                error, self._pending_error = self._pending_error, None
                self._exhausted = True
                raise error
            current = self._next if self._next is not None else self._stage_next()
            self._next = None
            if current is None:
                raise StopIteration
            if self.ahead:
                try:
                    self._next = self._stage_next()
                except Exception as error:  # noqa: BLE001 - delivered after the batch in hand
                    self._pending_error = error
            staged = current.ready()
        finally:
            self.data_wait_seconds += time.perf_counter() - started
        self.items_delivered += 1
        return staged

    def close(self, timeout: float = 5.0) -> None:
        """Close the source (a batch staged ahead is dropped: planned, never trained)."""
        self._next = None
        self._exhausted = True
        if isinstance(self._source, Prefetcher):
            self._source.close(timeout=timeout)
        else:
            close = getattr(self._source, "close", None)  # a generator, or any iterable that holds resources
            if callable(close):
                close()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def place_batch(batch: Batch, device: torch.device) -> tuple[Batch, Batch]:
    """(host batch, its ``values``/``mask``/``labels`` on ``device``), as a training step places one.

    A :class:`StagedBatch` brings its device copy along; a host batch is copied now (pinned,
    non-blocking); a batch already on ``device`` is used as is, with a host copy for the
    counts and the float64 statistics.
    """
    on_device = batch.on_device if isinstance(batch, StagedBatch) else None
    if on_device is None and batch.values.device == device:
        on_device = batch
    if batch.values.device.type != "cpu":  # a hand-made batch on the device: statistics need a host copy
        batch = batch.to("cpu")
    if on_device is None:
        staged = stage_batch(batch, device).ready().on_device
        assert staged is not None, "stage_batch always makes the device copy"
        on_device = staged
    return batch, on_device
