"""Ranks in threads of one process, for tests of code written for several processes: what the ranks
exchange (:class:`ThreadHub`) and the collectives the sharded checkpointer uses over it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from streamtrain.distributed.collectives import Collectives


class ThreadHub:
    """What the ranks' collectives exchange: every rank puts its value, then all read all of them."""

    def __init__(self, world: int, timeout: float | None = 20.0) -> None:
        # a rank that skips an exchange breaks the barrier for the others instead of hanging the test
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.slots: list[Any] = [None] * world

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # everyone has read them before the next exchange
        return values


class ThreadCollectives:
    """The collectives the checkpointer and the settings check use, for ``world`` ranks in threads (the real ones cross
    processes, which a mutation run cannot reach: tests/unit/distributed/test_distributed_processes.py)."""

    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, len(hub.slots)

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.hub.exchange(self.rank, row.reshape(-1).clone()))

    def broadcast_ints(self, values: Any, src: int = 0) -> list[int]:
        return [int(v) for v in self.hub.exchange(self.rank, [int(v) for v in values])[src]]

    def max_int(self, value: int) -> int:
        return max(self.hub.exchange(self.rank, int(value)))

    # the real check, over this exchange instead of the process group's
    agree_settings = Collectives.agree_settings


def on_ranks(world: int, each: Callable[[int, Any], Any]) -> list[Any]:
    """``each(rank, collectives)`` on ``world`` ranks at once; each rank's result, or the exception it raised."""
    hub = ThreadHub(world)
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = each(rank, ThreadCollectives(hub, rank))
        except Exception as err:  # noqa: BLE001 - the test reads it
            results[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results
