"""The ingest consumers: one configuration, two ways to own partitions.

:func:`open_consumer` is the one place a service consumer is configured: no auto-commit
(offsets are committed only after a checkpoint made them durable), ``earliest`` for a
partition the group never committed, fetch sizes that take any message the topic accepts,
and the kafka-python patches of :mod:`streamtrain.ingest.kafka_compat` installed before
the first request. A :data:`ConsumerFactory` then makes it own partitions:

- :func:`subscribed_consumer` joins the consumer group, which assigns them (and calls the
  listener on kafka-python's IO thread during ``poll``);
- :func:`assigned_consumer` (scale-out) assigns the partitions the ownership rule gives
  this rank, joins no group, and calls the listener at once.

Either way the listener's ``on_partitions_assigned`` sees every partition the consumer
gets, so each resumes from the window's offsets; a factory that fails closes the consumer
it opened.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener

from streamtrain.config import Settings
from streamtrain.ingest import security as kafka_security
from streamtrain.ingest.kafka_compat import forbid_topic_auto_creation, keep_rejoin_pending, rejoin_on_partition_changes

__all__ = [
    "ConsumerFactory",
    "OwnedPartitions",
    "SeekingListener",
    "assign_owned",
    "assigned_consumer",
    "fetch_bytes",
    "open_consumer",
    "subscribed_consumer",
    "topic_partition_count",
]

_FETCH_FLOOR_BYTES = 1 << 20
_METADATA_WAIT_S = 15.0  # how long a just-created topic may be missing from the metadata


def fetch_bytes(settings: Settings) -> int:
    """``max_partition_fetch_bytes``: one accepted message (Kafka's default, 1 MiB, for the
    default limit). Larger records still come whole (a fetch always returns its first
    record batch, KIP-74), so anything the topic holds can be read; a small share per
    partition keeps partitions taking turns within seconds while a backlog drains."""
    return max(_FETCH_FLOOR_BYTES, settings.max_message_bytes)


def open_consumer(settings: Settings, *, static_membership: bool = True) -> KafkaConsumer:
    """A consumer configured for the service (not yet subscribed or assigned)."""
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=settings.group_id,
        # Static membership (KIP-345): a replica that comes back under the same id
        # takes over its old member at once; without it, a crashed member holds its
        # partitions until the session times out. Assigned partitions join no group.
        group_instance_id=settings.group_instance_id if static_membership else None,
        client_id="streamtrain-ingest",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=settings.poll_max_records,
        max_partition_fetch_bytes=fetch_bytes(settings),
        fetch_max_bytes=64 << 20,
        reconnect_backoff_max_ms=2000,
        request_timeout_ms=30000,
        metadata_max_age_ms=10000,  # added partitions show up within 10 s, not 5 min
        **kafka_security.client_options(settings),
    )
    forbid_topic_auto_creation(consumer)  # the service creates its topic, with its settings
    rejoin_on_partition_changes(consumer)
    keep_rejoin_pending(consumer)  # wraps the check above too: a rejoin it asks for stays pending
    return consumer


def subscribed_consumer(settings: Settings, listener: ConsumerRebalanceListener) -> KafkaConsumer:
    """The default :data:`ConsumerFactory`: join the consumer group, which assigns partitions."""
    consumer = open_consumer(settings)
    try:
        # A just-created topic can be missing from the first metadata; subscribing then
        # assigns nothing until a metadata refresh (the rejoin that follows is safe now).
        deadline = time.monotonic() + _METADATA_WAIT_S
        while not consumer.partitions_for_topic(settings.topic) and time.monotonic() < deadline:
            time.sleep(0.2)
        consumer.subscribe([settings.topic], listener=listener)
    except BaseException:
        consumer.close(autocommit=False, timeout_ms=2000)
        raise
    return consumer


#: Opens a consumer that owns its partitions (subscribed, or assigned by hand) and calls
#: ``listener.on_partitions_assigned`` for them, so they resume from the window's offsets.
ConsumerFactory = Callable[[Settings, ConsumerRebalanceListener], KafkaConsumer]

#: Scale-out: the partitions this rank owns among the topic's ``count`` partitions.
OwnedPartitions = Callable[[int], list[int]]


class SeekingListener(ConsumerRebalanceListener):
    """A rebalance listener that seeks ``consumer`` to where the window goes on.

    :func:`assign_owned` sets ``consumer`` before it calls the listener: a consumer that a
    factory is still opening is not yet the one its owner holds.
    """

    def __init__(self) -> None:
        self.consumer: KafkaConsumer | None = None


def topic_partition_count(consumer: KafkaConsumer, topic: str, *, refresh: bool = False) -> int:
    """How many partitions ``topic`` has, from the consumer's metadata (``refresh``: ask the broker)."""
    if refresh:
        consumer.topics()  # a metadata request for every topic: the cache is then current
    partitions = consumer.partitions_for_topic(topic) or set()
    return max(partitions) + 1 if partitions else 0


def assign_owned(
    consumer: KafkaConsumer, topic: str, partitions: list[int], listener: ConsumerRebalanceListener
) -> None:
    """Assign exactly ``partitions`` (positions of those already assigned are kept) and let
    ``listener`` seek them to where the window goes on."""
    wanted = [TopicPartition(topic, p) for p in sorted(partitions)]
    if isinstance(listener, SeekingListener):
        listener.consumer = consumer  # it seeks this one: the ingestor may not hold it yet
    if not wanted:
        if consumer.assignment():
            consumer.unsubscribe()
        listener.on_partitions_assigned([])
        return
    consumer.assign(wanted)
    listener.on_partitions_assigned(wanted)


def assigned_consumer(settings: Settings, listener: ConsumerRebalanceListener, owned: OwnedPartitions) -> KafkaConsumer:
    """A :data:`ConsumerFactory` for scale-out: assign the partitions ``owned`` names, join no group."""
    consumer = open_consumer(settings, static_membership=False)
    try:
        deadline = time.monotonic() + _METADATA_WAIT_S
        count = topic_partition_count(consumer, settings.topic)
        while not count and time.monotonic() < deadline:  # a just-created topic can be missing at first
            time.sleep(0.2)
            count = topic_partition_count(consumer, settings.topic, refresh=True)
        if not count:
            raise RuntimeError(f"topic {settings.topic!r} has no partitions in the broker's metadata yet")
        assign_owned(consumer, settings.topic, owned(count), listener)
    except BaseException:
        consumer.close(autocommit=False, timeout_ms=2000)
        raise
    return consumer
