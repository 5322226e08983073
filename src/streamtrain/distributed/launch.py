"""This process's place in the training group, as the launcher set it, and what follows per rank.

Launch follows torch.distributed's ``env://`` convention, as ``torchrun`` and a
Kubernetes StatefulSet set it: ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (:meth:`DistContext.from_env`).
With ``WORLD_SIZE`` unset the world has one rank and nothing else here changes what a
one-process service does.

Invariants: a :class:`DistContext` that exists is consistent (every launch error is a
:class:`DistConfigError` of one line that names the variable); each rank's share of the
window (:func:`capacity_share`) adds up to the configured capacity; a rank's HTTP port
(:func:`http_port`) and GPU (:func:`rank_device`) follow from ``LOCAL_RANK`` alone, so
ranks on one host never collide without being told.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import torch

from streamtrain.distributed.ownership import Ownership

HTTP_PORT_ENV: Final = "STREAMTRAIN_HTTP_PORT"


class DistConfigError(ValueError):
    """The launch environment is inconsistent; ``str(error)`` is one line naming the variable."""


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
        port = _env_int(env, "MASTER_PORT", minimum=1, default=0)  # 0: unset
        if port > 65535:
            raise DistConfigError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=port or None,
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


def capacity_share(capacity: int, rank: int, world_size: int) -> int:
    """This rank's share of a window of ``capacity`` items; the shares add up to ``capacity``."""
    if capacity < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"capacity_share needs capacity >= 1 and 0 <= rank < world_size, got {capacity}, {rank}, {world_size}"
        )
    base, extra = divmod(capacity, world_size)
    return max(1, base + (1 if rank < extra else 0))


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
