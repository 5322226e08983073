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

from streamtrain.ingest.kafka_compat import (
    PARTITION_COUNTS_USER_DATA,
    forbid_topic_auto_creation,
    keep_rejoin_pending,
    rejoin_on_partition_changes,
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
