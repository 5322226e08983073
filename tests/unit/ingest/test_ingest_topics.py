"""What a three-broker cluster with brokers down looks like to readiness (``kafka_degraded``)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
from kafka import TopicPartition

import streamtrain.ingest.ingestor as ingestor_module
from streamtrain.config import load_settings
from streamtrain.ingest.ingestor import Ingestor
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
