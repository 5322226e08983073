"""The topics the service creates: the event topic and its dead-letter topic, fitted to the cluster.

Replication follows the broker's ``default.replication.factor`` unless
``TOPIC_REPLICATION_FACTOR`` is set (a hard-coded 1 would leave a three-broker cluster's
topics unreplicated). The dead-letter topic must take every message the event topic can
hold, plus the four contract headers: it is created with a ``max.message.bytes`` of the
event topic's limit (read from the broker, so a topic an operator configured is matched)
plus :data:`DLQ_HEADROOM_BYTES`. Existing topics are never altered; a dead-letter topic
that is smaller than its event topic is reported, and messages it refuses are forwarded
as bounded stand-ins (``dead_letters.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TypedDict

from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.errors import AuthorizationError, TopicAlreadyExistsError

from streamtrain.config import Settings
from streamtrain.ingest.security import authorization_failed, client_options

log = logging.getLogger(__name__)

#: Room for the contract headers and the record-batch framing of a forwarded message.
DLQ_HEADROOM_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = "max.message.bytes"


@dataclass(frozen=True)
class TopicLimits:
    """``max.message.bytes`` of the event topic and of its dead-letter topic, as the broker reports them."""

    source_max_message_bytes: int
    dlq_max_message_bytes: int


def _admin(bootstrap: str, timeout_s: float, security: Settings | None = None) -> KafkaAdminClient:
    # A short reconnect backoff: after a broker outage the default grows to 30 s, and ingest
    # (which prepares its topics on every reconnect) would wait that long after the broker is back.
    return KafkaAdminClient(
        bootstrap_servers=bootstrap,
        request_timeout_ms=int(timeout_s * 1000),
        reconnect_backoff_max_ms=1000,
        bootstrap_timeout_ms=int(timeout_s * 1000),
        **(client_options(security) if security is not None else {}),
    )


class _NewTopic(TypedDict):
    """One topic as ``KafkaAdminClient.create_topics`` takes it."""

    num_partitions: int
    replication_factor: int
    configs: dict[str, str]


def _create(
    admin: KafkaAdminClient,
    topics: Mapping[str, int],
    timeout_s: float,
    replication_factor: int | None,
    configs: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    configs = configs or {}
    wanted: dict[str, _NewTopic] = {
        name: {
            "num_partitions": partitions,
            "replication_factor": -1 if replication_factor is None else replication_factor,  # -1: the broker's default
            "configs": dict(configs.get(name, {})),
        }
        for name, partitions in topics.items()
    }
    if not wanted:
        return
    try:
        admin.create_topics(wanted, timeout_ms=int(timeout_s * 1000), wait_for_metadata=True)
    except TopicAlreadyExistsError:  # another replica was first
        log.info("topics %s: created meanwhile by someone else", sorted(wanted))
        return
    except AuthorizationError:  # the principal may not create topics: say which to create, and how
        how = "; ".join(
            f"{name}: {w['num_partitions']} partitions, replication {replication_factor or 'default'}"
            + "".join(f", {k}={v}" for k, v in w["configs"].items())
            for name, w in wanted.items()
        )
        raise authorization_failed(
            "CREATE", "topic", ", ".join(wanted), f"or DESCRIBE if it exists; else an operator creates it: {how}"
        ) from None
    for name in wanted:
        log.info(
            "created topic %s (%d partitions, replication %s, %s)",
            name,
            wanted[name]["num_partitions"],
            replication_factor or "broker default",
            wanted[name]["configs"] or "broker default configs",
        )


def ensure_topics(
    bootstrap: str,
    topics: Mapping[str, int],
    timeout_s: float = 10.0,
    *,
    replication_factor: int | None = None,
    configs: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Create missing topics (name -> partitions); existing ones are left alone.

    ``replication_factor=None`` uses the broker's ``default.replication.factor``;
    ``configs`` maps a topic name to topic configs for its creation.
    """
    admin = _admin(bootstrap, timeout_s)
    try:
        existing = set(admin.list_topics())
        missing = {name: p for name, p in topics.items() if name not in existing}
        _create(admin, missing, timeout_s, replication_factor, configs)
    finally:
        admin.close()


def max_message_bytes(admin: KafkaAdminClient, topic: str) -> int:
    """The topic's effective ``max.message.bytes`` (its own setting, else the broker's)."""
    try:
        described = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, {MAX_MESSAGE_BYTES: None})], config_filter="all"
        )
    except AuthorizationError:
        raise authorization_failed("DESCRIBE_CONFIGS", "topic", topic) from None
    return int(described["topic"][topic][MAX_MESSAGE_BYTES]["value"])


def dlq_configs(source_max_message_bytes: int) -> dict[str, str]:
    """Topic configs of a dead-letter topic that takes whatever its event topic holds."""
    return {MAX_MESSAGE_BYTES: str(source_max_message_bytes + DLQ_HEADROOM_BYTES)}


def _create_dead_letter_topic(
    admin: KafkaAdminClient, settings: Settings, source_max_message_bytes: int, timeout_s: float
) -> None:
    """``<topic>.dlq``: the event topic's partition count, and room for anything the event topic holds."""
    _create(
        admin,
        {settings.dlq_topic: settings.topic_partitions},
        timeout_s,
        settings.topic_replication_factor,
        {settings.dlq_topic: dlq_configs(source_max_message_bytes)},
    )


def prepare_topics(settings: Settings, timeout_s: float = 10.0) -> TopicLimits:
    """Create the event topic and ``<topic>.dlq`` if missing; report both size limits."""
    admin = _admin(settings.kafka_bootstrap, timeout_s, settings)
    try:
        existing = set(admin.list_topics())
        if settings.topic not in existing:
            _create(admin, {settings.topic: settings.topic_partitions}, timeout_s, settings.topic_replication_factor)
        source = max_message_bytes(admin, settings.topic)
        if settings.dlq_topic not in existing:
            _create_dead_letter_topic(admin, settings, source, timeout_s)
        dlq = max_message_bytes(admin, settings.dlq_topic)
    finally:
        admin.close()
    if dlq < source:
        log.warning(
            "dead-letter topic %s takes messages up to %d bytes, its event topic %s up to %d: larger dead letters "
            "are forwarded as stand-ins (raise its %s to keep them whole)",
            settings.dlq_topic, dlq, settings.topic, source, MAX_MESSAGE_BYTES,
        )  # fmt: skip
    return TopicLimits(source, dlq)


def ensure_dead_letter_topic(settings: Settings, source_max_message_bytes: int, timeout_s: float = 10.0) -> bool:
    """Create ``<topic>.dlq`` again if it went missing (deleted); True if it had to be created."""
    admin = _admin(settings.kafka_bootstrap, timeout_s, settings)
    try:
        if settings.dlq_topic in set(admin.list_topics()):
            return False
        _create_dead_letter_topic(admin, settings, source_max_message_bytes, timeout_s)
        return True
    finally:
        admin.close()


@dataclass(frozen=True)
class PartitionReplicas:
    """One partition as a client's cluster metadata has it: leader (-1: none), replicas, in-sync replicas."""

    leader: int
    replicas: tuple[int, ...]
    in_sync: tuple[int, ...]


def _brokers(ids: list[int]) -> str:
    return ("broker " if len(ids) == 1 else "brokers ") + ", ".join(str(i) for i in ids)


def degraded_report(
    topic: str,
    partitions: Mapping[int, PartitionReplicas],
    reachable: Callable[[int], bool],
    fetched: Collection[int] | None = None,
) -> str | None:
    """``kafka_degraded: ...`` when a partition of ``topic`` has no leader, a leader this client
    cannot reach (checked for the partitions in ``fetched`` only, None: all; a client connects
    only to the leaders it fetches from), or replicas out of sync; None when every partition is whole.

    A three-broker cluster with a broker down looks like this (``/readyz`` lists it while the
    service goes on reading from what remains): ``kafka_degraded: topic sensor-events: partitions
    0, 2: 2 of 3 replicas in sync (out: broker 1)``. With a controller quorum lost (two of three
    combined nodes down) the metadata stops changing, so a leader that is gone shows as
    unreachable rather than replaced.
    """
    by_issue: dict[str, list[int]] = {}
    for partition in sorted(partitions):
        replicas = partitions[partition]
        issues = []
        if replicas.leader < 0:
            issues.append("no leader")
        elif (fetched is None or partition in fetched) and not reachable(replicas.leader):
            issues.append(f"leader (broker {replicas.leader}) unreachable")
        out = [r for r in replicas.replicas if r not in replicas.in_sync]
        if out:
            in_sync = f"{len(replicas.in_sync)} of {len(replicas.replicas)} replicas in sync"
            issues.append(f"{in_sync} (out: {_brokers(out)})")
        if issues:
            by_issue.setdefault(", ".join(issues), []).append(partition)
    if not by_issue:
        return None
    parts = [
        f"{'partition' if len(ps) == 1 else 'partitions'} {', '.join(str(p) for p in ps)}: {issue}"
        for issue, ps in sorted(by_issue.items(), key=lambda item: item[1][0])
    ]
    return f"kafka_degraded: topic {topic}: " + "; ".join(parts)
