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


KNOWN = ", ".join(SimulationConfig.model_fields)
RATE_REFUSED = "invalid simulation setting rate=-1.0 (from --rate): Input should be greater than or equal to 0"


def test_each_refusal_names_where_the_value_came_from(tmp_path: Path, monkeypatch) -> None:
    top = tmp_path / "top.toml"
    top.write_text("channels = 0\n")  # a top-level key shared with the service's config, no [simulate]
    with pytest.raises(SimulationConfigError) as err:
        load_simulation_config(top, environ={})
    assert (
        str(err.value)
        == f"invalid simulation setting channels=0 (from {top}): Input should be greater than or equal to 1"
    )
    with pytest.raises(
        SimulationConfigError, match=r"^invalid simulation setting max_message_bytes=10 \(from --max-message-bytes\)"
    ):
        load_simulation_config(None, environ={}, overrides={"max_message_bytes": 10})
    monkeypatch.setenv("STREAMTRAIN_TOPIC", "from-the-process")
    assert load_simulation_config(None).topic == "from-the-process"  # no environ given: the process's


def test_a_file_without_a_simulate_section_and_an_alias_inside_one(tmp_path: Path) -> None:
    top = tmp_path / "service.toml"
    top.write_text('kafka_bootstrap = "broker:9092"\nwindow_capacity = 5000\n')  # the service's keys are left alone
    assert load_simulation_config(top, environ={}).bootstrap == "broker:9092"
    section = tmp_path / "section.toml"
    section.write_text('[simulate]\nkafka_bootstrap = "other:9092"\n')
    assert load_simulation_config(section, environ={}).bootstrap == "other:9092"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("simulate = 5\n", "config file {path}: 'simulate' must be a table ([simulate]), got int"),
        ("[simulate]\nrte = 5\n", "config file {path}: unknown setting 'rte' in [simulate]; known settings: " + KNOWN),
        ("rate = \n", "config file {path} is not valid TOML: Invalid value (at line 1, column 8)"),
    ],
)
def test_a_bad_file_is_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SimulationConfigError) as err:
        load_simulation_config(path, environ={})
    assert str(err.value) == message.format(path=path)


def test_a_file_that_is_not_utf8_is_refused_as_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'topic = "caf\xe9"\n')
    with pytest.raises(SimulationConfigError, match=rf"^config file {path} is not valid TOML: 'utf-8' codec"):
        load_simulation_config(path, environ={})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"rate": -1.0},
            "invalid simulation setting rate=-1.0 (from --rate): Input should be greater than or equal to 0",
        ),
        (
            {"rate": -1.0, "channels": 0},
            RATE_REFUSED + " (and 1 more)",
        ),
        (
            {"rate": -1.0, "channels": 0, "max_len": 0},
            RATE_REFUSED + " (and 2 more)",
        ),
        ({"rte": 5}, f"unknown simulation setting 'rte' (from --rte); known: {KNOWN}"),
        (
            {"drift_at_s": (5.0, 1.0)},
            "invalid simulation settings: Value error, drift_at_s must be non-negative and ascending, got [5.0, 1.0]",
        ),
    ],
)
def test_the_first_error_is_said_in_full_and_the_rest_counted(overrides: dict, message: str) -> None:
    with pytest.raises(SimulationConfigError) as err:
        load_simulation_config(None, environ={}, overrides=overrides)
    assert str(err.value) == message
