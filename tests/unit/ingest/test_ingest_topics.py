"""The service's topics on a stand-in admin client (what is created, with which settings, what is
refused), and what a three-broker cluster with brokers down looks like to readiness (``kafka_degraded``).

Against a real broker: tests/integration (fresh topics, a deleted dead-letter topic, ACLs)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
from kafka import TopicPartition
from kafka.admin import ConfigResourceType
from kafka.errors import TopicAlreadyExistsError, TopicAuthorizationFailedError

import streamtrain.ingest.ingestor as ingestor_module
import streamtrain.ingest.topics as topics
from streamtrain.config import load_settings
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.ingest.security import KafkaAccessError
from streamtrain.ingest.topics import PartitionReplicas, degraded_report
from streamtrain.metrics import Metrics
from streamtrain.window.reservoir import RecencyWindow

WHOLE = {p: PartitionReplicas(p + 1, (1, 2, 3), (1, 2, 3)) for p in range(3)}


def test_a_whole_cluster_is_not_degraded() -> None:
    assert degraded_report("events", WHOLE, lambda broker: True) is None
    assert degraded_report("events", {0: PartitionReplicas(1, (1,), (1,))}, lambda broker: True) is None


def test_a_killed_broker_shows_as_replicas_out_of_sync_grouped_by_partition() -> None:
    after_failover = {
        0: PartitionReplicas(2, (1, 2, 3), (2, 3)),
        1: PartitionReplicas(2, (2, 3, 1), (2, 3)),
        2: PartitionReplicas(3, (3, 1, 2), (3, 1, 2)),
    }
    report = degraded_report("events", after_failover, lambda broker: broker != 1)
    assert report == "kafka_degraded: topic events: partitions 0, 1: 2 of 3 replicas in sync (out: broker 1)"


def test_no_leader_and_an_unreachable_leader_are_named() -> None:
    quorum_lost = {
        0: PartitionReplicas(-1, (1, 2, 3), (3,)),
        1: PartitionReplicas(2, (2, 3, 1), (2, 3)),
        2: PartitionReplicas(3, (3, 1, 2), (3, 1, 2)),
    }
    report = degraded_report("events", quorum_lost, lambda broker: broker == 3)
    assert report == (
        "kafka_degraded: topic events: partition 0: no leader, 1 of 3 replicas in sync (out: brokers 1, 2); "
        "partition 1: leader (broker 2) unreachable, 2 of 3 replicas in sync (out: broker 1)"
    )


def consumer_seeing(
    partitions: dict[int, PartitionReplicas], down: set[int], assigned_partitions: tuple[int, ...] = (0, 1, 2)
) -> SimpleNamespace:
    metadata = {
        p: SimpleNamespace(leader_id=r.leader, replica_nodes=list(r.replicas), isr_nodes=list(r.in_sync))
        for p, r in partitions.items()
    }
    cluster = SimpleNamespace(_partitions={"events": metadata})
    client = SimpleNamespace(cluster=cluster, connected=lambda broker: broker not in down)
    assigned = [TopicPartition("events", p) for p in assigned_partitions]
    return SimpleNamespace(_client=client, assignment=lambda: set(assigned))


def test_ingest_keeps_the_report_for_readiness_and_logs_each_change_once(caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(topic="events")
    ingest = Ingestor(settings, RecencyWindow(10, math.inf), Metrics())
    ingest._connected = True
    degraded = {**WHOLE, 0: PartitionReplicas(2, (1, 2, 3), (2, 3))}
    with caplog.at_level(logging.INFO, logger="streamtrain.ingest.ingestor"):
        ingest._note_degraded(consumer_seeing(WHOLE, set()))
        assert ingest.kafka_degraded is None
        for _ in range(3):
            ingest._note_degraded(consumer_seeing(degraded, {1}))
        assert ingest.kafka_degraded == (
            "kafka_degraded: topic events: partition 0: 2 of 3 replicas in sync (out: broker 1)"
        )
        ingest._note_degraded(consumer_seeing(WHOLE, set()))
        assert ingest.kafka_degraded is None
        ingest._connected = False  # not connected at all: kafka_not_connected says it, not this
        ingest._note_degraded(consumer_seeing(degraded, {1, 2, 3}))
        assert ingest.kafka_degraded is None
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if m.startswith("kafka_degraded:")]) == 1, said
    assert len([m for m in said if m.startswith("kafka no longer degraded")]) == 1, said


def test_a_leader_is_called_unreachable_only_after_a_while_and_only_where_ingest_fetches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ingest = Ingestor(load_settings(topic="events"), RecencyWindow(10, math.inf), Metrics())
    ingest._connected = True
    clock = [1000.0]
    monkeypatch.setattr(ingestor_module.time, "monotonic", lambda: clock[0])
    leader_gone = {**WHOLE, 1: PartitionReplicas(2, (2, 3, 1), (2, 3, 1))}
    ingest._note_degraded(consumer_seeing(leader_gone, {2}))
    assert ingest.kafka_degraded is None  # not connected yet: start-up, a rejoin
    clock[0] += 6
    ingest._note_degraded(consumer_seeing(leader_gone, {2}))
    assert ingest.kafka_degraded == "kafka_degraded: topic events: partition 1: leader (broker 2) unreachable"
    ingest._note_degraded(consumer_seeing(leader_gone, {2}, assigned_partitions=(0, 2)))
    assert ingest.kafka_degraded is None  # another member fetches partition 1: its leader is none of ours
    clock[0] += 1
    ingest._note_degraded(consumer_seeing(leader_gone, set()))
    clock[0] += 6
    ingest._note_degraded(consumer_seeing(leader_gone, {2}))
    assert ingest.kafka_degraded is None  # connected again in between: the clock starts over


class Admin:
    """The calls the topic functions make on kafka-python's ``KafkaAdminClient``, on topics kept in a dict."""

    BROKER_LIMIT = 1048588  # the broker's message.max.bytes, for a topic without its own

    def __init__(self, limits: dict[str, int | None] | None = None) -> None:
        self.limits = dict(limits or {})  # topic -> its own max.message.bytes (None: the broker's)
        self.created: list[tuple[dict[str, Any], int, bool]] = []
        self.described: list[tuple[Any, str]] = []
        self.refuse: dict[str, BaseException] = {}
        self.closed = 0

    def list_topics(self) -> list[str]:
        return sorted(self.limits)

    def create_topics(self, new_topics: dict[str, Any], timeout_ms: int, wait_for_metadata: bool) -> None:
        self.created.append((new_topics, timeout_ms, wait_for_metadata))
        if "create" in self.refuse:
            raise self.refuse["create"]
        for name, spec in new_topics.items():
            own = spec["configs"].get("max.message.bytes")
            self.limits[name] = None if own is None else int(own)

    def describe_configs(self, resources: list[Any], config_filter: str) -> dict[str, Any]:
        [resource] = resources
        self.described.append((resource, config_filter))
        if "describe" in self.refuse:
            raise self.refuse["describe"]
        assert resource.resource_type == ConfigResourceType.TOPIC and resource.configs == {"max.message.bytes": None}
        limit = self.limits[resource.name]
        value = str(self.BROKER_LIMIT if limit is None else limit)
        return {"topic": {resource.name: {"max.message.bytes": {"value": value}}}}

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch) -> Admin:
    """The admin client every topic function opens (its options in ``admin.options``)."""
    made = Admin()
    made.options: list[dict[str, Any]] = []  # type: ignore[misc]

    def build(**kw: Any) -> Admin:
        made.options.append(kw)  # type: ignore[attr-defined]
        return made

    monkeypatch.setattr(topics, "KafkaAdminClient", build)
    return made


def test_the_admin_client_waits_the_call_s_timeout_and_reconnects_within_a_second(admin: Admin) -> None:
    settings = load_settings(kafka_bootstrap="b:9092", topic="events")
    admin.limits = {"events": None, "events.dlq": None}
    topics.ensure_topics("a:9092", {}, 2.5)
    topics.ensure_dead_letter_topic(settings, 1000, timeout_s=4.0)
    topics.ensure_topics("a:9092", {})  # each call's timeout defaults to 10 s
    topics.ensure_dead_letter_topic(settings, 1000)
    topics.prepare_topics(settings)

    def options(bootstrap: str, timeout_ms: int, secured: bool) -> dict[str, Any]:
        made = {"bootstrap_servers": bootstrap, "request_timeout_ms": timeout_ms, "reconnect_backoff_max_ms": 1000}
        made["bootstrap_timeout_ms"] = timeout_ms
        return made | ({"security_protocol": "PLAINTEXT"} if secured else {})

    assert admin.options == [  # type: ignore[attr-defined]
        options("a:9092", 2500, False),
        options("b:9092", 4000, True),
        options("a:9092", 10000, False),
        options("b:9092", 10000, True),
        options("b:9092", 10000, True),
    ]


def test_only_missing_topics_are_created_with_their_settings_and_logged(
    admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    admin.limits = {"a": None}
    with caplog.at_level(logging.INFO, logger="streamtrain.ingest.topics"):
        topics.ensure_topics("a:9092", {"a": 3, "b": 2, "c": 1}, 4.0, configs={"b": {"cleanup.policy": "compact"}})
        topics.ensure_topics("a:9092", {"d": 1}, 1.0, replication_factor=3)
        topics.ensure_topics("a:9092", {"a": 3}, 1.0)  # nothing missing: nothing asked
    assert admin.created == [
        (
            {
                "b": {"num_partitions": 2, "replication_factor": -1, "configs": {"cleanup.policy": "compact"}},
                "c": {"num_partitions": 1, "replication_factor": -1, "configs": {}},
            },
            4000,
            True,
        ),
        ({"d": {"num_partitions": 1, "replication_factor": 3, "configs": {}}}, 1000, True),
    ]
    assert admin.closed == 3
    assert [r.getMessage() for r in caplog.records] == [
        "created topic b (2 partitions, replication broker default, {'cleanup.policy': 'compact'})",
        "created topic c (1 partitions, replication broker default, broker default configs)",
        "created topic d (1 partitions, replication 3, broker default configs)",
    ]


def test_a_topic_another_replica_created_first_is_no_error(admin: Admin, caplog: pytest.LogCaptureFixture) -> None:
    admin.refuse["create"] = TopicAlreadyExistsError()
    with caplog.at_level(logging.INFO, logger="streamtrain.ingest.topics"):
        topics.ensure_topics("a:9092", {"b": 1, "a": 1}, 1.0)
    assert [r.getMessage() for r in caplog.records] == ["topics ['a', 'b']: created meanwhile by someone else"]


def test_a_principal_that_may_not_create_topics_is_told_what_to_create(admin: Admin) -> None:
    admin.refuse["create"] = TopicAuthorizationFailedError()
    with pytest.raises(KafkaAccessError) as refused:
        topics.ensure_topics("a:9092", {"b": 2, "c": 1}, 1.0, configs={"b": {"cleanup.policy": "compact"}})
    assert str(refused.value) == (
        "kafka_authorization_failed: CREATE on topic b, c (or DESCRIBE if it exists; else an operator creates it: "
        "b: 2 partitions, replication default, cleanup.policy=compact; c: 1 partitions, replication default)"
    )
    with pytest.raises(KafkaAccessError, match=r"b: 1 partitions, replication default, a=1, b=2\)$"):
        topics.ensure_topics("a:9092", {"b": 1}, 1.0, configs={"b": {"a": "1", "b": "2"}})
    with pytest.raises(KafkaAccessError, match=r"b: 2 partitions, replication 3\)$"):
        topics.ensure_topics("a:9092", {"b": 2}, 1.0, replication_factor=3)
    assert admin.closed == 3  # closed on the way out


def test_a_topic_s_size_limit_is_its_own_or_the_broker_s(admin: Admin) -> None:
    admin.limits = {"own": 5 << 20, "plain": None}
    assert topics.max_message_bytes(admin, "own") == 5 << 20  # type: ignore[arg-type]
    assert topics.max_message_bytes(admin, "plain") == Admin.BROKER_LIMIT  # type: ignore[arg-type]
    assert [(r.name, f) for r, f in admin.described] == [("own", "all"), ("plain", "all")]
    admin.refuse["describe"] = TopicAuthorizationFailedError()
    with pytest.raises(KafkaAccessError, match=r"^kafka_authorization_failed: DESCRIBE_CONFIGS on topic own$"):
        topics.max_message_bytes(admin, "own")  # type: ignore[arg-type]


def test_a_fresh_cluster_gets_the_event_topic_and_a_dead_letter_topic_that_takes_anything_it_holds(
    admin: Admin,
) -> None:
    settings = load_settings(topic="events", topic_partitions=4, topic_replication_factor=2)
    limits = topics.prepare_topics(settings, timeout_s=3.0)
    assert admin.created == [
        ({"events": {"num_partitions": 4, "replication_factor": 2, "configs": {}}}, 3000, True),
        (
            {
                "events.dlq": {
                    "num_partitions": 4,
                    "replication_factor": 2,
                    "configs": {"max.message.bytes": str(Admin.BROKER_LIMIT + 65536)},
                }
            },
            3000,
            True,
        ),
    ]
    assert limits == topics.TopicLimits(Admin.BROKER_LIMIT, Admin.BROKER_LIMIT + 65536) and admin.closed == 1
    assert topics.dlq_configs(1000) == {"max.message.bytes": "66536"}


def test_an_existing_topic_s_own_limit_sizes_a_new_dead_letter_topic(admin: Admin) -> None:
    admin.limits = {"events": 8 << 20}
    limits = topics.prepare_topics(load_settings(topic="events"))
    [(created, _, _)] = admin.created
    assert created["events.dlq"]["configs"] == {"max.message.bytes": str((8 << 20) + 65536)}
    assert created["events.dlq"]["replication_factor"] == -1 and created["events.dlq"]["num_partitions"] == 3
    assert limits == topics.TopicLimits(8 << 20, (8 << 20) + 65536)


def test_a_dead_letter_topic_smaller_than_its_event_topic_is_reported_not_altered(
    admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    admin.limits = {"events": 8 << 20, "events.dlq": 1 << 20}
    with caplog.at_level(logging.WARNING, logger="streamtrain.ingest.topics"):
        limits = topics.prepare_topics(load_settings(topic="events"))
        admin.limits["events.dlq"] = 8 << 20  # as large: nothing to say
        topics.prepare_topics(load_settings(topic="events"))
    assert limits == topics.TopicLimits(8 << 20, 1 << 20) and admin.created == []
    assert [r.getMessage() for r in caplog.records] == [
        "dead-letter topic events.dlq takes messages up to 1048576 bytes, its event topic events up to 8388608: "
        "larger dead letters are forwarded as stand-ins (raise its max.message.bytes to keep them whole)"
    ]


def test_a_deleted_dead_letter_topic_is_created_again_and_an_existing_one_left_alone(admin: Admin) -> None:
    settings = load_settings(topic="events", topic_partitions=2)
    admin.limits = {"events": None, "events.dlq": None}
    assert topics.ensure_dead_letter_topic(settings, 5000) is False and admin.created == []
    del admin.limits["events.dlq"]
    assert topics.ensure_dead_letter_topic(settings, 5000, timeout_s=2.0) is True
    assert admin.created == [
        (
            {"events.dlq": {"num_partitions": 2, "replication_factor": -1, "configs": {"max.message.bytes": "70536"}}},
            2000,
            True,
        )
    ]
    assert admin.closed == 2


def test_a_leader_on_broker_0_is_a_leader() -> None:
    assert degraded_report("events", {0: PartitionReplicas(0, (0, 1), (0, 1))}, lambda broker: True) is None
