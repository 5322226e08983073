"""Kafka security settings: validation, the one translation into kafka-python options, failure reasons."""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path

import pytest
from kafka.errors import (
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    SaslAuthenticationFailedError,
    TopicAuthorizationFailedError,
)

from streamtrain.config import SettingsError, load_settings
from streamtrain.ingest import security as kafka_security
from streamtrain.ingest.security import (
    AuthWatch,
    FileTokenProvider,
    KafkaSecurity,
    authorization_reason,
    client_options,
)

SECRET = "s3cr3t-Pa55word-xyz"


@pytest.fixture()
def pem(tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return path


def scram(tmp_path: Path, **more: object) -> dict[str, object]:
    return {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512",
            "kafka_sasl_username": "svc", "kafka_sasl_password": SECRET, **more}  # fmt: skip


def test_plaintext_by_default_gives_kafka_python_its_defaults() -> None:
    assert client_options(load_settings()) == {"security_protocol": "PLAINTEXT"}


def test_scram_over_tls_becomes_kafka_pythons_own_options(tmp_path: Path, pem: Path) -> None:
    settings = load_settings(**scram(tmp_path, kafka_ssl_cafile=pem))
    assert client_options(settings) == {
        "security_protocol": "SASL_SSL", "ssl_check_hostname": True, "ssl_cafile": str(pem),
        "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "svc", "sasl_plain_password": SECRET,
    }  # fmt: skip


def test_mutual_tls_and_hostname_check_off(tmp_path: Path, pem: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "c.key"
    cert.write_text("x")
    key.write_text("x")
    settings = load_settings(kafka_security_protocol="ssl", kafka_ssl_cafile=pem, kafka_ssl_certfile=cert,
                             kafka_ssl_keyfile=key, kafka_ssl_check_hostname=False)  # fmt: skip
    assert client_options(settings) == {
        "security_protocol": "SSL", "ssl_check_hostname": False, "ssl_cafile": str(pem),
        "ssl_certfile": str(cert), "ssl_keyfile": str(key),
    }  # fmt: skip


def test_the_password_file_is_read_at_every_client(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("first\n")
    settings = load_settings(**{**scram(tmp_path), "kafka_sasl_password": None, "kafka_sasl_password_file": secret})
    assert client_options(settings)["sasl_plain_password"] == "first"
    secret.write_text("rotated")
    assert client_options(settings)["sasl_plain_password"] == "rotated"


def test_a_password_file_that_is_not_utf8_stops_start_up_without_quoting_it(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_bytes(b"\xff" + SECRET.encode())
    with pytest.raises(SettingsError) as refused:
        load_settings(**{**scram(tmp_path), "kafka_sasl_password": None, "kafka_sasl_password_file": secret})
    message = str(refused.value)
    assert "cannot be read (UnicodeDecodeError: not UTF-8)" in message
    assert "\n" not in message and SECRET not in message


def test_environment_names_of_spec_section_8(monkeypatch: pytest.MonkeyPatch, pem: Path) -> None:
    for name, value in {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "scram-sha-256",
                        "KAFKA_SASL_USERNAME": "svc", "KAFKA_SASL_PASSWORD": SECRET, "KAFKA_SSL_CAFILE": str(pem),
                        "KAFKA_SSL_CHECK_HOSTNAME": "false"}.items():  # fmt: skip
        monkeypatch.setenv(f"STREAMTRAIN_{name}", value)
    settings = load_settings()
    assert settings.kafka_sasl_mechanism == "SCRAM-SHA-256" and settings.kafka_ssl_check_hostname is False
    assert client_options(settings) == client_options(KafkaSecurity.from_environment(os.environ))


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"kafka_sasl_mechanism": "PLAIN"}, "kafka_sasl_mechanism=PLAIN needs a SASL protocol"),
        ({"kafka_security_protocol": "SASL_SSL"}, "needs STREAMTRAIN_KAFKA_SASL_MECHANISM"),
        (
            {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "PLAIN", "kafka_sasl_password": SECRET},
            "needs STREAMTRAIN_KAFKA_SASL_USERNAME",
        ),
        (
            {
                "kafka_security_protocol": "SASL_SSL",
                "kafka_sasl_mechanism": "SCRAM-SHA-512",
                "kafka_sasl_username": "u",
            },
            "needs STREAMTRAIN_KAFKA_SASL_PASSWORD or STREAMTRAIN_KAFKA_SASL_PASSWORD_FILE",
        ),
        (
            {
                "kafka_security_protocol": "SASL_SSL",
                "kafka_sasl_mechanism": "PLAIN",
                "kafka_sasl_username": "u",
                "kafka_sasl_password_file": "/nonexistent/password",
            },
            "kafka_sasl_password_file='/nonexistent/password' cannot be read",
        ),
        ({"kafka_ssl_cafile": "/nonexistent/ca.pem"}, "does not use TLS"),
        (
            {"kafka_security_protocol": "SSL", "kafka_ssl_cafile": "/nonexistent/ca.pem"},
            "kafka_ssl_cafile='/nonexistent/ca.pem' is not a readable file",
        ),
        (
            {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "OAUTHBEARER"},
            "reads its token from STREAMTRAIN_KAFKA_SASL_PASSWORD_FILE",
        ),
        ({"kafka_security_protocol": "TLS"}, "kafka_security_protocol"),
    ],
)
def test_a_bad_combination_stops_start_up_with_one_line_naming_the_setting(
    settings: dict[str, object], says: str
) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(**settings)
    message = str(refused.value)
    assert says in message and "\n" not in message and SECRET not in message


def test_mutual_tls_needs_certificate_and_key(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(
        SettingsError, match="needs both STREAMTRAIN_KAFKA_SSL_CERTFILE and STREAMTRAIN_KAFKA_SSL_KEYFILE"
    ):
        load_settings(kafka_security_protocol="SSL", kafka_ssl_certfile=cert)


def test_the_password_never_shows(tmp_path: Path) -> None:
    settings = load_settings(**scram(tmp_path))
    assert SECRET not in repr(settings) and SECRET not in str(settings.public_dict())
    assert settings.public_dict()["kafka_sasl_password"] == "***"
    with pytest.raises(SettingsError) as refused:  # a bad value of the secret setting itself is not echoed
        load_settings(**scram(tmp_path, kafka_sasl_password=["not", SECRET]))
    assert SECRET not in str(refused.value)
    assert SECRET not in kafka_security.describe(settings)


def test_oauthbearer_token_file_is_reread_when_it_changes(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("token-1\n")
    settings = load_settings(
        kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="OAUTHBEARER", kafka_sasl_password_file=token
    )
    provider = client_options(settings)["sasl_oauth_token_provider"]
    assert isinstance(provider, FileTokenProvider) and provider.token() == "token-1"
    token.write_text("token-2, renewed before expiry\n")
    os.utime(token, (1, 2_000_000_000))
    assert provider.token() == "token-2, renewed before expiry"


def test_authorization_errors_name_the_operation_and_the_resource() -> None:
    assert authorization_reason(GroupAuthorizationFailedError("streamtrain"), "READ") == (
        "kafka_authorization_failed: READ on group streamtrain"
    )
    assert authorization_reason(TopicAuthorizationFailedError("sensor-events.dlq"), "WRITE", topic="x") == (
        "kafka_authorization_failed: WRITE on topic sensor-events.dlq"
    )
    assert authorization_reason(KafkaConnectionError("down"), "READ") is None


def _record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_auth_watch_learns_the_cause_once_and_drops_the_retries(tmp_path: Path) -> None:
    watch = AuthWatch(load_settings(**scram(tmp_path)))
    refused = SaslAuthenticationFailedError("Authentication failed during authentication due to invalid credentials")
    assert not watch.filter(
        _record("kafka.net.manager", logging.WARNING, "Bootstrap connection to %s failed: %s", "b-0", refused)
    )
    assert (
        watch.current()
        == "kafka_auth_failed: SCRAM-SHA-512 authentication failed for user svc (the broker refused the credentials)"
    )
    assert not watch.filter(_record("kafka.net.transport", logging.ERROR, "socket disconnected"))
    assert not watch.filter(
        _record("kafka.coordinator", logging.ERROR, "failed: %s", GroupAuthorizationFailedError("g"))
    )
    assert watch.filter(_record("streamtrain.ingest.ingestor", logging.WARNING, "socket disconnected"))
    watch.clear()
    assert watch.current() is None


def test_auth_watch_keeps_plaintext_network_lines(tmp_path: Path) -> None:
    watch = AuthWatch(load_settings())
    assert watch.filter(_record("kafka.net.transport", logging.ERROR, "socket disconnected"))
    handshake = KafkaConnectionError("Handshake failed: [SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    assert not watch.filter(_record("kafka.net.connection", logging.ERROR, "Connection failed: %s", handshake))
    assert (watch.current() or "").startswith("kafka_auth_failed: TLS handshake failed")


def test_a_refused_client_certificate_is_named(tmp_path: Path) -> None:
    """The broker's TLS alert about the client's certificate (mutual TLS) says so; without a
    client certificate the same alert is the generic handshake reason."""
    cert, key = tmp_path / "svc.pem", tmp_path / "svc.key"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    alert = ssl.SSLError(1, "[SSL: SSLV3_ALERT_CERTIFICATE_UNKNOWN] sslv3 alert certificate unknown (_ssl.c:2580)")
    mutual = AuthWatch(load_settings(kafka_security_protocol="SSL", kafka_ssl_certfile=cert, kafka_ssl_keyfile=key))
    assert not mutual.filter(_record("kafka.net.connection", logging.ERROR, "Connection failed: %s", alert))
    assert (mutual.current() or "").startswith("kafka_auth_failed: the broker refused the client certificate")
    assert "KAFKA_SSL_CERTFILE" in (mutual.current() or "")
    plain_tls = AuthWatch(load_settings(kafka_security_protocol="SSL"))
    assert not plain_tls.filter(_record("kafka.net.connection", logging.ERROR, "Connection failed: %s", alert))
    assert (plain_tls.current() or "").startswith("kafka_auth_failed: TLS handshake failed")


def test_an_expired_broker_certificate_is_named() -> None:
    """Our own verification failing on the broker's certificate: renew it there (not a client setting)."""
    expired = ssl.SSLCertVerificationError(
        1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: certificate has expired (_ssl.c:1006)"
    )
    watch = AuthWatch(load_settings(kafka_security_protocol="SSL"))
    assert not watch.filter(_record("kafka.net.connection", logging.ERROR, "Connection failed: %s", expired))
    assert (watch.current() or "").startswith("kafka_auth_failed: the broker's certificate has expired")
    unknown = ssl.SSLCertVerificationError(
        1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get local issuer certificate"
    )
    other = AuthWatch(load_settings(kafka_security_protocol="SSL"))
    assert not other.filter(_record("kafka.net.connection", logging.ERROR, "Connection failed: %s", unknown))
    assert (other.current() or "").startswith("kafka_auth_failed: TLS handshake failed")
