"""The quality settings, and the randomness streams the quality machinery draws from.

The stream coordinates are the ``worker`` coordinate of :func:`make_randomness`; they are
never used by a data-loader worker, so holdout and scoring draws are independent of the
training order and of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamtrain.data.randomness import ShuffleMode

HOLDOUT_STREAM = 1_000_001  # which blocks of a sensor's events are held out
SCORING_STREAM = 1_000_002  # which events of a poll batch are scored when the budget is short


@dataclass(frozen=True)
class QualityConfig:
    """The quality settings (a view of config.Settings, so tests can build one directly)."""

    max_events_per_s: float = 100.0
    score_delay_s: float = 0.0  # the service's default is QUALITY_SCORE_DELAY_S's
    half_life_events: float = 2000.0
    drift_detector: str = "adwin"
    drift_adwin_delta: float = 0.002
    drift_ph_threshold: float = 100.0
    holdout_share: float = 0.0  # the service's default is HOLDOUT_SHARE's (0.1); 0 here: nothing held out unless asked
    holdout_capacity: int = 256
    holdout_min_events: int = 32
    holdout_block_events: int = 1
    publish_gate_tolerance: float = 0.05
    linear_max_order: int = 24
    auto_rollback: bool = True
    rollback_min_events: int = 100
    rollback_margin: float = 0.1
    token_budget: int = 2048
    shuffle: ShuffleMode = "seeded"
    seed: int = 0

    @classmethod
    def from_settings(cls, settings: Any) -> QualityConfig:
        return cls(
            max_events_per_s=settings.quality_max_events_per_s,
            score_delay_s=settings.quality_score_delay_s,
            half_life_events=settings.quality_half_life_events,
            drift_detector=settings.drift_detector,
            drift_adwin_delta=settings.drift_adwin_delta,
            drift_ph_threshold=settings.drift_ph_threshold,
            holdout_share=settings.holdout_share,
            holdout_capacity=settings.holdout_capacity,
            holdout_min_events=settings.holdout_min_events,
            holdout_block_events=settings.holdout_block_events,
            publish_gate_tolerance=settings.publish_gate_tolerance,
            linear_max_order=settings.linear_max_order,
            auto_rollback=settings.auto_rollback,
            rollback_min_events=settings.rollback_min_events,
            rollback_margin=settings.rollback_margin,
            token_budget=settings.token_budget,
            shuffle=settings.shuffle,
            seed=settings.seed,
        )
