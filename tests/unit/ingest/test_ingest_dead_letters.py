"""The dead-letter outbox against a scripted producer: nothing lost, nothing retried forever."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import namedtuple
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.errors import (
    ClusterAuthorizationFailedError,
    IllegalStateError,
    InvalidReplicationFactorError,
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotEnoughReplicasError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)

import streamtrain.ingest.dead_letters as dead_letters
from streamtrain.config import load_settings
from streamtrain.ingest.dead_letters import CONTRACT_HEADERS, STAND_IN_HEADERS, DeadLetterOutbox
from streamtrain.metrics import Metrics

Message = namedtuple("Message", "topic partition offset key value")
REAL_BACKOFF_S = dead_letters._BACKOFF_S  # before the fixture below shortens it
SETTINGS = load_settings(topic="events", dlq_send_attempts=3, dlq_stand_in_bytes=16)
PATIENT = load_settings(topic="events", dlq_send_attempts=1000)  # transient failures never make a stand-in


class Done:
    """A kafka-python future that is already resolved: callbacks run when added."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def add_callback(self, fn: Callable[..., Any]) -> Done:
        if self.error is None:
            fn(object())
        return self

    def add_errback(self, fn: Callable[..., Any]) -> Done:
        if self.error is not None:
            fn(self.error)
        return self


class ScriptedProducer:
    """Answers each send with the next scripted outcome for that record (then success)."""

    def __init__(self, script: Callable[[tuple[int, int], int], BaseException | None]) -> None:
        self.script = script
        self.attempts: dict[tuple[int, int], int] = {}
        self.written: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> Done:
        meta = {k: v.decode() for k, v in headers}
        identity = (int(meta["source_partition"]), int(meta["source_offset"]))
        with self.lock:
            attempt = self.attempts.get(identity, 0)
            self.attempts[identity] = attempt + 1
            outcome = self.script(identity, attempt)
            if isinstance(outcome, KafkaTimeoutError):
                raise outcome  # metadata never came: send() itself raises
            if outcome is None:
                self.written.append({"topic": topic, "key": key, "value": value, "headers": meta})
        return Done(outcome)

    def close(self, timeout: float | None = None) -> None:
        pass


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dead_letters, "_BACKOFF_S", (0.001, 0.002, 0.005))


def outbox_with(script: Callable[[tuple[int, int], int], BaseException | None], **kw: Any):
    producer = ScriptedProducer(script)
    repairs: list[int] = []
    metrics = Metrics()
    box = DeadLetterOutbox(
        kw.pop("settings", SETTINGS), metrics, producer_factory=lambda size: producer,
        repair_topic=lambda limit: repairs.append(limit) or True,
    )  # fmt: skip
    return box, producer, repairs, metrics


def message(i: int, size: int = 40) -> Message:
    return Message("events", i % 3, 100 + i, f"k{i}".encode(), bytes([i % 251]) * size)


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_dead_letter_goes_unchanged_with_the_four_headers() -> None:
    box, producer, _, metrics = outbox_with(lambda identity, attempt: None)
    box.start()
    try:
        box.submit(message(1), "schema")
        assert box.wait_acknowledged(box.mark(), 5)
    finally:
        box.close(1)
    [written] = producer.written
    assert written["topic"] == "events.dlq" and written["key"] == b"k1" and written["value"] == message(1).value
    assert written["headers"] == {
        "reason": "schema",
        "source_topic": "events",
        "source_partition": "1",
        "source_offset": "101",
    }
    assert sample(metrics, "streamtrain_dead_letters_written_total", form="raw") == 1
    assert box.pending == 0 and sample(metrics, "streamtrain_dead_letters_pending") == 0


def test_a_failed_send_is_kept_and_the_checkpoint_keeps_waiting_until_it_is_acknowledged() -> None:
    """The lost-dead-letter bug: a failure must not be forgotten by the next flush."""
    release = threading.Event()
    box, producer, _, metrics = outbox_with(
        lambda identity, attempt: None if release.is_set() else NotEnoughReplicasError(),
        settings=PATIENT,
    )
    box.start()
    try:
        box.submit(message(2), "decode")
        mark = box.mark()
        assert not box.wait_acknowledged(mark, 0.3)
        assert sample(metrics, "streamtrain_dead_letters_failed_total") >= 1
        assert not box.wait_acknowledged(mark, 0.3)  # still not: nothing was reset
        assert box.pending == 1 and "not acknowledged" in box.describe() and "NotEnoughReplicas" in box.describe()
        release.set()
        assert box.wait_acknowledged(mark, 5)
    finally:
        box.close(1)
    assert [w["value"] for w in producer.written] == [message(2).value]  # once, unchanged


def test_a_record_the_dlq_refuses_goes_as_a_bounded_stand_in_at_once() -> None:
    box, producer, _, metrics = outbox_with(
        lambda identity, attempt: MessageSizeTooLargeError() if attempt == 0 else None
    )
    big = Message("events", 2, 7, b"K" * 40, bytes(range(256)) * 100)
    box.start()
    try:
        box.submit(big, "too_large")
        assert box.wait_acknowledged(None, 5)
    finally:
        box.close(1)
    [written] = producer.written
    assert written["value"] == big.value[:16] and written["key"] == big.key[:16]
    headers = written["headers"]
    assert set(headers) == set(CONTRACT_HEADERS) | set(STAND_IN_HEADERS)
    assert headers["reason"] == "too_large" and headers["source_partition"] == "2" and headers["source_offset"] == "7"
    assert headers["original_size"] == str(len(big.value))
    assert headers["original_sha256"] == hashlib.sha256(big.value).hexdigest()
    assert headers["stand_in_cause"] == "too_large_for_dlq"
    assert producer.attempts[(2, 7)] == 2  # one raw try, then the stand-in: never retried forever
    assert sample(metrics, "streamtrain_dead_letters_written_total", form="stand_in") == 1


def test_the_kafka_producer_is_idempotent_with_acks_all_and_survives_a_refused_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kafka import KafkaProducer
    from kafka.producer.transaction_manager import TransactionManager

    # a known broker version: built without asking a broker
    monkeypatch.setattr(dead_letters, "KafkaProducer", lambda **kw: KafkaProducer(api_version=(4, 1), **kw))
    box = DeadLetterOutbox(load_settings(topic="events", kafka_bootstrap="127.0.0.1:9"), Metrics())
    producer = box._kafka_producer(2 << 20)
    try:
        assert producer.config["acks"] == -1 and producer.config["enable_idempotence"] is True
        manager = producer._transaction_manager
        decided = manager.classify_batch_error(MessageSizeTooLargeError(), None)
        assert decided == TransactionManager.ERROR_CLASS_NEEDS_EPOCH_BUMP  # not FATAL (kafka_compat)
    finally:
        producer.close(timeout=1)


class FailingForGood(ScriptedProducer):
    """A producer that goes into kafka-python's fatal state after its first send (every send fails)."""

    def __init__(self) -> None:
        super().__init__(lambda identity, attempt: None)
        self.fatal = False
        self._transaction_manager = SimpleNamespace(
            classify_batch_error=None, is_transactional=lambda: False, _supports_epoch_bump=lambda: True,
            has_fatal_error=lambda: self.fatal, _FATAL_ERRORS=frozenset(), ERROR_CLASS_NEEDS_EPOCH_BUMP="BUMP",
        )  # fmt: skip

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> Done:
        if self.fatal:
            return Done(ClusterAuthorizationFailedError())
        self.fatal = True
        return Done(ClusterAuthorizationFailedError())


def outbox_replacing(first: ScriptedProducer) -> tuple[DeadLetterOutbox, list[ScriptedProducer]]:
    """A started outbox whose first producer is ``first`` and every later one accepts everything."""
    made: list[ScriptedProducer] = []

    def factory(size: int) -> ScriptedProducer:
        made.append(first if not made else ScriptedProducer(lambda identity, attempt: None))
        return made[-1]

    box = DeadLetterOutbox(PATIENT, Metrics(), producer_factory=factory)
    box.start()
    return box, made


def test_a_producer_left_in_its_fatal_state_is_replaced() -> None:
    box, made = outbox_replacing(FailingForGood())
    try:
        box.submit(message(3), "decode")
        assert box.wait_acknowledged(None, 10)
    finally:
        box.close(1)
    assert len(made) == 2 and len(made[1].written) == 1


class InFlight:
    """A kafka-python future that never resolves by itself (its broker is gone)."""

    def __init__(self) -> None:
        self.errbacks: list[Callable[..., Any]] = []

    def add_callback(self, fn: Callable[..., Any]) -> InFlight:
        return self

    def add_errback(self, fn: Callable[..., Any]) -> InFlight:
        self.errbacks.append(fn)
        return self


class StuckInItsFatalState(FailingForGood):
    """Fatal after its first send, whose record stays in flight: kafka-python 3.0.12's
    ``close(timeout)`` raises on it, and only its sender's ``force_close`` fails it."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight: list[InFlight] = []
        self._sender = SimpleNamespace(force_close=self._force_close)

    def send(self, topic: str, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> Any:
        if self.fatal:
            return Done(ClusterAuthorizationFailedError())
        self.fatal = True
        self.in_flight.append(InFlight())
        return self.in_flight[-1]

    def close(self, timeout: float | None = None) -> None:
        if self.in_flight:
            raise KafkaTimeoutError("Timeout waiting for future")

    def _force_close(self) -> None:
        stuck, self.in_flight = self.in_flight, []
        for future in stuck:
            for errback in future.errbacks:
                errback(IllegalStateError("Producer is closed forcefully."))


def test_a_letter_in_flight_on_a_replaced_producer_is_sent_again_not_left_waiting() -> None:
    stuck = StuckInItsFatalState()
    box, made = outbox_replacing(stuck)
    try:
        box.submit(message(3), "decode")
        wait_until = time.monotonic() + 10
        while not stuck.fatal:
            assert time.monotonic() < wait_until, "the first letter was never sent"
            time.sleep(0.01)
        box.submit(message(4), "decode")  # due: the fatal producer is replaced, and closed
        assert box.wait_acknowledged(None, 10)
    finally:
        box.close(1)
    assert len(made) == 2
    assert sorted(int(w["headers"]["source_offset"]) for w in made[1].written) == [103, 104]


def test_after_the_allowed_attempts_a_stand_in_goes_instead() -> None:
    box, producer, _, _ = outbox_with(lambda identity, attempt: NotEnoughReplicasError() if attempt < 3 else None)
    box.start()
    try:
        box.submit(message(3), "schema")
        assert box.wait_acknowledged(None, 5)
    finally:
        box.close(1)
    [written] = producer.written
    assert producer.attempts[(0, 103)] == 4 and written["headers"]["stand_in_cause"] == "send_attempts_exhausted"


def test_a_stand_in_is_retried_until_acknowledged() -> None:
    box, producer, _, _ = outbox_with(
        lambda identity, attempt: TopicAuthorizationFailedError() if attempt < 6 else None
    )
    box.start()
    try:
        box.submit(message(4), "schema")
        assert box.wait_acknowledged(None, 5)
    finally:
        box.close(1)
    [written] = producer.written
    assert written["headers"]["stand_in_cause"] == "not_authorized" and producer.attempts[(1, 104)] == 7


def test_a_missing_dlq_is_created_again_before_the_next_attempt() -> None:
    box, producer, repairs, _ = outbox_with(
        lambda identity, attempt: UnknownTopicOrPartitionError() if attempt == 0 else None
    )
    box.configure(16 << 20, 8 << 20)
    box.start()
    try:
        box.submit(message(5), "decode")
        assert box.wait_acknowledged(None, 5)
    finally:
        box.close(1)
    assert repairs == [16 << 20]  # with the event topic's size limit
    assert [w["value"] for w in producer.written] == [message(5).value]


def test_send_raising_at_once_is_a_failed_attempt_too() -> None:
    box, producer, repairs, _ = outbox_with(lambda identity, attempt: KafkaTimeoutError() if attempt < 2 else None)
    box.start()
    try:
        box.submit(message(6), "decode")
        assert box.wait_acknowledged(None, 5)
    finally:
        box.close(1)
    assert repairs and [w["value"] for w in producer.written] == [message(6).value]


def test_letters_after_the_mark_do_not_hold_up_a_checkpoint() -> None:
    blocked = {(1, 107)}
    box, producer, _, _ = outbox_with(
        lambda identity, attempt: NotEnoughReplicasError() if identity in blocked else None,
        settings=PATIENT,
    )
    box.start()
    try:
        box.submit(message(6), "decode")
        mark = box.mark()
        box.submit(message(7), "decode")  # after the checkpoint's state: it may wait
        assert box.wait_acknowledged(mark, 5)
        assert not box.wait_acknowledged(None, 0.2)
        blocked.clear()
        assert box.wait_acknowledged(None, 5)
    finally:
        box.close(1)


def test_the_request_size_follows_the_fetch_limits() -> None:
    sizes: list[int] = []
    box = DeadLetterOutbox(
        SETTINGS, Metrics(), producer_factory=lambda size: sizes.append(size) or ScriptedProducer(lambda i, a: None)
    )
    box.configure(16 << 20, 1 << 20)
    box.configure(16 << 20, 1 << 20)  # every reconnect configures it again: the same size, the same producer
    box.start()
    try:
        box.submit(message(8), "decode")
        assert box.wait_acknowledged(None, 5)
        box.configure(16 << 20, 1 << 20)
        box.submit(message(9), "decode")
        assert box.wait_acknowledged(None, 5)
    finally:
        box.close(1)
    assert sizes == [(16 << 20) + 64 * 1024]


OUTCOMES = st.sampled_from(["ok", "transient", "too_large", "missing", "timeout", "denied"])
ERRORS: dict[str, Callable[[], BaseException | None]] = {
    "ok": lambda: None,
    "transient": NotEnoughReplicasError,
    "too_large": MessageSizeTooLargeError,
    "missing": UnknownTopicOrPartitionError,
    "timeout": KafkaTimeoutError,
    "denied": TopicAuthorizationFailedError,
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 200), min_size=1, max_size=12),
    scripts=st.lists(st.lists(OUTCOMES, max_size=6), min_size=12, max_size=12),
)
def test_every_dead_letter_arrives_exactly_once_whole_or_as_its_stand_in(
    sizes: list[int], scripts: list[list[str]]
) -> None:
    messages = [
        Message("events", i % 2, 10 + i, None if i % 5 == 4 else f"k{i}".encode(), bytes([i]) * n)
        for i, n in enumerate(sizes)
    ]

    def script(identity: tuple[int, int], attempt: int) -> BaseException | None:
        plan = scripts[identity[1] - 10]
        return ERRORS[plan[attempt]]() if attempt < len(plan) else None

    box, producer, _, metrics = outbox_with(script)
    box.start()
    try:
        for m in messages:
            box.submit(m, "schema")
        assert box.wait_acknowledged(None, 20)
    finally:
        box.close(1)
    by_identity: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for w in producer.written:
        by_identity.setdefault((int(w["headers"]["source_partition"]), int(w["headers"]["source_offset"])), []).append(
            w
        )
    assert sorted(by_identity) == sorted((m.partition, m.offset) for m in messages)
    for m in messages:
        [w] = by_identity[(m.partition, m.offset)]
        if "stand_in_cause" in w["headers"]:
            assert w["value"] == m.value[:16] and len(w["value"]) <= 16
            assert w["headers"]["original_sha256"] == hashlib.sha256(m.value).hexdigest()
            assert w["headers"]["original_size"] == str(len(m.value))
        else:
            assert w["value"] == m.value and w["key"] == m.key
    written = sum(sample(metrics, "streamtrain_dead_letters_written_total", form=f) for f in ("raw", "stand_in"))
    assert written == len(messages) and box.pending == 0


def test_a_checkpoint_is_neither_written_nor_committed_past_an_unacknowledged_dead_letter(tmp_path: Any) -> None:
    """Service level: the old flush forgot a failure, so the next checkpoint (and commit) passed it."""
    from streamtrain.runtime.service import Service

    settings = load_settings(
        kafka_bootstrap="127.0.0.1:9",
        topic="events",
        checkpoint_dir=tmp_path / "ckpt",
        d_model=16,
        n_heads=2,
        n_layers=1,
        token_budget=512,
        max_len=32,
    )
    service = Service(settings)
    deliver = threading.Event()
    clock = [0.0]
    box, producer, _, _ = outbox_with(lambda identity, attempt: None if deliver.is_set() else NotEnoughReplicasError(),
                                      settings=PATIENT)  # fmt: skip
    box._clock = lambda: clock[0]
    service.ingest.dead_letters = box
    flush = service.ingest.flush_dead_letters
    service.ingest.flush_dead_letters = lambda timeout_s=10.0, upto=None: flush(0.3, upto)  # type: ignore[method-assign]
    commits: list[dict[int, int]] = []
    service.ingest.request_commit = lambda offsets, timeout_s=10.0: commits.append(dict(offsets)) or True  # type: ignore[method-assign]
    box.start()
    try:
        box.submit(message(9), "schema")
        service.window.advance_offsets({0: 110})  # the window state covers the rejected message's offset
        for _ in range(2):  # and the second attempt must fail as the first did
            assert service.checkpoint() is None
            assert "not acknowledged" in (service.checkpoint_error or "")
        assert not list((tmp_path / "ckpt").glob("*.stck")) and commits == []
        clock[0] = 31.0
        _, reasons = service.readiness()
        assert any(r.startswith("dead_letters_pending: 1 dead letters not acknowledged") for r in reasons), reasons
        deliver.set()
        assert box.wait_acknowledged(None, 5)
        assert service.checkpoint() is not None and commits == [{0: 110}]
        assert service.checkpoint_error is None
    finally:
        box.close(1)
    assert [w["value"] for w in producer.written] == [message(9).value]


def test_past_the_raw_bytes_cap_letters_go_as_stand_ins_and_the_cap_frees_as_they_are_acknowledged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The outbox holds at most ``_MAX_RAW_PENDING_BYTES`` of unacknowledged originals: beyond, a stand-in."""
    monkeypatch.setattr(dead_letters, "_MAX_RAW_PENDING_BYTES", 100)
    box, producer, _, _ = outbox_with(lambda identity, attempt: None)
    for offset, size in ((1, 40), (2, 60), (3, 1), (5, 40)):  # 100 bytes exactly fit; one more does not
        box.submit(Message("events", 0, offset, None, b"v" * size), "schema")
    with caplog.at_level(logging.WARNING, logger="streamtrain.ingest.dead_letters"):
        box.start()
        try:
            assert box.wait_acknowledged(None, 5)
            box.submit(Message("events", 0, 4, None, b"w" * 100), "schema")  # acknowledged: the cap is free again
            assert box.wait_acknowledged(None, 5)
        finally:
            box.close(1)
    forms = {int(w["headers"]["source_offset"]): w["headers"].get("stand_in_cause", "raw") for w in producer.written}
    assert forms == {1: "raw", 2: "raw", 3: "outbox_full", 4: "raw", 5: "outbox_full"}
    assert [w["value"] for w in producer.written if w["headers"]["source_offset"] == "5"] == [b"v" * 16]
    assert [r.getMessage() for r in caplog.records if "stand-in" in r.getMessage()] == [
        "dead letter of events[0]@3 (1 bytes, schema) written as a stand-in: outbox_full",
        "dead letter of events[0]@5 (40 bytes, schema) written as a stand-in: outbox_full",
    ]


def test_a_dlq_that_refuses_this_principal_is_named_until_it_accepts_again(caplog: pytest.LogCaptureFixture) -> None:
    box, _, _, _ = outbox_with(lambda identity, attempt: TopicAuthorizationFailedError() if attempt == 0 else None)
    box.submit(message(5), "schema")
    box._send(box._producer_factory(1 << 20), box._pending[1])
    with box._cond:
        box._settle_locked()
    assert box.security_failure == "kafka_authorization_failed: WRITE on topic events.dlq"
    assert box.last_error == box.security_failure and box.describe().endswith(box.security_failure)
    box._send(box._producer_factory(1 << 20), box._pending[1])
    with caplog.at_level(logging.INFO, logger="streamtrain.ingest.dead_letters"), box._cond:
        box._settle_locked()
    assert box.security_failure is None and box.pending == 0
    assert "dead-letter topic accepts writes again (was: kafka_authorization_failed: WRITE on topic events.dlq)" in [
        r.getMessage() for r in caplog.records
    ]


def test_a_fresh_outbox_marks_nothing_and_numbers_letters_from_one() -> None:
    box, _, _, _ = outbox_with(lambda identity, attempt: None)
    assert box.mark() == 0 and box.wait_acknowledged(0, 0) and box.wait_acknowledged(None, 0)
    assert box.security_failure is None and box.last_error is None
    box.submit(message(1), "schema")
    box.submit(message(2), "schema")
    assert box.mark() == 2 and list(box._pending) == [1, 2]


def test_the_kafka_producer_is_built_with_these_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[dict[str, Any]] = []

    class Built(Exception):
        pass

    def record(**kw: Any) -> None:
        built.append(kw)
        raise Built

    monkeypatch.setattr(dead_letters, "KafkaProducer", record)
    settings = load_settings(topic="events", kafka_bootstrap="broker-a:9092,broker-b:9092")
    with pytest.raises(Built):
        DeadLetterOutbox(settings, Metrics())._kafka_producer(3 << 20)
    assert built == [
        {
            "bootstrap_servers": "broker-a:9092,broker-b:9092",
            "client_id": "streamtrain-dlq",
            "acks": "all",
            "enable_idempotence": True,
            "max_in_flight_requests_per_connection": 1,
            "linger_ms": 20,
            "max_request_size": 3 << 20,
            "max_block_ms": 5000,
            "delivery_timeout_ms": 30000,
            "request_timeout_ms": 15000,
            "reconnect_backoff_max_ms": 2000,
            "security_protocol": "PLAINTEXT",
        }
    ]


def test_the_outbox_thread_is_one_daemon_named_dead_letters_and_close_stops_it() -> None:
    box, producer, _, _ = outbox_with(lambda identity, attempt: None)
    closed: list[float | None] = []
    producer.close = lambda timeout=None: closed.append(timeout)  # type: ignore[method-assign]
    box.start()
    box.start()
    threads = [t for t in threading.enumerate() if t.name == "dead-letters" and t.is_alive()]
    assert threads == [box._thread] and box._thread is not None and box._thread.daemon
    box.submit(message(1), "schema")
    assert box.wait_acknowledged(None, 5)
    box.close(1)
    assert not box._thread.is_alive() and closed == [2.0]  # the producer gets two seconds to finish


def test_close_gives_up_on_an_unacknowledged_letter_after_its_timeout() -> None:
    box, _, _, _ = outbox_with(
        lambda identity, attempt: NotEnoughReplicasError(),
        settings=PATIENT,
    )
    box.start()
    box.submit(message(1), "schema")
    started = time.monotonic()
    box.close(0.3)
    assert time.monotonic() - started < 3 and box.pending == 1  # left uncommitted: read again after a restart


def test_waiting_for_all_so_far_ignores_letters_submitted_during_the_wait() -> None:
    first = threading.Event()
    box, _, _, _ = outbox_with(
        lambda identity, attempt: None if identity == (1, 101) and first.is_set() else NotEnoughReplicasError(),
        settings=PATIENT,
    )
    box.submit(message(1), "schema")
    outcome: list[bool] = []
    waiter = threading.Thread(target=lambda: outcome.append(box.wait_acknowledged(None, 5)))
    waiter.start()
    time.sleep(0.1)
    box.submit(message(2), "schema")  # never acknowledged, as the next one
    box.submit(message(3), "schema")
    box.start()
    try:
        first.set()
        waiter.join(10)
        assert outcome == [True] and box.pending == 2
    finally:
        box.close(0.1)


class Pauses(threading.Event):
    """The outbox's stop event, recording how long the thread pauses on it (and pausing a tenth of that)."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.pauses.append(timeout)
        return super().wait(None if timeout is None else timeout / 10)


def test_the_outbox_thread_survives_an_error_of_its_own_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    producer = ScriptedProducer(lambda identity, attempt: UnknownTopicOrPartitionError() if attempt == 0 else None)
    repairs: list[int] = []

    def repair(limit: int) -> bool:
        repairs.append(limit)
        if len(repairs) == 1:
            raise RuntimeError("boom")  # not a Kafka error: the thread's own guard catches it
        return True

    box = DeadLetterOutbox(SETTINGS, Metrics(), producer_factory=lambda size: producer, repair_topic=repair)
    box._stop = Pauses()
    with caplog.at_level(logging.ERROR, logger="streamtrain.ingest.dead_letters"):
        box.start()
        try:
            box.submit(message(1), "schema")
            assert box.wait_acknowledged(None, 10)
        finally:
            box.close(1)
    assert box.last_error == "RuntimeError: boom" and len(repairs) == 2
    assert box._stop.pauses == [1.0]  # a second's pause after the error, then on
    [record] = caplog.records
    assert record.getMessage() == "dead-letter outbox error; going on" and record.exc_info is not None


class Sleeper(threading.Condition):
    """The outbox's condition for a test that runs the thread's steps itself: a sleep is recorded, not slept."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.sleeps.append(timeout)
        return False


class Stepped:
    """An outbox that is not started, on a clock the test moves; ``step`` runs one turn of its thread."""

    def __init__(
        self,
        script: Callable[[tuple[int, int], int], BaseException | None] = lambda identity, attempt: None,
        *,
        settings: Any = SETTINGS,
        factory_fails: int = 0,
        repair: Callable[[int], bool] | None = None,
    ) -> None:
        self.now = 1000.0
        self.sizes: list[int] = []
        self.producers: list[ScriptedProducer] = []
        self.closed: list[tuple[int, float | None]] = []
        self.repairs: list[int] = []
        self.sent: dict[tuple[int, int], int] = {}  # attempts per record, over every producer
        self.script = script
        self.factory_fails = factory_fails
        self.repair = repair or (lambda limit: True)
        self.metrics = Metrics()
        self.box = DeadLetterOutbox(
            settings, self.metrics, producer_factory=self._factory, repair_topic=self._repair, clock=lambda: self.now
        )
        self.cond = Sleeper()
        self.box._cond = self.cond

    def _factory(self, size: int) -> ScriptedProducer:
        self.sizes.append(size)
        if self.factory_fails:
            self.factory_fails -= 1
            raise ConnectionRefusedError("no broker at 127.0.0.1:9")
        producer = ScriptedProducer(self.script)
        producer.attempts = self.sent
        index = len(self.producers)
        producer.close = lambda timeout=None: self.closed.append((index, timeout))  # type: ignore[method-assign]
        self.producers.append(producer)
        return producer

    def _repair(self, limit: int) -> bool:
        self.repairs.append(limit)
        return self.repair(limit)

    def step(self, at: float | None = None) -> None:
        if at is not None:
            self.now = at
        self.box._step()

    def attempts(self, offset: int, partition: int | None = None) -> int:
        identity = ((offset - 100) % 3 if partition is None else partition, offset)
        return self.sent.get(identity, 0)


def test_a_due_letter_goes_at_once_and_a_failed_one_waits_out_its_backoff() -> None:
    run = Stepped(lambda identity, attempt: NotEnoughReplicasError() if attempt < 2 else None,
                  settings=PATIENT)  # fmt: skip
    run.box.submit(message(1), "schema")
    run.step()
    assert run.attempts(101) == 1
    run.step()  # the failure settles: the next try is due after the first backoff step
    failed_at = run.now
    assert run.cond.sleeps == [pytest.approx(0.01)]  # 1 ms to wait: the floor of a sleep
    run.step(at=failed_at + 0.0005)
    assert run.attempts(101) == 1
    run.step(at=failed_at + dead_letters.retry_delay_s(1))  # due exactly now: it goes
    assert run.attempts(101) == 2
    run.step()
    run.step(at=run.now + dead_letters.retry_delay_s(2) - 0.0005)
    assert run.attempts(101) == 2
    run.step(at=run.now + 0.0005)
    assert run.attempts(101) == 3
    run.step()
    assert run.box.pending == 0 and run.cond.sleeps[-1] == 1.0  # nothing pending: a second at most


def test_the_retry_delay_grows_by_the_backoff_steps_and_stays_at_the_last() -> None:
    assert [dead_letters.retry_delay_s(n) for n in range(1, 7)] == [0.001, 0.002, 0.005, 0.005, 0.005, 0.005]


def test_the_real_backoff_steps_from_a_fifth_of_a_second_to_half_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dead_letters, "_BACKOFF_S", REAL_BACKOFF_S)
    assert [dead_letters.retry_delay_s(n) for n in (1, 2, 7, 8)] == [0.2, 0.5, 30.0, 30.0]


def test_a_letter_in_flight_is_not_sent_again_and_the_thread_sleeps_until_the_next_due_one() -> None:
    run = Stepped(settings=PATIENT)
    in_flight: list[InFlight] = []

    def send_and_hang(*args: Any, **kw: Any) -> InFlight:
        in_flight.append(InFlight())
        return in_flight[-1]

    run.box.submit(message(1), "schema")
    run.step()
    run.producers[0].send = send_and_hang  # type: ignore[method-assign]
    run.box.submit(message(2), "schema")
    run.step()
    assert len(in_flight) == 1
    run.step()
    run.step()
    assert len(in_flight) == 1 and run.cond.sleeps == [1.0, 1.0]  # in flight: no wake-up for it
    in_flight[0].errbacks[0](NotEnoughReplicasError())
    run.step()  # settled: due again after 1 ms, a sleep of the 10 ms floor
    assert run.cond.sleeps[-1] == pytest.approx(0.01)
    run.step(at=run.now + 0.25)
    assert len(in_flight) == 2


def test_the_idle_sleep_runs_to_the_next_due_letter_or_the_end_of_a_hold_back() -> None:
    run = Stepped(settings=PATIENT)
    box = run.box
    assert box._idle_s_locked(run.now) == 1.0
    box.submit(message(1), "schema")
    letter = box._pending[1]
    letter.due = run.now + 0.25
    assert box._idle_s_locked(run.now) == pytest.approx(0.25)
    box._blocked_until = run.now + 0.5
    assert box._idle_s_locked(run.now) == pytest.approx(0.5)
    box._blocked_until = run.now + 5.0
    assert box._idle_s_locked(run.now) == 1.0
    letter.due = run.now
    assert box._due_locked(run.now) == []  # held back: not even a due letter goes
    box._blocked_until = run.now
    assert box._due_locked(run.now) == [letter]


def test_no_broker_for_the_producer_holds_sends_back_two_seconds(caplog: pytest.LogCaptureFixture) -> None:
    run = Stepped(factory_fails=1)
    run.box.submit(message(1), "schema")
    with caplog.at_level(logging.WARNING, logger="streamtrain.ingest.dead_letters"):
        run.step()
    failed_at = run.now
    text = "dead-letter producer: ConnectionRefusedError: no broker at 127.0.0.1:9"
    assert run.box.last_error == text and run.box.describe().endswith(f"s: {text}")
    assert [r.getMessage() for r in caplog.records] == [f"dead-letter send failed (kept, retried): {text}"]
    run.step(at=failed_at + 1.99)
    assert len(run.sizes) == 1 and run.cond.sleeps[-1] == pytest.approx(0.01)
    run.step(at=failed_at + 2.0)
    assert len(run.sizes) == 2 and run.attempts(101) == 1


def test_a_larger_request_size_replaces_the_producer_and_closes_the_old_one() -> None:
    run = Stepped()
    run.box.submit(message(1), "schema")
    run.step()
    run.box.configure(4 << 20, 1 << 20)
    run.box.submit(message(2), "schema")
    run.step()
    assert run.sizes == [(1 << 20) + 65536, (4 << 20) + 65536]
    assert run.closed == [(0, 5.0)]  # in-flight sends get five seconds to finish or fail
    assert run.attempts(101) == 1 and run.attempts(102) == 1
    assert [w["headers"]["source_offset"] for w in run.producers[1].written] == ["102"]


@pytest.mark.parametrize(
    ("max_message_bytes", "source", "fetch", "expected"),
    [
        (1 << 20, None, None, 1 << 20),  # before configure: the floor of 1 MiB
        (4096, None, None, 1 << 20),
        (4096, 1000, 2000, 1 << 20),
        (3 << 20, None, None, 3 << 20),  # before configure: this service's own limit
        (1 << 20, 1000, 2000, 1 << 20),  # small topic and fetch limits: the floor
        (2 << 20, 1000, 2000, 2 << 20),
        (1 << 20, 1000, 5 << 20, 5 << 20),  # the fetch limit
        (1 << 20, 6 << 20, 5 << 20, 6 << 20),  # the event topic's limit
    ],
)
def test_the_first_producer_is_sized_for_anything_the_consumer_can_fetch(
    max_message_bytes: int, source: int | None, fetch: int | None, expected: int
) -> None:
    run = Stepped(settings=load_settings(topic="events", max_message_bytes=max_message_bytes))
    if source is not None and fetch is not None:
        run.box.configure(source, fetch)
    run.box.submit(message(1), "schema")
    run.step()
    assert run.sizes == [expected + 65536]


def test_the_same_failure_is_logged_once_and_each_new_one_again(caplog: pytest.LogCaptureFixture) -> None:
    errors = [NotEnoughReplicasError("isr 1 of 2"), NotEnoughReplicasError("isr 1 of 2"), MessageSizeTooLargeError()]
    run = Stepped(lambda identity, attempt: errors[attempt] if attempt < len(errors) else None,
                  settings=PATIENT)  # fmt: skip
    run.box.submit(message(1), "schema")
    with caplog.at_level(logging.WARNING, logger="streamtrain.ingest.dead_letters"):
        for _ in range(4):
            run.step()
            run.step(at=run.now + 1.0)
    first = f"NotEnoughReplicasError: {errors[0]}"
    assert [r.getMessage() for r in caplog.records][:2] == [
        f"dead-letter send failed (kept, retried): {first}",
        f"dead-letter send failed (kept, retried): MessageSizeTooLargeError: {errors[2]}",
    ]


def test_describe_names_the_oldest_letter_its_age_and_its_own_error() -> None:
    run = Stepped(
        lambda identity, attempt: NotEnoughReplicasError() if identity == (1, 101) else InvalidReplicationFactorError(),
        settings=PATIENT,
    )
    box = run.box
    assert box.describe() == "no dead letter pending" and box.oldest_pending_age_s() is None
    box.submit(message(1), "schema")
    run.now += 7.4
    assert box.oldest_pending_age_s() == pytest.approx(7.4)
    assert box.describe() == (
        "1 dead letters not acknowledged by Kafka, the oldest (partition 1 offset 101, raw) for 7 s: no answer yet"
    )
    box.submit(message(2), "schema")
    run.step()
    run.step()  # both failed; the later one's error is the outbox's last
    assert box.last_error == f"InvalidReplicationFactorError: {InvalidReplicationFactorError()}"
    assert box.describe().endswith(f"for 7 s: NotEnoughReplicasError: {NotEnoughReplicasError()}")
    assert box._pending[1].last_error == f"NotEnoughReplicasError: {NotEnoughReplicasError()}"


def test_a_tombstone_the_dlq_refuses_goes_as_an_empty_stand_in() -> None:
    run = Stepped(lambda identity, attempt: MessageSizeTooLargeError() if attempt == 0 else None)
    run.box.submit(Message("events", 1, 9, None, None), "decode")
    for _ in range(3):
        run.step()
    [written] = run.producers[0].written
    assert written["key"] is None and written["value"] is None
    assert written["headers"]["original_size"] == "0"
    assert written["headers"]["original_sha256"] == hashlib.sha256(b"").hexdigest()
    assert written["headers"]["stand_in_cause"] == "too_large_for_dlq" and run.box.pending == 0


def test_a_letter_turned_stand_in_frees_its_raw_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dead_letters, "_MAX_RAW_PENDING_BYTES", 100)
    run = Stepped(lambda identity, attempt: MessageSizeTooLargeError() if identity == (0, 1) and attempt == 0 else None)
    run.box.submit(Message("events", 0, 1, None, b"a" * 100), "schema")
    run.step()
    run.step()  # refused: it goes on as a stand-in, and its 100 raw bytes are free
    run.box.submit(Message("events", 0, 2, None, b"b" * 100), "schema")
    for _ in range(3):
        run.step()
    forms = {
        int(w["headers"]["source_offset"]): w["headers"].get("stand_in_cause", "raw") for w in run.producers[0].written
    }
    assert forms == {1: "too_large_for_dlq", 2: "raw"}


def test_a_stand_in_starts_its_own_backoff_from_the_first_step() -> None:
    run = Stepped(lambda identity, attempt: NotEnoughReplicasError() if attempt < 3 else None,
                  settings=load_settings(topic="events", dlq_send_attempts=2))  # fmt: skip
    run.box.submit(message(1), "schema")
    run.step()
    run.step()
    run.step(at=run.now + dead_letters.retry_delay_s(1))
    run.step()  # the second raw attempt failed: the stand-in goes at once (its first attempt)
    assert run.attempts(101) == 3
    run.step()  # that failed too: the stand-in's first backoff step, not its second
    run.step(at=run.now + dead_letters.retry_delay_s(1))
    assert run.attempts(101) == 4
    assert run.producers[0].written[0]["headers"]["stand_in_cause"] == "send_attempts_exhausted"


def test_a_repaired_dlq_gets_a_fresh_producer_and_a_found_one_keeps_it(caplog: pytest.LogCaptureFixture) -> None:
    for created in (True, False):
        run = Stepped(lambda identity, attempt: UnknownTopicOrPartitionError() if attempt == 0 else None,
                      repair=lambda limit, created=created: created)  # fmt: skip
        run.box.submit(message(1), "schema")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="streamtrain.ingest.dead_letters"):
            run.step()
            run.step()  # the failure settles: the topic is missing
            run.step(at=run.now + 1.0)  # due again: repaired first (before configure: with this service's limit)
        assert run.repairs == [SETTINGS.max_message_bytes] and run.box._topic_missing is False
        run.step()
        run.step()
        assert run.repairs == [SETTINGS.max_message_bytes] and run.box.pending == 0
        assert len(run.producers) == (2 if created else 1)
        messages = [r.getMessage() for r in caplog.records]
        assert ("dead-letter topic events.dlq was missing: created it again" in messages) is created


def test_a_failed_repair_is_noted_and_holds_sends_back_two_seconds() -> None:
    attempts = {"n": 0}

    def repair(limit: int) -> bool:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise KafkaConnectionError("broker gone")
        return True

    run = Stepped(lambda identity, attempt: UnknownTopicOrPartitionError() if attempt == 0 else None, repair=repair)
    run.box.submit(message(1), "schema")
    run.step()
    run.step()
    run.step(at=run.now + 1.0)
    failed_at = run.now
    assert run.box.last_error == f"recreating events.dlq: KafkaConnectionError: {KafkaConnectionError('broker gone')}"
    run.step(at=failed_at + 1.99)
    assert attempts["n"] == 1
    run.step(at=failed_at + 2.0)
    assert attempts["n"] == 2


def test_close_waits_its_timeout_for_acknowledgements_and_for_the_thread() -> None:
    box, _, _, _ = outbox_with(lambda identity, attempt: None)
    waits: list[tuple[int | None, float]] = []
    joins: list[float | None] = []
    box.wait_acknowledged = lambda upto, timeout_s: waits.append((upto, timeout_s)) or True  # type: ignore[method-assign]
    box._thread = SimpleNamespace(join=joins.append)  # type: ignore[assignment]
    box.close()
    box.close(0.5)
    assert waits == [(None, 10.0), (None, 0.5)] and joins == [10.0, 0.5]


def test_without_a_repair_given_a_missing_dlq_is_recreated_with_this_service_s_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, int]] = []
    monkeypatch.setattr(dead_letters, "ensure_dead_letter_topic", lambda s, limit: calls.append((s, limit)) or True)
    box = DeadLetterOutbox(SETTINGS, Metrics(), producer_factory=lambda size: ScriptedProducer(lambda i, a: None))
    assert box._repair_topic(12345) is True and calls == [(SETTINGS, 12345)]
