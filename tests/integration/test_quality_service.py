"""Learning quality end to end: a real ``streamtrain serve`` fed through the real broker."""

from __future__ import annotations

import pytest
from kafka_helpers import wait_for
from service_process import ServiceProcess

from streamtrain.tools.simulate import run_simulation
from streamtrain.tools.simulation_config import SimulationConfig

pytestmark = pytest.mark.integration


def simulate(bootstrap: str, topic: str, count: int, seed: int) -> int:
    config = SimulationConfig(
        bootstrap=bootstrap, topic=topic, rate=0, count=count, sensors=8, length_median=32, length_sigma=0.3,
        max_len=128, process="seasonal", seed=seed, progress_interval_s=60,
    )  # fmt: skip
    report = run_simulation(config)
    assert report.delivery_errors == 0
    return report.sent - report.malformed


@pytest.mark.expected_seconds(30)
def test_prequential_skill_is_positive_on_a_learnable_stream(kafka_bootstrap, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=2)
    service = ServiceProcess(
        kafka_bootstrap, topic, tmp_path / "ckpt", tmp_path / "serve.log",
        max_len=128, window_capacity=20000, quality_max_events_per_s=100000, holdout_share=0.05,
        checkpoint_interval_s=300,
    )  # fmt: skip
    with service:
        first = simulate(kafka_bootstrap, topic, count=3000, seed=1)
        service.wait_ready()
        # Let it learn the fleet before the next events are scored by the serving model.
        wait_for(lambda: service.get("/v1/model")["training"]["live_step"] >= 150, 240, "150 training steps", 0.5)
        second = simulate(kafka_bootstrap, topic, count=3000, seed=2)

        def scored() -> dict | None:
            quality = service.get("/v1/model")["quality"]
            return quality if quality is not None and quality["n"] >= 2000 else None

        quality = wait_for(scored, 120, "2000 events scored", 0.5)
        assert quality["skill"] > 0.1, quality  # the served model beats the last-value forecast
        assert quality["prequential_mse"] < quality["naive_mse"]
        assert quality["holdout"]["held_out_total"] > 0
        window = wait_for(
            lambda: (w := service.get("/v1/window"))["seen_total"] == first + second and w, 60, "every event read"
        )
        held_out = service.get("/v1/model")["quality"]["holdout"]["held_out_total"]
        # Held-out events never reach the window (so never the trainer).
        assert window["accepted_total"] + held_out == first + second
        metrics = service.client.get("/metrics").text
        assert "streamtrain_prequential_events_total" in metrics and "streamtrain_prequential_mse" in metrics
