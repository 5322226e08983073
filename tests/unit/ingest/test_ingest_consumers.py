"""The consumer factories' pure parts on a stand-in consumer: fetch sizes, partition counts, assignment by hand.

Opening real consumers needs a broker: tests/integration/test_liveness.py and test_scale_out.py do that.
"""

from __future__ import annotations

from typing import Any

from kafka import TopicPartition

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
        return self.partitions

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


def test_owning_no_partition_gives_up_those_assigned() -> None:
    consumer, listener = Consumer({0, 1}, assigned=[TopicPartition("events", 0)]), Recorder()
    assign_owned(consumer, "events", [], listener)
    assert consumer.assigned == [] and consumer.calls == ["unsubscribe"]
    assert listener.seen == [(consumer, [])]
    assign_owned(consumer, "events", [], listener)  # nothing assigned: nothing to give up
    assert consumer.calls == ["unsubscribe"]
