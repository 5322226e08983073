"""Partition ownership: every partition owned exactly once, by ``p mod WORLD_SIZE``, stable
as the topic grows, and recorded with its rule's name and version."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamtrain.distributed.ownership import OWNERSHIP_VERSION, Ownership, owner


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(0, 300))
def test_ownership_partitions_the_partitions(world_size: int, partition_count: int) -> None:
    rule = Ownership(world_size=world_size, partition_count=partition_count)
    shares = [rule.partitions_of(rank) for rank in range(world_size)]
    flat = sorted(p for share in shares for p in share)
    assert flat == list(range(partition_count))  # every partition exactly once
    for rank, share in enumerate(shares):
        assert share == sorted(share)
        assert all(owner(p, world_size) == rank == p % world_size for p in share)
        assert len(share) in (partition_count // world_size, partition_count // world_size + 1)
    assert rule.idle_ranks() == [r for r in range(world_size) if not shares[r]]
    # growing the topic never moves an existing partition
    grown = Ownership(world_size=world_size, partition_count=partition_count + 5)
    assert all(grown.owner(p) == rule.owner(p) for p in range(partition_count))


def test_ownership_is_versioned() -> None:
    rule = Ownership(world_size=3, partition_count=8)
    record = rule.as_dict()
    assert record == {"rule": "modulo", "version": OWNERSHIP_VERSION, "world_size": 3, "partition_count": 8}
    assert Ownership.from_dict(record) == rule
    with pytest.raises(ValueError, match="unknown"):
        Ownership.from_dict({**record, "version": OWNERSHIP_VERSION + 1})
    with pytest.raises(ValueError, match="negative"):
        owner(-1, 2)


def test_each_refusal_in_full() -> None:
    with pytest.raises(ValueError, match=r"^world_size 0 must be >= 1$"):
        owner(3, 0)
    with pytest.raises(ValueError, match=r"^Ownership needs world_size >= 1 and partition_count >= 0, got 2, -1$"):
        Ownership(world_size=2, partition_count=-1)
    with pytest.raises(ValueError, match=r"^Ownership needs world_size >= 1 and partition_count >= 0, got 0, 4$"):
        Ownership(world_size=0, partition_count=4)
    with pytest.raises(ValueError, match=r"^rank 2 is outside \[0, 2\)$"):
        Ownership(world_size=2, partition_count=4).partitions_of(2)


def test_a_record_of_another_rule_is_refused_by_name() -> None:
    record = Ownership(world_size=2, partition_count=4).as_dict() | {"rule": "hash"}
    with pytest.raises(ValueError, match=r"^ownership rule 'hash' version 1 is unknown"):
        Ownership.from_dict(record)
