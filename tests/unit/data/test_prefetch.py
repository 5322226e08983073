"""Prefetcher: order, exceptions, wait accounting, and a clean stop."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from device_params import CUDA
from streamtrain.data.collate import Batch, collate
from streamtrain.data.prefetch import DevicePrefetcher, Prefetcher, StagedBatch, place_batch, stage_batch


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


class Closable:
    """An endless or finite iterator (not a generator) that records where it was closed."""

    def __init__(self, items: int | None = None, gate: threading.Event | None = None) -> None:
        self.items, self.gate, self.produced = items, gate, 0
        self.closed_in: list[str] = []

    def __iter__(self) -> Closable:
        return self

    def __next__(self) -> int:
        if self.gate is not None:
            self.gate.wait()
        if self.items is not None and self.produced == self.items:
            raise StopIteration
        self.produced += 1
        return self.produced - 1

    def close(self) -> None:
        self.closed_in.append(threading.current_thread().name)


def test_defaults_two_ahead_on_a_named_daemon_thread() -> None:
    """A daemon: a source stuck in a read never keeps the process from exiting."""
    prefetcher = Prefetcher(Closable(0))
    try:
        assert prefetcher.depth == 2
        assert prefetcher._thread.name == "streamtrain-prefetch" and prefetcher._thread.daemon  # noqa: SLF001
    finally:
        prefetcher.close()
    with pytest.raises(ValueError, match=r"^Prefetcher depth must be an integer >= 1, got 0$"):
        Prefetcher([], depth=0)


@pytest.mark.parametrize("source", [range(3), [0, 1, 2]], ids=["range", "list"])
def test_a_source_without_close_ends_its_producer_cleanly(monkeypatch, source) -> None:
    failures: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    prefetcher = Prefetcher(source)
    assert list(prefetcher) == [0, 1, 2]
    prefetcher._thread.join(5)  # noqa: SLF001
    assert failures == []


class Failing(Closable):
    def __next__(self) -> int:
        raise RuntimeError("source broke")


@pytest.mark.parametrize("make", [lambda: Closable(3), Failing], ids=["ends", "fails"])
def test_the_source_is_closed_in_the_producer_thread_when_it_ends_or_fails(make) -> None:
    source = make()
    prefetcher = Prefetcher(source, name="producer-under-test")
    fails = isinstance(source, Failing)
    with pytest.raises(RuntimeError, match="source broke") if fails else contextlib.nullcontext():
        assert list(prefetcher) == [0, 1, 2]
    prefetcher._thread.join(5)  # noqa: SLF001
    assert source.closed_in == ["producer-under-test"]


@pytest.mark.timeout(20)
def test_a_consumer_slower_than_the_producers_poll_still_gets_every_item() -> None:
    """The producer re-checks for close() every 0.1 s while the queue is full; a full queue is
    not a close."""
    with Prefetcher(Closable(5), depth=1) as prefetcher:
        time.sleep(0.35)  # the producer waits on a full queue through several polls
        assert [prefetcher.poll(2.0) for _ in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(StopIteration):
            prefetcher.poll(2.0)


@pytest.mark.timeout(20)
def test_close_stops_a_producer_that_waits_for_room_and_closes_its_source() -> None:
    source = Closable()
    prefetcher = Prefetcher(source, depth=1, name="blocked-producer")
    time.sleep(0.3)  # one item queued, the next held by the producer, waiting for room
    prefetcher.close(timeout=2.0)
    assert not prefetcher.alive
    assert source.closed_in == ["blocked-producer"]


@pytest.mark.timeout(20)
def test_close_gives_up_on_a_producer_stuck_in_its_source_after_the_timeout() -> None:
    gate = threading.Event()
    prefetcher = Prefetcher(Closable(gate=gate))
    started = time.perf_counter()
    prefetcher.close(timeout=0.2)
    assert time.perf_counter() - started < 2.0 and prefetcher.alive  # still in the source's read
    gate.set()
    prefetcher._thread.join(5)  # noqa: SLF001
    assert not prefetcher.alive


@pytest.mark.timeout(20)
def test_a_consumer_waiting_in_another_thread_gets_the_end_when_closed() -> None:
    gate = threading.Event()
    prefetcher = Prefetcher(Closable(gate=gate))
    outcome: list[object] = []

    def consume() -> None:
        try:
            outcome.append(next(prefetcher))
        except StopIteration:
            outcome.append("end")

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.2)  # the consumer waits on an empty queue
    prefetcher.close(timeout=0.2)
    consumer.join(5)
    assert outcome == ["end"]
    gate.set()


@pytest.mark.timeout(20)
def test_a_finished_or_closed_prefetcher_answers_at_once_without_its_queue() -> None:
    for end in ("source", "error", "close"):
        source = Closable(1) if end != "error" else Failing()
        prefetcher = Prefetcher(source)
        if end == "source":
            assert list(prefetcher) == [0]
        elif end == "error":
            with pytest.raises(RuntimeError):
                next(prefetcher)
        else:
            prefetcher.close()
            while prefetcher.buffered:  # nothing left to read: only the flag can answer
                prefetcher._queue.get_nowait()  # noqa: SLF001
        for ask in (lambda: next(prefetcher), prefetcher.poll, lambda: prefetcher.poll(5.0)):
            with pytest.raises(StopIteration):
                ask()
        prefetcher.close()


@pytest.mark.timeout(20)
def test_poll_takes_what_is_ready_within_its_timeout_and_counts_the_wait() -> None:
    gate = threading.Event()
    with Prefetcher(Closable(2, gate=gate), depth=1) as prefetcher:
        started = time.perf_counter()
        assert prefetcher.poll() is None  # nothing ready: no wait
        assert time.perf_counter() - started < 0.2
        started = time.perf_counter()
        assert prefetcher.poll(0.3) is None  # nothing within 0.3 s
        assert 0.25 < time.perf_counter() - started < 2.0
        threading.Timer(0.2, gate.set).start()
        assert prefetcher.poll(1.5) == 0  # ready after 0.2 s, within the 1.5 s asked
        assert 0.4 < prefetcher.data_wait_seconds < 3.0  # the 0.3 s and the 0.2 s waited
        assert prefetcher.items_delivered == 1
        time.sleep(0.2)
        before = prefetcher.data_wait_seconds
        assert prefetcher.poll() == 1
        assert prefetcher.data_wait_seconds - before < 0.05


# ---------------------------------------------------------------------------- the device stage
CPU, META = torch.device("cpu"), torch.device("meta")  # meta: a device that is not the host's, without a GPU


def host_batches(count: int) -> list[Batch]:
    rng = np.random.default_rng(count)
    return [
        collate([rng.standard_normal((n, 1)).astype(np.float32) for n in (3, 5)], labels=np.array([0, 1]))
        for _ in range(count)
    ]


def test_a_host_batch_for_another_device_gets_a_copy_of_what_the_step_reads() -> None:
    batch = host_batches(1)[0]
    host, on_device = place_batch(batch, META)
    assert host is batch
    for name in ("values", "mask", "labels"):  # what the forward and the loss read
        copy = getattr(on_device, name)
        assert copy.device == META and copy.shape == getattr(batch, name).shape
    assert on_device.lengths is batch.lengths and on_device.ts is batch.ts  # host-side counters stay
    staged = stage_batch(batch, META).ready()
    assert isinstance(staged, StagedBatch) and staged.values is batch.values
    assert staged.on_device is not None and staged.on_device.values.device == META
    assert place_batch(staged, META) == (staged, staged.on_device)


def test_a_batch_already_on_the_device_or_staged_is_placed_as_it_is() -> None:
    batch = host_batches(1)[0]
    host, on_device = place_batch(batch, CPU)
    assert host is batch and on_device is batch  # no copy, no new batch
    staged = stage_batch(batch, CPU).ready()
    host, on_device = place_batch(staged, CPU)
    assert host is staged and on_device is staged.on_device


class Sized:
    """A batch source without close(), which says when it is asked again after its end."""

    def __init__(self, items: list[Batch], delay_s: float = 0.0) -> None:
        self.items, self.delay_s, self.asked_after_end = list(items), delay_s, 0

    def __iter__(self) -> Sized:
        return self

    def __next__(self) -> Batch:
        time.sleep(self.delay_s)
        if not self.items:
            self.asked_after_end += 1
            raise StopIteration
        return self.items.pop(0)


@pytest.mark.parametrize("ahead", [False, True])
def test_the_device_stage_counts_the_time_inside_next_and_never_asks_an_ended_source_again(ahead: bool) -> None:
    source = Sized(host_batches(3), delay_s=0.1)
    stage = DevicePrefetcher(source, META, ahead=ahead)
    assert stage.data_wait_seconds == 0.0
    delivered = list(stage)
    assert [b.on_device.values.device for b in delivered] == [META] * 3
    assert 0.3 <= stage.data_wait_seconds < 3.0  # four waits of 0.1 s for the source: three batches and the end
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(stage)
    assert source.asked_after_end == 1


@pytest.mark.parametrize("ahead", [False, True])
def test_a_closed_device_stage_delivers_nothing_more(ahead: bool) -> None:
    source = Sized(host_batches(3))
    with DevicePrefetcher(source, CPU, ahead=ahead) as stage:  # a source without close() closes too
        next(stage)
    with pytest.raises(StopIteration):
        next(stage)  # neither the batch staged ahead nor the source's next
    assert len(source.items) == (1 if ahead else 2)


@pytest.mark.timeout(20)
def test_closing_the_device_stage_passes_its_timeout_to_the_prefetcher() -> None:
    gate = threading.Event()
    stage = DevicePrefetcher(Prefetcher(Closable(gate=gate)), CPU)
    started = time.perf_counter()
    stage.close(timeout=0.2)  # the producer is stuck in its source: the close gives up after 0.2 s
    assert time.perf_counter() - started < 2.0
    gate.set()


@pytest.mark.parametrize("device", [CUDA])
def test_a_batch_made_on_the_gpu_is_placed_as_it_is_with_a_host_copy_for_the_counts(device: str) -> None:
    made_there = host_batches(1)[0].to(device)
    host, on_device = place_batch(made_there, torch.device(device))
    assert on_device is made_there
    assert host.values.device.type == "cpu" and torch.equal(host.values, made_there.values.cpu())
    assert host.lengths.device.type == "cpu"
