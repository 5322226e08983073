"""What ranks tell each other at every step, and how it is written into a tensor.

Lockstep: every rank takes the same decisions at the same step because it takes them
from one small collective per step (:meth:`~streamtrain.distributed.collectives.Collectives.agree`).
Each rank contributes one float64 row, :class:`StepRow`, and every rank decodes the same
gathered ``[world_size, row]`` tensor into the same :class:`StepAgreement`. The row is::

    step | layout | number of counts | signal flags | rollback request | counts | payload

- ``layout`` is a CRC of the count names, the payload length and the signal names: ranks
  that write different layouts (a bug, or different releases) are caught by
  :class:`LockstepError` instead of being misread.
- The flags (:class:`StepSignals`) are ORed over the ranks, the counts summed, the
  payloads kept per rank in rank order.
- At most one rollback wins per step, the same on every rank: an admin's request before
  an automatic one, then the lowest rank's (:class:`AgreedRollback`).
- Counts and versions travel as float64, so they must be below 2**53 (exact there).

The settings check (:func:`settings_checksums`, :func:`check_settings_checksums`) is the
same idea once at start-up: one row of CRCs, one per setting.

Nothing here talks to a process group: encoding and decoding are pure, so one process
can test them against hand-made rows.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from streamtrain.distributed.launch import DistConfigError


class LockstepError(RuntimeError):
    """Ranks disagree on something they must agree on (the step, the counts they report)."""


class SettingsMismatch(DistConfigError):
    """Ranks of one group were started with different values of a setting they must share (one line)."""


#: Who may ask for a rollback, in order of precedence when ranks ask at the same step.
ROLLBACK_TRIGGERS: Final = ("admin", "automatic")

_EXACT_FLOAT_INT: Final = 2**53


@dataclass(frozen=True)
class AskedRollback:
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
    request: AskedRollback


@dataclass(frozen=True)
class StepSignals:
    """What one rank wants at this step; the agreement ORs the flags over the ranks."""

    stop: bool = False
    checkpoint_due: bool = False
    publish_due: bool = False
    has_data: bool = False
    reset_optimizer: bool = False  # a drift reaction: clear AdamW's moments on every rank
    rollback: AskedRollback | None = None  # at most one per rank and step; one wins (StepAgreement.rollback)


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


# the flags of StepSignals, in the order they travel
_SIGNAL_FIELDS: Final = ("stop", "checkpoint_due", "publish_due", "has_data", "reset_optimizer")
_ROLLBACK_FIELDS: Final = 3  # trigger code (0: none, 1 + index in ROLLBACK_TRIGGERS), version, from version (0: none)
_HEAD: Final = 3  # step, layout, number of counts
_COUNTS_START: Final = _HEAD + len(_SIGNAL_FIELDS) + _ROLLBACK_FIELDS


@dataclass(frozen=True)
class StepRow:
    """This rank's row of one step's agreement, and the layout it was written in."""

    step: int
    count_names: tuple[str, ...]
    payload_size: int
    values: torch.Tensor  # float64, 1-D: what this rank contributes to the all-gather

    @classmethod
    def encode(
        cls,
        step: int,
        signals: StepSignals,
        counts: Mapping[str, int] | None = None,
        payload: torch.Tensor | np.ndarray | Sequence[float] | None = None,
    ) -> StepRow:
        """The row of ``signals``, ``counts`` (each in [0, 2**53)) and ``payload`` (float64) at ``step``."""
        counts = dict(counts or {})
        for name, value in counts.items():
            if not 0 <= int(value) < _EXACT_FLOAT_INT:
                raise ValueError(f"count {name}={value} must be in [0, 2**53)")
        extra = torch.as_tensor(payload if payload is not None else [], dtype=torch.float64).reshape(-1)
        names = sorted(counts)
        layout = float(zlib.crc32(f"{','.join(names)}|{extra.numel()}|{','.join(_SIGNAL_FIELDS)}".encode()))
        head = [float(step), layout, float(len(names))]
        head += [1.0 if getattr(signals, name) else 0.0 for name in _SIGNAL_FIELDS]
        head += _rollback_fields(signals.rollback)
        head += [float(int(counts[name])) for name in names]
        values = torch.cat([torch.tensor(head, dtype=torch.float64), extra])
        return cls(step=int(step), count_names=tuple(names), payload_size=extra.numel(), values=values)

    def decode(self, rows: torch.Tensor) -> StepAgreement:
        """The agreement of every rank's row (``[world_size, len(values)]``, in rank order).

        Raises :class:`LockstepError` when a rank wrote another step or another layout.
        """
        names = list(self.count_names)
        steps = rows[:, 0]
        if bool((steps != steps[0]).any()) or bool((rows[:, 1] != rows[0, 1]).any()):
            detail = ", ".join(f"rank {r}: step {int(s)}" for r, s in enumerate(steps.tolist()))
            raise LockstepError(
                f"ranks are out of lockstep ({detail}; count names {names}, payload {self.payload_size}); "
                "every rank must run the same steps with the same row layout"
            )
        flags = rows[:, _HEAD : _HEAD + len(_SIGNAL_FIELDS)] > 0.5
        requests = rows[:, _HEAD + len(_SIGNAL_FIELDS) : _COUNTS_START]
        summed = rows[:, _COUNTS_START : _COUNTS_START + len(names)].sum(dim=0).tolist()
        return StepAgreement(
            step=self.step,
            stop=bool(flags[:, 0].any()),
            checkpoint=bool(flags[:, 1].any()),
            publish=bool(flags[:, 2].any()),
            ranks_with_data=int(flags[:, 3].sum()),
            totals={name: int(round(total)) for name, total in zip(names, summed)},
            per_rank=rows[:, _COUNTS_START + len(names) :].numpy().copy(),
            reset_optimizer=bool(flags[:, 4].any()),
            rollback=_winning_rollback(requests.numpy()),
        )


def _rollback_fields(request: AskedRollback | None) -> list[float]:
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
        request=AskedRollback(
            version=int(version),
            trigger=ROLLBACK_TRIGGERS[code - 1],
            from_version=int(from_version) or None,
        ),
    )


def settings_checksums(values: Mapping[str, Any]) -> torch.Tensor:
    """This rank's row of the settings check: a CRC of the setting names, then one per ``name=value``."""
    names = sorted(values)
    checksums = [float(zlib.crc32(f"{name}={values[name]!r}".encode())) for name in names]
    layout = float(zlib.crc32(",".join(names).encode()))
    return torch.tensor([layout, *checksums], dtype=torch.float64)


def check_settings_checksums(rows: torch.Tensor, values: Mapping[str, Any], rank: int) -> None:
    """Raise :class:`SettingsMismatch` unless every rank's row (in rank order) equals rank 0's.

    The same on every rank (they all see every rank's checksums): the first setting that
    differs, the ranks that differ from rank 0, and this rank's (``rank``) own value.
    """
    if bool((rows[:, 0] != rows[0, 0]).any()):
        raise SettingsMismatch(
            "the ranks check different lists of settings: every rank must run the same streamtrain release"
        )
    for index, name in enumerate(sorted(values), start=1):
        differ = [other for other in range(rows.shape[0]) if rows[other, index] != rows[0, index]]
        if differ:
            ranks = ", ".join(map(str, differ))
            raise SettingsMismatch(
                f"{name.upper()} differs between the ranks of one group (rank {ranks} vs rank 0; here, rank "
                f"{rank}: {values[name]!r}); every rank must run with the same {name.upper()}: "
                "give them one config"
            )
