"""Rank, world size, partition ownership and the collectives of data-parallel training.

Everything that knows there is more than one process lives here, so the rest of the
service asks one object (:class:`Collectives`) and never calls ``torch.distributed``
itself. With ``WORLD_SIZE`` unset the world has one rank, no process group is created
and every collective returns its input: a one-process service runs exactly as before.

Launch follows torch.distributed's ``env://`` convention, as ``torchrun`` and a
Kubernetes StatefulSet set it: ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (:meth:`DistContext.from_env`).

State belongs to Kafka partitions, never to processes: partition ``p`` is owned by rank
``p mod WORLD_SIZE`` (:class:`Ownership`). The rule is a pure function of (partition,
world size), recomputed by every rank on every start, and versioned: each checkpoint
records the rule's name and version and the topic's partition count, so a later release
that changes the rule can still read old checkpoints (or refuse them by name).

Lockstep: every rank takes the same decisions at the same step because it takes them
from one small collective per step (:meth:`Collectives.agree`), which carries the step
number, the control flags (stop, checkpoint due, publish due, has data, reset the
optimizer), a rollback request, the counts that normalize the loss, and any per-rank
statistics the caller adds. The gradients then travel in one bucketed all-reduce
(:meth:`Collectives.allreduce_gradients`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, Literal, NoReturn

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

OWNERSHIP_RULE: Final = "modulo"
OWNERSHIP_VERSION: Final = 1
DEFAULT_TIMEOUT_S: Final = 60.0
DEFAULT_RENDEZVOUS_TIMEOUT_S: Final = 900.0  # torchrun's default rendezvous timeout
DEFAULT_BUCKET_BYTES: Final = 25 << 20  # DDP's default bucket size
HTTP_PORT_ENV: Final = "STREAMTRAIN_HTTP_PORT"
EXIT_COLLECTIVE_FAILURE: Final = 17  # a survivor's exit code when a peer died or hung

Backend = Literal["auto", "gloo", "nccl"]
BACKENDS: Final[tuple[str, ...]] = ("auto", "gloo", "nccl")


class DistConfigError(ValueError):
    """The launch environment is inconsistent; ``str(error)`` is one line naming the variable."""


class CollectiveFailure(RuntimeError):
    """A collective failed: a peer died (connection closed) or hung (``DIST_TIMEOUT_S`` passed).

    The group cannot recover from it: log it, :meth:`Collectives.close`, exit non-zero, and
    let the supervisor (torchrun ``--max-restarts``, Kubernetes) restart every rank from
    the last complete checkpoint.
    """


class LockstepError(RuntimeError):
    """Ranks disagree on something they must agree on (the step, the counts they report)."""


class SettingsMismatch(DistConfigError):
    """Ranks of one group were started with different values of a setting they must share (one line)."""


# ----------------------------------------------------------------------------------------
# who am I


@dataclass(frozen=True)
class DistContext:
    """This process's place in the world, as the launcher set it (world size 1 by default)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the group
    agent_store: bool = False  # TORCHELASTIC_USE_AGENT_STORE: torchrun's agent hosts the store at MASTER_PORT

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise DistConfigError(f"WORLD_SIZE={self.world_size}: a world has at least 1 rank")
        if not 0 <= self.rank < self.world_size:
            raise DistConfigError(
                f"RANK={self.rank} is outside [0, WORLD_SIZE={self.world_size}); give each process its own rank"
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise DistConfigError(
                f"LOCAL_RANK={self.local_rank} is outside [0, LOCAL_WORLD_SIZE={self.local_world_size})"
            )
        if self.world_size > 1 and (not self.master_addr or self.master_port is None):
            raise DistConfigError(
                f"WORLD_SIZE={self.world_size} needs MASTER_ADDR and MASTER_PORT (rank 0's address and a free "
                "port); torchrun sets them, on Kubernetes point MASTER_ADDR at pod 0's headless-service name"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> DistContext:
        """Read torch.distributed's ``env://`` variables; unset ``WORLD_SIZE`` means one process."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return cls()
        world_size = _env_int(env, "WORLD_SIZE", minimum=1)
        rank = _env_int(env, "RANK", minimum=0, default=None if world_size > 1 else 0)
        local_rank = _env_int(env, "LOCAL_RANK", minimum=0, default=0)
        local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", minimum=1, default=max(1, local_rank + 1))
        port = _env_int(env, "MASTER_PORT", minimum=1, default=-1)
        if port > 65535:
            raise DistConfigError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=None if port < 0 else port,
            restart_count=_env_int(env, "TORCHELASTIC_RESTART_COUNT", minimum=0, default=0),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() in ("1", "true"),
        )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_primary(self) -> bool:
        """Rank 0 writes what exists once (model state, the checkpoint manifest)."""
        return self.rank == 0

    def ownership(self, partition_count: int) -> Ownership:
        return Ownership(world_size=self.world_size, partition_count=partition_count)

    def owned_partitions(self, partition_count: int) -> list[int]:
        return self.ownership(partition_count).partitions_of(self.rank)

    def capacity_share(self, capacity: int) -> int:
        return capacity_share(capacity, self.rank, self.world_size)

    def http_port(self, configured: int, *, explicit: bool) -> int:
        return http_port(configured, self, explicit=explicit)


def _env_int(env: Mapping[str, str], name: str, *, minimum: int, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise DistConfigError(f"{name} is not set; torchrun sets it, or export it for each process")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise DistConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise DistConfigError(f"{name}={value} must be >= {minimum}")
    return value


def http_port(configured: int, ctx: DistContext, *, explicit: bool) -> int:
    """The HTTP port of this rank: an explicit per-rank port as is, else ``configured + LOCAL_RANK``.

    ``explicit`` is true when the port was given to this process on its own
    (``STREAMTRAIN_HTTP_PORT`` or ``--port``). torchrun gives every rank on a host the
    same environment, so an explicit port with several local ranks would make them fight
    for one port: that is refused with a line saying what to do instead.
    """
    if explicit:
        if ctx.local_world_size > 1:
            raise DistConfigError(
                f"the HTTP port {configured} was set for the process ({HTTP_PORT_ENV} or --port), but "
                f"{ctx.local_world_size} ranks share this host and would all bind it; set HTTP_PORT in the "
                "config file instead (each rank binds HTTP_PORT + LOCAL_RANK), or start the ranks one by one"
            )
        return configured
    if configured == 0:
        return 0  # an ephemeral port per rank
    port = configured + ctx.local_rank
    if port > 65535:
        raise DistConfigError(
            f"HTTP_PORT {configured} + LOCAL_RANK {ctx.local_rank} = {port} is past 65535; lower HTTP_PORT"
        )
    return port


# ----------------------------------------------------------------------------------------
# partition ownership


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
                f"Ownership needs world_size >= 1 and partition_count >= 0, got {self.world_size}, {self.partition_count}"
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


def capacity_share(capacity: int, rank: int, world_size: int) -> int:
    """This rank's share of a window of ``capacity`` items; the shares add up to ``capacity``."""
    if capacity < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"capacity_share needs capacity >= 1 and 0 <= rank < world_size, got {capacity}, {rank}, {world_size}"
        )
    base, extra = divmod(capacity, world_size)
    return max(1, base + (1 if rank < extra else 0))


# ----------------------------------------------------------------------------------------
# lockstep


#: Who may ask for a rollback, in order of precedence when ranks ask at the same step.
ROLLBACK_TRIGGERS: Final = ("admin", "automatic")


@dataclass(frozen=True)
class RollbackRequest:
    """One rank asks every rank to make kept ``version`` serve again.

    ``from_version`` (automatic rollbacks): the version judged worse; the request applies
    only while that version still serves, so a request overtaken by a publication or by
    another rollback lapses instead of undoing it. An admin's request applies as asked.
    """

    version: int
    trigger: str = "admin"
    from_version: int | None = None

    def __post_init__(self) -> None:
        if self.trigger not in ROLLBACK_TRIGGERS:
            raise ValueError(f"rollback trigger must be one of {ROLLBACK_TRIGGERS}, got {self.trigger!r}")
        versions = [self.version] if self.from_version is None else [self.version, self.from_version]
        if not all(1 <= int(v) < _EXACT_FLOAT_INT for v in versions):
            raise ValueError(f"rollback versions count from 1, got {self.version} (from {self.from_version})")


@dataclass(frozen=True)
class AgreedRollback:
    """The rollback every rank applies at this step: ``rank``'s request."""

    rank: int
    request: RollbackRequest


@dataclass(frozen=True)
class StepSignals:
    """What one rank wants at this step; the agreement ORs the flags over the ranks."""

    stop: bool = False
    checkpoint_due: bool = False
    publish_due: bool = False
    has_data: bool = False
    reset_optimizer: bool = False  # a drift reaction: clear AdamW's moments on every rank
    rollback: RollbackRequest | None = None  # at most one per rank and step; one wins (StepAgreement.rollback)


@dataclass(frozen=True)
class StepAgreement:
    """What every rank decided together at one step (identical on every rank)."""

    step: int
    stop: bool  # some rank was asked to stop: all stop (after the final checkpoint)
    checkpoint: bool  # some rank's checkpoint timer fired: all cut the same checkpoint
    publish: bool  # some rank's publish timer fired: all publish the same version
    ranks_with_data: int
    totals: dict[str, int]  # counts summed over the ranks
    per_rank: np.ndarray  # float64 [world_size, len(payload)]: each rank's payload, in rank order
    reset_optimizer: bool = False  # some rank's drift reaction fired: all clear AdamW's moments
    # The rollback all ranks apply at this step: an admin's request before an automatic
    # one, then the lowest rank's. Requests that lost are asked again at the next step.
    rollback: AgreedRollback | None = None

    @property
    def has_data(self) -> bool:
        return self.ranks_with_data > 0


_SIGNAL_FIELDS: Final = ("stop", "checkpoint_due", "publish_due", "has_data", "reset_optimizer")
_ROLLBACK_FIELDS: Final = 3  # trigger code (0: none, 1 + index in ROLLBACK_TRIGGERS), version, from version (0: none)
_EXACT_FLOAT_INT: Final = 2**53


# ----------------------------------------------------------------------------------------
# the process group


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


def rank_device(
    device: torch.device | str,
    ctx: DistContext,
    *,
    cuda_count: Callable[[], int] = torch.cuda.device_count,
) -> tuple[torch.device, bool]:
    """(the device this rank trains on, whether ranks on this host share a GPU).

    On CUDA with several ranks on one host (``LOCAL_WORLD_SIZE > 1``), rank ``LOCAL_RANK``
    takes GPU ``LOCAL_RANK mod (GPUs visible)``: torchrun's convention (pick the GPUs with
    ``CUDA_VISIBLE_DEVICES``). The configured index applies with one rank per host only.
    Off CUDA the device is returned as configured.
    """
    device = torch.device(device)
    if device.type != "cuda" or ctx.local_world_size <= 1:
        return device, False
    count = max(1, int(cuda_count()))
    return torch.device("cuda", ctx.local_rank % count), ctx.local_world_size > count


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (for tests and single-host launches that pick MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
        same length; otherwise :class:`LockstepError` (a bug that would let ranks drift).
        Counts travel as float64, exact below 2**53.
        """
        counts = dict(counts or {})
        for name, value in counts.items():
            if not 0 <= int(value) < _EXACT_FLOAT_INT:
                raise ValueError(f"count {name}={value} must be in [0, 2**53)")
        extra = torch.as_tensor(np.asarray(payload if payload is not None else [], dtype=np.float64)).reshape(-1)
        names = sorted(counts)
        # a fingerprint of the row layout, so ranks that disagree on it are caught, not misread
        layout = float(zlib.crc32(f"{','.join(names)}|{extra.numel()}|{','.join(_SIGNAL_FIELDS)}".encode()))
        head = [float(step), layout, float(len(names))]
        head += [1.0 if getattr(signals, name) else 0.0 for name in _SIGNAL_FIELDS]
        head += _rollback_fields(signals.rollback)
        head += [float(int(counts[name])) for name in names]
        row = torch.cat([torch.tensor(head, dtype=torch.float64), extra.to(torch.float64)])
        rows = self.all_gather_rows(row)
        steps = rows[:, 0]
        if bool((steps != steps[0]).any()) or bool((rows[:, 1] != rows[0, 1]).any()):
            detail = ", ".join(f"rank {r}: step {int(s)}" for r, s in enumerate(steps.tolist()))
            raise LockstepError(
                f"ranks are out of lockstep ({detail}; count names {names}, payload {extra.numel()}); "
                "every rank must run the same steps with the same row layout"
            )
        flags = rows[:, 3 : 3 + len(_SIGNAL_FIELDS)] > 0.5
        requests = rows[:, 3 + len(_SIGNAL_FIELDS) : 3 + len(_SIGNAL_FIELDS) + _ROLLBACK_FIELDS]
        start = 3 + len(_SIGNAL_FIELDS) + _ROLLBACK_FIELDS
        summed = rows[:, start : start + len(names)].sum(dim=0).tolist()
        return StepAgreement(
            step=int(step),
            stop=bool(flags[:, 0].any()),
            checkpoint=bool(flags[:, 1].any()),
            publish=bool(flags[:, 2].any()),
            ranks_with_data=int(flags[:, 3].sum()),
            totals={name: int(round(total)) for name, total in zip(names, summed)},
            per_rank=rows[:, start + len(names) :].numpy().copy(),
            reset_optimizer=bool(flags[:, 4].any()),
            rollback=_winning_rollback(requests.numpy()),
        )

    def sum_rows(self, values: np.ndarray | Sequence[float]) -> np.ndarray:
        """The sum over the ranks of a small float64 vector, bit for bit the same on every rank.

        Gathered and added up in rank order (an all-reduce may add in another order on
        each rank): for sums a decision is taken from, such as the publish gate's holdout
        errors. Every rank must call it with a vector of the same length.
        """
        row = torch.as_tensor(np.asarray(values, dtype=np.float64)).reshape(-1)
        rows = self.all_gather_rows(row).numpy()
        total = rows[0].copy()
        for other in rows[1:]:
            total = total + other
        return total

    def agree_settings(self, values: Mapping[str, Any]) -> None:
        """Check that every rank was started with the same ``values`` (setting name → value).

        One all-gather of a checksum per setting. Raises :class:`SettingsMismatch` on every
        rank alike (they all see every rank's checksums), naming the first setting that
        differs, the ranks that differ from rank 0, and this rank's own value.
        """
        names = sorted(values)
        checksums = [float(zlib.crc32(f"{name}={values[name]!r}".encode())) for name in names]
        layout = float(zlib.crc32(",".join(names).encode()))
        rows = self.all_gather_rows(torch.tensor([layout, *checksums], dtype=torch.float64))
        if bool((rows[:, 0] != rows[0, 0]).any()):
            raise SettingsMismatch(
                "the ranks check different lists of settings: every rank must run the same streamtrain release"
            )
        for index, name in enumerate(names, start=1):
            differ = [rank for rank in range(rows.shape[0]) if rows[rank, index] != rows[0, index]]
            if differ:
                ranks = ", ".join(map(str, differ))
                raise SettingsMismatch(
                    f"{name.upper()} differs between the ranks of one group (rank {ranks} vs rank 0; here, rank "
                    f"{self.rank}: {values[name]!r}); every rank must run with the same {name.upper()}: give them one config"
                )

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
        params = [p for p in parameters if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not self.active:
            return None if tail is None else tail.clone()
        buckets = _buckets(params, bucket_bytes)
        reduced_tail = None
        for index, bucket in enumerate(buckets):
            grads = [p.grad for p in bucket]
            parts = [g.reshape(-1) for g in grads]  # type: ignore[union-attr]
            last = index == len(buckets) - 1
            if last and tail is not None:
                parts.append(tail.reshape(-1).to(grads[0].dtype))  # type: ignore[union-attr]
            flat = torch.cat(parts).to(self.comm_device)
            self._call("gradient all_reduce", dist.all_reduce, flat, op=dist.ReduceOp.SUM)
            flat = flat.to(grads[0].device)  # type: ignore[union-attr]
            offset = 0
            for grad in grads:
                n = grad.numel()  # type: ignore[union-attr]
                grad.copy_(flat[offset : offset + n].view_as(grad))  # type: ignore[union-attr]
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


def _rollback_fields(request: RollbackRequest | None) -> list[float]:
    if request is None:
        return [0.0] * _ROLLBACK_FIELDS
    return [
        float(1 + ROLLBACK_TRIGGERS.index(request.trigger)),
        float(int(request.version)),
        float(int(request.from_version or 0)),
    ]


def _winning_rollback(requests: np.ndarray) -> AgreedRollback | None:
    """The request every rank applies: the highest-precedence trigger, then the lowest rank."""
    best: tuple[int, int] | None = None
    for rank, (code, _, _) in enumerate(requests.tolist()):
        if code > 0 and (best is None or (int(code), rank) < best):
            best = (int(code), rank)
    if best is None:
        return None
    code, rank = best
    _, version, from_version = requests[rank].tolist()
    return AgreedRollback(
        rank=rank,
        request=RollbackRequest(
            version=int(version),
            trigger=ROLLBACK_TRIGGERS[code - 1],
            from_version=int(from_version) or None,
        ),
    )


def exit_after_collective_failure(err: BaseException, code: int = EXIT_COLLECTIVE_FAILURE) -> NoReturn:
    """Log why, flush, and end the process at once with ``code`` (non-zero).

    After a failed collective the group is unusable and a normal interpreter exit can
    abort in gloo's teardown (SIGABRT, "terminate called without an active exception"),
    so the survivor leaves through ``os._exit`` once its log line is out. What was not
    checkpointed is not lost: offsets were only committed for complete checkpoints.
    """
    log.critical("leaving the training group (exit %d): %s", code, err)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters grouped by (device, dtype), each group cut at ``bucket_bytes``."""
    buckets: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        same_kind = not current or (current[0].device, current[0].dtype) == (p.device, p.dtype)
        if current and (not same_kind or size + nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
