"""Learning quality end to end: a real ``streamtrain serve`` fed through the real broker."""

from __future__ import annotations

import pytest
from kafka_helpers import produce, wait_for
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


@pytest.mark.expected_seconds(40)
def test_a_short_series_of_sliding_windows_is_served_on_the_default_window_and_holdout(
    kafka_bootstrap, make_topic, tmp_path
) -> None:
    """100 yearly readings, the first 70 sent as 47 sliding windows of 24, as a user with a short
    series sends them: with the defaults three such real series never became ready (windows of
    24-51 items below MIN_WINDOW_ITEMS 64), and a sensor whose holdout phase holds its first
    block kept only what followed that block and its guard (none of 47). The sensor here has
    that phase."""
    import numpy as np
    import orjson

    from streamtrain.config import Settings
    from streamtrain.quality.holdout import HoldoutSplitter

    defaults = Settings.model_fields
    share, seed = defaults["holdout_share"].default, defaults["seed"].default
    probe = HoldoutSplitter(share, defaults["holdout_block_events"].default, defaults["shuffle"].default, seed)
    sensor = next(f"river-{i}" for i in range(1000) if probe._phase(f"river-{i}") == 0)
    rng = np.random.default_rng(7)
    level = np.empty(70)
    level[0] = 0.0
    for t in range(1, 70):  # a level that reverts to its mean, as a yearly flow does
        level[t] = 0.6 * level[t - 1] + rng.normal()
    windows = [level[i : i + 24] for i in range(70 - 24 + 1)]
    topic = make_topic()
    service = ServiceProcess(
        kafka_bootstrap, topic, tmp_path / "ckpt", tmp_path / "serve.log", max_len=64, half_life_s="inf",
        min_window_items=defaults["min_window_items"].default, holdout_share=share,
    )  # fmt: skip
    with service:
        produce(kafka_bootstrap, topic, [
            (sensor.encode(), orjson.dumps({"sensor_id": sensor, "ts": 1.7e9 + i, "values": window.tolist()}))
            for i, window in enumerate(windows)
        ])  # fmt: skip
        read = wait_for(lambda: (w := service.get("/v1/window"))["seen_total"] == len(windows) and w, 60, "47 events")
        held = read["held_out_total"]  # held out and their guards: never in the window
        assert read["accepted_total"] + held == len(windows)
        assert read["accepted_total"] >= defaults["min_window_items"].default, (read["accepted_total"], held)
        service.wait_ready(120)
        answer = service.client.post("/v1/predict", json={"instances": [{"values": windows[-1].tolist()}]})
        assert answer.status_code == 200 and len(answer.json()["predictions"]) == 1


@pytest.mark.expected_seconds(30)
def test_events_waiting_to_be_scored_are_scored_once_the_stream_goes_quiet(
    kafka_bootstrap, make_topic, tmp_path
) -> None:
    """Sampled events wait up to ``QUALITY_SCORE_DELAY_S`` to be scored together with later
    ones; when none follow, the polls that bring nothing score them: a stream that pauses
    leaves nothing unscored."""
    import time

    import numpy as np
    import orjson

    rng = np.random.default_rng(11)

    def events(count: int) -> list[tuple[bytes, bytes]]:
        return [
            (b"s", orjson.dumps({"sensor_id": f"s{i % 4}", "ts": time.time(), "values": rng.normal(size=24).tolist()}))
            for i in range(count)
        ]

    def scored() -> int:
        quality = service.get("/v1/model")["quality"]
        return 0 if quality is None else int(quality["n"])

    topic = make_topic()
    service = ServiceProcess(
        kafka_bootstrap, topic, tmp_path / "ckpt", tmp_path / "serve.log", max_len=64,
        quality_max_events_per_s=100000, quality_score_delay_s=2.0, holdout_share=0,
    )  # fmt: skip
    with service:
        produce(kafka_bootstrap, topic, events(40))  # before a model serves: not scored
        service.wait_ready(120)
        time.sleep(2.5)  # the last scoring, if any, is older than the delay
        base = scored()
        produce(kafka_bootstrap, topic, events(5))  # scored at once: nothing was scored for a while
        wait_for(lambda: scored() == base + 5, 20, "the first 5 events scored")
        produce(kafka_bootstrap, topic, events(5))  # within the delay of that scoring: they wait
        wait_for(lambda: scored() == base + 10, 20, "the 5 waiting events scored after the stream went quiet")
