"""Merge concurrent predict requests (/v1/predict and OIP infer) into shared forward passes.

On a few CPU cores, N requests each running their own forward from N threads fight over
the cores and the GIL: a request's latency grows with N while the work per request stays
the same. A fixed set of worker threads instead takes every request waiting for the same
model version, runs one length-bucketed forward over all their instances and hands each
request its own slice. Bigger micro-batches pad less and pay the per-op overhead once, so
the cores answer more requests per second, and requests never outnumber the cores.

Merging is safe because the model has no cross-instance operation: an instance's answer
does not depend on which other instances share its forward (the tests check this to
1e-5), so answers are the same as if each request ran alone. Each request is answered by
the model version it was admitted with.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: ``predict(model, norm, arrays, token_budget)`` as :func:`streamtrain.model.inference.predict_arrays`:
#: one answer per array, in order, in anything that slices (a list, PredictionArrays).
PredictFn = Callable[[Any, Any, Sequence[np.ndarray], int], Any]


class Overloaded(Exception):
    """More predict requests are waiting than the queue admits (or the service is stopping)."""


@dataclass(eq=False)
class _Request:
    published: Any  # the model version the request was admitted with (model, norm)
    arrays: list[np.ndarray]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any] = field(repr=False)


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():  # the client went away and the request was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class PredictBatcher:
    """``workers`` threads serve queued requests; at most ``admit`` are inside at once.

    A worker takes the oldest request and every other waiting one with the same model
    version, up to ``max_instances`` instances, and runs them as one forward.
    """

    def __init__(
        self,
        predict: PredictFn,
        token_budget: int,
        *,
        workers: int,
        admit: int,
        max_instances: int,
    ) -> None:
        if workers < 1 or admit < workers or max_instances < 1:
            raise ValueError(
                f"PredictBatcher: need workers >= 1, admit >= workers, max_instances >= 1; "
                f"got {workers}, {admit}, {max_instances}"
            )
        self._predict = predict
        self._token_budget = token_budget
        self._admit = admit
        self._max_instances = max_instances
        self._waiting: deque[_Request] = deque()
        self._inside = 0  # waiting + being served
        self._closed = False
        self._cond = threading.Condition()
        self.merged_forwards = 0  # forwards that served more than one request
        self._threads = [threading.Thread(target=self._serve, name=f"predict-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    async def submit(self, published: Any, arrays: list[np.ndarray]) -> Any:
        """The predictions for ``arrays`` (the predict function's slice), in order;
        :class:`Overloaded` when the queue is full."""
        loop = asyncio.get_running_loop()
        request = _Request(published, arrays, loop, loop.create_future())
        with self._cond:
            if self._closed:  # shutting down: a 503, as when full, not a 500
                raise Overloaded("the predict workers are stopping")
            if self._inside >= self._admit:
                raise Overloaded(f"too many predictions in flight ({self._inside})")
            self._inside += 1
            self._waiting.append(request)
            self._cond.notify()
        return await request.future

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers once the waiting requests are answered."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def _take(self) -> list[_Request] | None:
        """The next group of requests sharing a model version (None once closed and drained)."""
        with self._cond:
            while not self._waiting:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._waiting.popleft()
            group, instances = [first], len(first.arrays)
            left: deque[_Request] = deque()
            for request in self._waiting:
                if request.published is first.published and instances + len(request.arrays) <= self._max_instances:
                    group.append(request)
                    instances += len(request.arrays)
                else:
                    left.append(request)
            self._waiting = left
            return group

    def _serve(self) -> None:
        while (group := self._take()) is not None:
            answers = self._forward(group)
            # Leave before answering: a client that sends its next request the moment it
            # gets this answer must find the slot free.
            with self._cond:
                self._inside -= len(group)
            for request, answer in zip(group, answers, strict=True):
                if isinstance(answer, BaseException):
                    request.loop.call_soon_threadsafe(_resolve, request.future, None, answer)
                else:
                    request.loop.call_soon_threadsafe(_resolve, request.future, answer)

    def _forward(self, group: list[_Request]) -> list[Any]:
        """Each request's predictions (or the error of the shared forward)."""
        published = group[0].published
        arrays = [a for request in group for a in request.arrays]
        try:
            predictions = self._predict(published.served, published.norm, arrays, self._token_budget)
        except Exception as err:  # noqa: BLE001 - each request gets the error, the worker lives on
            log.exception("predict forward failed for %d requests", len(group))
            return [err] * len(group)
        if len(group) > 1:
            self.merged_forwards += 1
        answers: list[Any] = []
        start = 0
        for request in group:
            answers.append(predictions[start : start + len(request.arrays)])
            start += len(request.arrays)
        return answers
