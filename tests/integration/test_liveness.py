"""Ingest never silently stops: the lost-rejoin bug and its fix, fresh topics, forced
rejoins, a restarted coordinator, and the watchdog healing the stalls it can see.

All against the real broker. A "fresh start" is a service (or its Ingestor) on a topic
that does not exist yet: the service creates it, as on a new user's first run.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kafka import KafkaConsumer
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewPartitions
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka_helpers import Broker, Placements, assert_window_holds_exactly, topic_exists, wait_for
from service_process import ServiceProcess

from streamtrain.config import Settings, load_settings
from streamtrain.ingest.consumers import subscribed_consumer
from streamtrain.ingest.ingestor import Ingestor
from streamtrain.ingest.kafka_compat import keep_rejoin_pending
from streamtrain.metrics import Metrics
from streamtrain.window.reservoir import RecencyWindow

pytestmark = pytest.mark.integration


@pytest.fixture()
def admin(kafka_bootstrap: str) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, request_timeout_ms=15000)
    yield client
    client.close()


@pytest.fixture()
def fresh_topics(kafka_bootstrap: str, admin: KafkaAdminClient) -> Iterator[Callable[[str], str]]:
    """Names of topics that do not exist yet; whatever got created under them is deleted afterwards."""
    names: list[str] = []

    def name(prefix: str = "fresh") -> str:
        topic = f"{prefix}-{uuid.uuid4().hex[:10]}"
        names.extend([topic, f"{topic}.dlq"])
        return topic

    yield name
    existing = set(admin.list_topics())
    doomed = [n for n in names if n in existing]
    if doomed:
        try:
            admin.delete_topics(doomed, timeout_ms=15000)
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass


def ingest_settings(bootstrap: str, topic: str, **overrides: Any) -> Settings:
    base: dict[str, Any] = dict(
        kafka_bootstrap=bootstrap, topic=topic, group_id=f"g-{topic}", max_len=16, window_capacity=50_000,
        half_life_s=math.inf, decode_workers=0,
    )  # fmt: skip
    base.update(overrides)
    return load_settings(**base)


def start_ingestor(settings: Settings, **kwargs: Any) -> tuple[Ingestor, RecencyWindow]:
    window = RecencyWindow(settings.window_capacity, settings.half_life_s, channels=1)
    ingestor = Ingestor(settings, window, Metrics(), **kwargs)
    ingestor.start()
    return ingestor, window


class Recorder(ConsumerRebalanceListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, set[int]]] = []

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.events.append(("revoked", {tp.partition for tp in revoked}))

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.events.append(("assigned", {tp.partition for tp in assigned}))


# ---------------------------------------------------------------------------------------
# the root cause, reproduced on kafka-python itself


@pytest.mark.parametrize("kept_pending", [False, True], ids=["kafka-python as is", "with keep_rejoin_pending"])
def test_a_rejoin_whose_waiter_gave_up_is_lost_unless_kept_pending(
    kafka_bootstrap: str, make_topic: Any, admin: KafkaAdminClient, kept_pending: bool
) -> None:
    """Minimal reproduction of the stall: the leader sees the topic's partitions change
    after its assignment (here: partitions added; on a fresh topic: its partitions
    appearing), a poll() starts the rejoin and gives up waiting while JoinGroup is in
    flight, and the in-flight join's own assignment step makes need_rejoin() false again.

    As is, kafka-python 3.0.12 then never completes the join: revoked, REBALANCING,
    nothing fetchable, for good. If this half ever fails, kafka-python fixed it upstream
    and ``keep_rejoin_pending`` can go."""
    topic = make_topic(partitions=1)
    consumer = KafkaConsumer(
        bootstrap_servers=kafka_bootstrap, group_id=f"g-{topic}", enable_auto_commit=False, metadata_max_age_ms=300
    )
    if kept_pending:
        keep_rejoin_pending(consumer)
    listener = Recorder()
    # The first join must see the topic's partition: one that assigns before the metadata has
    # it ("No partition metadata") is the stall itself, too early for this test (as is, the
    # first assignment then never came: seen once with another test file running beside it).
    wait_for(lambda: consumer.partitions_for_topic(topic), 30, "the topic in the consumer's metadata")
    consumer.subscribe([topic], listener=listener)
    coordinator = consumer._coordinator
    try:
        wait_for(
            lambda: consumer.poll(timeout_ms=200) is not None and consumer.assignment(), 60, "the first assignment"
        )
        partitions = 1
        for _ in range(3):  # establish the race: the waiter gives up while JoinGroup is in flight
            partitions += 1
            admin.create_partitions({topic: NewPartitions(partitions)})
            wait_for(
                lambda: len(coordinator._metadata_snapshot.get(topic, ())) == partitions,
                30,
                "the leader to see the new partitions",
            )
            consumer.poll(timeout_ms=1)  # rejoin starts: partitions revoked, JoinGroup sent, waiter gives up after 1 ms
            if coordinator._join_task is not None and not coordinator._join_task.is_done:
                break
            wait_for(lambda: len(consumer.assignment()) == partitions, 30, "the join that beat the 1 ms waiter")
        else:
            pytest.fail("JoinGroup completed within 1 ms three times: the race could not be set up")
        wait_for(lambda: coordinator._join_task.is_done, 30, "the in-flight JoinGroup + SyncGroup to finish")
        assert listener.events[-1] == ("revoked", set(range(partitions - 1)))
        if not kept_pending:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                assert consumer.poll(timeout_ms=250) == {}
            # the bug: its rejoin is forgotten; nothing fetchable, the heartbeat off, for good
            assert not coordinator.need_rejoin()
            assert coordinator.state == "<rebalancing>" and consumer._subscription.fetchable_partitions() == []
            assert listener.events[-1][0] == "revoked"
        else:
            wait_for(
                lambda: consumer.poll(timeout_ms=250) is not None
                and len(consumer._subscription.fetchable_partitions()) == partitions,
                30, "the rejoin to complete",
            )  # fmt: skip
            assert coordinator.state == "<stable>" and listener.events[-1] == ("assigned", set(range(partitions)))
    finally:
        consumer.close(autocommit=False, timeout_ms=3000)


# ---------------------------------------------------------------------------------------
# fresh starts and forced rejoins, through the Ingestor


def fresh_start(bootstrap: str, topic: str, events: int = 120) -> dict[str, Any]:
    """Start the Ingestor on a topic that does not exist; once it created it, produce; all must land once."""
    settings = ingest_settings(bootstrap, topic)
    ingestor, window = start_ingestor(settings)
    stream = None
    try:
        wait_for(lambda: topic_exists(bootstrap, topic), 60, f"the service to create {topic}", interval=0.2)
        stream = Placements(bootstrap, topic)
        started = time.monotonic()
        stream.events(events)
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 60, f"{topic}: every event ingested")
        assert_window_holds_exactly(window, stream.placed)
        return {"topic": topic, "seconds": time.monotonic() - started, "restarts": dict(ingestor.restarts)}
    finally:
        ingestor.stop()
        if stream is not None:
            stream.close()


def test_twenty_fresh_starts_in_a_row_each_ingest_everything(kafka_bootstrap: str, fresh_topics: Any) -> None:
    """Twenty starts, one after the other, each on a topic that did not exist: every one
    ingests all its events, exactly once, without the watchdog's help."""
    results = [fresh_start(kafka_bootstrap, fresh_topics("fresh")) for _ in range(20)]
    assert all(r["restarts"] == {} for r in results), [r for r in results if r["restarts"]]


def test_partitions_added_right_after_the_first_assignment_are_all_ingested(
    kafka_bootstrap: str, fresh_topics: Any, admin: KafkaAdminClient
) -> None:
    """A rejoin forced during the first generation: the topic grows the moment the
    service got its first partition; the rejoin completes and nothing is lost or doubled."""
    topic = fresh_topics("grows")
    ingestor, window = start_ingestor(ingest_settings(kafka_bootstrap, topic, topic_partitions=1))
    stream = None
    try:
        wait_for(lambda: ingestor.assigned == {0}, 60, "the first assignment")
        admin.create_partitions({topic: NewPartitions(3)})
        stream = Placements(kafka_bootstrap, topic)
        for partition in (0, 1, 2):
            stream.events(40, partition=partition)
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 60, "every partition ingested")
        assert ingestor.assigned == {0, 1, 2}
        assert_window_holds_exactly(window, stream.placed)
        assert ingestor.restarts == {}, "the rejoin must complete by itself, not by the watchdog"
    finally:
        ingestor.stop()
        if stream is not None:
            stream.close()


@pytest.mark.parametrize("fixed", [False, True], ids=["kafka-python as is", "with rejoin_on_partition_changes"])
def test_partitions_added_after_a_static_member_restarted_are_assigned(
    kafka_bootstrap: str, fresh_topics: Any, admin: KafkaAdminClient, monkeypatch: pytest.MonkeyPatch, fixed: bool
) -> None:
    """A static member (GROUP_INSTANCE_ID) that restarts takes its old place without a
    rebalance, so it did not compute the assignment, and kafka-python lets only the
    member that did watch the topic for new partitions. Found by bench/chaos.py: after a
    SIGKILL, partitions added to the topic waited for the next membership change."""
    if not fixed:
        monkeypatch.setattr("streamtrain.ingest.consumers.rejoin_on_partition_changes", lambda consumer: None)
    topic = fresh_topics("static")
    settings = ingest_settings(kafka_bootstrap, topic, topic_partitions=1, group_instance_id=f"static-{topic}")
    first, _ = start_ingestor(settings)
    try:
        wait_for(lambda: first.assigned == {0}, 60, "the first assignment")
    finally:
        first.stop()  # a static member sends no LeaveGroup: the group stays Stable
    ingestor, window = start_ingestor(settings)  # the restart: same instance id, no rebalance
    stream = None
    try:
        wait_for(lambda: ingestor.assigned == {0}, 60, "the restarted member's old partition")
        admin.create_partitions({topic: NewPartitions(3)})
        stream = Placements(kafka_bootstrap, topic)
        for partition in (0, 1, 2):
            stream.events(40, partition=partition)
        if not fixed:  # metadata is refreshed every 10 s; twice that and still nothing
            time.sleep(25)
            assert ingestor.assigned == {0}, (
                "kafka-python assigns added partitions now: drop rejoin_on_partition_changes"
            )
            return
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 60, "every partition ingested")
        assert ingestor.assigned == {0, 1, 2}
        assert_window_holds_exactly(window, stream.placed)
    finally:
        ingestor.stop()
        if stream is not None:
            stream.close()


# ---------------------------------------------------------------------------------------
# the watchdog heals what it sees


class SabotagedConsumers:
    """A consumer factory whose first consumers are broken in the ways a stall shows; then healthy ones."""

    def __init__(self, *sabotage: Callable[[KafkaConsumer], None]) -> None:
        self.sabotage = list(sabotage)
        self.opened = 0

    def __call__(self, settings: Settings, listener: ConsumerRebalanceListener) -> KafkaConsumer:
        consumer = subscribed_consumer(settings, listener)
        if self.opened < len(self.sabotage):
            self.sabotage[self.opened](consumer)
        self.opened += 1
        return consumer


def never_joins(consumer: KafkaConsumer) -> None:
    consumer._coordinator.need_rejoin = lambda: False  # the lost rejoin, from the very start


def fetches_nothing(consumer: KafkaConsumer) -> None:
    def fetch_records(max_records: int, update_offsets: bool = True, timeout_ms: float | None = None) -> Any:
        time.sleep(min(0.1, (timeout_ms or 0) / 1000))
        return {}, False

    consumer._fetcher.fetch_records = fetch_records


def stops_heartbeating(consumer: KafkaConsumer) -> None:
    consumer._coordinator._close_heartbeat()


def test_the_watchdog_recreates_a_stalled_consumer_and_ingest_stays_exact(
    kafka_bootstrap: str, make_topic: Any
) -> None:
    topic = make_topic(partitions=2)
    factory = SabotagedConsumers(never_joins, fetches_nothing, stops_heartbeating)
    settings = ingest_settings(kafka_bootstrap, topic, ingest_stall_timeout_s=2.0)
    ingestor, window = start_ingestor(settings, consumer_factory=factory)
    stream = Placements(kafka_bootstrap, topic)
    reports: list[str] = []
    stop = threading.Event()

    def produce_and_watch() -> None:
        while not stop.is_set():
            stream.events(10)
            report = ingestor.stall_report()
            if report:
                reports.append(report)
            stop.wait(0.2)

    producer = threading.Thread(target=produce_and_watch, daemon=True)
    producer.start()
    try:
        wait_for(lambda: factory.opened >= 4 and len(window) > 0, 90, "three stalls healed")
        wait_for(lambda: ingestor.restarts.get("no_heartbeat", 0) >= 1, 60, "the heartbeat stall to be healed")
        stop.set()
        producer.join(30)
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 60, "everything ingested")
        assert_window_holds_exactly(window, stream.placed)
        assert dict(ingestor.restarts) == {"unassigned": 1, "no_fetch_progress": 1, "no_heartbeat": 1}
        metric = ingestor.metrics.registry.get_sample_value
        for reason in ("unassigned", "no_fetch_progress", "no_heartbeat"):
            assert metric("streamtrain_ingest_restarts_total", {"reason": reason}) == 1
        assert metric("streamtrain_ingest_restarts_total", {"reason": "error"}) == 0
        for reason in ("unassigned", "no_fetch_progress", "no_heartbeat"):  # /readyz named each real cause
            assert any(r.startswith(reason) for r in reports), (reason, reports)
        assert any("has" in r and "records waiting" in r for r in reports), reports
        assert ingestor.stall_report() is None
    finally:
        stop.set()
        ingestor.stop()
        stream.close()


# ---------------------------------------------------------------------------------------
# the group coordinator restarts


@pytest.mark.expected_seconds(40)
def test_a_restarted_coordinator_loses_and_doubles_nothing(private_broker: Broker) -> None:
    private_broker.up()
    bootstrap = private_broker.bootstrap
    topic = "restart-events"  # does not exist: the service creates it
    ingestor, window = start_ingestor(ingest_settings(bootstrap, topic, ingest_stall_timeout_s=5.0))
    stream = None
    try:
        wait_for(lambda: topic_exists(bootstrap, topic), 60, "the topic")
        stream = Placements(bootstrap, topic, delivery_timeout_ms=120_000, request_timeout_ms=10_000)
        stream.events(200)
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 60, "the first events")
        private_broker.down()
        wait_for(lambda: not ingestor.connected, 30, "the service to see the broker gone")
        private_broker.up()
        stream.events(200)
        wait_for(lambda: window.next_offsets == stream.end_offsets(), 90, "the events after the restart")
        assert_window_holds_exactly(window, stream.placed)
        wait_for(lambda: ingestor.stall_report() is None and ingestor.assigned, 30, "a settled consumer")
    finally:
        ingestor.stop()
        if stream is not None:
            stream.close()


# ---------------------------------------------------------------------------------------
# the real service process, on a topic that does not exist yet


def test_serve_creates_its_topics_and_ingests(
    kafka_bootstrap: str, fresh_topics: Any, admin: KafkaAdminClient, tmp_path: Path
) -> None:
    topic = fresh_topics("serve")
    service = ServiceProcess(kafka_bootstrap, topic, tmp_path / "ckpt", tmp_path / "serve.log", max_len=16)
    with service:
        wait_for(
            lambda: topic_exists(kafka_bootstrap, topic) and topic_exists(kafka_bootstrap, f"{topic}.dlq"),
            60,
            "the topics",
        )
        stream = Placements(kafka_bootstrap, topic)
        stream.events(300)
        stream.send(b"bad", b"not json", "decode")
        total = len(stream.placed)
        wait_for(lambda: service.get("/v1/window")["seen_total"] == total, 60, "every message read")
        service.wait_ready()
        window = service.get("/v1/window")
        assert window["accepted_total"] == 300 and window["rejected_total"]["decode"] == 1
        assert window["next_offsets"] == {str(p): o for p, o in stream.end_offsets().items()}
        assert 0 <= window["last_record_age_s"] < 60
        assert window["ingest_restarts_total"] == {
            "unassigned": 0,
            "no_fetch_progress": 0,
            "no_heartbeat": 0,
            "error": 0,
        }
        wait_for(lambda: service.get("/v1/window")["dead_letters_pending"] == 0, 30, "the dead letter acknowledged")
        ready = httpx.get(f"http://127.0.0.1:{service.port}/readyz").json()
        assert ready == {"status": "ok", "reasons": []}
        metrics = service.client.get("/metrics").text
        assert 'streamtrain_ingest_restarts_total{reason="unassigned"} 0.0' in metrics
        assert 'streamtrain_dead_letters_written_total{form="raw"} 1.0' in metrics
        stream.close()
    # it says which malloc it runs on (streamtrain.runtime.allocator)
    assert "malloc: " in (tmp_path / "serve.log").read_text()
    # the topics it created: the broker's replication default, a .dlq that takes what the topic takes
    described = admin.describe_topics([topic, f"{topic}.dlq"])
    assert [len(t["partitions"]) for t in described] == [3, 3]
    assert {len(p["replica_nodes"]) for t in described for p in t["partitions"]} == {1}  # this broker's default
    limits = admin.describe_configs(
        [
            ConfigResource(ConfigResourceType.TOPIC, name, {"max.message.bytes": None})
            for name in (topic, f"{topic}.dlq")
        ],
        config_filter="all",
    )["topic"]
    source, dlq = (int(limits[name]["max.message.bytes"]["value"]) for name in (topic, f"{topic}.dlq"))
    assert dlq == source + 64 * 1024
