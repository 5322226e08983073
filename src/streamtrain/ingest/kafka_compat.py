"""The kafka-python 3.0.12 patches: five bugs of its clients, each worked around where a client is opened or closed.

Every consumer and producer the service opens gets the patches that apply to it before
its first request (:func:`streamtrain.ingest.consumers.open_consumer` installs the three
consumer patches, the dead-letter outbox :func:`forbid_topic_auto_creation` and
:func:`survive_refused_records`). Each patch replaces or adjusts private kafka-python
state, so each first checks that the attributes it relies on are still there and
otherwise raises a ``RuntimeError`` naming the patch (``re-check
streamtrain.ingest.kafka_compat.<name>``): a kafka-python upgrade that moves them fails
at the first client, never silently. ``tests/integration/test_liveness.py`` reproduces
both consumer-group bugs with and without their patch, and fails the day kafka-python
fixes one, so the patch can go.

- :func:`forbid_topic_auto_creation`: ``allow_auto_create_topics=False`` is accepted and
  ignored, so a deleted topic would be auto-created with the broker's defaults.
- :func:`keep_rejoin_pending`: a group rejoin that a metadata change starts can be
  dropped half-way, leaving the member without partitions for good (KAFKA-9815).
- :func:`rejoin_on_partition_changes`: only the member that computed the last assignment
  watches for added partitions, and after a static member's restart none did.
- :func:`survive_refused_records`: an idempotent producer turns one record the broker
  refuses (too large for the topic, not authorized) into a fatal state that fails every
  later send; :func:`producer_failed` tells a producer left in that state.
- :func:`close_producer`: ``close(timeout)`` flushes first and, when the flush times out
  (a broker gone, records in flight), raises before closing anything, leaving the
  producer's sender thread retrying for good.
"""

from __future__ import annotations

from typing import Any

from kafka import KafkaConsumer
from kafka.errors import KafkaTimeoutError

__all__ = [
    "PARTITION_COUNTS_USER_DATA",
    "close_producer",
    "forbid_topic_auto_creation",
    "keep_rejoin_pending",
    "producer_failed",
    "rejoin_on_partition_changes",
    "survive_refused_records",
]


def forbid_topic_auto_creation(client: Any) -> Any:
    """Make a kafka-python producer or consumer never create topics by asking for them.

    kafka-python 3.0.12 accepts ``allow_auto_create_topics=False`` but never passes it to
    its cluster metadata, which keeps asking the broker to auto-create every topic it
    requests: a deleted dead-letter topic would come back with the broker's defaults
    (1 MB limit, 1 partition) instead of being created again with its size limit.
    """
    cluster = getattr(client, "_metadata", None) or getattr(client, "_cluster", None)
    if cluster is None or "allow_auto_create_topics" not in getattr(cluster, "config", {}):
        raise RuntimeError(
            "kafka-python's cluster metadata changed: "
            "re-check streamtrain.ingest.kafka_compat.forbid_topic_auto_creation"
        )
    cluster.config["allow_auto_create_topics"] = False
    return client


def keep_rejoin_pending(consumer: KafkaConsumer) -> None:
    """Keep a group rejoin that kafka-python has started pending until it completes.

    The root cause of ingest stalling for good after the service created its topic
    (kafka-python 3.0.12, ``ConsumerCoordinator``): when the topic's metadata changes
    after the leader's assignment (a just-created topic's partitions show up, partitions
    are added), ``need_rejoin()`` turns true only through a snapshot comparison, not the
    ``rejoin_needed`` flag. ``poll()`` then revokes the partitions, starts JoinGroup as a
    task, and gives up waiting when its own timer runs out, leaving the task in flight.
    That task's assignment step (``_perform_assignment``) sets the assignment snapshot to
    the current metadata, so the next ``poll()`` finds ``need_rejoin()`` false, never
    awaits the task and never applies its assignment: the member stays ``REBALANCING``
    with its partitions revoked and heartbeats off, every poll fetches nothing, and the
    broker expires it at the session timeout. The Java client closed the same hole by
    setting ``rejoinNeeded`` when the metadata check fires (KAFKA-9815); this does the
    same: once ``need_rejoin()`` says yes, it stays yes until a join completes (which
    clears the flag). tests/integration/test_liveness.py reproduces the bug and the fix.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or not callable(getattr(coordinator, "request_rejoin", None)):
        raise RuntimeError(
            "kafka-python's coordinator changed: re-check streamtrain.ingest.kafka_compat.keep_rejoin_pending"
        )
    decide = coordinator.need_rejoin

    def need_rejoin() -> bool:
        needed = bool(decide())
        if needed:
            coordinator.request_rejoin()
        return needed

    coordinator.need_rejoin = need_rejoin


#: Prefix of the subscription user data this service's members send (range and round-robin
#: assignors send none and read none).
PARTITION_COUNTS_USER_DATA = b"streamtrain-partition-counts:"


def rejoin_on_partition_changes(consumer: KafkaConsumer) -> None:
    """Every member rejoins when a subscribed topic's partitions change, and says so in its join.

    kafka-python 3.0.12 watches the topic's metadata for a rebalance only in the member
    that computed the last assignment. With static membership (KIP-345) a member that
    restarts takes its old member's place without a rebalance, so after a restart nobody
    has computed the current assignment and partitions added to the topic stay unassigned
    until the next membership change (found by bench/chaos.py: added partitions waited up
    to two minutes for a second member to come and go). Here every member compares the
    metadata with the metadata of its last join, and puts the partition counts in its
    subscription's user data: a rejoin with changed metadata makes the broker rebalance
    even a Stable group of static members, and the assignor then sees every partition.
    Assignors that send user data of their own (sticky) are left as they are.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    snapshot = getattr(coordinator, "_metadata_snapshot", None)
    if (
        coordinator is None
        or not isinstance(snapshot, dict)
        or not callable(getattr(coordinator, "group_protocols", None))
    ):
        raise RuntimeError(
            "kafka-python's coordinator changed: re-check streamtrain.ingest.kafka_compat.rejoin_on_partition_changes"
        )
    protocols, decide = coordinator.group_protocols, coordinator.need_rejoin
    joined: dict[str, Any] = {"snapshot": None}

    def group_protocols() -> list[tuple[str, Any]]:
        current = {topic: set(partitions) for topic, partitions in coordinator._metadata_snapshot.items()}
        joined["snapshot"] = current
        counts = ",".join(f"{topic}={len(partitions)}" for topic, partitions in sorted(current.items())).encode()
        chosen = []
        for name, metadata in protocols():
            if not metadata.user_data:
                metadata = type(metadata)(metadata.version, metadata.topics, PARTITION_COUNTS_USER_DATA + counts)
            chosen.append((name, metadata))
        return chosen

    def need_rejoin() -> bool:
        if decide():
            return True
        last = joined["snapshot"]
        return (
            last is not None
            and coordinator._subscription.partitions_auto_assigned()
            and coordinator._metadata_snapshot != last
        )

    coordinator.group_protocols = group_protocols
    coordinator.need_rejoin = need_rejoin


def _transaction_manager(producer: Any, patch: str) -> Any:
    manager = getattr(producer, "_transaction_manager", None)
    if manager is None:
        return None  # not idempotent: nothing to patch
    needed = ("classify_batch_error", "is_transactional", "_supports_epoch_bump", "has_fatal_error", "_FATAL_ERRORS")
    if not all(hasattr(manager, name) for name in needed) or not hasattr(manager, "ERROR_CLASS_NEEDS_EPOCH_BUMP"):
        raise RuntimeError(
            f"kafka-python's transaction manager changed: re-check streamtrain.ingest.kafka_compat.{patch}"
        )
    return manager


def survive_refused_records(producer: Any) -> Any:
    """Let an idempotent (not transactional) kafka-python producer go on after the broker refuses a record.

    kafka-python 3.0.12 classifies every non-retriable batch error of an idempotent
    producer outside its short list of fatal ones (``MESSAGE_TOO_LARGE`` for a record over
    the topic's ``max.message.bytes``, ``TOPIC_AUTHORIZATION_FAILED``, ``INVALID_RECORD``,
    ``POLICY_VIOLATION``) as fatal: that send fails, and so does every later one, for good
    (its own docstring says such producers "just fail the batch without any state reset").
    The Java client fails the batch and bumps the producer epoch (KIP-360), so the
    sequence numbers start over and the next records go through; this does the same:
    such an error becomes ``NEEDS_EPOCH_BUMP`` (``NEEDS_PRODUCER_ID_RESET`` before Kafka
    2.5). The errors kafka-python lists as fatal (cluster authorization, fencing) stay
    fatal; a transactional producer is left alone. Returns ``producer``.
    """
    manager = _transaction_manager(producer, "survive_refused_records")
    if manager is None or manager.is_transactional():
        return producer
    classify = manager.classify_batch_error

    def classify_batch_error(error: Any, batch: Any, log_start_offset: int = -1) -> str:
        decided: str = classify(error, batch, log_start_offset=log_start_offset)
        kind = error if isinstance(error, type) else type(error)
        if decided == manager.ERROR_CLASS_FATAL and kind not in manager._FATAL_ERRORS:
            if manager._supports_epoch_bump():
                return str(manager.ERROR_CLASS_NEEDS_EPOCH_BUMP)
            return str(manager.ERROR_CLASS_NEEDS_PRODUCER_ID_RESET)
        return decided

    manager.classify_batch_error = classify_batch_error
    return producer


def producer_failed(producer: Any) -> bool:
    """True when an idempotent kafka-python producer is in its fatal state (every send fails):
    only a new producer sends again."""
    manager = _transaction_manager(producer, "producer_failed")
    return manager is not None and bool(manager.has_fatal_error())


def close_producer(producer: Any, timeout_s: float) -> bool:
    """Close a kafka-python producer within about ``timeout_s``; False when records were still in flight.

    kafka-python 3.0.12's ``close(timeout)`` calls ``flush(timeout)`` first, which raises
    ``KafkaTimeoutError`` when a batch is still unacknowledged (the broker is gone), and the
    close stops there: its sender thread goes on retrying until the process exits. Then the
    sender is closed the way ``close(0)`` did before that change (``force_close``): its batches
    fail (their futures' errbacks run) and it stops.
    """
    try:
        producer.close(timeout=max(0.0, timeout_s))
        return True
    except KafkaTimeoutError:
        sender = getattr(producer, "_sender", None)
        if sender is None or not hasattr(sender, "force_close"):
            raise RuntimeError(
                "kafka-python's producer changed: re-check streamtrain.ingest.kafka_compat.close_producer"
            ) from None
        sender.force_close()
        return False
