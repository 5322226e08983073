"""The quality settings as the service reads them, and the defaults a test gets without them."""

from __future__ import annotations

import dataclasses

from streamtrain.config import load_settings
from streamtrain.quality.config import HOLDOUT_STREAM, SCORING_STREAM, QualityConfig

#: every field at a value of its own, none its default
OWN_VALUES = {
    "max_events_per_s": 7.5,
    "score_delay_s": 0.25,
    "half_life_events": 321.0,
    "drift_detector": "page_hinkley",
    "drift_adwin_delta": 0.01,
    "drift_ph_threshold": 42.0,
    "holdout_share": 0.3,
    "holdout_capacity": 99,
    "holdout_min_events": 11,
    "holdout_block_events": 5,
    "publish_gate_tolerance": 0.2,
    "linear_max_order": 6,
    "auto_rollback": False,
    "rollback_min_events": 17,
    "rollback_margin": 0.4,
    "token_budget": 512,
    "shuffle": "crypto",
    "seed": 3,
}
#: the settings whose names are not the field's
SETTING_NAMES = {name: f"quality_{name}" for name in ("max_events_per_s", "score_delay_s", "half_life_events")}


def test_each_quality_setting_is_read_from_its_own_setting() -> None:
    """A field read from another setting, or left at its default, changes the result."""
    assert set(OWN_VALUES) == {f.name for f in dataclasses.fields(QualityConfig)}
    assert all(getattr(QualityConfig(), name) != value for name, value in OWN_VALUES.items())
    settings = load_settings(**{SETTING_NAMES.get(name, name): value for name, value in OWN_VALUES.items()})
    assert QualityConfig.from_settings(settings) == QualityConfig(**OWN_VALUES)


def test_a_config_built_directly_has_the_services_defaults_but_two() -> None:
    """Tests build a QualityConfig by hand and expect the service's behaviour, except scoring
    at once (no delay) and holding nothing out unless they ask."""
    service = QualityConfig.from_settings(load_settings())
    direct = QualityConfig()
    differing = {
        f.name for f in dataclasses.fields(QualityConfig) if getattr(service, f.name) != getattr(direct, f.name)
    }
    assert differing == {"score_delay_s", "holdout_share"}
    assert (direct.score_delay_s, direct.holdout_share) == (0.0, 0.0)


def test_the_holdout_and_scoring_draw_from_streams_of_their_own() -> None:
    """Which events are held out is independent of which events are scored."""
    assert HOLDOUT_STREAM != SCORING_STREAM
