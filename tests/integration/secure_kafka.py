"""A secured Kafka broker (deploy/kafka-secure.sh: TLS, SCRAM, ACLs) and the helpers its test modules share.

Each module that uses it starts its own broker (a module fixture calling
:func:`running_secure_broker`), with certificates and passwords made for it; principals and
their ACLs: deploy/kafka-secure.sh. What the module's services said is kept in
``SecureBroker.seen`` for :func:`assert_no_secret_leaked`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    #: everything the services of one test module said or wrote, scanned for secrets at its end
    seen: list[str] = field(default_factory=list)

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


def running_secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    """deploy/kafka-secure.sh up on free ports with a home of its own; down afterwards (a module fixture's body)."""
    port = free_ports(3)
    home = tmp_path_factory.mktemp("kafka-secure")
    env = {**os.environ, "KAFKA_SECURE_PORT": str(port), "KAFKA_SECURE_HOME": str(home), "PYTHON": sys.executable}
    subprocess.run([str(SECURE), "up"], env=env, check=True, timeout=240, stdout=subprocess.DEVNULL)
    try:
        yield SecureBroker(port, home, env)
    finally:
        subprocess.run([str(SECURE), "down"], env=env, check=False, timeout=120, stdout=subprocess.DEVNULL)


def secured_service(broker: SecureBroker, tmp_path: Path, name: str, security: dict[str, str]) -> ServiceProcess:
    return ServiceProcess(
        security["KAFKA_BOOTSTRAP"], TOPIC, tmp_path / f"ck-{name}", tmp_path / f"{name}.log",
        **{"GROUP_ID": GROUP, "CHECKPOINT_INTERVAL_S": "2", **security},
    )  # fmt: skip


def simulate(broker: SecureBroker, count: int, seed: int) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")}
    env.update({f"STREAMTRAIN_{k}": v for k, v in broker.scram("sim").items()})
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "simulate", "--count", str(count), "--rate", "0",
         "--malformed-share", "0.1", "--seed", str(seed), "--sensors", "8"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    broker.seen.append(done.stdout + done.stderr)
    return done.stderr


def record(broker: SecureBroker, service: ServiceProcess) -> None:
    """Keep every public answer and the metrics for the secret scan."""
    for path in ("/readyz", "/healthz", "/v1/window", "/v1/model", "/metrics"):
        try:
            broker.seen.append(service.client.get(path).text)
        except httpx.HTTPError:
            pass


def readiness_reasons(service: ServiceProcess) -> list[str]:
    response = service.client.get("/readyz")
    return [] if response.status_code == 200 else response.json()["reasons"]


def failing(service: ServiceProcess, kind: str) -> list[str]:
    """The service's readiness reasons that start with ``kind`` (e.g. ``kafka_auth_failed:``)."""
    return [reason for reason in readiness_reasons(service) if reason.startswith(kind)]


def refused_and_still_running(service: ServiceProcess, kind: str, retrying_s: float = 8.0) -> list[str]:
    """Wait until ``kind`` (``kafka_auth_failed``, ``kafka_authorization_failed``) is a readiness
    reason, let the service retry for ``retrying_s``, then check it still runs, has read nothing
    and said the failure once. Returns the reasons of that kind."""
    reasons = wait_for(lambda: failing(service, f"{kind}:"), 90, kind)
    time.sleep(retrying_s)
    assert service.process is not None and service.process.poll() is None
    assert service.get("/v1/window")["seen_total"] == 0
    said = log_lines(service, kind)
    assert len(said) == 1, said
    return reasons


def dead_letters(broker: SecureBroker) -> list[Any]:
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


def log_lines(service: ServiceProcess, needle: str) -> list[str]:
    return [line for line in service.log_path.read_text().splitlines() if needle in line]


def client_certificate(broker: SecureBroker, directory: Path, name: str, days: int) -> dict[str, str]:
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


def assert_no_secret_leaked(broker: SecureBroker, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No password, and no private key, in anything the module's services said, answered or wrote
    (their logs, checkpoints and JSON files under the test run's temporary directory)."""
    secrets = [broker.password(user) for user in ("admin", "svc", "sim", "denied")] + ["not-the-password-4711"]
    key_marker = "PRIVATE KEY"
    assert len(broker.seen) >= 10, "the module's tests ran first and recorded what the services said"
    texts = list(broker.seen)
    root = tmp_path_factory.getbasetemp()
    brokers = [home for home in root.glob("kafka-secure*") if home.is_dir()]  # their own secrets, not leaks
    files = [p for p in root.rglob("*") if p.is_file() and not any(home in p.parents for home in brokers)]
    checkpoints = [p for p in files if p.suffix == ".stck"]
    assert checkpoints, "the services wrote checkpoints"
    for path in files:
        if path.name.endswith((".log", ".stck", ".json")):
            texts.append(path.read_bytes().decode("latin-1"))
    for text in texts:
        for secret in secrets:
            assert secret not in text
        assert key_marker not in text
