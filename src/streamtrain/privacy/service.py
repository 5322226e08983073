"""DP mode inside the service: the DP engine on its public clock, with the Trainer's surface.

Ingest hands every valid event straight to :meth:`DPTrainer.admit` (the DP window's
admission rule); the recency window is never a training source in DP mode, since its
evictions would carry an event's influence on for an unbounded time (docs/privacy.md).
Steps run on the public clock whether or not anything was sampled; only period totals
and the spent ε are exported.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from pydantic import ValidationError

from streamtrain.config import Settings
from streamtrain.data.randomness import make_randomness
from streamtrain.events import EventBatch
from streamtrain.model import RunningNorm, build_model
from streamtrain.privacy.config import DPConfig, DPConfigError
from streamtrain.privacy.engine import DPAggregates, DPEngine
from streamtrain.metrics import Metrics
from streamtrain.train import ModelTrainer
from streamtrain.window import RecencyWindow

log = logging.getLogger(__name__)


def dp_config(settings: Settings) -> DPConfig:
    """The DP schedule from the settings; a bad value is one line naming the setting."""
    try:
        return DPConfig.from_settings(settings)
    except ValidationError as err:
        first = err.errors()[0]
        raise DPConfigError(f"invalid DP setting {first.get('loc')}: {first.get('msg')}") from None


class DPTrainer(ModelTrainer):
    """Trains with DP-SGD on the public clock; publishes frozen copies like :class:`Trainer`."""

    thread_name = "dp-trainer"

    def __init__(self, settings: Settings, window: RecencyWindow, metrics: Metrics) -> None:
        super().__init__(settings, metrics)
        torch.manual_seed(settings.seed)  # initial weights are public
        self.model = build_model(settings)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay
        )
        self.config = dp_config(settings)
        # SHUFFLE=seeded is refused inside (check_dp_safety), naming SHUFFLE and crypto.
        self.engine = DPEngine(
            self.model,
            self.optimizer,
            self.config,
            settings.dp_token_budget,
            randomness=make_randomness(settings.shuffle, settings.seed),
        )
        self.norm: RunningNorm = self.engine.norm
        self.last_pass = None
        self.loss_ema = None  # not released in DP mode
        self.naive_loss_ema = None
        self.step_seconds = 0.0
        self.data_wait_seconds = 0.0
        self._exported = DPAggregates()
        self.metrics.dp_epsilon.set(self.engine.epsilon_spent())

    # ------------------------------------------------------------------ the Trainer surface
    @property
    def step(self) -> int:
        return self.engine.steps

    @property
    def tokens_trained(self) -> int:
        return self.engine.report().sampled_tokens  # totals of completed periods only

    def admit(self, batch: EventBatch, next_offsets: dict[int, int]) -> None:
        """Called by ingest for every poll batch of valid events."""
        self.engine.admit(batch, time.time(), next_offsets)

    def dp_report(self) -> dict[str, Any]:
        return self.engine.model_info()

    def _work(self) -> None:
        """Run the next public-clock step when it is due."""
        with self.lock:
            report = self.engine.step(time.time())
        if report is None:
            self._stop.wait(min(0.5, self.engine.seconds_until_next_step(time.time())))
            return
        self.metrics.dp_epsilon.set(report.epsilon)
        self.metrics.train_steps.inc()
        if report.aggregates_updated:
            self._export_period(report.aggregates)
        if report.behind_steps:
            log.debug("DP clock is %d steps ahead of training", report.behind_steps)
        self._publish_if_due()

    def _export_period(self, totals: DPAggregates) -> None:
        """Metrics move by whole reporting periods: no per-step batch size is ever visible."""
        new = DPAggregates(**{k: getattr(totals, k) - getattr(self._exported, k) for k in totals.__dataclass_fields__})
        self._exported = totals
        self.metrics.train_tokens.inc(new.sampled_tokens)
        self.metrics.train_padding_tokens.inc(max(0, new.padded_tokens - new.sampled_tokens))
        self.step_seconds += new.step_seconds

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "model": self.model.state_dict(),
                "model_config": dict(self.model.config),
                "optimizer": self.optimizer.state_dict(),
                "dp": self.engine.state_dict(),
                "step": self.engine.steps,
                "version": self._version,
                "tokens_trained": self.tokens_trained,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            if "dp" not in state:
                raise DPConfigError(
                    "the newest checkpoint was written without DP: its model saw data outside the DP window; "
                    "use an empty CHECKPOINT_DIR for DP mode"
                )
            if dict(state["model_config"]) != dict(self.model.config):
                raise ValueError("checkpoint model does not match the configured model; use a fresh CHECKPOINT_DIR")
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.engine.load_state_dict(state["dp"])
            self._version = int(state.get("version", 0))
            self._exported = self.engine.report()
        self.metrics.dp_epsilon.set(self.engine.epsilon_spent())
        self.publish()
