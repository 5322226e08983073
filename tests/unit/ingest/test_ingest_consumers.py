"""The consumer factories on a stand-in consumer: their settings, the wait for a just-created
topic, fetch sizes, partition counts, assignment by hand.

Consumers against a real broker: tests/integration/test_liveness.py and test_scale_out.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import KafkaError

import streamtrain.ingest.consumers as consumers
from streamtrain.config import load_settings
from streamtrain.ingest.consumers import SeekingListener, assign_owned, fetch_bytes, topic_partition_count


class Consumer:
    """The calls the factories make on a kafka-python consumer, recorded."""

    def __init__(self, partitions: set[int] | None = None, assigned: list[TopicPartition] | None = None) -> None:
        self.partitions = partitions
        self.assigned = list(assigned or [])
        self.calls: list[str] = []

    def topics(self) -> set[str]:
        self.calls.append("topics")
        return {"events"}

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return self.partitions if topic == "events" else None

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.calls.append("assign")
        self.assigned = list(partitions)

    def unsubscribe(self) -> None:
        self.calls.append("unsubscribe")
        self.assigned = []


class Recorder(SeekingListener):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, list[TopicPartition]]] = []

    def on_partitions_revoked(self, revoked: Any) -> None:
        raise AssertionError("assignment by hand revokes nothing")

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.seen.append((self.consumer, list(assigned)))


def test_a_fetch_takes_one_accepted_message_and_never_less_than_kafkas_default() -> None:
    assert fetch_bytes(load_settings(max_message_bytes=4096)) == 1 << 20
    assert fetch_bytes(load_settings(max_message_bytes=8 << 20)) == 8 << 20


def test_the_partition_count_is_one_past_the_highest_partition() -> None:
    assert topic_partition_count(Consumer({0, 1, 2}), "events") == 3
    assert topic_partition_count(Consumer(None), "events") == 0
    refreshed = Consumer({0})
    assert topic_partition_count(refreshed, "events", refresh=True) == 1
    assert refreshed.calls == ["topics"]


def test_assigned_partitions_reach_the_listener_with_the_consumer_that_seeks_them() -> None:
    consumer, listener = Consumer({0, 1, 2, 3}), Recorder()
    assign_owned(consumer, "events", [3, 1], listener)
    wanted = [TopicPartition("events", 1), TopicPartition("events", 3)]
    assert consumer.assigned == wanted and consumer.calls == ["assign"]
    assert listener.seen == [(consumer, wanted)]


def test_a_listener_seeks_no_consumer_until_one_is_assigned_to_it() -> None:
    assert Recorder().consumer is None


def test_owning_no_partition_gives_up_those_assigned() -> None:
    consumer, listener = Consumer({0, 1}, assigned=[TopicPartition("events", 0)]), Recorder()
    assign_owned(consumer, "events", [], listener)
    assert consumer.assigned == [] and consumer.calls == ["unsubscribe"]
    assert listener.seen == [(consumer, [])]
    assign_owned(consumer, "events", [], listener)  # nothing assigned: nothing to give up
    assert consumer.calls == ["unsubscribe"]


class Opened(Consumer):
    """A consumer as ``open_consumer`` returns it, whose metadata shows the topic after ``ready_after`` looks."""

    def __init__(self, kw: dict[str, Any], ready_after: int = 0, partitions: set[int] | None = None) -> None:
        super().__init__(partitions if partitions is not None else {0, 1})
        self.kw = kw
        self.looks = 0
        self.ready_after = ready_after
        self.closed: list[dict[str, Any]] = []
        self.subscribed: list[tuple[list[str], Any]] = []

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        self.looks += 1
        return super().partitions_for_topic(topic) if self.looks > self.ready_after else None

    def subscribe(self, topics: list[str], listener: Any) -> None:
        self.subscribed.append((topics, listener))

    def close(self, **kw: Any) -> None:
        self.closed.append(kw)


class Clock:
    """``consumers.time`` for a test: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now = round(self.now + seconds, 9)  # 75 sleeps of 0.2 s reach 15 s exactly


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``KafkaConsumer`` and the kafka_compat patches replaced by recorders; the clock by :class:`Clock`."""
    made: dict[str, Any] = {"consumers": [], "patches": [], "ready_after": 0, "partitions": None, "clock": Clock()}

    def build(**kw: Any) -> Opened:
        made["consumers"].append(Opened(kw, made["ready_after"], made["partitions"]))
        return made["consumers"][-1]

    monkeypatch.setattr(consumers, "KafkaConsumer", build)
    for name in ("forbid_topic_auto_creation", "rejoin_on_partition_changes", "keep_rejoin_pending"):
        monkeypatch.setattr(consumers, name, lambda c, name=name: made["patches"].append((name, c)))
    monkeypatch.setattr(consumers, "time", made["clock"])
    return made


def test_the_service_consumer_commits_nothing_itself_and_takes_any_accepted_message(opened: dict[str, Any]) -> None:
    settings = load_settings(
        kafka_bootstrap="a:9092,b:9092", topic="events", group_id="trainers", group_instance_id="replica-1",
        poll_max_records=321, max_message_bytes=3 << 20,
    )  # fmt: skip
    consumer = consumers.open_consumer(settings)
    assert consumer.kw == {
        "bootstrap_servers": "a:9092,b:9092",
        "group_id": "trainers",
        "group_instance_id": "replica-1",
        "client_id": "streamtrain-ingest",
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "max_poll_records": 321,
        "max_partition_fetch_bytes": 3 << 20,
        "fetch_max_bytes": 64 << 20,
        "reconnect_backoff_max_ms": 2000,
        "request_timeout_ms": 30000,
        "metadata_max_age_ms": 10000,
        "security_protocol": "PLAINTEXT",
    }
    # the patches go on before any request, and the rejoin check is wrapped last
    assert opened["patches"] == [
        ("forbid_topic_auto_creation", consumer),
        ("rejoin_on_partition_changes", consumer),
        ("keep_rejoin_pending", consumer),
    ]
    assert consumers.open_consumer(settings, static_membership=False).kw["group_instance_id"] is None


def test_subscribing_waits_for_a_just_created_topic_then_joins_the_group(opened: dict[str, Any]) -> None:
    opened["ready_after"] = 3
    listener = Recorder()
    consumer = consumers.subscribed_consumer(load_settings(topic="events"), listener)
    assert consumer.subscribed == [(["events"], listener)] and consumer.closed == []
    assert opened["clock"].sleeps == [0.2, 0.2, 0.2]


def test_subscribing_gives_up_waiting_for_metadata_after_fifteen_seconds(opened: dict[str, Any]) -> None:
    opened["ready_after"] = 10**6  # never: the group's rejoin assigns the partitions later
    consumer = consumers.subscribed_consumer(load_settings(topic="events"), Recorder())
    assert consumer.subscribed and opened["clock"].now == 15.0


def test_a_factory_that_fails_closes_the_consumer_it_opened(
    opened: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kw: Any) -> None:
        raise KafkaError("subscribe refused")

    monkeypatch.setattr(Opened, "subscribe", refuse)
    with pytest.raises(KafkaError, match="subscribe refused"):
        consumers.subscribed_consumer(load_settings(topic="events"), Recorder())
    [consumer] = opened["consumers"]
    assert consumer.closed == [{"autocommit": False, "timeout_ms": 2000}]


def test_scale_out_assigns_what_this_rank_owns_once_the_topic_shows_up(opened: dict[str, Any]) -> None:
    opened["ready_after"], opened["partitions"] = 2, {0, 1, 2, 3}
    listener, counts = Recorder(), []
    consumer = consumers.assigned_consumer(
        load_settings(topic="events", group_instance_id="replica-1"),  # ignored: an assigned consumer joins no group
        listener,
        lambda count: counts.append(count) or [1, 3],
    )
    assert counts == [4] and consumer.kw["group_instance_id"] is None and consumer.closed == []
    assert consumer.calls == ["topics", "topics", "assign"]  # each later look asks the broker afresh
    assert listener.seen == [(consumer, [TopicPartition("events", 1), TopicPartition("events", 3)])]
    assert opened["clock"].sleeps == [0.2, 0.2]


def test_scale_out_refuses_a_topic_missing_from_the_metadata_and_closes_its_consumer(opened: dict[str, Any]) -> None:
    opened["ready_after"] = 10**6
    with pytest.raises(RuntimeError, match=r"^topic 'events' has no partitions in the broker's metadata yet$"):
        consumers.assigned_consumer(load_settings(topic="events"), Recorder(), lambda count: [])
    [consumer] = opened["consumers"]
    assert consumer.closed == [{"autocommit": False, "timeout_ms": 2000}]
    assert opened["clock"].now == 15.0


def test_scale_out_asks_the_broker_nothing_more_when_the_topic_is_known(opened: dict[str, Any]) -> None:
    consumer = consumers.assigned_consumer(load_settings(topic="events"), Recorder(), lambda count: [0])
    assert consumer.calls == ["assign"] and opened["clock"].sleeps == []
