"""The simulation's settings: precedence of file, environment and flags; one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamtrain.tools.simulation_config import SimulationConfig, SimulationConfigError, load_simulation_config


def test_config_precedence_toml_then_env_then_flags(tmp_path: Path):
    toml = tmp_path / "sim.toml"
    toml.write_text(
        'kafka_bootstrap = "shared:9092"\nchannels = 2\nhalf_life_s = 60.0\n'
        '[simulate]\nrate = 7.5\ndrift = "recurring"\ndrift_at_s = [1.0, 2.0]\ntopic = "from-file"\n'
    )
    cfg = load_simulation_config(toml, environ={})
    assert (cfg.bootstrap, cfg.channels, cfg.rate, cfg.drift, cfg.drift_at_s, cfg.topic) == (
        "shared:9092",
        2,
        7.5,
        "recurring",
        (1.0, 2.0),
        "from-file",
    )
    env = {"STREAMTRAIN_TOPIC": "from-env", "STREAMTRAIN_MAX_LEN": "64", "STREAMTRAIN_N_CLASSES": "3"}
    cfg = load_simulation_config(toml, environ=env)
    assert (cfg.topic, cfg.max_len, cfg.n_classes) == ("from-env", 64, 3)
    cfg = load_simulation_config(toml, environ=env, overrides={"topic": "from-flag"})
    assert cfg.topic == "from-flag"
    assert load_simulation_config(None, environ={}) == SimulationConfig()


def test_config_errors_name_the_setting_and_its_source(tmp_path: Path):
    with pytest.raises(SimulationConfigError, match=r"rate=-1.0 \(from --rate\)"):
        load_simulation_config(None, environ={}, overrides={"rate": -1.0})
    with pytest.raises(SimulationConfigError, match="STREAMTRAIN_CHANNELS"):
        load_simulation_config(None, environ={"STREAMTRAIN_CHANNELS": "two"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[simulate]\nrte = 5\n")
    with pytest.raises(SimulationConfigError, match="unknown setting 'rte'"):
        load_simulation_config(bad, environ={})
    with pytest.raises(SimulationConfigError, match="does not exist"):
        load_simulation_config(tmp_path / "missing.toml", environ={})
    with pytest.raises(SimulationConfigError, match="max_message_bytes"):
        load_simulation_config(None, environ={}, overrides={"max_len": 100_000, "channels": 8})
    with pytest.raises(SimulationConfigError, match="ascending"):
        load_simulation_config(None, environ={}, overrides={"drift_at_s": (5.0, 1.0)})
