"""DP mode end to end: real broker, real process; ε grows, stays under the target, steps go on."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from kafka_helpers import wait_for
from service_process import ServiceProcess

from streamtrain.tools.simulation_config import SimulationConfig

pytestmark = pytest.mark.integration

DP_SETTINGS = dict(
    dp="on",
    shuffle="crypto",
    dp_noise_multiplier=2.0,
    dp_q0=0.2,
    dp_eligible_steps=20,
    dp_admit_per_step=16,
    dp_step_rate_hz=5,
    dp_target_epsilon=8,
    dp_token_budget=512,
    max_len=128,
    window_capacity=5000,
)


@pytest.mark.expected_seconds(30)
def test_dp_service_spends_bounded_epsilon_while_training(kafka_bootstrap, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=1)
    with ServiceProcess(kafka_bootstrap, topic, tmp_path / "ckpt", tmp_path / "serve.log", **DP_SETTINGS) as service:
        config = SimulationConfig(
            bootstrap=kafka_bootstrap,
            topic=topic,
            rate=200,
            duration_s=6,
            sensors=4,
            length_median=16,
            max_len=128,
            process="ar",
            seed=5,
            progress_interval_s=60,
        )
        sender = subprocess.Popen(
            [
                sys.executable,
                "-c",
                (
                    "from streamtrain.tools.simulate import run_simulation;"
                    "from streamtrain.tools.simulation_config import SimulationConfig;"
                    f"run_simulation(SimulationConfig(**{config.model_dump()!r}))"
                ),
            ]
        )
        try:
            service.wait_ready(60)
            first = service.get("/v1/model")
            assert first["dp"] is not None
            time.sleep(3)
            later = wait_for(lambda: ((m := service.get("/v1/model"))["dp"]["steps"] > first["dp"]["steps"] + 5
                                      and m["dp"]["epsilon"] > 0 and m),
                             30, "DP steps on the public clock, with events admitted")  # fmt: skip
        finally:
            sender.wait(30)
        dp = later["dp"]
        assert 0 < dp["epsilon"] <= dp["target_epsilon"] == 8
        assert dp["epsilon"] <= dp["epsilon_cap"] + 1e-9
        assert dp["delta"] == 1e-12 and dp["K"] == 20 and dp["R"] == 16 and dp["unit"] == "event"
        metrics = service.client.get("/metrics").text
        epsilon_line = next(line for line in metrics.splitlines() if line.startswith("streamtrain_dp_epsilon "))
        assert 0 < float(epsilon_line.split()[1]) <= 8
        # nothing unaccounted on the public plane: no counts of events, tokens or window statistics
        for name in (
            "streamtrain_events_consumed_total",
            "streamtrain_train_tokens_total",
            "streamtrain_window_size",
            "streamtrain_train_step_seconds",
            "streamtrain_consumer_lag_messages",
        ):
            assert name not in metrics, name
        assert service.client.get("/v1/window").status_code == 404  # no admin token: no operator plane
        # the training loss is not released in DP mode, and predictions still work
        assert later["loss"] is None and later["tokens_trained"] is None
        answer = service.client.post("/v1/predict", json={"instances": [{"values": [0.1, 0.2, 0.3]}]})
        assert answer.status_code == 200
        # keeps stepping on the clock even after the stream stopped (noise-only steps)
        steps = later["dp"]["steps"]
        wait_for(lambda: service.get("/v1/model")["dp"]["steps"] >= steps + 5, 20, "noise-only steps")


def test_dp_with_seeded_shuffle_refuses_to_start() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "serve"],
        env={"STREAMTRAIN_DP": "on", "STREAMTRAIN_SHUFFLE": "seeded", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "SHUFFLE" in lines[0] and "crypto" in lines[0]
