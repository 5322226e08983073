"""The service against a secured broker's TLS listener (deploy/kafka-secure.sh): mutual TLS,
client and broker certificates, plaintext spoken to TLS, no secret leaks.

The broker gets its own ports and data directory (certificates and passwords made for this
module) and is stopped afterwards. SCRAM and ACLs: test_kafka_security.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka_helpers import wait_for
from secure_kafka import (
    SECURE,
    SecureBroker,
    assert_no_secret_leaked,
    client_certificate,
    failing,
    log_lines,
    readiness_reasons,
    record,
    refused_and_still_running,
    running_secure_broker,
    secured_service,
    simulate,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    yield from running_secure_broker(tmp_path_factory)


@pytest.mark.expected_seconds(70)
def test_mutual_tls_ingests(broker: SecureBroker, tmp_path: Path) -> None:
    with secured_service(broker, tmp_path, "mtls", broker.mutual_tls("svc")) as service:
        before = wait_for(lambda: service.client.get("/v1/window").json(), 30, "the window")["seen_total"]
        simulate(broker, 200, seed=2)
        wait_for(
            lambda: service.get("/v1/window")["seen_total"] >= before + 200, 90, "200 new events read over mutual TLS"
        )
        service.wait_ready()
        record(broker, service)
    broker.seen.append(service.log_path.read_text())


@pytest.mark.expected_seconds(35)
def test_an_expired_client_certificate_is_a_readiness_reason_and_reads_nothing(
    broker: SecureBroker, tmp_path: Path
) -> None:
    security = client_certificate(broker, tmp_path, "svc", days=-1)  # svc's ACLs, but the certificate expired
    with secured_service(broker, tmp_path, "expired", security) as service:
        reasons = refused_and_still_running(service, "kafka_auth_failed")
        assert reasons[0].startswith("kafka_auth_failed: the broker refused the client certificate"), reasons
        record(broker, service)
    broker.seen.append(service.log_path.read_text())


@pytest.mark.expected_seconds(55)
def test_a_renewed_broker_certificate_is_picked_up_without_a_restart(broker: SecureBroker, tmp_path: Path) -> None:
    """The broker gets a new certificate (a new key, the same CA) and restarts on it while the
    service reads: the same process reads on, with no security failure. (An expired one cannot be
    served: Kafka refuses to start on it. What a client says of a broker that does serve one, a
    TLS proxy say, is unit-tested: test_an_expired_broker_certificate_is_named.)"""

    def serial() -> str:
        done = subprocess.run(["openssl", "x509", "-noout", "-serial", "-in", str(broker.secret("server.pem"))],
                              check=True, capture_output=True, text=True)  # fmt: skip
        return done.stdout.strip()

    with secured_service(broker, tmp_path, "renewed", broker.mutual_tls("svc")) as service:
        simulate(broker, 60, seed=5)
        wait_for(lambda: service.get("/v1/window")["seen_total"] > 0, 90, "ingest before the renewal")
        before, old = service.get("/v1/window")["seen_total"], serial()
        subprocess.run([str(SECURE), "renew-certificate", "30"], env=broker.env, check=True, timeout=180,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        assert serial() != old
        simulate(broker, 60, seed=6)
        wait_for(lambda: service.get("/v1/window")["seen_total"] > before, 90, "ingest after the renewal")
        assert not failing(service, "kafka_auth"), readiness_reasons(service)
        assert service.process is not None and service.process.poll() is None  # the same process throughout
        assert not log_lines(service, "kafka_auth_failed")
        record(broker, service)
    broker.seen.append(service.log_path.read_text())


@pytest.mark.expected_seconds(45)
def test_plaintext_spoken_to_the_tls_port_is_named(broker: SecureBroker, tmp_path: Path) -> None:
    with secured_service(broker, tmp_path, "plaintext", {"KAFKA_BOOTSTRAP": broker.tls}) as service:
        reasons = refused_and_still_running(service, "kafka_auth_failed")
        assert "KAFKA_SECURITY_PROTOCOL" in reasons[0], reasons
        record(broker, service)
    broker.seen.append(service.log_path.read_text())


def test_no_secret_in_any_log_response_metric_or_checkpoint(
    broker: SecureBroker, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert_no_secret_leaked(broker, tmp_path_factory)
