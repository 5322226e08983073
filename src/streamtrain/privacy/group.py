"""DP-SGD trained by several ranks as one mechanism: one clock, exact integer sums, one noise draw.

With ``WORLD_SIZE > 1`` each rank admits, samples and clips the privacy units of its own
partitions, exactly as one process does. What makes the N ranks *one* DP mechanism — the
mechanism of one process over the union of their records, with the same ε — is what they
share, all through this object:

* **one public clock**: rank 0's clock decides when a step is due and where the clock is
  anchored, and every rank runs that step with the same number (:meth:`DPGroup.agree_due`);
* **exact sums**: each rank's clipped integer vectors are summed on the integer grid, and
  the ranks' int64 sums are all-reduced exactly (:meth:`DPGroup.sum_exactly`): integer
  addition has no rounding and no order, so every rank holds the same vector, bit for bit,
  equal to the one-process sum over the union;
* **one noise draw**: only rank 0 draws the discrete Gaussian vector and adds it to its own
  sum before the reduce (:attr:`DPGroup.draws_noise`), so the released sum is the union's sum
  plus exactly one draw of ``N_Z(0, (σ·grid)²)`` per coordinate — N draws would be N times
  the variance the accountant assumes the *adversary* faces only once, and no draw on a rank
  would leave nothing to hide its records;
* **one admission budget**: rank ``r`` admits its share of ``R`` per step (the shares add up to
  ``R``), so the group's window holds at most ``R·K`` records and the public divisor is the
  configured one;
* **one writer** in the admission record: rank 0's name, so the sensor ledger's spacing rule
  (one candidacy per K steps of the *model's* clock) holds across the ranks, and one clock log
  (rank 0's) counts every admission's eligible steps once.

Since every released quantity (the update, the step count) is identical on every rank and the
accountant is a function of the settings and the step count, every rank reports the same ε,
the one-process accountant's for that step. ``Collectives`` (:mod:`streamtrain.distributed`)
is the implementation used; anything with the five methods of :class:`GroupCollectives` works.
"""

from __future__ import annotations

from typing import Protocol

import torch

from streamtrain.privacy.config import DPConfigError

#: Bytes of a writer name carried in one broadcast (names are 16 hex characters).
_WRITER_BYTES = 64


class GroupError(RuntimeError):
    """The ranks of a DP group are not in lockstep (a bug): continuing would release two mechanisms."""


class GroupCollectives(Protocol):
    """What the DP group needs from the process group (``distributed.collectives.Collectives`` has it)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    def agree_all(self, ok: bool) -> bool: ...


def admit_share(admit_per_step: int, rank: int, world_size: int) -> int:
    """Rank ``rank``'s share of the R admissions per step: ``R // N``, plus one for the first ``R mod N``."""
    return admit_per_step // world_size + (1 if rank < admit_per_step % world_size else 0)


class DPGroup:
    """The ranks that train one DP model (module docstring). Collective: every rank calls every
    method in the same order, from one thread."""

    def __init__(self, collectives: GroupCollectives) -> None:
        self.collectives = collectives

    @property
    def rank(self) -> int:
        return int(self.collectives.rank)

    @property
    def world_size(self) -> int:
        return int(self.collectives.world_size)

    @property
    def draws_noise(self) -> bool:
        """Only rank 0 draws the step's noise: the group's sum gets exactly one draw."""
        return self.rank == 0

    @property
    def writes_clock(self) -> bool:
        """Only rank 0 writes the group's clock log (one line per step)."""
        return self.rank == 0

    def admit_share(self, admit_per_step: int) -> int:
        """This rank's R; refuses R below the world size (a rank that may admit nothing)."""
        if admit_per_step < self.world_size:
            raise DPConfigError(
                f"DP_ADMIT_PER_STEP={admit_per_step} with WORLD_SIZE={self.world_size}: the ranks share R, and each "
                "needs at least one admission per step; raise DP_ADMIT_PER_STEP to at least WORLD_SIZE"
            )
        return admit_share(admit_per_step, self.rank, self.world_size)

    def agree_due(self, due: bool, origin: float, step: int) -> tuple[bool, float]:
        """Rank 0's decision whether ``step`` is due, and rank 0's clock origin, on every rank.

        Every rank passes the step it would run next; ranks that disagree raise
        :class:`GroupError` on every rank instead of drifting apart.
        """
        local = torch.tensor([1.0 if due else 0.0, float(origin), float(step)], dtype=torch.float64)
        steps = torch.tensor([float(step), -float(step)], dtype=torch.float64)
        self.collectives.broadcast_(local, 0)
        self.collectives.all_reduce_(steps, "max")  # max of step and of -step: equal iff every rank agrees
        if steps[0].item() != -steps[1].item():
            raise GroupError(
                f"DP group rank {self.rank}: ranks are at different clock steps ({-steps[1].item():.0f} to "
                f"{steps[0].item():.0f}); every rank must run every step"
            )
        return bool(local[0].item()), float(local[1].item())

    def sum_exactly(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of an int64 vector, in place (integer addition: exact, any order)."""
        if flat.dtype != torch.int64:
            raise TypeError(f"DPGroup.sum_exactly needs int64 (the integer grid), got {flat.dtype}")
        return self.collectives.all_reduce_(flat, "sum")

    def last_step(self, step: int) -> int:
        """The largest of the ranks' ``step`` (the step the group's clock continues after)."""
        value = torch.tensor([int(step)], dtype=torch.int64)
        return int(self.collectives.all_reduce_(value, "max").item())

    def all_ok(self, ok: bool) -> bool:
        """True on every rank only if ``ok`` is true on every rank."""
        return bool(self.collectives.agree_all(ok))

    def writer(self, local: str) -> str:
        """Rank 0's writer name in the shared record, on every rank."""
        raw = local.encode("ascii")
        if len(raw) > _WRITER_BYTES:
            raise ValueError(f"writer name {local!r} is longer than {_WRITER_BYTES} bytes")
        buffer = torch.zeros(_WRITER_BYTES, dtype=torch.uint8)
        buffer[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        self.collectives.broadcast_(buffer, 0)
        return bytes(buffer.tolist()).rstrip(b"\0").decode("ascii")
