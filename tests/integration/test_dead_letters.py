"""Poison messages cannot stop ingest, and no dead letter is lost: against the real broker.

Every rejected message must reach ``<topic>.dlq`` exactly once, byte-exact or as the
documented stand-in, while the window stays exactly-once: oversized messages up to a
16 MB topic limit, a dead-letter topic too small for them, failed sends, a deleted one.
"""

from __future__ import annotations

import hashlib
import math
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.errors import MessageSizeTooLargeError, NotEnoughReplicasError
from kafka.future import Future
from kafka_helpers import Placements, assert_window_holds_exactly, topic_exists, wait_for

from streamtrain.config import Settings, load_settings
from streamtrain.ingest.dead_letters import DeadLetterOutbox
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.ingest.kafka_compat import forbid_topic_auto_creation
from streamtrain.metrics import Metrics
from streamtrain.window.reservoir import RecencyWindow

pytestmark = pytest.mark.integration

LIMIT = 16 << 20  # the event topic's max.message.bytes in the large-message test
# A v2 record batch holding one record with no key and no headers, of a value this large
# (around 16 MB): 61 bytes of batch header, 13 bytes of record framing.
BATCH_OVERHEAD = 74


@pytest.fixture()
def admin(kafka_bootstrap: str) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=30000)
    yield client
    client.close()


@pytest.fixture()
def topic_name(admin: KafkaAdminClient) -> Iterator[str]:
    """A unique name; the topic and its .dlq (whoever created them) are deleted afterwards."""
    name = f"dl-{uuid.uuid4().hex[:10]}"
    yield name
    doomed = [t for t in (name, f"{name}.dlq") if t in set(admin.list_topics())]
    if doomed:
        try:
            admin.delete_topics(doomed, timeout_ms=15000)
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass


def settings_for(bootstrap: str, topic: str, **overrides: Any) -> Settings:
    base: dict[str, Any] = dict(
        kafka_bootstrap=bootstrap, topic=topic, group_id=f"g-{topic}", max_len=16, window_capacity=50_000,
        half_life_s=math.inf, decode_workers=0, topic_partitions=2,
    )  # fmt: skip
    base.update(overrides)
    return load_settings(**base)


def start(settings: Settings, metrics: Metrics | None = None, **kwargs: Any) -> tuple[Ingestor, RecencyWindow]:
    window = RecencyWindow(settings.window_capacity, settings.half_life_s, channels=1)
    ingestor = Ingestor(settings, window, metrics or Metrics(), **kwargs)
    ingestor.start()
    return ingestor, window


def read_dlq(bootstrap: str, topic: str, expected: int, timeout_s: float = 60) -> list[Any]:
    consumer = KafkaConsumer(
        f"{topic}.dlq", bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False,
        group_id=None, max_partition_fetch_bytes=LIMIT + (1 << 20), fetch_max_bytes=64 << 20,
    )  # fmt: skip
    records: list[Any] = []
    try:
        wait_for(lambda: records.extend(r for batch in consumer.poll(timeout_ms=500).values() for r in batch)
                 or len(records) >= expected,
                 timeout_s, f"{expected} dead letters")  # fmt: skip
        records.extend(r for batch in consumer.poll(timeout_ms=1000).values() for r in batch)  # and no more
    finally:
        consumer.close()
    return records


def headers_of(record: Any) -> dict[str, str]:
    return {k: v.decode() for k, v in record.headers}


def max_message_bytes(admin: KafkaAdminClient, topic: str) -> int:
    described = admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, topic, {"max.message.bytes": None})], config_filter="all"
    )
    return int(described["topic"][topic]["max.message.bytes"]["value"])


def assert_whole_dead_letters(records: list[Any], sent: dict[tuple[int, int], bytes], topic: str, reason: str) -> None:
    """Each sent rejected message exactly once, byte-exact, with the contract headers."""
    seen = {}
    for record in records:
        headers = headers_of(record)
        identity = (int(headers["source_partition"]), int(headers["source_offset"]))
        assert identity not in seen, f"dead letter {identity} written twice"
        seen[identity] = record
        assert headers["reason"] == reason and headers["source_topic"] == topic and "stand_in_cause" not in headers
    assert sorted(seen) == sorted(sent)
    for identity, value in sent.items():
        assert hashlib.sha256(seen[identity].value).digest() == hashlib.sha256(value).digest() and len(
            seen[identity].value
        ) == len(value)


def test_messages_up_to_a_16_mb_topic_limit_reach_the_dlq_whole_and_ingest_goes_on(
    kafka_bootstrap: str, admin: KafkaAdminClient, topic_name: str
) -> None:
    topic = topic_name
    admin.create_topics(
        {topic: {"num_partitions": 2, "configs": {"max.message.bytes": str(LIMIT)}}}, wait_for_metadata=True
    )
    ingestor, window = start(settings_for(kafka_bootstrap, topic))  # it creates the .dlq: the source's limit + headroom
    stream = Placements(kafka_bootstrap, topic, max_request_size=LIMIT + (1 << 20))
    try:
        wait_for(lambda: topic_exists(kafka_bootstrap, f"{topic}.dlq"), 60, "the .dlq")
        assert max_message_bytes(admin, f"{topic}.dlq") == LIMIT + 64 * 1024
        exact = bytes(range(256)) * ((LIMIT - BATCH_OVERHEAD) // 256) + b"x" * ((LIMIT - BATCH_OVERHEAD) % 256)
        probe = KafkaProducer(
            bootstrap_servers=kafka_bootstrap, max_request_size=LIMIT + (1 << 20), enable_idempotence=False
        )
        with pytest.raises(MessageSizeTooLargeError):  # one byte more is refused: this one is exactly the limit
            probe.send(topic, value=exact + b"!", partition=0).get(timeout=60)
        probe.close()
        big = {"1.5MB": b"a" * 1_500_000, "8MB": b"\x00\xff" * (4 << 20), "limit": exact}
        stream.events(30, partition=0)
        stream.send(None, big["1.5MB"], "1.5MB", partition=0)
        stream.events(30, partition=1)
        stream.send(None, big["8MB"], "8MB", partition=1)
        stream.events(30, partition=0)
        stream.send(None, big["limit"], "limit", partition=0)
        stream.events(60)
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 90, "ingest past the oversized messages")
        assert_window_holds_exactly(window, stream.placed)
        assert dict(ingestor.stats.rejected) == {"too_large": 3}
        assert ingestor.flush_dead_letters(timeout_s=60)
        assert ingestor.restarts == {}
    finally:
        ingestor.stop()
        stream.close()
    sent = {po: big[label] for po, label in stream.placed.items() if label in big}
    assert_whole_dead_letters(read_dlq(kafka_bootstrap, topic, 3), sent, topic, "too_large")


def test_a_dlq_too_small_for_a_message_gets_its_stand_in(
    kafka_bootstrap: str, admin: KafkaAdminClient, topic_name: str
) -> None:
    topic = topic_name
    admin.create_topics(
        {
            topic: {"num_partitions": 1},
            f"{topic}.dlq": {"num_partitions": 1, "configs": {"max.message.bytes": "200000"}},
        },
        wait_for_metadata=True,
    )
    metrics = Metrics()
    settings = settings_for(kafka_bootstrap, topic)
    ingestor, window = start(settings, metrics, dead_letters=DeadLetterOutbox(settings, metrics))
    stream = Placements(kafka_bootstrap, topic)
    original = bytes(range(256)) * 6000  # 1.5 MB: within the topic's limit, far beyond its .dlq's
    try:
        stream.events(20)
        stream.send(b"key-1", original, "big")
        stream.send(b"key-2", b"\x00not json", "small")  # fits the .dlq: goes whole
        stream.events(20)
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 60, "ingest past the message")
        assert_window_holds_exactly(window, stream.placed)
        assert ingestor.flush_dead_letters(timeout_s=60)
        assert metrics.registry.get_sample_value("streamtrain_dead_letters_written_total", {"form": "stand_in"}) == 1
        assert metrics.registry.get_sample_value("streamtrain_dead_letters_written_total", {"form": "raw"}) == 1
    finally:
        ingestor.stop()
        stream.close()
    records = {headers_of(r)["source_offset"]: r for r in read_dlq(kafka_bootstrap, topic, 2)}
    big_offset = next(o for (p, o), label in stream.placed.items() if label == "big")
    small_offset = next(o for (p, o), label in stream.placed.items() if label == "small")
    assert sorted(records) == sorted([str(big_offset), str(small_offset)])
    stand_in = records[str(big_offset)]
    headers = headers_of(stand_in)
    assert headers == {
        "reason": "too_large", "source_topic": topic, "source_partition": "0", "source_offset": str(big_offset),
        "original_size": str(len(original)), "original_sha256": hashlib.sha256(original).hexdigest(),
        "stand_in_cause": "too_large_for_dlq",
    }  # fmt: skip
    assert stand_in.value == original[:1024] and stand_in.key == b"key-1"
    whole = records[str(small_offset)]
    assert (
        whole.value == b"\x00not json"
        and headers_of(whole)["reason"] == "decode"
        and "stand_in_cause" not in headers_of(whole)
    )


class HookedProducer:
    """A real producer whose sends fail (as Kafka answers NOT_ENOUGH_REPLICAS) while ``failing`` is set."""

    def __init__(self, failing: threading.Event, **config: Any) -> None:
        self.failing = failing
        self.real = forbid_topic_auto_creation(KafkaProducer(**config))
        self.refused = 0

    def send(self, topic: str, **kwargs: Any) -> Any:
        if self.failing.is_set():
            self.refused += 1
            return Future().failure(NotEnoughReplicasError("send hook: refused"))
        return self.real.send(topic, **kwargs)

    def close(self, timeout: float | None = None) -> None:
        self.real.close(timeout=timeout)


def test_failed_dead_letter_sends_block_checkpoints_until_they_land_then_a_deleted_dlq_is_recreated(
    kafka_bootstrap: str, admin: KafkaAdminClient, topic_name: str
) -> None:
    topic = topic_name
    settings = settings_for(kafka_bootstrap, topic, dlq_send_attempts=1000)
    failing = threading.Event()
    failing.set()
    producers: list[HookedProducer] = []

    def factory(max_request_size: int) -> HookedProducer:
        producers.append(HookedProducer(failing, bootstrap_servers=kafka_bootstrap, acks="all",
                                        max_request_size=max_request_size, max_block_ms=5000, delivery_timeout_ms=15000,
                                        request_timeout_ms=10000))  # fmt: skip
        return producers[-1]

    outbox = DeadLetterOutbox(settings, Metrics(), producer_factory=factory)
    ingestor, window = start(settings, dead_letters=outbox)
    stream = Placements(kafka_bootstrap, topic_name)
    try:
        wait_for(lambda: topic_exists(kafka_bootstrap, f"{topic}.dlq"), 60, "the .dlq")
        # 1. every send fails: ingest goes on, checkpoints may not pass the letters, and nothing resets that
        first: dict[tuple[int, int], bytes] = {}
        for i in range(6):
            stream.events(10)
            value = b"\x00poison-" + str(i).encode()
            stream.send(None, value, f"poison-{i}")
        first = {
            po: b"\x00poison-" + label.split("-")[1].encode()
            for po, label in stream.placed.items()
            if isinstance(label, str)
        }
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 60, "ingest past the poison")
        assert_window_holds_exactly(window, stream.placed)
        mark = ingestor.dead_letter_mark()
        wait_for(lambda: producers and producers[-1].refused >= 6, 30, "the sends to be refused")
        for _ in range(3):
            assert not ingestor.flush_dead_letters(timeout_s=0.5, upto=mark)
        assert outbox.pending == 6 and "NotEnoughReplicas" in outbox.describe()
        failing.clear()  # recovery
        assert ingestor.flush_dead_letters(timeout_s=60, upto=mark)
        assert_whole_dead_letters(read_dlq(kafka_bootstrap, topic, 6), first, topic, "decode")

        # 2. the .dlq is deleted: the next letters fail, the outbox creates it again (with its size limit),
        # they land once
        failed = outbox.metrics.registry.get_sample_value("streamtrain_dead_letters_failed_total")
        admin.delete_topics([f"{topic}.dlq"], timeout_ms=15000)
        wait_for(lambda: not topic_exists(kafka_bootstrap, f"{topic}.dlq"), 30, "the .dlq to be gone")
        for i in range(6, 10):
            stream.send(None, b"\x00poison-" + str(i).encode(), f"poison-{i}")
        stream.events(10)
        second = {po: b"\x00poison-" + label.split("-")[1].encode() for po, label in stream.placed.items()
                  if isinstance(label, str) and int(label.split("-")[1]) >= 6}  # fmt: skip
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 60, "ingest past the poison")
        assert ingestor.flush_dead_letters(timeout_s=90)
        assert (
            outbox.metrics.registry.get_sample_value("streamtrain_dead_letters_failed_total") > failed
            and len(producers) >= 2
        )  # failed, repaired, resent
        assert topic_exists(kafka_bootstrap, f"{topic}.dlq")
        assert max_message_bytes(admin, f"{topic}.dlq") == max_message_bytes(admin, topic) + 64 * 1024
        assert_whole_dead_letters(read_dlq(kafka_bootstrap, topic, 4), second, topic, "decode")
        assert_window_holds_exactly(window, stream.placed)
        assert ingestor.restarts == {}
    finally:
        ingestor.stop()
        stream.close()
