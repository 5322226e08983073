"""The process group of data-parallel training: backend choice, joining, and every collective.

Everything that crosses processes goes through one object, :class:`Collectives`, so the
rest of the service never calls ``torch.distributed`` itself. With one rank no process
group is created and every collective returns its input, so a one-process service does
what it would do without scale-out.

Invariants:

- Collectives are issued in the same order on every rank, from one thread (the
  trainer's): :class:`Collectives` is not thread-safe.
- A collective that fails (a peer died, or hung past ``DIST_TIMEOUT_S``) raises
  :class:`CollectiveFailure`; the group cannot recover, so the rank leaves
  (:func:`exit_after_collective_failure`) and the supervisor restarts every rank from the
  last complete checkpoint.
- A step costs one small all-gather (:meth:`Collectives.agree`, its row is
  :mod:`streamtrain.distributed.wire`) and one bucketed all-reduce of the gradients
  (:meth:`Collectives.allreduce_gradients`), whose sum is left unscaled.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Final, Literal, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from streamtrain.distributed.launch import DistConfigError, DistContext
from streamtrain.distributed.wire import (
    StepAgreement,
    StepRow,
    StepSignals,
    check_settings_checksums,
    settings_checksums,
)
from streamtrain.runtime.exits import leave_now

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: Final = 60.0
DEFAULT_RENDEZVOUS_TIMEOUT_S: Final = 900.0  # torchrun's default rendezvous timeout
DEFAULT_BUCKET_BYTES: Final = 25 << 20  # DDP's default bucket size
EXIT_COLLECTIVE_FAILURE: Final = 17  # a survivor's exit code when a peer died or hung

Backend = Literal["auto", "gloo", "nccl"]
BACKENDS: Final[tuple[str, ...]] = ("auto", "gloo", "nccl")


class CollectiveFailure(RuntimeError):
    """A collective failed: a peer died (connection closed) or hung (``DIST_TIMEOUT_S`` passed).

    The group cannot recover from it: log it, :meth:`Collectives.close`, exit non-zero, and
    let the supervisor (torchrun ``--max-restarts``, Kubernetes) restart every rank from
    the last complete checkpoint.
    """


def resolve_backend(backend: str, device: torch.device | str | None = None, *, gpus_shared: bool = False) -> str:
    """``auto``: NCCL when training on CUDA (and NCCL is built in), gloo otherwise.

    ``gpus_shared``: ranks on this host share a GPU (more local ranks than GPUs). NCCL
    refuses two ranks of one communicator on one GPU, so ``auto`` takes gloo then (the
    collectives go through host memory) and an explicit ``nccl`` is refused.
    """
    if backend not in BACKENDS:
        raise DistConfigError(f"DIST_BACKEND={backend!r} is not one of {', '.join(BACKENDS)}")
    device_type = torch.device(device).type if device is not None else "cpu"
    if backend == "auto":
        return "nccl" if device_type == "cuda" and dist.is_nccl_available() and not gpus_shared else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise DistConfigError("DIST_BACKEND=nccl needs training on CUDA (DEVICE=cuda); use gloo (or auto) on CPU")
    if backend == "nccl" and not dist.is_nccl_available():
        raise DistConfigError("DIST_BACKEND=nccl: this torch build has no NCCL; use gloo")
    if backend == "nccl" and gpus_shared:
        raise DistConfigError(
            "DIST_BACKEND=nccl with more ranks on this host than GPUs: NCCL needs a GPU of its own per rank; "
            "start at most one rank per GPU, or set DIST_BACKEND=gloo (or auto)"
        )
    return backend


class Collectives:
    """The process group as the trainer and the checkpointer use it.

    ``start()`` joins the group when the world has more than one rank: a rendezvous at
    ``MASTER_ADDR:MASTER_PORT`` (rank 0 hosts the store) that waits up to
    ``rendezvous_timeout_s`` for every rank, then ``init_process_group`` with ``timeout_s``
    (``DIST_TIMEOUT_S``) as the deadline of every collective: a rank that dies or hangs
    makes the others' next collective raise within about that time, so they exit and the
    supervisor restarts the group. With one rank nothing is created and every method
    works locally.

    Not thread-safe: collectives must be issued in the same order on every rank, so one
    thread (the trainer's) issues all of them.
    """

    def __init__(
        self,
        ctx: DistContext,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
        gpus_shared: bool = False,
    ) -> None:
        for name, value in (("DIST_TIMEOUT_S", timeout_s), ("rendezvous timeout", rendezvous_timeout_s)):
            if not (value > 0 and math.isfinite(value)):
                raise DistConfigError(f"{name}={value!r} must be a positive number of seconds")
        self.ctx = ctx
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.backend = resolve_backend(backend, self.device, gpus_shared=gpus_shared)
        self.timeout_s = float(timeout_s)
        self.rendezvous_timeout_s = max(float(rendezvous_timeout_s), self.timeout_s)
        self._owns_group = False
        self._failed = False  # a collective failed: the group is broken, no barrier on close

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def active(self) -> bool:
        """True when collectives cross processes (world size > 1 and the group is up)."""
        return self.ctx.distributed and dist.is_available() and dist.is_initialized()

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: the GPU for NCCL, the CPU for gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def start(self) -> Collectives:
        """Join the process group (no-op for one rank or when the launcher already did)."""
        if not self.ctx.distributed or dist.is_initialized():
            return self
        if self.backend == "nccl" and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        log.info(
            "joining process group: rank %d of %d (local %d), %s at %s:%s, timeout %.0f s",
            self.rank,
            self.world_size,
            self.ctx.local_rank,
            self.backend,
            self.ctx.master_addr,
            self.ctx.master_port,
            self.timeout_s,
        )
        # The rendezvous gets its own, longer deadline: ranks start minutes apart (a pod
        # pulling its image, a slow import) and that is no failure. Rank 0's store waits
        # until every rank has connected; only then is the group built, with the
        # collectives' deadline, which a late start can no longer trip. Under torchrun
        # its agent already hosts the store at MASTER_PORT and outlives restarts of the
        # group: every rank is its client, and each attempt keeps its keys apart.
        store = dist.TCPStore(
            host_name=str(self.ctx.master_addr),
            port=int(self.ctx.master_port),  # type: ignore[arg-type]
            world_size=None if self.ctx.agent_store else self.world_size,
            is_master=self.rank == 0 and not self.ctx.agent_store,
            timeout=timedelta(seconds=self.rendezvous_timeout_s),
            wait_for_workers=not self.ctx.agent_store,
        )
        dist.init_process_group(
            backend=self.backend,
            store=dist.PrefixStore(f"streamtrain/attempt_{self.ctx.restart_count}", store),
            world_size=self.world_size,
            rank=self.rank,
            timeout=timedelta(seconds=self.timeout_s),
        )
        self._owns_group = True
        return self

    def close(self) -> None:
        """Leave the group (only one this object created). Safe after a failed collective.

        After a healthy run the ranks meet at a barrier first, so none tears its gloo
        pairs down while a peer still uses them (a rank doing so could abort in C++,
        "terminate called without an active exception", instead of exiting 0).
        """
        if self._owns_group and dist.is_initialized():
            if not self._failed:
                try:
                    dist.barrier()
                except Exception as err:  # noqa: BLE001 - a peer that left already: nothing to wait for
                    log.info("no barrier before leaving the group: %s", err)
            try:
                dist.destroy_process_group()
            except Exception as err:  # noqa: BLE001 - shutting down after a peer died
                log.warning("destroying the process group failed: %s", err)
        self._owns_group = False

    def __enter__(self) -> Collectives:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, name: str, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except RuntimeError as err:  # gloo and NCCL report dead and hung peers as RuntimeError
            self._failed = True
            raise CollectiveFailure(
                f"rank {self.rank} of {self.world_size}: {name} failed, a peer died or hung "
                f"(DIST_TIMEOUT_S={self.timeout_s:g}): {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            ) from err

    # -- small collectives -------------------------------------------------------------------

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D ``row`` stacked in rank order, ``[world_size, len(row)]`` (same dtype)."""
        row = row.reshape(-1)
        if not self.active:
            return row[None].clone()
        local = row.to(self.comm_device)
        rows = [torch.empty_like(local) for _ in range(self.world_size)]
        self._call("all_gather", dist.all_gather, rows, local)
        return torch.stack(rows).to(row.device)

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``sum``, ``max`` or ``min``); returns ``tensor``."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
        if not self.active:
            return tensor
        if tensor.device == self.comm_device:
            self._call("all_reduce", dist.all_reduce, tensor, op=ops[op])
        else:
            moved = tensor.to(self.comm_device)
            self._call("all_reduce", dist.all_reduce, moved, op=ops[op])
            tensor.copy_(moved)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from ``src``; returns ``tensor``."""
        if not self.active:
            return tensor
        if tensor.device == self.comm_device:
            self._call("broadcast", dist.broadcast, tensor, src=src)
        else:
            moved = tensor.to(self.comm_device)
            self._call("broadcast", dist.broadcast, moved, src=src)
            tensor.copy_(moved)
        return tensor

    def broadcast_ints(self, values: Sequence[int], src: int = 0) -> list[int]:
        """``src``'s integers on every rank (int64, exact)."""
        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64)
        return [int(v) for v in self.broadcast_(tensor, src).tolist()]

    def agree_all(self, ok: bool) -> bool:
        """True on every rank only if ``ok`` is true on every rank."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        return bool(self.all_reduce_(flag, "min").item())

    def max_int(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        return int(self.all_reduce_(torch.tensor([int(value)], dtype=torch.int64), "max").item())

    def barrier(self) -> None:
        if self.active:
            self._call("barrier", dist.barrier)

    # -- lockstep ---------------------------------------------------------------------------

    def agree(
        self,
        step: int,
        signals: StepSignals,
        counts: Mapping[str, int] | None = None,
        payload: torch.Tensor | np.ndarray | Sequence[float] | None = None,
    ) -> StepAgreement:
        """The one collective of a step: flags ORed, counts summed, payloads gathered, one rollback chosen.

        An all-gather rather than an all-reduce: merging normalization moments exactly
        (Chan's formula, in rank order) needs every rank's own numbers, and gathering a
        few dozen float64 costs the same single round trip as reducing them.

        Every rank must pass the same ``step``, the same count names and a payload of the
        same length; otherwise :class:`~streamtrain.distributed.wire.LockstepError` (a bug that would let ranks drift).
        Counts travel as float64, exact below 2**53.
        """
        row = StepRow.encode(step, signals, counts, payload)
        return row.decode(self.all_gather_rows(row.values))

    def sum_rows(self, values: np.ndarray | Sequence[float]) -> np.ndarray:
        """The sum over the ranks of a small float64 vector, bit for bit the same on every rank.

        Gathered and added up in rank order (an all-reduce may add in another order on
        each rank): for sums a decision is taken from, such as the publish gate's holdout
        errors. Every rank must call it with a vector of the same length.
        """
        row = torch.as_tensor(np.asarray(values, dtype=np.float64)).reshape(-1)
        rows: np.ndarray = self.all_gather_rows(row).numpy()
        total: np.ndarray = rows[0].copy()
        for other in rows[1:]:
            total = total + other
        return total

    def agree_settings(self, values: Mapping[str, Any]) -> None:
        """Check that every rank was started with the same ``values`` (setting name → value).

        One all-gather of a checksum per setting. Raises
        :class:`~streamtrain.distributed.wire.SettingsMismatch` on every rank alike (they
        all see every rank's checksums), naming the first setting that differs, the ranks
        that differ from rank 0, and this rank's own value.
        """
        rows = self.all_gather_rows(settings_checksums(values))
        check_settings_checksums(rows, values, self.rank)

    # -- gradients and parameters -----------------------------------------------------------

    def allreduce_gradients(
        self,
        parameters: Iterable[torch.nn.Parameter],
        tail: torch.Tensor | None = None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> torch.Tensor | None:
        """Sum every parameter's gradient over the ranks, in flat buckets; also sum ``tail``.

        A parameter without a gradient (a rank with no data, an unused head) contributes
        zeros, so every rank issues the same collectives. ``tail`` (a small 1-D tensor: loss
        sums, flags) rides in the last bucket, so a step costs no extra round trip. The
        sum is left unscaled: the caller weights each rank's loss by the global counts
        before backward (see :mod:`streamtrain.distributed.data_parallel`). Returns the summed ``tail``.
        """
        grads: list[torch.Tensor] = []
        for p in parameters:
            if not p.requires_grad:
                continue
            grad = p.grad
            if grad is None:
                grad = p.grad = torch.zeros_like(p)
            grads.append(grad)
        if not self.active:
            return None if tail is None else tail.clone()
        buckets = _buckets(grads, bucket_bytes)
        reduced_tail = None
        for index, bucket in enumerate(buckets):
            parts = [g.reshape(-1) for g in bucket]
            last = index == len(buckets) - 1
            if last and tail is not None:
                parts.append(tail.reshape(-1).to(bucket[0].dtype))
            flat = torch.cat(parts).to(self.comm_device)
            self._call("gradient all_reduce", dist.all_reduce, flat, op=dist.ReduceOp.SUM)
            flat = flat.to(bucket[0].device)
            offset = 0
            for grad in bucket:
                n = grad.numel()
                grad.copy_(flat[offset : offset + n].view_as(grad))
                offset += n
            if last and tail is not None:
                reduced_tail = flat[offset:].to(tail.dtype)
        if tail is not None and not buckets:
            reduced_tail = tail.clone()
            self.all_reduce_(reduced_tail)
        return reduced_tail

    def broadcast_module(self, module: torch.nn.Module, src: int = 0) -> None:
        """Make every rank's parameters and buffers equal to ``src``'s (at start and after a restore)."""
        if not self.active:
            return
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                self.broadcast_(tensor.data, src)

    def check_in_sync(self, module: torch.nn.Module) -> float:
        """Largest difference of any parameter between this rank and rank 0 (0.0 when in sync).

        Costs a broadcast of the whole model: for tests, start-up checks and diagnostics,
        not for every step.
        """
        worst = 0.0
        if not self.active:
            return worst
        with torch.no_grad():
            for p in module.parameters():
                reference = p.detach().clone()
                self.broadcast_(reference, 0)
                worst = max(worst, float((reference - p.detach()).abs().max()) if p.numel() else 0.0)
        return float(self.all_reduce_(torch.tensor([worst], dtype=torch.float64), "max").item())


def exit_after_collective_failure(err: BaseException, code: int = EXIT_COLLECTIVE_FAILURE) -> NoReturn:
    """Log why, flush, and end the process at once with ``code`` (non-zero).

    After a failed collective the group is unusable and a normal interpreter exit can
    abort in gloo's teardown (SIGABRT, "terminate called without an active exception"),
    so the survivor leaves through ``os._exit`` once its log line is out. What was not
    checkpointed is not lost: offsets were only committed for complete checkpoints.
    """
    leave_now(code, f"leaving the training group (exit {code}): {err}")


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients grouped by (device, dtype), each group cut at ``bucket_bytes``."""
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        same_kind = not current or (current[0].device, current[0].dtype) == (g.device, g.dtype)
        if current and (not same_kind or size + nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
