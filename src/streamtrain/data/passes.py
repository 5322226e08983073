"""Bounded training passes: fresh events first, the rest replayed by a sampling policy.

A window of 100k events takes minutes to pass over on a CPU; a stream learner should
see new events sooner. A bounded pass takes at most ``max_items`` items of a window
snapshot: the events that arrived since the previous pass (*fresh*, by arrival number)
newest first, up to ``fresh_share`` of the pass, and a replay of the window for the
rest, both chosen by the :mod:`~streamtrain.data.policies` policy. Fresh events beyond
the fresh share stay in the window as replay candidates; they are not trained in this
pass and no longer count as fresh afterwards (newest first keeps the event-to-trained
latency bounded when the stream outruns training). ``max_items == 0``, or a window no
larger than ``max_items``, gives a pass over the whole window.

The sampler draws from its own stream (purpose ``select``), never the batch planner's.
Its state is two counters; :class:`~streamtrain.data.dataset.WindowBatchDataset` saves
it as it was before the pass being trained, so a restore never skips events that were
selected but not trained.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from streamtrain.data._validate import require_int
from streamtrain.data.policies import (
    PassCandidates,
    SamplingPolicy,
    UniformPolicy,
    concentration,
    group_codes,
    make_policy,
)
from streamtrain.data.randomness import SHUFFLE_MODES, ShuffleMode, make_randomness
from streamtrain.window.storage import SensorCodes

log = logging.getLogger(__name__)


class SelectableSnapshot(Protocol):
    """What the sampler reads from a window snapshot (``streamtrain.window.snapshot.WindowSnapshot``)."""

    lengths: np.ndarray
    labels: np.ndarray
    sensor_ids: np.ndarray | SensorCodes
    seq: np.ndarray | None

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class PassSelection:
    """The items of one pass (ascending indices into the window snapshot) and what they look like.

    ``fresh`` are the indices taken as fresh; ``stratify`` asks the batch planner to keep
    every batch's label mix close to the pass's; ``facts`` feed the pass diagnostics.
    """

    index: np.ndarray
    fresh: np.ndarray
    stratify: bool = False
    facts: dict[str, float | int] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.index.shape[0])


class PassSampler:
    """Chooses each pass's items: ``max_items`` at most, fresh first, the replay by ``policy``."""

    def __init__(
        self,
        max_items: int,
        fresh_share: float,
        mode: ShuffleMode,
        seed: int,
        policy: SamplingPolicy | None = None,
    ) -> None:
        if mode not in SHUFFLE_MODES:
            raise ValueError(f"shuffle mode must be one of {SHUFFLE_MODES}, got {mode!r}")
        if not 0.0 <= fresh_share <= 1.0:
            raise ValueError(f"fresh_share must be within [0, 1], got {fresh_share}")
        self.max_items = require_int(max_items, "max_items (0: the whole window)")
        self.fresh_share = float(fresh_share)
        self.mode: ShuffleMode = mode
        self.seed = require_int(seed, "seed")
        self.policy = policy if policy is not None else UniformPolicy()
        self.passes = 0  # selections made: the pass coordinate of the sampler's stream
        self.watermark = 0  # first arrival number not yet offered to a pass

    def select(self, snapshot: SelectableSnapshot, *, planned_steps: int = 0) -> PassSelection:
        """The next pass's items; moves the watermark past every event in ``snapshot``."""
        n = len(snapshot)
        rng = make_randomness(self.mode, self.seed, self.passes, purpose="select")
        seq = snapshot.seq
        if seq is not None and n:
            fresh_all = np.flatnonzero(seq >= self.watermark)
            fresh_order = fresh_all[np.argsort(-seq[fresh_all], kind="stable")]
        else:
            fresh_order = np.zeros(0, dtype=np.int64)
        sensor_codes, sensors = group_codes(snapshot.sensor_ids)
        bounded = 0 < self.max_items < n
        if bounded:
            candidates = PassCandidates(
                lengths=np.asarray(snapshot.lengths),
                labels=np.asarray(snapshot.labels),
                sensor_codes=sensor_codes,
                sensors=sensors,
                pass_items=self.max_items,
                fresh_order=fresh_order,
                fresh_cap=int(self.max_items * self.fresh_share),
                planned_steps=planned_steps,
            )
            fresh, replay = self.policy.choose(candidates, rng)
            index = np.sort(np.concatenate([fresh, replay]))
        else:
            fresh, index = fresh_order, np.arange(n)
        self.advance_past(snapshot)
        top_share, hhi = concentration(sensor_codes[index], sensors)
        facts: dict[str, float | int] = {
            "window_items": n,
            "fresh_items": int(fresh.size),
            "fresh_deferred": int(fresh_order.size - fresh.size),
            "sensors": int(np.count_nonzero(np.bincount(sensor_codes[index], minlength=sensors))),
            "sensor_top_share": top_share,
            "sensor_hhi": hhi,
            "window_sensor_hhi": concentration(sensor_codes, sensors)[1],
            **self.policy.facts(planned_steps),
        }
        return PassSelection(index=index, fresh=np.sort(fresh), stratify=self.policy.stratify_batches, facts=facts)

    def advance_past(self, snapshot: SelectableSnapshot) -> None:
        """Count a pass over ``snapshot`` without choosing (what :meth:`select` does after choosing).

        A rank that receives rank 0's selection (crypto mode) keeps its counters in step this way.
        """
        self.passes += 1
        seq = snapshot.seq
        if seq is not None and len(snapshot):
            self.watermark = max(self.watermark, int(seq.max()) + 1)

    def signature(self) -> str:
        """What decides a selection besides the snapshot and the counters, as text."""
        return f"max_items={self.max_items} fresh_share={self.fresh_share!r} {self.policy.signature()}"

    def __call__(self, snapshot: Any) -> Any:
        """The next pass as a snapshot of its own (``snapshot.subset`` of :meth:`select`)."""
        return snapshot.subset(self.select(snapshot).index)

    def state_dict(self) -> dict[str, Any]:
        return {"passes": self.passes, "watermark": self.watermark, "seed": self.seed, "policy": self.policy.name}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters; the configured seed and policy stay (a change is logged)."""
        missing = {"passes", "watermark"} - set(state)
        if missing:
            raise ValueError(f"PassSampler state lacks {sorted(missing)}; pass a dict from state_dict()")
        passes, watermark = int(state["passes"]), int(state["watermark"])
        if passes < 0 or watermark < 0:
            raise ValueError(f"PassSampler state needs passes >= 0 and watermark >= 0, got {dict(state)}")
        saved_policy = state.get("policy", "uniform")
        if saved_policy != self.policy.name:
            log.info("sampling policy changed from %s (checkpoint) to %s", saved_policy, self.policy.name)
        self.passes, self.watermark = passes, watermark


def pass_sampler_from_settings(settings: Any) -> PassSampler:
    """The service's sampler: PASS_MAX_ITEMS, PASS_FRESH_SHARE, SHUFFLE, SEED and SAMPLING with its knobs."""
    policy = make_policy(
        settings.sampling,
        sensor_temperature=settings.sensor_temperature,
        curriculum_strength=settings.curriculum_strength,
        curriculum_half_life_steps=settings.curriculum_half_life_steps,
    )
    return PassSampler(settings.pass_max_items, settings.pass_fresh_share, settings.shuffle, settings.seed, policy)
