"""The training stream: endless passes over a live window, each pass on a fresh snapshot.

A pass takes one immutable snapshot, plans it (:func:`plan_batches`) and yields every
item of it exactly once, in token-budget batches; inserts that land meanwhile go to the
window, not to this pass, and show up in the next one. Passes repeat forever. With a
:class:`~streamtrain.data.passes.PassSampler` a pass is a bounded selection of the
snapshot (fresh events first, the rest by the sampling policy); the sampler is asked
only once the window holds ``min_items``, so waiting for the window never moves its
watermark.

Resuming. A consumer that trains in another thread than the one that plans (a
:class:`~streamtrain.data.prefetch.Prefetcher` runs passes ahead) passes
``track_trained=True`` and calls :meth:`WindowBatchDataset.mark_trained` for each batch
it trained. :meth:`~WindowBatchDataset.state_dict` is then the point right after the
last trained batch: the counters and sampler state as they were before that batch's
pass was drawn, plus how many of its batches were done. On restore (or on a new
iteration after an error) that pass is drawn again; in seeded mode, when the window is
unchanged (same items in the same order, checked by a digest), the draw is identical and
the done batches are skipped, so the next batches are exactly those of an uninterrupted
run. When the window moved on, the pass is drawn again whole from the new window: every
event selected but not trained is offered again, none is marked trained without being
trained (at-least-once around a restart). Without ``track_trained`` every handed-out
batch counts, and a state resumes at the next pass.

Data parallelism: every rank plans the same pass from ``(seed, pass)`` and keeps its
own equal share of batches (:meth:`BatchPlan.for_rank`). In crypto mode a plan cannot be
recomputed elsewhere, so rank 0 draws the selection and the plan and broadcasts them
(torch.distributed must be initialized). Either way every rank must see the same snapshot
for the same pass (for example one broadcast from rank 0); with separate windows per rank
the shards would not be disjoint. The crypto broadcast checks this (size and version) and
raises on a mismatch.

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

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from streamtrain.data._validate import require_int
from streamtrain.data.bucketing import BatchPlan, PassDiagnostics, TokenBudget, plan_batches
from streamtrain.data.collate import Batch, BatchPosition, collate_flat
from streamtrain.data.passes import PassSampler, PassSelection
from streamtrain.data.randomness import SHUFFLE_MODES, ShuffleMode, derive_seed, make_randomness

log = logging.getLogger(__name__)


class Snapshot(Protocol):
    """What the dataset needs from a window snapshot (``streamtrain.window.snapshot.WindowSnapshot``,
    or the ``PassSource`` a trainer reads, which gathers most columns for the chosen items only).

    A sampler also reads ``sensor_ids`` and ``seq``, and the pass is ``subset(index)``.
    Read-only properties, so a frozen dataclass (the window's snapshot) is one.
    """

    @property
    def lengths(self) -> np.ndarray: ...

    @property
    def labels(self) -> np.ndarray: ...

    @property
    def ts(self) -> np.ndarray: ...

    @property
    def version(self) -> int: ...

    def __len__(self) -> int: ...

    def gather_values(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


def _distributed_coordinates() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def snapshot_digest(snapshot: Any, configuration: str) -> str:
    """A short fingerprint of which items a snapshot holds, in which order, their lengths,
    and ``configuration`` (whatever else decides the pass drawn from it)."""
    seq = getattr(snapshot, "seq", None)
    identity = np.ascontiguousarray(seq if seq is not None else snapshot.ts)
    digest = hashlib.blake2b(identity.tobytes(), digest_size=16)
    digest.update(np.ascontiguousarray(snapshot.lengths, dtype=np.int64).tobytes())
    digest.update(configuration.encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class _PassRecord:
    """A drawn pass: this rank's batch count, the resume point before it, the window's digest."""

    batches: int
    start: dict[str, Any]
    digest: str | None


class WindowBatchDataset(IterableDataset[Batch]):
    """Collated token-budget batches over a live window, one fresh snapshot per pass.

    ``rank``/``world_size`` default to torch.distributed's when it is initialized. A pass
    needs ``max(min_items, world_size)`` items in the window; with fewer the dataset waits
    ``idle_wait_s`` and takes a new snapshot without using up a pass. ``sampler`` bounds
    each pass (:class:`~streamtrain.data.passes.PassSampler`). ``max_passes`` (default:
    forever) ends the iteration after that many passes. ``on_pass_end`` receives each
    pass's :class:`PassDiagnostics` after its last batch was handed out.
    ``track_trained``: the consumer reports trained batches (see the module docstring).
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
        sampler: PassSampler | None = None,
        track_trained: bool = False,
        min_batches_per_pass: int = 1,
    ) -> None:
        super().__init__()
        if shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, got {shuffle!r}")
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither to take them from torch.distributed")
        if world_size is not None and not 0 <= rank < world_size:  # type: ignore[operator]
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        require_int(min_items, "min_items", 1)
        require_int(min_batches_per_pass, "min_batches_per_pass", 1)
        require_int(max_passes, "max_passes (None: forever)", 0, optional=True)
        require_int(seed, "seed")
        if sampler is not None and (sampler.mode != shuffle or sampler.seed != seed):
            raise ValueError(
                f"the sampler draws with shuffle={sampler.mode!r}, seed={sampler.seed} but the dataset with "
                f"shuffle={shuffle!r}, seed={seed}; give both the same"
            )
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
        self.sampler = sampler
        self.track_trained = track_trained
        self.min_batches_per_pass = min_batches_per_pass
        self.next_pass = 0
        self.planned_steps = 0  # this rank's batches planned before next_pass
        self.last_diagnostics: PassDiagnostics | None = None
        self._lock = threading.RLock()  # counters, sampler and records move together
        self._records: dict[int, _PassRecord] = {}
        self._trained: BatchPosition | None = None
        self._skip: tuple[int, int, str | None] | None = None  # (pass, batches done, digest) after a restore
        self._epoch = 0  # a new iteration retires the previous generator

    @property
    def coordinates(self) -> tuple[int, int]:
        """(rank, world_size) this dataset shards for."""
        if self._world_size is None:
            return _distributed_coordinates()
        return self._rank, self._world_size  # type: ignore[return-value]

    # ------------------------------------------------------------------ planning
    def _plan(self, snapshot: Snapshot, pass_index: int, world_size: int, stratify: bool) -> BatchPlan:
        rng = make_randomness(self.shuffle, self.seed, pass_index, purpose="plan")
        return plan_batches(
            snapshot.lengths,
            self.pass_budget(snapshot.lengths),
            rng,
            pool_size=self.pool_size,
            world_size=world_size,
            labels=snapshot.labels,
            stratify=stratify,
        )

    def pass_budget(self, lengths: np.ndarray) -> TokenBudget:
        """The budget of a pass over items of ``lengths``: small enough for ``min_batches_per_pass`` batches.

        A window smaller than one budget would otherwise be one full batch per pass: a step
        per pass over every event, few steps for many replays. Never below the longest
        (padded) item, so no item becomes too long for its pass.
        """
        lengths = np.asarray(lengths)
        if self.min_batches_per_pass <= 1 or lengths.size == 0:
            return self.budget
        longest = int(self.budget.padded_length(lengths.max()))
        tokens = max(longest, -(-int(lengths.sum()) // self.min_batches_per_pass))
        if tokens >= self.budget.max_tokens:
            return self.budget
        return replace(self.budget, max_tokens=tokens)

    @staticmethod
    def _stamp(plan: BatchPlan, pass_index: int, version: int, **facts: Any) -> BatchPlan:
        diagnostics = replace(plan.diagnostics, pass_index=pass_index, snapshot_version=version, **facts)
        return replace(plan, diagnostics=diagnostics)

    def _draw(self, window: Snapshot, pass_index: int) -> tuple[Snapshot, BatchPlan]:
        """Select the pass's items (when a sampler is set) and plan them."""
        rank, world_size = self.coordinates

        def select() -> tuple[PassSelection | None, Snapshot]:
            if self.sampler is None:
                return None, window
            selection = self.sampler.select(window, planned_steps=self.planned_steps)  # type: ignore[arg-type]
            return selection, window.subset(selection.index)  # type: ignore[attr-defined]

        if self.shuffle == "crypto" and world_size > 1:
            selection, plan = self._share_from_rank_zero(window, pass_index, rank, select)
            snapshot = window if selection is None else window.subset(selection.index)  # type: ignore[attr-defined]
            if rank != 0 and self.sampler is not None:
                self.sampler.advance_past(window)  # type: ignore[arg-type]
        else:
            selection, snapshot = select()
            plan = self._plan(snapshot, pass_index, world_size, selection is not None and selection.stratify)
        facts = {} if selection is None else selection.facts
        return snapshot, self._stamp(plan, pass_index, window.version, **facts)

    def _share_from_rank_zero(
        self,
        window: Snapshot,
        pass_index: int,
        rank: int,
        select: Callable[[], tuple[PassSelection | None, Snapshot]],
    ) -> tuple[PassSelection | None, BatchPlan]:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError(
                "WindowBatchDataset: shuffle='crypto' with world_size > 1 needs torch.distributed initialized, "
                "so that rank 0 can share its unpredictable plan; initialize the process group first"
            )
        world_size = torch.distributed.get_world_size()
        payload: list[Any] = [None, None, None, None]
        if rank == 0:
            selection, snapshot = select()
            stratify = selection is not None and selection.stratify
            payload = [selection, self._plan(snapshot, pass_index, world_size, stratify), len(window), window.version]
        torch.distributed.broadcast_object_list(payload, src=0)
        selection, plan, size, version = payload
        if (size, version) != (len(window), window.version):
            raise RuntimeError(
                f"WindowBatchDataset: rank {rank} took a snapshot of {len(window)} items (version "
                f"{window.version}) but rank 0 planned {size} items (version {version}); every rank must "
                "read the same snapshot for a pass"
            )
        return selection, plan

    # ------------------------------------------------------------------ iteration
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
        if self.track_trained:
            raise RuntimeError(
                "WindowBatchDataset: track_trained needs the batches in one process, in order; "
                "use num_workers=0 with streamtrain.data.Prefetcher"
            )
        return info.id, info.num_workers

    def _wait_for_snapshot(self, required: int, epoch: int) -> Snapshot | None:
        while self._epoch == epoch:
            snapshot = self.snapshot_fn()
            if len(snapshot) >= required:
                return snapshot
            time.sleep(self.idle_wait_s)
        return None

    def __iter__(self) -> Iterator[Batch]:
        worker, workers = self._worker_slice()
        rank, world_size = self.coordinates
        required = max(self.min_items, world_size)
        with self._lock:
            self._epoch += 1
            epoch = self._epoch
            if self.track_trained:
                self._load_point(self._resume_point())
        passes = 0
        while self.max_passes is None or passes < self.max_passes:
            window = self._wait_for_snapshot(required, epoch)
            if window is None:
                return  # a newer iteration took over
            with self._lock:
                if self._epoch != epoch:
                    return
                pass_index = self.next_pass
                start = self._live_point()
                digest = self._digest(window) if self.track_trained and self.shuffle == "seeded" else None
                snapshot, plan = self._draw(window, pass_index)
                mine = plan.for_rank(rank)
                skip = self._batches_to_skip(pass_index, digest, len(mine))
                if self.track_trained:
                    self._records[pass_index] = _PassRecord(len(mine), start, digest)
                    trained = self._trained
                    for finished in [p for p in self._records if trained is not None and p < trained.pass_index]:
                        del self._records[finished]
                self.next_pass += 1
                self.planned_steps += len(mine)
            # the pass trains its subset: a window's snapshot, held for the whole pass, would
            # keep the columns it reads from being written again by the window's next cuts
            del window
            if worker is not None:  # worker-local randomness (e.g. augmentation) gets its own stream
                torch.manual_seed(derive_seed(self.seed, pass_index, rank, worker, purpose="worker"))
            for number in range(skip + (worker or 0), len(mine), workers):
                index = mine[number]
                flat, lengths = snapshot.gather_values(index)
                batch = collate_flat(
                    flat, lengths, snapshot.labels[index], snapshot.ts[index], self.budget.pad_to_multiple_of
                )
                if self._epoch != epoch:
                    return
                yield replace(batch, position=BatchPosition(pass_index, number, len(mine)))
            self.last_diagnostics = plan.diagnostics
            if self.on_pass_end is not None:
                self.on_pass_end(plan.diagnostics)
            passes += 1

    def _digest(self, window: Snapshot) -> str:
        """The window's digest together with everything that shapes a pass drawn from it.

        A restore skips the trained batches of the interrupted pass only when this matches:
        another budget, pool size, rank count, seed or sampling setting would draw another
        pass, and skipping its first batches would leave items untrained.
        """
        configuration = (
            f"seed={self.seed} budget={self.budget!r} pool_size={self.pool_size} coordinates={self.coordinates} "
            f"sampler={None if self.sampler is None else self.sampler.signature()}"
        )
        return snapshot_digest(window, configuration)

    def _batches_to_skip(self, pass_index: int, digest: str | None, batches: int) -> int:
        """Batches of a restored pass that were trained before the checkpoint (0 unless resumable)."""
        pending, self._skip = self._skip, None
        if pending is None or pending[0] != pass_index:
            return 0
        _, done, saved_digest = pending
        if digest is not None and digest == saved_digest:
            return min(done, batches)
        log.info(
            "pass %d was %d batches in when the state was saved; the window or the settings have changed "
            "since (or the plan is not reproducible), so the pass is drawn again from its start",
            pass_index,
            done,
        )
        return 0

    # ------------------------------------------------------------------ trained batches and state
    def mark_trained(self, batch: Batch | BatchPosition) -> None:
        """The consumer trained ``batch`` (in order); a resume starts right after it.

        One reference assignment, no lock: a training step never waits for a pass being
        drawn. Records of passes before it are dropped at the next draw.
        """
        position = batch if isinstance(batch, BatchPosition) else batch.position
        if position is not None:
            self._trained = position

    def _live_point(self) -> dict[str, Any]:
        """The state to continue from the next pass not yet drawn."""
        skip = self._skip if self._skip is not None and self._skip[0] == self.next_pass else None
        return {
            "next_pass": self.next_pass,
            "planned_steps": self.planned_steps,
            "seed": self.seed,
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "skip_batches": 0 if skip is None else skip[1],
            "skip_digest": None if skip is None else skip[2],
        }

    def _resume_point(self) -> dict[str, Any]:
        """The state right after the last trained batch (the live state without tracking)."""
        if not self.track_trained:
            return self._live_point()
        trained = self._trained
        if trained is None or trained.pass_index not in self._records:
            first = min(self._records, default=None)
            return self._live_point() if first is None else dict(self._records[first].start)
        record = self._records[trained.pass_index]
        done = trained.index + 1
        if done >= record.batches:
            following = self._records.get(trained.pass_index + 1)
            return self._live_point() if following is None else dict(following.start)
        return {**record.start, "skip_batches": done, "skip_digest": record.digest}

    def _load_point(self, point: Mapping[str, Any]) -> None:
        self.next_pass = int(point["next_pass"])
        self.planned_steps = int(point.get("planned_steps", 0))
        sampler_state = point.get("sampler")
        if self.sampler is not None and sampler_state is not None:
            self.sampler.load_state_dict(sampler_state)
        done = int(point.get("skip_batches", 0))
        self._skip = (self.next_pass, done, point.get("skip_digest")) if done > 0 else None
        self._records.clear()
        self._trained = None

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the next pass to draw (or the pass to redo and how far), the sampler's counters.

        Without ``track_trained`` a resumed run starts the next pass on a fresh snapshot:
        half a pass is not resumed, since the window has moved on and its plan would not apply.
        """
        with self._lock:
            return self._resume_point()

    def load_state_dict(self, state: Mapping[str, Any], sampler_state: Mapping[str, Any] | None = None) -> int | None:
        """Resume from :meth:`state_dict`; returns the seed the state was saved with.

        The configured seed stays: a state saved under another seed continues with this
        one (logged), so changing SEED takes effect on restart. ``sampler_state`` is for
        states written before the sampler's counters were part of this one.
        """
        missing = {"next_pass", "seed"} - set(state)
        if missing:
            raise ValueError(f"WindowBatchDataset state lacks {sorted(missing)}; pass a dict from state_dict()")
        next_pass, saved_seed = int(state["next_pass"]), int(state["seed"])
        planned, done = int(state.get("planned_steps", 0)), int(state.get("skip_batches", 0))
        if min(next_pass, saved_seed, planned, done) < 0:
            raise ValueError(f"WindowBatchDataset state needs counters >= 0, got {dict(state)}")
        if saved_seed != self.seed:
            log.warning(
                "the checkpoint was trained with SEED=%d; continuing with the configured SEED=%d: "
                "passes from here on are drawn from the new seed",
                saved_seed,
                self.seed,
            )
            state = {**state, "skip_batches": 0}  # the interrupted pass cannot be redrawn the same way
        point = dict(state)
        if point.get("sampler") is None and sampler_state is not None:
            point["sampler"] = sampler_state
        with self._lock:
            self._load_point(point)
        return saved_seed
