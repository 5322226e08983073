"""Dead letters: every rejected message reaches ``<topic>.dlq``, and none is lost on the way.

The ingest thread hands each rejected message to a :class:`DeadLetterOutbox` and goes on
at once; the outbox's own thread sends it, keeps it until Kafka acknowledges it, and
retries a failed send, so a dead-letter topic that is slow, deleted or refusing never
holds up ingest of any partition. Checkpoints (and with them offset commits) wait for
the dead letters of the offsets they cover: :meth:`DeadLetterOutbox.mark` under the same
lock as the window state, then :meth:`DeadLetterOutbox.wait_acknowledged` up to that mark.

A message is forwarded unchanged (key, value) with the four contract headers ``reason``,
``source_topic``, ``source_partition``, ``source_offset``. When that cannot be written —
the dead-letter topic refuses the record itself (too large for it, invalid, not
authorized) at once, any other failure after ``DLQ_SEND_ATTEMPTS`` attempts — a bounded
**stand-in** goes instead: the same key and value cut to ``DLQ_STAND_IN_BYTES``, the four
headers, and ``original_size`` (bytes of the value), ``original_sha256`` (hex digest of
the value) and ``stand_in_cause``. A stand-in is retried until acknowledged. A deleted
dead-letter topic is created again (with its size limit) before the next attempt.

The producer sends with ``acks=all`` and is idempotent: a retry of a request whose answer
was lost (a leader killed, a connection broken) is not appended twice. Each dead letter is
written once, unless a send's outcome is still unknown when its delivery timeout ends
(the outbox then sends it again, as a new record) or the service restarts before a
checkpoint covered the message: then it can arrive twice; ``source_topic``,
``source_partition`` and ``source_offset`` identify it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer
from kafka.errors import (
    AuthorizationError,
    InvalidRecordError,
    InvalidTopicError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    UnknownTopicOrPartitionError,
)

from streamtrain.config import Settings
from streamtrain.ingest.kafka_compat import (
    close_producer,
    forbid_topic_auto_creation,
    producer_failed,
    survive_refused_records,
)
from streamtrain.ingest.security import authorization_reason, client_options
from streamtrain.ingest.topics import DLQ_HEADROOM_BYTES, ensure_dead_letter_topic
from streamtrain.metrics import Metrics

log = logging.getLogger(__name__)

CONTRACT_HEADERS = ("reason", "source_topic", "source_partition", "source_offset")
STAND_IN_HEADERS = ("original_size", "original_sha256", "stand_in_cause")

_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_MAX_RAW_PENDING_BYTES = 256 << 20  # beyond this much unacknowledged raw data, new letters go as stand-ins
# Errors that say the dead-letter topic refuses this very record: retrying it unchanged cannot help.
_RECORD_REFUSED: dict[type[Exception], str] = {
    MessageSizeTooLargeError: "too_large_for_dlq",
    RecordListTooLargeError: "too_large_for_dlq",
    InvalidRecordError: "refused_by_dlq",
    PolicyViolationError: "refused_by_dlq",
    AuthorizationError: "not_authorized",
}
# Errors that say the topic is not there (deleted; or metadata for it never came).
_TOPIC_MISSING = (UnknownTopicOrPartitionError, InvalidTopicError, KafkaTimeoutError)


@dataclass
class DeadLetter:
    """One rejected message on its way to the dead-letter topic."""

    seq: int  # submission order; checkpoints wait up to a mark in this order
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None  # the original value while it may still go unchanged
    reason: str
    size: int  # bytes of the original value
    digest: str = ""  # hex SHA-256 of the original value, once a stand-in is made
    cause: str | None = None  # why a stand-in goes instead (None: the message goes unchanged)
    attempts: int = 0
    due: float = 0.0  # monotonic time of the next attempt
    in_flight: bool = False
    submitted_at: float = 0.0
    last_error: str | None = None

    def headers(self) -> list[tuple[str, bytes]]:
        headers = [
            ("reason", self.reason.encode()),
            ("source_topic", self.topic.encode()),
            ("source_partition", str(self.partition).encode()),
            ("source_offset", str(self.offset).encode()),
        ]
        if self.cause is not None:
            headers += [
                ("original_size", str(self.size).encode()),
                ("original_sha256", self.digest.encode()),
                ("stand_in_cause", self.cause.encode()),
            ]
        return headers

    def make_stand_in(self, cause: str, keep_bytes: int) -> None:
        """Replace the original by its bounded stand-in (digest first, then drop the bytes)."""
        if self.cause is not None:
            return
        self.digest = hashlib.sha256(self.value or b"").hexdigest()
        self.value = None if self.value is None else self.value[:keep_bytes]
        self.key = None if self.key is None else self.key[:keep_bytes]
        self.cause = cause
        self.attempts = 0

    @property
    def form(self) -> str:
        return "raw" if self.cause is None else "stand_in"


def stand_in_cause(error: BaseException) -> str | None:
    """The cause to name when ``error`` means the record itself is refused; None otherwise."""
    for kind, cause in _RECORD_REFUSED.items():
        if isinstance(error, kind):
            return cause
    return None


def retry_delay_s(attempts: int) -> float:
    """Seconds before the next try of a letter that failed ``attempts`` times (the last step repeats)."""
    return _BACKOFF_S[min(attempts, len(_BACKOFF_S)) - 1]


ProducerFactory = Callable[[int], Any]  # max_request_size -> a KafkaProducer (or a test double)


class DeadLetterOutbox:
    """Sends dead letters on a thread of its own and keeps each until Kafka acknowledges it."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        producer_factory: ProducerFactory | None = None,
        repair_topic: Callable[[int], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._producer_factory = producer_factory or self._kafka_producer
        self._repair_topic = repair_topic or (lambda limit: ensure_dead_letter_topic(settings, limit))
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: dict[int, DeadLetter] = {}  # seq -> letter; insertion order is seq order
        self._completions: list[tuple[DeadLetter, BaseException | None]] = []
        self._next_seq = 1
        self._raw_bytes = 0
        self._producer: Any = None
        self._producer_request_size = 0
        self._request_size = max(1 << 20, settings.max_message_bytes) + DLQ_HEADROOM_BYTES
        self._source_limit = settings.max_message_bytes
        self._topic_missing = False
        self._blocked_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        #: ``kafka_authorization_failed: WRITE on topic <topic>.dlq`` while the .dlq refuses this principal
        self.security_failure: str | None = None
        metrics.dead_letters_pending.set_function(lambda: len(self._pending))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dead-letters", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is pending for up to ``timeout_s``, then stop; unsent letters stay
        uncommitted (their messages are read, and dead-lettered, again after a restart)."""
        self.wait_acknowledged(None, timeout_s)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                close_producer(producer, 2.0)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    def configure(self, source_max_message_bytes: int, fetch_max_bytes: int) -> None:
        """Size requests for anything the consumer can fetch: the event topic's limit or the fetch limit."""
        with self._cond:
            self._source_limit = source_max_message_bytes
            floor = max(1 << 20, self.settings.max_message_bytes)
            self._request_size = max(floor, source_max_message_bytes, fetch_max_bytes) + DLQ_HEADROOM_BYTES
            self._cond.notify_all()

    # ------------------------------------------------------------------ the ingest thread's side
    def submit(self, message: Any, reason: str) -> None:
        """Queue one rejected message (a kafka-python ConsumerRecord); never blocks on Kafka."""
        value = message.value
        letter = DeadLetter(
            seq=0, topic=message.topic, partition=message.partition, offset=message.offset, key=message.key,
            value=value, reason=reason, size=0 if value is None else len(value), submitted_at=self._clock(),
        )  # fmt: skip
        if self._raw_bytes + letter.size > _MAX_RAW_PENDING_BYTES:
            letter.make_stand_in("outbox_full", self.settings.dlq_stand_in_bytes)
        with self._cond:
            letter.seq = self._next_seq
            self._next_seq += 1
            self._pending[letter.seq] = letter
            if letter.cause is None:
                self._raw_bytes += letter.size
            self._cond.notify_all()

    # ------------------------------------------------------------------ checkpoints' side
    def mark(self) -> int:
        """The sequence number of the newest dead letter submitted so far."""
        with self._cond:
            return self._next_seq - 1

    def wait_acknowledged(self, upto: int | None, timeout_s: float) -> bool:
        """Wait until every dead letter up to ``upto`` (None: all so far) is acknowledged."""
        with self._cond:
            limit = self._next_seq - 1 if upto is None else upto
            return self._cond.wait_for(lambda: self._oldest_seq() > limit, timeout=timeout_s)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def oldest_pending_age_s(self) -> float | None:
        """Seconds the oldest unacknowledged dead letter has waited; None when none waits."""
        with self._cond:
            oldest = next(iter(self._pending.values()), None)
            return None if oldest is None else self._clock() - oldest.submitted_at

    def describe(self) -> str:
        """One line on what is unacknowledged, for logs and /readyz."""
        with self._cond:
            if not self._pending:
                return "no dead letter pending"
            oldest = next(iter(self._pending.values()))
            age = self._clock() - oldest.submitted_at
            error = oldest.last_error or self.last_error or "no answer yet"
        return (
            f"{len(self._pending)} dead letters not acknowledged by Kafka, the oldest (partition {oldest.partition} "
            f"offset {oldest.offset}, {oldest.form}) for {age:.0f} s: {error}"
        )

    def _oldest_seq(self) -> float:
        return next(iter(self._pending), float("inf"))

    # ------------------------------------------------------------------ the outbox thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as err:  # noqa: BLE001 - the outbox thread must survive anything
                self.last_error = f"{type(err).__name__}: {err}"
                log.exception("dead-letter outbox error; going on")
                self._stop.wait(1.0)

    def _step(self) -> None:
        with self._cond:
            self._settle_locked()
            now = self._clock()
            due = self._due_locked(now)
            if not due:
                self._cond.wait(timeout=self._idle_s_locked(now))
                return
        if self._topic_missing:
            self._repair()
            return
        producer = self._ensure_producer()
        if producer is None:
            return
        for letter in due:
            if self._stop.is_set():
                break
            self._send(producer, letter)

    def _due_locked(self, now: float) -> list[DeadLetter]:
        """The letters to send now: due and not in flight; none while sends are held back."""
        if now < self._blocked_until:
            return []
        return [letter for letter in self._pending.values() if not letter.in_flight and letter.due <= now]

    def _idle_s_locked(self, now: float) -> float:
        """How long the thread may sleep when nothing is due: until the next letter or the end of
        a hold-back, at most a second (submissions and completions wake it sooner)."""
        waits = [letter.due for letter in self._pending.values() if not letter.in_flight]
        wake = max(min(waits, default=now + 1.0), self._blocked_until)
        return min(1.0, max(0.01, wake - now))

    def _ensure_producer(self) -> Any:
        if (
            self._producer is not None
            and self._producer_request_size >= self._request_size
            and not producer_failed(self._producer)
        ):
            return self._producer
        old, self._producer = self._producer, None
        if old is not None:
            close_producer(old, 5.0)  # in-flight sends finish or fail (and come back through the callbacks)
        try:
            self._producer = self._producer_factory(self._request_size)
            self._producer_request_size = self._request_size
        except Exception as err:  # noqa: BLE001 - no broker yet: try again later
            self._note_failure(f"dead-letter producer: {type(err).__name__}: {err}")
            self._blocked_until = self._clock() + 2.0
        return self._producer

    def _kafka_producer(self, max_request_size: int) -> KafkaProducer:
        producer = KafkaProducer(
            bootstrap_servers=self.settings.kafka_bootstrap,
            client_id="streamtrain-dlq",
            acks="all",
            # Idempotent: a retry after a leader change or a lost answer is not appended twice.
            # kafka-python 3.0.12 would turn one refused dead letter (too large for the .dlq, not
            # authorized) into a fatal state that fails every later send: survive_refused_records
            # makes it bump the epoch and go on, as the Java client does; a producer that is
            # fatal all the same (cluster authorization) is replaced (_ensure_producer).
            enable_idempotence=True,
            max_in_flight_requests_per_connection=1,
            linger_ms=20,
            max_request_size=max_request_size,
            max_block_ms=5000,  # metadata for a missing topic: fail fast, repair, retry
            delivery_timeout_ms=30000,
            request_timeout_ms=15000,
            reconnect_backoff_max_ms=2000,
            **client_options(self.settings),
        )
        # a deleted .dlq comes back with its size limit, not broker defaults
        return survive_refused_records(forbid_topic_auto_creation(producer))

    def _send(self, producer: Any, letter: DeadLetter) -> None:
        letter.in_flight = True
        letter.attempts += 1
        try:
            future = producer.send(
                self.settings.dlq_topic, key=letter.key, value=letter.value, headers=letter.headers()
            )
        except Exception as err:  # noqa: BLE001 - KafkaTimeoutError, MessageSizeTooLargeError, closed producer...
            self._complete(letter, err)
            return
        future.add_callback(lambda _metadata, letter=letter: self._complete(letter, None))
        future.add_errback(lambda err, letter=letter: self._complete(letter, err))

    def _complete(self, letter: DeadLetter, error: BaseException | None) -> None:
        """Runs on kafka-python's IO thread (or this one): record the outcome, nothing more."""
        with self._cond:
            self._completions.append((letter, error))
            self._cond.notify_all()

    def _settle_locked(self) -> None:
        completions, self._completions = self._completions, []
        for letter, error in completions:
            letter.in_flight = False
            if error is None:
                if self.security_failure is not None:
                    log.info("dead-letter topic accepts writes again (was: %s)", self.security_failure)
                    self.security_failure = None
                self._pending.pop(letter.seq, None)
                if letter.cause is None:
                    self._raw_bytes -= letter.size
                self.metrics.dead_letters_written.labels(letter.form).inc()
                if letter.cause is not None:
                    log.warning(
                        "dead letter of %s[%d]@%d (%d bytes, %s) written as a stand-in: %s",
                        letter.topic, letter.partition, letter.offset, letter.size, letter.reason, letter.cause,
                    )  # fmt: skip
                continue
            self._failed_locked(letter, error)
        if completions:
            self._cond.notify_all()

    def _failed_locked(self, letter: DeadLetter, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        if isinstance(error, AuthorizationError):
            self.security_failure = authorization_reason(error, "WRITE", topic=self.settings.dlq_topic)
            text = self.security_failure or text
        letter.last_error = text
        self._note_failure(text)
        self.metrics.dead_letters_failed.inc()
        now = self._clock()
        if isinstance(error, _TOPIC_MISSING):
            self._topic_missing = True
        if letter.cause is None:
            cause = stand_in_cause(error)
            if cause is None and letter.attempts >= self.settings.dlq_send_attempts:
                cause = "send_attempts_exhausted"
            if cause is not None:
                self._raw_bytes -= letter.size
                letter.make_stand_in(cause, self.settings.dlq_stand_in_bytes)
                letter.due = now
                return
        letter.due = now + retry_delay_s(letter.attempts)

    def _note_failure(self, text: str) -> None:
        if text != self.last_error:
            log.warning("dead-letter send failed (kept, retried): %s", text)
        self.last_error = text

    def _repair(self) -> None:
        """The dead-letter topic is missing: create it again, then start a fresh producer."""
        try:
            created = self._repair_topic(self._source_limit)
        except (KafkaError, OSError) as err:
            self._note_failure(f"recreating {self.settings.dlq_topic}: {type(err).__name__}: {err}")
            self._blocked_until = self._clock() + 2.0
            return
        if created:
            log.warning("dead-letter topic %s was missing: created it again", self.settings.dlq_topic)
            self._producer_request_size = 0  # a producer that knew the old topic starts over
        self._topic_missing = False
