"""Which rank owns which Kafka partition.

State belongs to Kafka partitions, never to processes: partition ``p`` is owned by rank
``p mod WORLD_SIZE``. The rule is a pure function of (partition, world size), recomputed
by every rank on every start without coordination, and versioned: each checkpoint
records the rule's name and version and the topic's partition count, so a later release
that changes the rule can still read old checkpoints (or refuse them by name). Never
change the rule under the same version.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

OWNERSHIP_RULE: Final = "modulo"
OWNERSHIP_VERSION: Final = 1


def owner(partition: int, world_size: int) -> int:
    """The rank that owns ``partition``: ``partition mod world_size`` (rule "modulo", version 1)."""
    if partition < 0:
        raise ValueError(f"partition {partition} is negative; Kafka partitions count from 0")
    if world_size < 1:
        raise ValueError(f"world_size {world_size} must be >= 1")
    return partition % world_size


@dataclass(frozen=True)
class Ownership:
    """Which rank owns which partition: a pure, versioned function of (partition, world size).

    Never change the rule under the same version: every rank filters locally, without
    coordination, and checkpoints record the version they were cut under.
    """

    world_size: int
    partition_count: int
    rule: str = OWNERSHIP_RULE
    version: int = OWNERSHIP_VERSION

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.partition_count < 0:
            raise ValueError(
                "Ownership needs world_size >= 1 and partition_count >= 0, "
                f"got {self.world_size}, {self.partition_count}"
            )
        if (self.rule, self.version) != (OWNERSHIP_RULE, OWNERSHIP_VERSION):
            raise ValueError(
                f"ownership rule {self.rule!r} version {self.version} is unknown; this streamtrain knows "
                f"{OWNERSHIP_RULE!r} version {OWNERSHIP_VERSION}"
            )

    def owner(self, partition: int) -> int:
        return owner(partition, self.world_size)

    def partitions_of(self, rank: int) -> list[int]:
        """The partitions ``rank`` owns, ascending (empty when there are fewer partitions than ranks)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return list(range(rank, self.partition_count, self.world_size))

    def idle_ranks(self) -> list[int]:
        """Ranks that own no partition (they still train: a zero gradient each step)."""
        return list(range(self.partition_count, self.world_size))

    def as_dict(self) -> dict[str, Any]:
        """What a checkpoint manifest records about the rule."""
        return {
            "rule": self.rule,
            "version": self.version,
            "world_size": self.world_size,
            "partition_count": self.partition_count,
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Ownership:
        return cls(
            world_size=int(record["world_size"]),
            partition_count=int(record["partition_count"]),
            rule=str(record["rule"]),
            version=int(record["version"]),
        )
