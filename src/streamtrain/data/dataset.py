"""The training stream: endless passes over a live window, each pass on a fresh snapshot.

A pass takes one immutable snapshot, plans it (:func:`plan_batches`) and yields every
item of it exactly once, in token-budget batches; inserts that land meanwhile go to the
window, not to this pass, and show up in the next one. Passes repeat forever.

Data parallelism: every rank plans the same pass from ``(seed, pass)`` and keeps its
own equal share of batches (:meth:`BatchPlan.for_rank`). In crypto mode a plan cannot be
recomputed elsewhere, so rank 0 draws it and broadcasts it (torch.distributed must be
initialized). Either way every rank must see the same snapshot for the same pass (for
example one broadcast from rank 0); with separate windows per rank the shards would not
be disjoint. The crypto broadcast checks this (size and version) and raises on a mismatch.

Worker processes: the service does not use DataLoader workers. A worker is a forked copy
of the process, so a ``snapshot_fn`` bound to an in-process window reads the window as
it was at fork time; and bench/batching.py (``loader`` rows) measures planning +
collation at about 1 ms per batch in process, several times faster than two worker
processes deliver batches (each batch crosses process boundaries), while a
:class:`~streamtrain.data.prefetch.Prefetcher` thread hides it behind the step. A
``snapshot_fn`` that reads a store shared across processes may opt in with
``allow_worker_processes=True``: workers then take disjoint slices of the same seeded
plan and seed their own torch generator from ``(seed, pass, rank, worker)``.
Crypto mode refuses workers: an unpredictable plan cannot be recomputed identically in
several processes, so their slices would overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from streamtrain.data._validate import require_int
from streamtrain.data.bucketing import BatchPlan, PassDiagnostics, TokenBudget, plan_batches
from streamtrain.data.collate import Batch, collate_flat
from streamtrain.data.randomness import SHUFFLE_MODES, ShuffleMode, derive_seed, make_randomness

class Snapshot(Protocol):
    """What the dataset needs from a window snapshot (``streamtrain.window.WindowSnapshot``)."""

    lengths: np.ndarray
    labels: np.ndarray
    ts: np.ndarray
    version: int

    def __len__(self) -> int: ...

    def gather_values(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


def _distributed_coordinates() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class WindowBatchDataset(IterableDataset[Batch]):
    """Collated token-budget batches over a live window, one fresh snapshot per pass.

    ``rank``/``world_size`` default to torch.distributed's when it is initialized. A pass
    needs ``max(min_items, world_size)`` items; with fewer the dataset waits
    ``idle_wait_s`` and takes a new snapshot without using up a pass. ``max_passes``
    (default: forever) ends the iteration after that many passes. ``on_pass_end``
    receives each pass's :class:`PassDiagnostics` after its last batch was handed out.
    """

    def __init__(
        self,
        snapshot_fn: Callable[[], Snapshot],
        budget: TokenBudget,
        *,
        pool_size: int | None = None,
        shuffle: ShuffleMode = "seeded",
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        min_items: int = 1,
        idle_wait_s: float = 0.05,
        max_passes: int | None = None,
        on_pass_end: Callable[[PassDiagnostics], None] | None = None,
        allow_worker_processes: bool = False,
    ) -> None:
        super().__init__()
        if shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, got {shuffle!r}")
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither to take them from torch.distributed")
        if world_size is not None and not 0 <= rank < world_size:  # type: ignore[operator]
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        require_int(min_items, "min_items", 1)
        require_int(max_passes, "max_passes (None: forever)", 0, optional=True)
        require_int(seed, "seed")
        self.snapshot_fn = snapshot_fn
        self.budget = budget
        self.pool_size = pool_size
        self.shuffle: ShuffleMode = shuffle
        self.seed = seed
        self._rank, self._world_size = rank, world_size
        self.min_items = min_items
        self.idle_wait_s = idle_wait_s
        self.max_passes = max_passes
        self.on_pass_end = on_pass_end
        self.allow_worker_processes = allow_worker_processes
        self.next_pass = 0
        self.last_diagnostics: PassDiagnostics | None = None

    @property
    def coordinates(self) -> tuple[int, int]:
        """(rank, world_size) this dataset shards for."""
        if self._world_size is None:
            return _distributed_coordinates()
        return self._rank, self._world_size  # type: ignore[return-value]

    def plan_pass(self, snapshot: Snapshot, pass_index: int) -> BatchPlan:
        """The plan of one pass, the same on every rank and worker."""
        rank, world_size = self.coordinates
        if self.shuffle == "crypto" and world_size > 1:
            plan = self._plan_on_rank_zero(snapshot, pass_index, rank)
        else:
            plan = self._plan(snapshot, pass_index, world_size)
        diagnostics = replace(plan.diagnostics, pass_index=pass_index, snapshot_version=snapshot.version)
        return replace(plan, diagnostics=diagnostics)

    def _plan(self, snapshot: Snapshot, pass_index: int, world_size: int) -> BatchPlan:
        rng = make_randomness(self.shuffle, self.seed, pass_index)
        return plan_batches(snapshot.lengths, self.budget, rng, pool_size=self.pool_size, world_size=world_size)

    def _plan_on_rank_zero(self, snapshot: Snapshot, pass_index: int, rank: int) -> BatchPlan:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError(
                "WindowBatchDataset: shuffle='crypto' with world_size > 1 needs torch.distributed initialized, "
                "so that rank 0 can share its unpredictable plan; initialize the process group first"
            )
        world_size = torch.distributed.get_world_size()
        payload: list[Any] = (
            [self._plan(snapshot, pass_index, world_size), len(snapshot), snapshot.version]
            if rank == 0
            else [None, None, None]
        )
        torch.distributed.broadcast_object_list(payload, src=0)
        plan, size, version = payload
        if (size, version) != (len(snapshot), snapshot.version):
            raise RuntimeError(
                f"WindowBatchDataset: rank {rank} took a snapshot of {len(snapshot)} items (version "
                f"{snapshot.version}) but rank 0 planned {size} items (version {version}); every rank must "
                "read the same snapshot for a pass"
            )
        return plan

    def _worker_slice(self) -> tuple[int | None, int]:
        """(worker id or None outside a worker, worker count); refuses unsafe worker processes."""
        info = get_worker_info()
        if info is None:
            return None, 1
        if self.shuffle == "crypto":
            raise RuntimeError(
                "WindowBatchDataset: shuffle='crypto' cannot run in DataLoader worker processes, because each "
                "would draw a different plan and their batches would overlap; use num_workers=0 with "
                "streamtrain.data.Prefetcher"
            )
        if not self.allow_worker_processes:
            raise RuntimeError(
                "WindowBatchDataset: a DataLoader worker process sees the window as it was at fork time, not the "
                "live one; use num_workers=0 with streamtrain.data.Prefetcher, or pass "
                "allow_worker_processes=True if snapshot_fn reads a store shared across processes"
            )
        return info.id, info.num_workers

    def _wait_for_snapshot(self, required: int) -> Snapshot:
        while True:
            snapshot = self.snapshot_fn()
            if len(snapshot) >= required:
                return snapshot
            time.sleep(self.idle_wait_s)

    def __iter__(self) -> Iterator[Batch]:
        worker, workers = self._worker_slice()
        rank, world_size = self.coordinates
        required = max(self.min_items, world_size)
        passes = 0
        while self.max_passes is None or passes < self.max_passes:
            snapshot = self._wait_for_snapshot(required)
            pass_index = self.next_pass
            self.next_pass += 1
            plan = self.plan_pass(snapshot, pass_index)
            if worker is not None:  # worker-local randomness (e.g. augmentation) gets its own stream
                torch.manual_seed(derive_seed(self.seed, pass_index, rank, worker))
            for index in plan.for_rank(rank)[worker or 0 :: workers]:
                flat, lengths = snapshot.gather_values(index)
                yield collate_flat(
                    flat, lengths, snapshot.labels[index], snapshot.ts[index], self.budget.pad_to_multiple_of
                )
            self.last_diagnostics = plan.diagnostics
            if self.on_pass_end is not None:
                self.on_pass_end(plan.diagnostics)
            passes += 1

    def state_dict(self) -> dict[str, Any]:
        """The next pass to plan and the seed; a resumed run starts that pass on a fresh snapshot.

        Half a pass is not resumed: the window has moved on, so its plan would not apply.
        """
        return {"next_pass": self.next_pass, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = {"next_pass", "seed"} - set(state)
        if missing:
            raise ValueError(f"WindowBatchDataset state lacks {sorted(missing)}; pass a dict from state_dict()")
        next_pass, seed = int(state["next_pass"]), int(state["seed"])
        if next_pass < 0 or seed < 0:
            raise ValueError(f"WindowBatchDataset state needs next_pass >= 0 and seed >= 0, got {dict(state)}")
        self.next_pass, self.seed = next_pass, seed
