"""Pacing and sending (``run_simulation``) and the ``streamtrain simulate`` command line."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import threading

import numpy as np
import pytest
from kafka.errors import KafkaTimeoutError
from simulation_fixtures import NOW, config

from streamtrain.tools.simulate import (
    TokenBucket,
    add_cli,
    chunk_size,
    one_line_socket_errors,
    run_cli,
    run_simulation,
)
from streamtrain.tools.simulation_config import SimulationConfig, load_simulation_config

# --- pacing ----------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_token_bucket_paces_reservations_exactly():
    clock = FakeClock()
    bucket = TokenBucket(rate=50.0, burst=10, clock=clock)
    assert bucket.reserve(10) == 0.0  # the initial burst is free
    for _ in range(20):
        delay = bucket.reserve(10)
        assert delay == pytest.approx(0.2)
        clock.sleep(delay)
    assert clock.now - 100.0 == pytest.approx(200 / 50.0)
    clock.now += 60.0  # idle time refills at most one burst
    assert bucket.reserve(10) == 0.0
    assert bucket.reserve(10) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="rate > 0"):
        TokenBucket(rate=0.0, burst=1)


class FakeFuture:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def add_callback(self, fn, *args):
        if self.error is None:
            fn(*args, "metadata")
        return self

    def add_errback(self, fn, *args):
        if self.error is not None:
            fn(*args, self.error)
        return self


class FakeProducer:
    def __init__(self, clock: FakeClock | None = None, fail_every: int = 0) -> None:
        self.records: list[tuple[str, bytes, bytes, float]] = []
        self.clock = clock
        self.fail_every = fail_every
        self.flushed = self.closed = False

    def send(self, topic, value=None, key=None):
        self.records.append((topic, key, value, self.clock() if self.clock else 0.0))
        failed = self.fail_every and len(self.records) % self.fail_every == 0
        return FakeFuture(RuntimeError("broker said no") if failed else None)

    def flush(self, timeout=None):
        self.flushed = True

    def close(self, timeout=None):
        self.closed = True


def test_run_simulation_sends_count_records_at_the_configured_rate(caplog):
    clock = FakeClock()
    producer = FakeProducer(clock)
    cfg = config(rate=200.0, count=1000, malformed_share=0.1, n_classes=2, progress_interval_s=1.0)
    with caplog.at_level(logging.INFO, logger="streamtrain.tools.simulate"):
        report = run_simulation(cfg, lambda c: producer, clock=clock, wall_clock=lambda: NOW, sleep=clock.sleep)
    assert report.sent == len(producer.records) == 1000
    assert producer.flushed and producer.closed
    assert report.malformed == sum(report.malformed_by_reason.values())
    assert 0 < report.malformed < 1000
    assert report.delivery_errors == 0
    burst = chunk_size(200.0)
    assert report.elapsed_s == pytest.approx((1000 - burst) / 200.0)
    assert len(clock.sleeps) <= math.ceil(1000 / burst)  # one sleep per chunk, never per message
    # any 1-second span holds at most rate + one burst of records
    times = np.array([t for *_, t in producer.records])
    for start in np.arange(times.min(), times.max(), 0.5):
        assert np.sum((times >= start) & (times < start + 1.0)) <= 200 + burst
    assert all(topic == cfg.topic for topic, *_ in producer.records)
    assert sum("progress:" in r.message for r in caplog.records) >= 3


def test_run_simulation_stops_on_duration_and_on_stop_event():
    clock = FakeClock()
    report = run_simulation(
        config(rate=100.0, duration_s=2.0),
        lambda c: FakeProducer(clock),
        clock=clock,
        wall_clock=lambda: NOW,
        sleep=clock.sleep,
    )
    assert report.elapsed_s == pytest.approx(2.0, abs=0.11)
    assert 190 <= report.sent <= 310  # 2 s at 100/s plus the initial burst

    stop = threading.Event()

    class StoppingProducer(FakeProducer):
        def send(self, topic, value=None, key=None):
            if len(self.records) == 99:
                stop.set()
            return super().send(topic, value, key)

    report = run_simulation(config(rate=0.0), lambda c: StoppingProducer(), stop=stop)
    assert report.sent == 100 < chunk_size(0.0)  # a stop ends the chunk in flight too


def test_run_simulation_counts_delivery_errors():
    report = run_simulation(config(rate=0.0, count=100), lambda c: FakeProducer(fail_every=10))
    assert report.sent == 100
    assert report.delivery_errors == 10
    assert "broker said no" in report.first_delivery_error

    class RefusingProducer(FakeProducer):
        def send(self, topic, value=None, key=None):
            future = super().send(topic, value, key)
            if len(self.records) % 25 == 0:
                raise KafkaTimeoutError("no metadata")
            return future

    report = run_simulation(config(rate=0.0, count=100), lambda c: RefusingProducer())
    assert (report.sent, report.delivery_errors) == (100, 4)
    assert "KafkaTimeoutError" in report.first_delivery_error


class PendingFuture(FakeFuture):
    """A record in flight: neither acknowledged nor failed."""

    def add_callback(self, fn, *args):
        return self

    def add_errback(self, fn, *args):
        return self


class UnreachableBroker(FakeProducer):
    """kafka-python 3.0 with its broker gone: nothing is acknowledged, ``flush(t)`` waits ``t``
    and raises, ``close`` flushes first and raises; only its sender's ``force_close`` ends it."""

    class Sender:
        force_closed = False

        def force_close(self):
            self.force_closed = True

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self._sender = self.Sender()
        self.waited: list[float] = []

    def send(self, topic, value=None, key=None):
        super().send(topic, value, key)
        return PendingFuture(None)

    def flush(self, timeout=None):
        self.waited.append(timeout)
        self.clock.sleep(timeout)
        raise KafkaTimeoutError("Timeout waiting for future")

    def close(self, timeout=None):
        self.flush(timeout)


@pytest.mark.parametrize("second_signal", [False, True])
def test_a_stop_with_the_broker_gone_waits_close_timeout_once_and_counts_what_is_in_flight(second_signal):
    clock = FakeClock()
    producer = UnreachableBroker(clock)
    abandon = threading.Event()
    if second_signal:
        abandon.set()
    report = run_simulation(
        config(rate=0.0, count=300, close_timeout_s=5.0),
        lambda c: producer,
        abandon=abandon,
        clock=clock,
        wall_clock=lambda: NOW,
        sleep=clock.sleep,
    )
    assert report.sent == report.unacknowledged == 300
    assert report.delivery_errors == 0
    assert producer._sender.force_closed  # nothing keeps retrying behind the report
    waited = sum(producer.waited)
    assert waited == pytest.approx(0.0 if second_signal else 5.0)  # one deadline for the flush and the close
    assert max(producer.waited, default=0.0) <= 0.25  # in slices, so a second signal is seen


# --- command line -----------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamtrain")
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def test_add_cli_registers_every_setting_with_help(capsys):
    with pytest.raises(SystemExit) as exited:
        make_parser().parse_args(["simulate", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for name in SimulationConfig.model_fields:
        assert "--" + name.replace("_", "-") in text
    assert "--config" in text and "STREAMTRAIN_KAFKA_BOOTSTRAP" in text

    args = make_parser().parse_args(
        ["simulate", "--rate", "5", "--event-ids", "--drift", "abrupt", "--drift-at-s", "1", "2.5", "--count", "10"]
    )
    assert args.func is run_cli
    given = {k: v for k, v in vars(args).items() if k in SimulationConfig.model_fields}
    assert given == {"rate": 5.0, "event_ids": True, "drift": "abrupt", "drift_at_s": [1.0, 2.5], "count": 10}
    cfg = load_simulation_config(None, environ={}, overrides=given)
    assert cfg.drift_at_s == (1.0, 2.5) and cfg.event_ids is True


def test_run_cli_rejects_bad_settings_with_one_line(capsys):
    args = make_parser().parse_args(["simulate", "--malformed-share", "1.5"])
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "malformed_share" in err and "--malformed-share" in err


def test_a_dropped_broker_connection_is_logged_in_one_line_without_its_traceback() -> None:
    formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        record = logging.getLogger("kafka.net.transport").makeRecord(
            "kafka.net.transport", logging.ERROR, __file__, 1, "%s: Error receiving network data closing socket",
            ("<transport>",), sys.exc_info(),
        )  # fmt: skip
    assert one_line_socket_errors(record)
    assert formatter.format(record) == (
        "ERROR kafka.net.transport: <transport>: Error receiving network data closing socket "
        "(ConnectionResetError: [Errno 104] Connection reset by peer)"
    )
    try:
        raise ValueError("a bug, not the network")
    except ValueError:
        other = logging.getLogger("kafka.net.transport").makeRecord(
            "kafka.net.transport", logging.ERROR, __file__, 1, "boom", (), sys.exc_info()
        )
    assert one_line_socket_errors(other) and "Traceback" in formatter.format(other)  # kept for anything else
