"""The service against a secured broker (deploy/kafka-secure.sh): SCRAM over TLS, ACLs, no secret leaks.

The broker gets its own ports and data directory (certificates and passwords made for this
module) and is stopped afterwards. Certificates, mutual TLS: test_kafka_tls.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka_helpers import wait_for
from secure_kafka import (
    GROUP,
    TOPIC,
    SecureBroker,
    assert_no_secret_leaked,
    client_certificate,
    dead_letters,
    failing,
    log_lines,
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


@pytest.mark.expected_seconds(65)
def test_scram_over_tls_ingests_and_dead_letters_end_to_end(broker: SecureBroker, tmp_path: Path) -> None:
    simulate(broker, 400, seed=1)
    with secured_service(broker, tmp_path, "scram", broker.scram("svc")) as service:
        window = wait_for(lambda: (w := service.get("/v1/window"))["seen_total"] >= 400 and w, 90, "400 events read")
        rejected = sum(window["rejected_total"].values())
        assert window["seen_total"] == 400 and rejected > 0
        assert window["accepted_total"] + window.get("held_out_total", 0) + rejected == 400
        letters = wait_for(
            lambda: (d := dead_letters(broker)) and len(d) >= rejected and d, 60, "dead letters in the .dlq"
        )
        assert len(letters) == rejected
        assert all(
            {"reason", "source_topic", "source_partition", "source_offset"} <= {k for k, _ in r.headers}
            for r in letters
        )
        service.wait_ready()
        assert wait_for(lambda: list((tmp_path / "ck-scram").glob("*.stck")), 30, "a checkpoint")
        record(broker, service)
    broker.seen.append(service.log_path.read_text())
    assert "SASL_SSL, SCRAM-SHA-512 as svc" in service.log_path.read_text()


@pytest.mark.expected_seconds(55)
def test_wrong_password_is_a_readiness_reason_once_logged_and_recovers(broker: SecureBroker, tmp_path: Path) -> None:
    password_file = tmp_path / "svc.password"
    password_file.write_text("not-the-password-4711\n")
    with secured_service(broker, tmp_path, "wrong", broker.scram("svc", password_file)) as service:
        reasons = refused_and_still_running(service, "kafka_auth_failed", retrying_s=15)  # several retries
        assert reasons == [
            "kafka_auth_failed: SCRAM-SHA-512 authentication failed for user svc (the broker refused the credentials)"
        ]
        assert service.client.get("/healthz").status_code == 200
        metrics = service.client.get("/metrics").text
        assert 'streamtrain_kafka_security_failing{kind="kafka_auth_failed"} 1.0' in metrics
        record(broker, service)
        lines = service.log_path.read_text().splitlines()
        said = next(i for i, line in enumerate(lines) if "kafka_auth_failed" in line)
        after = [line for line in lines[said:] if " kafka." in line]
        assert not after, f"kafka-python's retries stay quiet once the reason is known: {after[:3]}"
        assert len([line for line in lines[:said] if " kafka." in line]) <= 6  # the first attempt, cause not yet known
        simulate(broker, 100, seed=3)  # something to read once it gets in
        password_file.write_text(broker.password("svc"))  # the mounted secret is fixed: it recovers by itself
        service.wait_ready(120)
        assert service.get("/v1/window")["seen_total"] > 0
        assert len(log_lines(service, "kafka security failure resolved")) == 1
        assert 'streamtrain_kafka_security_failing{kind="kafka_auth_failed"} 0.0' in service.client.get("/metrics").text
        record(broker, service)
    broker.seen.append(service.log_path.read_text())


@pytest.mark.expected_seconds(30)
@pytest.mark.parametrize("how", ["scram", "mutual_tls"])
def test_a_denied_principal_reads_nothing_and_is_told_what_is_missing(
    broker: SecureBroker, tmp_path: Path, how: str
) -> None:
    security = broker.scram("denied") if how == "scram" else broker.mutual_tls("denied")
    with secured_service(broker, tmp_path, f"denied-{how}", security) as service:
        reasons = refused_and_still_running(service, "kafka_authorization_failed")
        assert reasons[0].startswith(f"kafka_authorization_failed: CREATE on topic {TOPIC} "), reasons
        assert "an operator creates it" in reasons[0] and "3 partitions" in reasons[0]
        assert not log_lines(service, "AuthorizationFailed")
        record(broker, service)
    broker.seen.append(service.log_path.read_text())


def grant_reader(broker: SecureBroker, principal: str) -> None:
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
    security = client_certificate(broker, tmp_path, "late", days=1)
    with secured_service(broker, tmp_path, "late", security) as service:
        reasons = wait_for(
            lambda: failing(service, "kafka_authorization_failed:"),
            60,
            "kafka_authorization_failed",
        )
        assert reasons, reasons
        assert service.get("/v1/window")["seen_total"] == 0
        grant_reader(broker, "User:late")
        simulate(broker, 100, seed=5)
        service.wait_ready(180)  # the same process: no restart, no crash loop
        wait_for(lambda: service.get("/v1/window")["seen_total"] > 0, 60, "events read after the grant")
        assert not failing(service, "kafka_authorization_failed:")
        said = log_lines(service, "kafka_authorization_failed")
        assert len([line for line in said if "failure resolved" not in line]) == 1, said  # the failure, once
        assert len(log_lines(service, "kafka security failure resolved")) == 1
        record(broker, service)
    broker.seen.append(service.log_path.read_text())


def test_no_secret_in_any_log_response_metric_or_checkpoint(
    broker: SecureBroker, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert_no_secret_leaked(broker, tmp_path_factory)
