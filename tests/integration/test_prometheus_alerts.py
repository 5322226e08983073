"""The shipped alert rules (deploy/prometheus/alerts.yml) run by a real Prometheus scraping a running service."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from kafka_helpers import REPO, free_port, wait_for
from service_process import ServiceProcess

pytestmark = pytest.mark.integration


@pytest.mark.expected_seconds(80)
def test_a_real_prometheus_fires_ingest_stalled_when_the_broker_stops(private_broker: Any, tmp_path: Path) -> None:
    """deploy/prometheus/alerts.yml loaded by Prometheus (Debian's package) scraping a running service."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(
            "prometheus not found: install Debian's prometheus package (apt-get install prometheus; .ci/run does)"
        )
    private_broker.up()
    with ServiceProcess(private_broker.bootstrap, "alerts", tmp_path / "ck", tmp_path / "service.log") as service:
        wait_for(
            lambda: "streamtrain_kafka_connected 1.0" in service.client.get("/metrics").text, 60, "a broker connection"
        )
        port = free_port()
        # The shipped rules, but IngestStalled pending for 20 s instead of its 2 minutes: the
        # expression, labels and annotations are what Prometheus runs; `for` itself is covered by
        # `promtool test rules` (tests/unit/test_alerts.py). Saves two minutes of CI.
        shipped = (REPO / "deploy" / "prometheus" / "alerts.yml").read_text()
        head, stalled, rest = shipped.partition("- alert: StreamtrainIngestStalled")
        assert stalled and "for: 2m" in rest.split("- alert:")[0]
        rules = tmp_path / "alerts.yml"
        rules.write_text(head + stalled + rest.replace("for: 2m", "for: 20s", 1))
        config = tmp_path / "prometheus.yml"
        config.write_text(
            # a scrape that times out marks the series stale and resets a pending alert: 5 s of
            # slack for a service busy training on a shared CPU
            "global: {scrape_interval: 5s, scrape_timeout: 5s, evaluation_interval: 1s}\n"
            f"rule_files: [{rules}]\n"
            "scrape_configs:\n"
            f"  - {{job_name: streamtrain, static_configs: [{{targets: ['127.0.0.1:{service.port}']}}]}}\n"
        )
        prometheus = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"),
        )  # fmt: skip
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
        try:

            def query(expr: str) -> list[Any]:
                try:
                    return api.get("/api/v1/query", params={"query": expr}).json()["data"]["result"]
                except (httpx.HTTPError, KeyError, ValueError):
                    return []

            def alert(state: str) -> list[Any]:
                try:
                    alerts = api.get("/api/v1/alerts").json()["data"]["alerts"]
                except (httpx.HTTPError, KeyError, ValueError):
                    return []
                return [
                    a for a in alerts if a["labels"]["alertname"] == "StreamtrainIngestStalled" and a["state"] == state
                ]

            wait_for(lambda: query("streamtrain_kafka_connected == 1"), 60, "Prometheus scraping the service")
            assert not alert("pending") and not alert("firing")
            private_broker.down()
            wait_for(lambda: alert("pending"), 90, "StreamtrainIngestStalled pending")
            try:
                (firing,) = wait_for(
                    lambda: alert("firing"), 120, "StreamtrainIngestStalled firing (after its `for`, 20 s here)"
                )
            except AssertionError as late:
                seen = {
                    e: query(e)
                    for e in ("up", "changes(streamtrain_kafka_connected[5m])", "streamtrain_kafka_connected")
                }
                raise AssertionError(
                    f"{late}; Prometheus saw {seen}, alerts {api.get('/api/v1/alerts').text}"
                ) from None
            assert (
                firing["labels"]["instance"] == f"127.0.0.1:{service.port}" and firing["labels"]["severity"] == "page"
            )
            assert firing["annotations"]["runbook_url"] == "docs/operations.md#streamtrainingeststalled"
            assert service.client.get("/healthz").status_code == 200  # stalled, not dead
        finally:
            api.close()
            prometheus.terminate()
            prometheus.wait(30)
