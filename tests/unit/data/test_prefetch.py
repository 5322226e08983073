"""Prefetcher: order, exceptions, wait accounting, and a clean stop."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest

from streamtrain.data.prefetch import Prefetcher


def test_items_arrive_in_order_and_the_end_is_reported() -> None:
    with Prefetcher(range(50), depth=3) as prefetcher:
        assert list(prefetcher) == list(range(50))
        assert prefetcher.items_delivered == 50
        with pytest.raises(StopIteration):
            next(prefetcher)


def test_an_exception_in_the_source_reaches_the_consumer_after_earlier_items() -> None:
    def source() -> Iterator[int]:
        yield 1
        yield 2
        raise KeyError("window vanished")

    prefetcher = Prefetcher(source())
    assert next(prefetcher) == 1 and next(prefetcher) == 2
    with pytest.raises(KeyError, match="window vanished"):
        next(prefetcher)
    prefetcher.close()


def test_the_producer_runs_at_most_depth_items_ahead() -> None:
    produced = itertools.count()
    source = (next(produced) for _ in itertools.count())
    prefetcher = Prefetcher(source, depth=2)
    time.sleep(0.3)
    # depth items wait in the queue and one more is held by the blocked producer.
    assert next(produced) <= 2 + 1
    prefetcher.close()


def test_wait_time_counts_only_when_the_consumer_waits() -> None:
    def slow() -> Iterator[int]:
        for i in range(3):
            time.sleep(0.1)
            yield i

    with Prefetcher(slow()) as waiting:
        list(waiting)
    assert waiting.data_wait_seconds >= 0.2

    with Prefetcher(range(3), depth=4) as ready:
        time.sleep(0.2)  # the producer queues all three items and the end meanwhile
        list(ready)
    assert ready.data_wait_seconds < 0.05


def test_close_stops_an_endless_source_and_closes_it_in_the_producer_thread() -> None:
    closed_in: list[str] = []

    def endless() -> Iterator[int]:
        try:
            yield from itertools.count()
        finally:
            closed_in.append(threading.current_thread().name)

    prefetcher = Prefetcher(endless(), depth=2, name="prefetch-under-test")
    assert next(prefetcher) == 0
    prefetcher.close()
    assert not prefetcher.alive
    assert closed_in == ["prefetch-under-test"]
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        Prefetcher([], depth=0)
