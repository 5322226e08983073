"""``streamtrain simulate``: pace the fleet's records and send them to Kafka.

The fleet exists to exercise the service end to end (see :mod:`streamtrain.tools.sensor_fleet`
for what it generates, :mod:`streamtrain.tools.simulation_config` for its settings).
Generation is separate from sending: :class:`~streamtrain.tools.sensor_fleet.SensorFleet`
makes message bytes without Kafka, :func:`run_simulation` paces them with a token bucket
(the long-run rate is exact) and sends them, counting every record Kafka did not
acknowledge. ``python -m streamtrain.tools.simulate`` is the same command.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import types
import typing
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from kafka.errors import KafkaError, KafkaTimeoutError

from streamtrain.ingest.kafka_compat import close_producer
from streamtrain.tools.sensor_fleet import SensorFleet
from streamtrain.tools.simulation_config import (
    ENV_PREFIX,
    ENV_SETTINGS,
    SimulationConfig,
    SimulationConfigError,
    load_simulation_config,
)

logger = logging.getLogger(__name__)


def one_line_socket_errors(record: logging.LogRecord) -> bool:
    """kafka-python logs a broker that drops or refuses a connection with the traceback of the socket's
    ``OSError`` (``log.exception``); the error's class and words say all of it, on the same line."""
    error = record.exc_info[1] if record.exc_info else None
    if isinstance(error, OSError):
        record.msg, record.args = f"{record.getMessage()} ({type(error).__name__}: {error})", None
        record.exc_info = record.exc_text = None
    return True


class TokenBucket:
    """Paces a sender at ``rate`` tokens/s with bursts of at most ``burst`` tokens.

    Reservation style: :meth:`reserve` takes tokens at once (the balance may go
    negative) and says how long to wait before using them, so a sender sleeps once per
    chunk instead of spinning or sleeping per message, and the long-run rate is exact.
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not burst > 0:
            raise ValueError(f"TokenBucket needs rate > 0 and burst > 0, got rate={rate}, burst={burst}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._clock = clock
        self._tokens = self.burst
        self._stamp = clock()

    def reserve(self, n: float) -> float:
        """Take ``n`` tokens; return the seconds to wait before they may be spent."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate) - n
        self._stamp = now
        return max(0.0, -self._tokens / self.rate)


class _Future(Protocol):
    def add_callback(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...

    def add_errback(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...


class Producer(Protocol):
    """The part of ``kafka.KafkaProducer`` the simulation uses (fakes in tests)."""

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None) -> _Future: ...

    def flush(self, timeout: float | None = None) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


def kafka_producer(config: SimulationConfig) -> Producer:
    """A KafkaProducer whose request limit lets too_large messages reach the broker.

    gzip (zlib, in C) keeps record batches small: kafka-python falls back to a pure-Python
    CRC32C over every batch it writes (~0.35 s per MiB without the ``crc32c`` package), so
    compressing first makes the checksum, and the consumer's check of it, cheap.
    """
    from kafka import KafkaProducer

    from streamtrain.ingest.security import KafkaSecurity, client_options, watch

    security = KafkaSecurity.from_environment()
    watch(security)  # a refused login is said once (run_cli), not logged on every retry
    return KafkaProducer(
        bootstrap_servers=[s.strip() for s in config.bootstrap.split(",")],
        client_id="streamtrain-simulate",
        compression_type="gzip",
        linger_ms=10,
        batch_size=256 * 1024,
        max_request_size=max(1 << 20, config.max_message_bytes + (64 << 10)),
        max_block_ms=15_000,
        # the service's STREAMTRAIN_KAFKA_SECURITY_PROTOCOL, _SASL_*, _SSL_* (docs/contract.md, section 8)
        **client_options(security),
    )


@dataclass
class SimulationReport:
    """What a run sent and what became of it.

    ``delivery_errors`` counts records Kafka refused or that failed; ``unacknowledged`` those
    still in flight when the stop's ``close_timeout_s`` ran out (the broker may or may not
    have them).
    """

    sent: int = 0
    malformed: int = 0
    malformed_by_reason: dict[str, int] = field(default_factory=dict)
    delivery_errors: int = 0
    first_delivery_error: str | None = None
    unacknowledged: int = 0
    elapsed_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.sent / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> str:
        share = self.malformed / self.sent if self.sent else 0.0
        return (
            f"sent {self.sent} in {self.elapsed_s:.1f}s ({self.rate:.1f}/s), "
            f"malformed {self.malformed} ({share:.1%}), delivery errors {self.delivery_errors}"
            + (f", unacknowledged {self.unacknowledged}" if self.unacknowledged else "")
        )


class _Deliveries:
    """Counts acknowledged and failed sends; callbacks run on the producer's IO thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.acknowledged = 0
        self.failed = 0
        self.first_failure: str | None = None
        self._frozen = False

    def acknowledge(self, _metadata: Any = None) -> None:
        with self._lock:
            if not self._frozen:
                self.acknowledged += 1

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._frozen:
                return
            self.failed += 1
            if self.first_failure is None:
                self.first_failure = f"{type(exc).__name__}: {exc}"

    def freeze(self) -> None:
        """Count nothing more: records that settle later (dropped at close) stay unacknowledged."""
        with self._lock:
            self._frozen = True


CLOSE_WAIT_SLICE_S = 0.25  # how often the wait for acknowledgements looks at ``abandon``


def chunk_size(rate: float) -> int:
    """Records per send chunk: about a tenth of a second's worth, 1..512."""
    return 512 if rate <= 0 else int(min(512, max(1, rate // 10)))


def run_simulation(
    config: SimulationConfig,
    producer_factory: Callable[[SimulationConfig], Producer] = kafka_producer,
    *,
    stop: threading.Event | None = None,
    abandon: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    sleep: Callable[[float], Any] | None = None,
) -> SimulationReport:
    """Send the fleet's records until ``count``, ``duration_s`` or ``stop``, whichever comes first.

    Then wait up to ``config.close_timeout_s`` for Kafka to acknowledge what is in flight;
    ``abandon`` (a second Ctrl-C) cuts that wait short.

    ``sleep`` defaults to ``stop.wait`` (so a stop request cuts a pacing wait short) or
    ``time.sleep``. Injecting ``clock``/``sleep`` makes pacing testable without waiting.
    """
    stop = stop or threading.Event()
    sleep = sleep or stop.wait
    fleet = SensorFleet(config)
    chunk = chunk_size(config.rate)
    bucket = TokenBucket(config.rate, burst=chunk, clock=clock) if config.rate > 0 else None
    deliveries = _Deliveries()
    by_reason: Counter[str] = Counter()
    report = SimulationReport()
    producer = producer_factory(config)
    start = clock()
    next_progress = start + config.progress_interval_s
    logger.info(
        "simulating %d sensors to %s on %s at %s events/s (run id %s)",
        config.sensors,
        config.topic,
        config.bootstrap,
        config.rate or "max",
        fleet.run_id,
    )
    try:
        while not stop.is_set():
            n = chunk if config.count is None else min(chunk, config.count - report.sent)
            if n <= 0 or (config.duration_s is not None and clock() - start >= config.duration_s):
                break
            if bucket is not None:
                delay = bucket.reserve(n)
                if delay > 0:
                    sleep(delay)
                    if stop.is_set():
                        break
            batch = fleet.generate_batch(n, now=wall_clock(), elapsed_s=clock() - start)
            for key, value, reason in zip(batch.keys, batch.values, batch.reasons):
                if stop.is_set():  # a stop ends the chunk too: each send may block (max_block_ms)
                    break
                try:
                    future = producer.send(config.topic, value=value, key=key)
                    future.add_callback(deliveries.acknowledge).add_errback(deliveries.fail)
                except KafkaError as exc:  # a refused record (timeout, size) is counted, the run goes on
                    deliveries.fail(exc)
                if reason is not None:
                    by_reason[reason] += 1
                report.sent += 1
            if clock() >= next_progress:
                next_progress = clock() + config.progress_interval_s
                _fill(report, by_reason, deliveries, clock() - start)
                logger.info("progress: %s", report.summary())
    finally:
        _close(producer, config.close_timeout_s, abandon or threading.Event(), clock, deliveries)
    _fill(report, by_reason, deliveries, clock() - start)
    report.unacknowledged = report.sent - deliveries.acknowledged - deliveries.failed
    logger.info("done: %s", report.summary())
    return report


def _close(
    producer: Producer,
    timeout_s: float,
    abandon: threading.Event,
    clock: Callable[[], float],
    deliveries: _Deliveries,
) -> None:
    """Wait up to ``timeout_s`` for the records in flight (less if ``abandon`` is set), then close.

    A broker that has gone away would keep kafka-python's flush and close waiting out each
    batch in turn, so the wait here has one deadline and short slices (a second signal ends
    it); what is still in flight then is dropped (:func:`close_producer`) and counted as
    unacknowledged.
    """
    deadline = clock() + timeout_s
    flushed = False
    while not flushed and not abandon.is_set():
        remaining = deadline - clock()
        if remaining <= 0:
            break
        try:
            producer.flush(timeout=min(CLOSE_WAIT_SLICE_S, remaining))
            flushed = True
        except KafkaTimeoutError:
            pass
    if not flushed:
        deliveries.freeze()
    if not close_producer(producer, max(0.0, deadline - clock()) if flushed else 0.0):
        logger.warning("stopped with records in flight: Kafka did not acknowledge them within %.1fs", timeout_s)


def _fill(report: SimulationReport, by_reason: Counter[str], deliveries: _Deliveries, elapsed_s: float) -> None:
    report.malformed = sum(by_reason.values())
    report.malformed_by_reason = dict(sorted(by_reason.items()))
    report.delivery_errors = deliveries.failed
    report.first_delivery_error = deliveries.first_failure
    report.elapsed_s = elapsed_s


DESCRIPTION = (
    "Push synthetic sensor events to Kafka: K sensors (AR(2) oscillators or noisy sinusoids), "
    "lognormal lengths, optional labels, scheduled drift and a share of malformed messages. "
    "Settings come from defaults < --config TOML ([simulate] section or top-level keys) < "
    "STREAMTRAIN_KAFKA_BOOTSTRAP/TOPIC/CHANNELS/N_CLASSES/MAX_LEN/MAX_MESSAGE_BYTES < flags."
)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse subparsers object; ``args.func(args)`` runs it."""
    parser = subparsers.add_parser("simulate", help="push synthetic sensor events to Kafka", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per :class:`SimulationConfig` field, plus ``--config``; sets ``func``."""
    env_of = {name: ENV_PREFIX + env for env, name in ENV_SETTINGS.items()}
    parser.add_argument(
        "--config",
        dest="config_path",
        metavar="FILE",
        type=Path,
        default=None,
        help="TOML file with the settings (a [simulate] section or top-level keys)",
    )
    for name, info in SimulationConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = info.default
        shown = (
            "unset"
            if default is None
            else (" ".join(map(str, default)) or "none")
            if isinstance(default, tuple)
            else default
        )
        help_text = f"{info.description} (default: {shown}"
        help_text += f"; env {env_of[name]})" if name in env_of else ")"
        parser.add_argument(
            flag, dest=name, default=argparse.SUPPRESS, help=help_text, **_argparse_kind(info.annotation)
        )
    parser.set_defaults(func=run_cli)


def _argparse_kind(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field type: bool flags, choices, lists, numbers."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _argparse_kind(next(a for a in args if a is not type(None)))
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(args)}
    if origin is tuple:
        return {"nargs": "*", "type": args[0], "metavar": args[0].__name__.upper()}
    return {"type": annotation, "metavar": annotation.__name__.upper()}


def run_cli(args: argparse.Namespace) -> int:
    """Handler of ``streamtrain simulate``: 0 when every record was acknowledged, 1 if not, 2 on bad settings."""
    overrides = {name: value for name, value in vars(args).items() if name in SimulationConfig.model_fields}
    try:
        config = load_simulation_config(getattr(args, "config_path", None), os.environ, overrides)
        from streamtrain.ingest.security import KafkaSecurity

        KafkaSecurity.from_environment()  # refused here in one line, not by the producer
    except (SimulationConfigError, ValueError) as exc:
        print(f"streamtrain simulate: {exc}", file=sys.stderr)
        return 2
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka.net.transport").addFilter(one_line_socket_errors)
    stop, abandon = threading.Event(), threading.Event()
    previous = _install_stop_handlers(stop, abandon)
    try:
        report = run_simulation(config, stop=stop, abandon=abandon)
    except KafkaError as exc:  # e.g. NoBrokersAvailable: one line, not a traceback
        from streamtrain.ingest.security import current_failure

        cause = current_failure()
        if cause is not None:
            print(f"streamtrain simulate: cannot produce to {config.bootstrap}: {cause}", file=sys.stderr)
            return 1
        print(
            f"streamtrain simulate: cannot produce to {config.bootstrap} ({type(exc).__name__}: {exc}); "
            "check --bootstrap / STREAMTRAIN_KAFKA_BOOTSTRAP and that the broker runs",
            file=sys.stderr,
        )
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if report.delivery_errors or report.unacknowledged:
        problems = []
        if report.delivery_errors:
            problems.append(f"{report.delivery_errors} were not delivered (first: {report.first_delivery_error})")
        if report.unacknowledged:
            problems.append(
                f"{report.unacknowledged} were still unacknowledged when the run stopped "
                f"(close_timeout_s {config.close_timeout_s:g}): the broker may or may not have them"
            )
        print(f"streamtrain simulate: of {report.sent} records, " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


def _install_stop_handlers(stop: threading.Event, abandon: threading.Event) -> dict[int, Any]:
    """SIGINT/SIGTERM end the run cleanly (wait for acknowledgements, report); a second one
    stops the wait. Only possible on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handle(*_: Any) -> None:
        (abandon if stop.is_set() else stop).set()

    previous: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handle)
    return previous


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m streamtrain.tools.simulate [options]``: the same as ``streamtrain simulate``."""
    parser = argparse.ArgumentParser(prog="python -m streamtrain.tools.simulate", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
