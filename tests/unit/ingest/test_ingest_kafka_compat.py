"""The kafka-python patches on stand-in clients: what each changes, and a loud refusal when kafka-python moved.

The bugs themselves need a broker: tests/integration/test_liveness.py reproduces them with and without the patches.
"""

from __future__ import annotations

import importlib
import re
from collections import namedtuple
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError

from streamtrain.ingest.kafka_compat import (
    PARTITION_COUNTS_USER_DATA,
    close_producer,
    forbid_topic_auto_creation,
    keep_rejoin_pending,
    producer_failed,
    rejoin_on_partition_changes,
    survive_refused_records,
)

Metadata = namedtuple("Metadata", "version topics user_data")


class Coordinator:
    """The parts of kafka-python's ConsumerCoordinator the patches touch."""

    def __init__(self, snapshot: dict[str, set[int]], *, needed: bool = False, user_data: bytes = b"") -> None:
        self._metadata_snapshot = snapshot
        self._subscription = SimpleNamespace(partitions_auto_assigned=lambda: True)
        self.needed = needed
        self.user_data = user_data
        self.rejoins_requested = 0

    def need_rejoin(self) -> bool:
        return self.needed

    def request_rejoin(self) -> None:
        self.rejoins_requested += 1

    def group_protocols(self) -> list[tuple[str, Metadata]]:
        return [("range", Metadata(0, ["events"], self.user_data))]


def consumer_with(coordinator: Coordinator) -> Any:
    return SimpleNamespace(_coordinator=coordinator)


def test_topic_auto_creation_is_switched_off_where_kafka_python_reads_it() -> None:
    producer = SimpleNamespace(_metadata=SimpleNamespace(config={"allow_auto_create_topics": True}))
    assert forbid_topic_auto_creation(producer) is producer
    assert producer._metadata.config["allow_auto_create_topics"] is False
    consumer = SimpleNamespace(_client=None, _cluster=SimpleNamespace(config={"allow_auto_create_topics": True}))
    forbid_topic_auto_creation(consumer)
    assert consumer._cluster.config["allow_auto_create_topics"] is False


def test_a_rejoin_once_needed_is_requested_so_it_stays_pending() -> None:
    coordinator = Coordinator({"events": {0}})
    keep_rejoin_pending(consumer_with(coordinator))
    assert coordinator.need_rejoin() is False and coordinator.rejoins_requested == 0
    coordinator.needed = True
    assert coordinator.need_rejoin() is True and coordinator.rejoins_requested == 1


def test_every_member_rejoins_when_the_partitions_differ_from_its_last_join() -> None:
    coordinator = Coordinator({"events": {0, 1}})
    rejoin_on_partition_changes(consumer_with(coordinator))
    assert coordinator.need_rejoin() is False  # no join yet: nothing to compare with
    [(name, metadata)] = coordinator.group_protocols()  # the join
    assert name == "range" and metadata.user_data == PARTITION_COUNTS_USER_DATA + b"events=2"
    assert metadata.topics == ["events"]
    assert coordinator.need_rejoin() is False
    coordinator._metadata_snapshot = {"events": {0, 1, 2}}  # a partition was added
    assert coordinator.need_rejoin() is True
    coordinator.group_protocols()
    assert coordinator.need_rejoin() is False


def test_an_assignor_with_user_data_of_its_own_keeps_it() -> None:
    coordinator = Coordinator({"events": {0}}, user_data=b"sticky-state")
    rejoin_on_partition_changes(consumer_with(coordinator))
    [(_, metadata)] = coordinator.group_protocols()
    assert metadata.user_data == b"sticky-state"


def test_assigned_partitions_do_not_rejoin_on_metadata_changes() -> None:
    coordinator = Coordinator({"events": {0}})
    coordinator._subscription = SimpleNamespace(partitions_auto_assigned=lambda: False)
    rejoin_on_partition_changes(consumer_with(coordinator))
    coordinator.group_protocols()
    coordinator._metadata_snapshot = {"events": {0, 1}}
    assert coordinator.need_rejoin() is False


@pytest.mark.parametrize("patch", [forbid_topic_auto_creation, keep_rejoin_pending, rejoin_on_partition_changes])
def test_a_changed_kafka_python_is_refused_naming_the_patch_to_recheck(patch: Callable[[Any], Any]) -> None:
    with pytest.raises(RuntimeError, match="kafka-python's .* changed: re-check ") as refused:
        patch(SimpleNamespace())
    named = re.search(r"re-check ([\w.]+)", str(refused.value))
    assert named is not None
    module, _, name = named.group(1).rpartition(".")
    assert getattr(importlib.import_module(module), name) is patch


def idempotent_producer(api_version: tuple[int, int] = (4, 1), transactional_id: str | None = None) -> Any:
    """A stand-in producer holding kafka-python's own transaction manager (the classifier is the real one)."""
    from kafka.producer.transaction_manager import TransactionManager

    return SimpleNamespace(_transaction_manager=TransactionManager(transactional_id, api_version=api_version))


REFUSED = ["MessageSizeTooLargeError", "TopicAuthorizationFailedError", "InvalidRecordError", "PolicyViolationError"]


@pytest.mark.parametrize("error", REFUSED)
def test_a_refused_record_bumps_the_epoch_instead_of_failing_the_producer_for_good(error: str) -> None:
    import kafka.errors as errors
    from kafka.producer.transaction_manager import TransactionManager

    kind = getattr(errors, error)
    unpatched = idempotent_producer()._transaction_manager
    assert unpatched.classify_batch_error(kind(), None) == TransactionManager.ERROR_CLASS_FATAL  # the bug
    patched = survive_refused_records(idempotent_producer())._transaction_manager
    assert patched.classify_batch_error(kind(), None) == TransactionManager.ERROR_CLASS_NEEDS_EPOCH_BUMP
    old = survive_refused_records(idempotent_producer(api_version=(2, 4)))._transaction_manager  # before KIP-360
    assert old.classify_batch_error(kind, None) == TransactionManager.ERROR_CLASS_NEEDS_PRODUCER_ID_RESET


def test_what_kafka_python_calls_fatal_stays_fatal_and_retriable_stays_retriable() -> None:
    import kafka.errors as errors
    from kafka.producer.transaction_manager import TransactionManager

    manager = survive_refused_records(idempotent_producer())._transaction_manager
    fatal = manager.classify_batch_error(errors.ClusterAuthorizationFailedError(), None)
    assert fatal == TransactionManager.ERROR_CLASS_FATAL
    retriable = manager.classify_batch_error(errors.NotEnoughReplicasError(), None)
    assert retriable == TransactionManager.ERROR_CLASS_RETRIABLE
    transactional = survive_refused_records(idempotent_producer(transactional_id="t"))._transaction_manager
    assert transactional.classify_batch_error(errors.MessageSizeTooLargeError(), None) == "ABORTABLE"


def test_a_producer_in_its_fatal_state_is_told_and_a_plain_one_is_left_alone() -> None:
    import kafka.errors as errors

    producer = idempotent_producer()
    assert not producer_failed(producer)
    producer._transaction_manager.transition_to_fatal_error(errors.ClusterAuthorizationFailedError())
    assert producer_failed(producer)
    plain = SimpleNamespace(_transaction_manager=None)  # enable_idempotence=False
    assert survive_refused_records(plain) is plain and not producer_failed(plain)


def test_a_moved_transaction_manager_is_refused_loudly() -> None:
    moved = SimpleNamespace(_transaction_manager=SimpleNamespace(is_transactional=lambda: False))
    with pytest.raises(RuntimeError, match="kafka_compat.survive_refused_records"):
        survive_refused_records(moved)
    with pytest.raises(RuntimeError, match="kafka_compat.producer_failed"):
        producer_failed(moved)


class ClosingProducer:
    """kafka-python 3.0.12's close: flush(timeout) first, which raises while a batch is unacknowledged."""

    def __init__(self, in_flight: bool, sender: bool = True) -> None:
        self.in_flight = in_flight
        self.timeouts: list[float] = []
        if sender:
            self._sender = SimpleNamespace(force_closed=False)
            self._sender.force_close = lambda: setattr(self._sender, "force_closed", True)

    def close(self, timeout: float | None = None) -> None:
        self.timeouts.append(timeout)
        if self.in_flight:
            raise KafkaTimeoutError("Timeout waiting for future")


def test_a_producer_closes_within_its_timeout_and_one_stuck_on_a_gone_broker_has_its_sender_stopped() -> None:
    settled = ClosingProducer(in_flight=False)
    assert close_producer(settled, 5.0) is True
    assert settled.timeouts == [5.0] and not settled._sender.force_closed
    stuck = ClosingProducer(in_flight=True)
    assert close_producer(stuck, 2.0) is False
    assert stuck.timeouts == [2.0] and stuck._sender.force_closed  # no sender left retrying
    assert close_producer(ClosingProducer(in_flight=False), -1.0) is True  # a spent deadline closes at once


def test_a_producer_without_the_sender_close_producer_stops_is_refused_naming_it() -> None:
    with pytest.raises(RuntimeError, match=r"re-check streamtrain\.ingest\.kafka_compat\.close_producer"):
        close_producer(ClosingProducer(in_flight=True, sender=False), 1.0)


@pytest.mark.parametrize(
    ("patch", "client"),
    [
        (forbid_topic_auto_creation, SimpleNamespace(_metadata=SimpleNamespace(config={}))),  # the option moved
        (forbid_topic_auto_creation, SimpleNamespace(_metadata=SimpleNamespace())),  # no config at all
        (keep_rejoin_pending, SimpleNamespace(_coordinator=SimpleNamespace(need_rejoin=lambda: False))),
        (
            rejoin_on_partition_changes,
            SimpleNamespace(_coordinator=SimpleNamespace(_metadata_snapshot={}, need_rejoin=lambda: False)),
        ),
        (
            rejoin_on_partition_changes,
            SimpleNamespace(_coordinator=SimpleNamespace(_metadata_snapshot=None, group_protocols=lambda: [])),
        ),
    ],
)
def test_a_client_missing_one_part_a_patch_needs_is_refused_too(patch: Callable[[Any], Any], client: Any) -> None:
    with pytest.raises(
        RuntimeError,
        match=rf"^kafka-python's [\w ]+ changed: re-check streamtrain\.ingest\.kafka_compat\.{patch.__name__}$",
    ):
        patch(client)


def test_a_rejoin_kafka_python_asks_for_itself_is_kept_before_any_join() -> None:
    coordinator = Coordinator({"events": {0}}, needed=True)
    rejoin_on_partition_changes(consumer_with(coordinator))
    assert coordinator.need_rejoin() is True


def test_the_join_carries_every_topic_s_partition_count_and_the_protocol_version() -> None:
    coordinator = Coordinator({"events": {0, 1}, "alerts": {0}})
    coordinator.group_protocols = lambda: [("range", Metadata(3, ["alerts", "events"], b""))]  # type: ignore[method-assign]
    rejoin_on_partition_changes(consumer_with(coordinator))
    [(_, metadata)] = coordinator.group_protocols()
    assert metadata == Metadata(3, ["alerts", "events"], PARTITION_COUNTS_USER_DATA + b"alerts=1,events=2")


def test_a_transaction_manager_without_its_error_classes_is_refused() -> None:
    needed = ("classify_batch_error", "is_transactional", "_supports_epoch_bump", "has_fatal_error", "_FATAL_ERRORS")
    manager = SimpleNamespace(**{name: None for name in needed})
    with pytest.raises(RuntimeError, match="kafka_compat.producer_failed"):
        producer_failed(SimpleNamespace(_transaction_manager=manager))


def test_the_patched_classifier_passes_the_batch_and_log_start_offset_on() -> None:
    import kafka.errors as errors
    from kafka.producer.transaction_manager import TransactionManager

    producer = idempotent_producer()
    manager = producer._transaction_manager
    seen: list[tuple[Any, Any, int]] = []
    original = manager.classify_batch_error

    def recording(error: Any, batch: Any, log_start_offset: int = -1) -> str:
        seen.append((error, batch, log_start_offset))
        return str(original(error, batch, log_start_offset=log_start_offset))

    manager.classify_batch_error = recording
    survive_refused_records(producer)
    error, batch = errors.NotEnoughReplicasError(), object()
    assert manager.classify_batch_error(error, batch, log_start_offset=7) == TransactionManager.ERROR_CLASS_RETRIABLE
    assert manager.classify_batch_error(error, batch) == TransactionManager.ERROR_CLASS_RETRIABLE
    assert seen == [(error, batch, 7), (error, batch, -1)]
    # a fatal error named by its class stays fatal as its instance does
    fatal = manager.classify_batch_error(errors.ClusterAuthorizationFailedError, None)
    assert fatal == TransactionManager.ERROR_CLASS_FATAL


def test_close_passes_its_timeout_and_a_spent_one_as_zero() -> None:
    for timeout, passed in ((0.5, 0.5), (-1.0, 0.0)):
        producer = ClosingProducer(in_flight=False)
        close_producer(producer, timeout)
        assert producer.timeouts == [passed]


def test_a_sender_without_force_close_is_refused_with_the_whole_message() -> None:
    stuck = ClosingProducer(in_flight=True, sender=False)
    stuck._sender = SimpleNamespace()
    with pytest.raises(
        RuntimeError,
        match=r"^kafka-python's producer changed: re-check streamtrain\.ingest\.kafka_compat\.close_producer$",
    ):
        close_producer(stuck, 1.0)
