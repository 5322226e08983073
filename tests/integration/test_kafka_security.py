"""The service against a secured broker (deploy/kafka-secure.sh): TLS, SCRAM, ACLs, no secret leaks.

The broker gets its own ports and data directory (certificates and passwords made for this
module) and is stopped afterwards. Principals and their ACLs: deploy/kafka-secure.sh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka_helpers import REPO, free_ports, wait_for
from service_process import ServiceProcess

TOPIC, GROUP = "sensor-events", "streamtrain"
SECURE = REPO / "deploy" / "kafka-secure.sh"


@dataclass
class SecureBroker:
    port: int
    home: Path
    env: dict[str, str]

    @property
    def tls(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sasl_ssl(self) -> str:
        return f"127.0.0.1:{self.port + 1}"

    def secret(self, name: str) -> Path:
        return self.home / "secrets" / name

    def password(self, user: str) -> str:
        return self.secret(f"{user}.password").read_text().strip()

    def scram(self, user: str, password_file: Path | None = None) -> dict[str, str]:
        """Service settings for SCRAM-SHA-512 over TLS as ``user``."""
        return {
            "KAFKA_BOOTSTRAP": self.sasl_ssl, "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "KAFKA_SASL_USERNAME": user,
            "KAFKA_SASL_PASSWORD_FILE": str(password_file or self.secret(f"{user}.password")),
            "KAFKA_SSL_CAFILE": str(self.secret("ca.pem")),
        }  # fmt: skip

    def mutual_tls(self, user: str) -> dict[str, str]:
        return {
            "KAFKA_BOOTSTRAP": self.tls, "KAFKA_SECURITY_PROTOCOL": "SSL",
            "KAFKA_SSL_CAFILE": str(self.secret("ca.pem")),
            "KAFKA_SSL_CERTFILE": str(self.secret(f"{user}.pem")), "KAFKA_SSL_KEYFILE": str(self.secret(f"{user}.key")),
        }  # fmt: skip

    def admin_options(self) -> dict[str, Any]:
        return {
            "bootstrap_servers": self.sasl_ssl, "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
            "sasl_plain_username": "admin", "sasl_plain_password": self.password("admin"),
            "ssl_cafile": str(self.secret("ca.pem")),
        }  # fmt: skip


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    port = free_ports(3)
    home = tmp_path_factory.mktemp("kafka-secure")
    env = {**os.environ, "KAFKA_SECURE_PORT": str(port), "KAFKA_SECURE_HOME": str(home), "PYTHON": sys.executable}
    subprocess.run([str(SECURE), "up"], env=env, check=True, timeout=240, stdout=subprocess.DEVNULL)
    try:
        yield SecureBroker(port, home, env)
    finally:
        subprocess.run([str(SECURE), "down"], env=env, check=False, timeout=120, stdout=subprocess.DEVNULL)


#: Everything the services of this module said or wrote, scanned for secrets at the end.
SEEN: list[str] = []


def _service(broker: SecureBroker, tmp_path: Path, name: str, security: dict[str, str]) -> ServiceProcess:
    return ServiceProcess(
        security["KAFKA_BOOTSTRAP"], TOPIC, tmp_path / f"ck-{name}", tmp_path / f"{name}.log",
        **{"GROUP_ID": GROUP, "CHECKPOINT_INTERVAL_S": "2", **security},
    )  # fmt: skip


def _simulate(broker: SecureBroker, count: int, seed: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    env.update({f"STREAMTRAIN_{k}": v for k, v in broker.scram("sim").items()})
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "simulate", "--count", str(count), "--rate", "0",
         "--malformed-share", "0.1", "--seed", str(seed), "--sensors", "8"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    SEEN.append(done.stdout + done.stderr)
    return done.stderr


def _record(service: ServiceProcess) -> None:
    """Keep every public answer and the metrics for the secret scan."""
    for path in ("/readyz", "/healthz", "/v1/window", "/v1/model", "/metrics"):
        try:
            SEEN.append(service.client.get(path).text)
        except httpx.HTTPError:
            pass


def _reasons(service: ServiceProcess) -> list[str]:
    response = service.client.get("/readyz")
    return [] if response.status_code == 200 else response.json()["reasons"]


def _dead_letters(broker: SecureBroker) -> list[Any]:
    consumer = KafkaConsumer(group_id=None, enable_auto_commit=False, **broker.admin_options())
    try:
        parts = [TopicPartition(f"{TOPIC}.dlq", p) for p in sorted(consumer.partitions_for_topic(f"{TOPIC}.dlq") or [])]
        consumer.assign(parts)
        consumer.seek_to_beginning()
        ends = consumer.end_offsets(parts)
        records: list[Any] = []
        deadline = time.monotonic() + 30
        while sum(consumer.position(tp) for tp in parts) < sum(ends.values()) and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def _log_lines(service: ServiceProcess, needle: str) -> list[str]:
    return [line for line in service.log_path.read_text().splitlines() if needle in line]


def test_scram_over_tls_ingests_and_dead_letters_end_to_end(broker: SecureBroker, tmp_path: Path) -> None:
    _simulate(broker, 400, seed=1)
    with _service(broker, tmp_path, "scram", broker.scram("svc")) as service:
        window = wait_for(lambda: (w := service.get("/v1/window"))["seen_total"] >= 400 and w, 90, "400 events read")
        rejected = sum(window["rejected_total"].values())
        assert window["seen_total"] == 400 and rejected > 0
        assert window["accepted_total"] + window.get("held_out_total", 0) + rejected == 400
        letters = wait_for(
            lambda: (d := _dead_letters(broker)) and len(d) >= rejected and d, 60, "dead letters in the .dlq"
        )
        assert len(letters) == rejected
        assert all(
            {"reason", "source_topic", "source_partition", "source_offset"} <= {k for k, _ in r.headers}
            for r in letters
        )
        service.wait_ready()
        assert wait_for(lambda: list((tmp_path / "ck-scram").glob("*.stck")), 30, "a checkpoint")
        _record(service)
    SEEN.append(service.log_path.read_text())
    assert "SASL_SSL, SCRAM-SHA-512 as svc" in service.log_path.read_text()


def test_mutual_tls_ingests(broker: SecureBroker, tmp_path: Path) -> None:
    with _service(broker, tmp_path, "mtls", broker.mutual_tls("svc")) as service:
        before = wait_for(lambda: service.client.get("/v1/window").json(), 30, "the window")["seen_total"]
        _simulate(broker, 200, seed=2)
        wait_for(
            lambda: service.get("/v1/window")["seen_total"] >= before + 200, 90, "200 new events read over mutual TLS"
        )
        service.wait_ready()
        _record(service)
    SEEN.append(service.log_path.read_text())


def test_wrong_password_is_a_readiness_reason_once_logged_and_recovers(broker: SecureBroker, tmp_path: Path) -> None:
    password_file = tmp_path / "svc.password"
    password_file.write_text("not-the-password-4711\n")
    with _service(broker, tmp_path, "wrong", broker.scram("svc", password_file)) as service:
        reasons = wait_for(
            lambda: [r for r in _reasons(service) if r.startswith("kafka_auth_failed:")], 60, "kafka_auth_failed"
        )
        assert reasons == [
            "kafka_auth_failed: SCRAM-SHA-512 authentication failed for user svc (the broker refused the credentials)"
        ]
        time.sleep(15)  # several retries: still running, still one line
        assert service.process is not None and service.process.poll() is None
        assert service.client.get("/healthz").status_code == 200
        assert service.get("/v1/window")["seen_total"] == 0
        metrics = service.client.get("/metrics").text
        assert 'streamtrain_kafka_security_failing{kind="kafka_auth_failed"} 1.0' in metrics
        _record(service)
        assert len(_log_lines(service, "kafka_auth_failed")) == 1, _log_lines(service, "kafka_auth_failed")
        lines = service.log_path.read_text().splitlines()
        said = next(i for i, line in enumerate(lines) if "kafka_auth_failed" in line)
        after = [line for line in lines[said:] if " kafka." in line]
        assert not after, f"kafka-python's retries stay quiet once the reason is known: {after[:3]}"
        assert len([line for line in lines[:said] if " kafka." in line]) <= 6  # the first attempt, cause not yet known
        _simulate(broker, 100, seed=3)  # something to read once it gets in
        password_file.write_text(broker.password("svc"))  # the mounted secret is fixed: it recovers by itself
        service.wait_ready(120)
        assert service.get("/v1/window")["seen_total"] > 0
        assert len(_log_lines(service, "kafka security failure resolved")) == 1
        assert 'streamtrain_kafka_security_failing{kind="kafka_auth_failed"} 0.0' in service.client.get("/metrics").text
        _record(service)
    SEEN.append(service.log_path.read_text())


@pytest.mark.parametrize("how", ["scram", "mutual_tls"])
def test_a_denied_principal_reads_nothing_and_is_told_what_is_missing(
    broker: SecureBroker, tmp_path: Path, how: str
) -> None:
    security = broker.scram("denied") if how == "scram" else broker.mutual_tls("denied")
    with _service(broker, tmp_path, f"denied-{how}", security) as service:
        reasons = wait_for(
            lambda: [r for r in _reasons(service) if r.startswith("kafka_authorization_failed:")],
            60,
            "kafka_authorization_failed",
        )
        assert reasons[0].startswith(f"kafka_authorization_failed: CREATE on topic {TOPIC} "), reasons
        assert "an operator creates it" in reasons[0] and "3 partitions" in reasons[0]
        time.sleep(8)
        assert service.get("/v1/window")["seen_total"] == 0
        assert service.process is not None and service.process.poll() is None
        assert len(_log_lines(service, "kafka_authorization_failed")) == 1
        assert not _log_lines(service, "AuthorizationFailed")
        _record(service)
    SEEN.append(service.log_path.read_text())


def _client_certificate(broker: SecureBroker, directory: Path, name: str, days: int) -> dict[str, str]:
    """Mutual-TLS settings with a client certificate for ``name`` signed by the broker's CA now
    (``days`` < 0: already expired)."""
    key, csr, pem, raw = (directory / f"{name}.{ext}" for ext in ("key", "csr", "pem", "rsa"))
    run = lambda *args: subprocess.run(["openssl", *args], check=True, capture_output=True)  # noqa: E731
    run(
        "req", "-newkey", "rsa:2048", "-nodes", "-sha256", "-subj", f"/CN={name}", "-keyout", str(raw), "-out", str(csr)
    )
    extensions = directory / f"{name}.ext"
    extensions.write_text("extendedKeyUsage=clientAuth\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(broker.secret("ca.pem")), "-CAkey", str(broker.secret("ca.key")),
        "-set_serial", str(int(time.time() * 1000)), "-days", str(days), "-sha256", "-extfile", str(extensions),
        "-out", str(pem))  # fmt: skip
    run("pkcs8", "-topk8", "-nocrypt", "-in", str(raw), "-out", str(key))
    return {
        "KAFKA_BOOTSTRAP": broker.tls, "KAFKA_SECURITY_PROTOCOL": "SSL",
        "KAFKA_SSL_CAFILE": str(broker.secret("ca.pem")), "KAFKA_SSL_CERTFILE": str(pem), "KAFKA_SSL_KEYFILE": str(key),
    }  # fmt: skip


def _grant_reader(broker: SecureBroker, principal: str) -> None:
    """The service's minimal ACL set (docs/operations.md) for ``principal``, granted while it runs."""
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, KafkaAdminClient, ResourcePattern, ResourceType

    wanted = [
        (ACLOperation.READ, ResourceType.TOPIC, TOPIC), (ACLOperation.DESCRIBE_CONFIGS, ResourceType.TOPIC, TOPIC),
        (ACLOperation.WRITE, ResourceType.TOPIC, f"{TOPIC}.dlq"),
        (ACLOperation.DESCRIBE_CONFIGS, ResourceType.TOPIC, f"{TOPIC}.dlq"),
        (ACLOperation.READ, ResourceType.GROUP, GROUP),
    ]  # fmt: skip
    admin = KafkaAdminClient(request_timeout_ms=20000, **broker.admin_options())
    try:
        result = admin.create_acls(
            [ACL(principal, "*", op, ACLPermissionType.ALLOW, ResourcePattern(kind, name)) for op, kind, name in wanted]
        )
        assert not result["failed"], result["failed"]
    finally:
        admin.close()


def test_an_acl_granted_while_it_runs_lets_it_in_without_a_restart(broker: SecureBroker, tmp_path: Path) -> None:
    security = _client_certificate(broker, tmp_path, "late", days=1)
    with _service(broker, tmp_path, "late", security) as service:
        reasons = wait_for(
            lambda: [r for r in _reasons(service) if r.startswith("kafka_authorization_failed:")],
            60,
            "kafka_authorization_failed",
        )
        assert reasons, reasons
        assert service.get("/v1/window")["seen_total"] == 0
        _grant_reader(broker, "User:late")
        _simulate(broker, 100, seed=5)
        service.wait_ready(180)  # the same process: no restart, no crash loop
        wait_for(lambda: service.get("/v1/window")["seen_total"] > 0, 60, "events read after the grant")
        assert not [r for r in _reasons(service) if r.startswith("kafka_authorization_failed:")]
        said = _log_lines(service, "kafka_authorization_failed")
        assert len([line for line in said if "failure resolved" not in line]) == 1, said  # the failure, once
        assert len(_log_lines(service, "kafka security failure resolved")) == 1
        _record(service)
    SEEN.append(service.log_path.read_text())


def test_an_expired_client_certificate_is_a_readiness_reason_and_reads_nothing(
    broker: SecureBroker, tmp_path: Path
) -> None:
    security = _client_certificate(broker, tmp_path, "svc", days=-1)  # svc's ACLs, but the certificate expired
    with _service(broker, tmp_path, "expired", security) as service:
        reasons = wait_for(
            lambda: [r for r in _reasons(service) if r.startswith("kafka_auth_failed:")], 90, "kafka_auth_failed"
        )
        assert reasons[0].startswith("kafka_auth_failed: the broker refused the client certificate"), reasons
        time.sleep(8)
        assert service.process is not None and service.process.poll() is None
        assert service.get("/v1/window")["seen_total"] == 0
        assert len(_log_lines(service, "kafka_auth_failed")) == 1, _log_lines(service, "kafka_auth_failed")
        _record(service)
    SEEN.append(service.log_path.read_text())


def test_a_renewed_broker_certificate_is_picked_up_without_a_restart(broker: SecureBroker, tmp_path: Path) -> None:
    """The broker gets a new certificate (a new key, the same CA) and restarts on it while the
    service reads: the same process reads on, with no security failure. (An expired one cannot be
    served: Kafka refuses to start on it. What a client says of a broker that does serve one, a
    TLS proxy say, is unit-tested: test_an_expired_broker_certificate_is_named.)"""

    def serial() -> str:
        done = subprocess.run(["openssl", "x509", "-noout", "-serial", "-in", str(broker.secret("server.pem"))],
                              check=True, capture_output=True, text=True)  # fmt: skip
        return done.stdout.strip()

    with _service(broker, tmp_path, "renewed", broker.mutual_tls("svc")) as service:
        _simulate(broker, 60, seed=5)
        wait_for(lambda: service.get("/v1/window")["seen_total"] > 0, 90, "ingest before the renewal")
        before, old = service.get("/v1/window")["seen_total"], serial()
        subprocess.run([str(SECURE), "renew-certificate", "30"], env=broker.env, check=True, timeout=180,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        assert serial() != old
        _simulate(broker, 60, seed=6)
        wait_for(lambda: service.get("/v1/window")["seen_total"] > before, 90, "ingest after the renewal")
        assert not [r for r in _reasons(service) if r.startswith("kafka_auth")], _reasons(service)
        assert service.process is not None and service.process.poll() is None  # the same process throughout
        assert not _log_lines(service, "kafka_auth_failed")
        _record(service)
    SEEN.append(service.log_path.read_text())


def test_plaintext_spoken_to_the_tls_port_is_named(broker: SecureBroker, tmp_path: Path) -> None:
    with _service(broker, tmp_path, "plaintext", {"KAFKA_BOOTSTRAP": broker.tls}) as service:
        reasons = wait_for(
            lambda: [r for r in _reasons(service) if r.startswith("kafka_auth_failed:")], 90, "kafka_auth_failed"
        )
        assert "KAFKA_SECURITY_PROTOCOL" in reasons[0], reasons
        time.sleep(8)
        assert service.process is not None and service.process.poll() is None
        assert service.get("/v1/window")["seen_total"] == 0
        assert len(_log_lines(service, "kafka_auth_failed")) == 1, _log_lines(service, "kafka_auth_failed")
        _record(service)
    SEEN.append(service.log_path.read_text())


def test_no_secret_in_any_log_response_metric_or_checkpoint(
    broker: SecureBroker, tmp_path_factory: pytest.TempPathFactory
) -> None:
    secrets = [broker.password(user) for user in ("admin", "svc", "sim", "denied")] + ["not-the-password-4711"]
    key_marker = "PRIVATE KEY"
    assert len(SEEN) >= 10, "the tests above ran first and recorded what the services said"
    texts = list(SEEN)
    root = tmp_path_factory.getbasetemp()
    files = [p for p in root.rglob("*") if p.is_file() and broker.home not in p.parents]
    checkpoints = [p for p in files if p.suffix == ".stck"]
    assert checkpoints, "the services wrote checkpoints"
    for path in files:
        if path.name.endswith((".log", ".stck", ".json")):
            texts.append(path.read_bytes().decode("latin-1"))
    for text in texts:
        for secret in secrets:
            assert secret not in text
        assert key_marker not in text


# --------------------------------------------------------------------------- alerts through a real Prometheus


def test_a_real_prometheus_fires_ingest_stalled_when_the_broker_stops(private_broker: Any, tmp_path: Path) -> None:
    """deploy/prometheus/alerts.yml loaded by Prometheus (Debian's package) scraping a running service."""
    import shutil

    from kafka_helpers import free_port

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
