"""Kafka security settings: validation, the one translation into kafka-python options, failure reasons."""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path
from types import SimpleNamespace

import pytest
from kafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    SaslAuthenticationFailedError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailedError,
)
from pydantic import SecretStr

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


def _security(**kw: object) -> KafkaSecurity:
    if isinstance(kw.get("kafka_sasl_password"), str):
        kw["kafka_sasl_password"] = SecretStr(str(kw["kafka_sasl_password"]))
    return KafkaSecurity(**kw)  # type: ignore[arg-type]


SASL = {"kafka_security_protocol": "SASL_SSL"}


@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        (
            {"kafka_security_protocol": "TLS"},
            "kafka_security_protocol='TLS' is not one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL",
        ),
        (
            {**SASL, "kafka_sasl_mechanism": "GSSAPI"},
            "kafka_sasl_mechanism='GSSAPI' is not one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER",
        ),
        (
            {"kafka_sasl_mechanism": "PLAIN"},
            "kafka_sasl_mechanism=PLAIN needs a SASL protocol, but kafka_security_protocol=PLAINTEXT: set "
            "STREAMTRAIN_KAFKA_SECURITY_PROTOCOL=SASL_SSL (or SASL_PLAINTEXT), "
            "or unset STREAMTRAIN_KAFKA_SASL_MECHANISM",
        ),
        (
            {"kafka_security_protocol": "SASL_PLAINTEXT"},
            "kafka_security_protocol=SASL_PLAINTEXT needs STREAMTRAIN_KAFKA_SASL_MECHANISM "
            "(one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER)",
        ),
        (
            {
                **SASL,
                "kafka_sasl_mechanism": "PLAIN",
                "kafka_sasl_username": "u",
                "kafka_sasl_password": "p",
                "kafka_sasl_password_file": Path("/nonexistent/p"),
            },  # fmt: skip
            "set one of STREAMTRAIN_KAFKA_SASL_PASSWORD and STREAMTRAIN_KAFKA_SASL_PASSWORD_FILE, not both",
        ),
        (
            {
                **SASL,
                "kafka_sasl_mechanism": "PLAIN",
                "kafka_sasl_username": "u",
                "kafka_sasl_password_file": Path("/nonexistent/p"),
            },  # fmt: skip
            "kafka_sasl_password_file='/nonexistent/p' cannot be read (FileNotFoundError: No such file or directory)",
        ),
        (
            {**SASL, "kafka_sasl_mechanism": "SCRAM-SHA-256", "kafka_sasl_password": "p"},
            "kafka_sasl_mechanism=SCRAM-SHA-256 needs STREAMTRAIN_KAFKA_SASL_USERNAME",
        ),
        (
            {**SASL, "kafka_sasl_mechanism": "SCRAM-SHA-256", "kafka_sasl_username": "u"},
            "kafka_sasl_mechanism=SCRAM-SHA-256 needs STREAMTRAIN_KAFKA_SASL_PASSWORD or "
            "STREAMTRAIN_KAFKA_SASL_PASSWORD_FILE",
        ),
        (
            {**SASL, "kafka_sasl_mechanism": "OAUTHBEARER"},
            "kafka_sasl_mechanism=OAUTHBEARER reads its token from STREAMTRAIN_KAFKA_SASL_PASSWORD_FILE (re-read "
            "whenever the file changes): set it to the token file your identity provider's agent renews",
        ),
        (
            {"kafka_ssl_keyfile": Path("/nonexistent/k")},
            "kafka_ssl_keyfile is set but kafka_security_protocol=PLAINTEXT does not use TLS: set SSL or SASL_SSL",
        ),
        (
            {"kafka_security_protocol": "SSL", "kafka_ssl_certfile": Path("/nonexistent/c")},
            "kafka_ssl_certfile='/nonexistent/c' is not a readable file",
        ),
        (
            {"kafka_security_protocol": "SSL", "kafka_ssl_certfile": Path("/"), "kafka_ssl_keyfile": Path("/")},
            "kafka_ssl_certfile='/' is not a readable file",  # a directory is readable, but no file
        ),
    ],
)
def test_each_refusal_in_full(given: dict[str, object], refusal: str) -> None:
    with pytest.raises(ValueError) as refused:
        kafka_security.check(_security(**given))
    assert str(refused.value) == refusal


@pytest.mark.parametrize("missing", ["kafka_ssl_certfile", "kafka_ssl_keyfile"])
def test_mutual_tls_with_one_of_its_two_files_is_refused_in_full(tmp_path: Path, missing: str) -> None:
    present = tmp_path / "present.pem"
    present.write_text("x")
    other = "kafka_ssl_keyfile" if missing == "kafka_ssl_certfile" else "kafka_ssl_certfile"
    with pytest.raises(ValueError) as refused:
        kafka_security.check(_security(kafka_security_protocol="SSL", **{other: present}))
    assert str(refused.value) == (
        "mutual TLS needs both STREAMTRAIN_KAFKA_SSL_CERTFILE and STREAMTRAIN_KAFKA_SSL_KEYFILE, or neither"
    )


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_each_password_mechanism_needs_a_username(mechanism: str) -> None:
    with pytest.raises(ValueError, match=rf"^kafka_sasl_mechanism={mechanism} needs STREAMTRAIN_KAFKA_SASL_USERNAME$"):
        kafka_security.check(_security(**SASL, kafka_sasl_mechanism=mechanism, kafka_sasl_password="p"))


def test_an_empty_secret_file_is_refused_naming_it(tmp_path: Path) -> None:
    empty = tmp_path / "password"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match=rf"^kafka_sasl_password_file='{empty}' is empty$"):
        kafka_security.check(_security(**SASL, kafka_sasl_mechanism="PLAIN", kafka_sasl_username="u",
                                       kafka_sasl_password_file=empty))  # fmt: skip


def test_a_password_file_removed_after_start_up_is_named_when_a_client_is_made(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("first")
    settings = load_settings(**{**scram(tmp_path), "kafka_sasl_password": None, "kafka_sasl_password_file": secret})
    secret.unlink()
    with pytest.raises(ValueError, match=rf"^kafka_sasl_password_file='{secret}' cannot be read \(FileNotFoundError"):
        client_options(settings)
    assert kafka_security.sasl_password(load_settings()) is None


def test_a_token_file_is_reread_only_when_it_changes(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("token-1")
    provider = FileTokenProvider(token)
    assert provider.token() == "token-1"
    stamp = token.stat()
    token.write_text("token-2")  # the same size; its time set back: no change seen
    os.utime(token, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert provider.token() == "token-1"
    token.write_text("")
    os.utime(token, (1, 2_000_000_000))
    with pytest.raises(ValueError, match=rf"^kafka_sasl_password_file='{token}' is empty$"):
        provider.token()


def test_the_security_line_of_the_start_up_log(tmp_path: Path, pem: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "c.key"
    cert.write_text("x")
    key.write_text("x")
    token = tmp_path / "token"
    token.write_text("t")
    assert kafka_security.describe(load_settings()) == "PLAINTEXT"
    assert kafka_security.describe(load_settings(**scram(tmp_path))) == "SASL_SSL, SCRAM-SHA-512 as svc"
    oauth = load_settings(kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="OAUTHBEARER",
                          kafka_sasl_password_file=token)  # fmt: skip
    assert kafka_security.describe(oauth) == "SASL_SSL, OAUTHBEARER"
    mutual = load_settings(kafka_security_protocol="SSL", kafka_ssl_certfile=cert, kafka_ssl_keyfile=key)
    assert kafka_security.describe(mutual) == f"SSL, client certificate {cert}"


def test_security_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, pem: Path) -> None:
    environ = {
        "STREAMTRAIN_KAFKA_SECURITY_PROTOCOL": " sasl_ssl ", "STREAMTRAIN_KAFKA_SASL_MECHANISM": "plain",
        "STREAMTRAIN_KAFKA_SASL_USERNAME": "svc", "STREAMTRAIN_KAFKA_SASL_PASSWORD": SECRET,
        "STREAMTRAIN_KAFKA_SSL_CAFILE": str(pem), "STREAMTRAIN_KAFKA_SSL_CHECK_HOSTNAME": "false",
        "STREAMTRAIN_KAFKA_SSL_CERTFILE": "",  # empty: unset
    }  # fmt: skip
    monkeypatch.delenv("STREAMTRAIN_KAFKA_SECURITY_PROTOCOL", raising=False)
    security = KafkaSecurity.from_environment(environ)
    assert security == KafkaSecurity(
        kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="PLAIN", kafka_sasl_username="svc",
        kafka_sasl_password=security.kafka_sasl_password, kafka_ssl_cafile=pem, kafka_ssl_check_hostname=False,
    )  # fmt: skip
    assert security.kafka_sasl_password is not None and security.kafka_sasl_password.get_secret_value() == SECRET
    assert isinstance(security.kafka_ssl_cafile, Path)
    assert KafkaSecurity.from_environment({}) == KafkaSecurity()
    monkeypatch.setenv("STREAMTRAIN_KAFKA_SECURITY_PROTOCOL", "SSL")
    assert KafkaSecurity.from_environment().kafka_security_protocol == "SSL"  # None: this process's environment
    with pytest.raises(ValueError) as refused:
        KafkaSecurity.from_environment({"STREAMTRAIN_KAFKA_SSL_CHECK_HOSTNAME": "maybe"})
    assert str(refused.value) == "STREAMTRAIN_KAFKA_SSL_CHECK_HOSTNAME='maybe' is not a boolean (true or false)"


def test_authorization_failures_in_full() -> None:
    assert str(kafka_security.authorization_failed("READ", "group", "g")) == (
        "kafka_authorization_failed: READ on group g"
    )
    assert str(kafka_security.authorization_failed("CREATE", "topic", "t", "ask an operator")) == (
        "kafka_authorization_failed: CREATE on topic t (ask an operator)"
    )
    access = kafka_security.KafkaAccessError("kafka_authorization_failed: DESCRIBE on topic t")
    assert authorization_reason(access, "READ") == "kafka_authorization_failed: DESCRIBE on topic t"
    # kafka-python's errors carry the resource's name, a sentence, or nothing
    assert authorization_reason(TopicAuthorizationFailedError(), "WRITE", topic="t.dlq") == (
        "kafka_authorization_failed: WRITE on topic t.dlq"
    )
    sentence = TopicAuthorizationFailedError("Topic authorization failed for this principal")
    assert authorization_reason(sentence, "READ", topic="t") == "kafka_authorization_failed: READ on topic t"
    assert authorization_reason(TopicAuthorizationFailedError(7), "READ", topic="t") == (
        "kafka_authorization_failed: READ on topic t"
    )
    assert authorization_reason(GroupAuthorizationFailedError(), "READ", group="g") == (
        "kafka_authorization_failed: READ on group g"
    )
    assert authorization_reason(ClusterAuthorizationFailedError(), "IDEMPOTENT_WRITE") == (
        "kafka_authorization_failed: IDEMPOTENT_WRITE on cluster"
    )
    assert authorization_reason(TransactionalIdAuthorizationFailedError(), "WRITE") == (
        "kafka_authorization_failed: WRITE (TransactionalIdAuthorizationFailedError)"
    )


OAUTH = {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "OAUTHBEARER"}


@pytest.mark.parametrize(
    ("error", "given", "reason"),
    [
        (
            KafkaConnectionError("SaslAuthenticationFailedError: bad token"),
            OAUTH,
            "kafka_auth_failed: OAUTHBEARER authentication failed (the broker refused the credentials)",
        ),
        (
            KafkaConnectionError("Handshake failed: outer (Handshake failed: inner)"),
            {"kafka_security_protocol": "SSL"},
            "kafka_auth_failed: TLS handshake failed (outer (Handshake failed: inner)): "
            "check KAFKA_SSL_CAFILE, KAFKA_SSL_CHECK_HOSTNAME and the client certificate",
        ),
        (
            Exception("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate"),
            {"kafka_security_protocol": "SSL"},
            "kafka_auth_failed: TLS handshake failed ([SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
            "self-signed certificate): check KAFKA_SSL_CAFILE, KAFKA_SSL_CHECK_HOSTNAME and the client certificate",
        ),
        (
            KafkaConnectionError("Handshake failed: wrong version number"),
            {"kafka_security_protocol": "SSL"},
            "kafka_auth_failed: TLS handshake failed (wrong version number): is the listener PLAINTEXT? "
            "check KAFKA_SECURITY_PROTOCOL",
        ),
        (
            KafkaConnectionError("Handshake failed: [SSL: WRONG_VERSION_NUMBER] (_ssl.c:1006)"),
            {"kafka_security_protocol": "SSL"},
            "kafka_auth_failed: TLS handshake failed ([SSL: WRONG_VERSION_NUMBER] (_ssl.c:1006)): is the listener "
            "PLAINTEXT? check KAFKA_SECURITY_PROTOCOL",
        ),
        (
            ssl.SSLCertVerificationError(1, "certificate verify failed: certificate has expired"),
            {"kafka_security_protocol": "SSL"},
            "kafka_auth_failed: the broker's certificate has expired (certificate verify failed: certificate "
            "has expired): renew it on the broker; the service connects again by itself once it is renewed",
        ),
        (
            Exception("Invalid frame length 352518912"),
            {"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_mechanism": "PLAIN"},
            "kafka_auth_failed: protocol mismatch (Invalid frame length 352518912): the listener speaks another "
            "protocol than KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT",
        ),
        (
            Exception("Unsupported SASL mechanism SCRAM-SHA-512"),
            {"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "SCRAM-SHA-512"},
            "kafka_auth_failed: protocol mismatch (Unsupported SASL mechanism SCRAM-SHA-512): the listener speaks "
            "another protocol than KAFKA_SECURITY_PROTOCOL=SASL_SSL",
        ),
        (KafkaConnectionError("Connection refused"), {"kafka_security_protocol": "SSL"}, None),
    ],
)
def test_each_authentication_failure_reason_in_full(error: BaseException, given: dict[str, str], reason: str) -> None:
    unset = {"kafka_sasl_username": None, "kafka_sasl_mechanism": None, "kafka_ssl_certfile": None}
    assert kafka_security._auth_reason(error, SimpleNamespace(**(unset | given))) == reason


def test_a_client_certificate_alert_names_the_certificate_only_when_one_is_sent() -> None:
    alert = ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required")
    mutual = SimpleNamespace(kafka_sasl_username=None, kafka_ssl_certfile=Path("svc.pem"))
    assert kafka_security._auth_reason(alert, mutual) == (
        "kafka_auth_failed: the broker refused the client certificate ([SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] "
        "tlsv13 alert certificate required): it has expired, or is not signed by a CA the broker trusts; "
        "check KAFKA_SSL_CERTFILE"
    )
    other = ssl.SSLError(1, "[SSL: DECRYPTION_FAILED] decryption failed")
    assert (kafka_security._auth_reason(other, mutual) or "").startswith("kafka_auth_failed: TLS handshake failed")


def test_the_watch_judges_a_record_s_exceptions_and_not_the_words_around_them(tmp_path: Path) -> None:
    watch = AuthWatch(load_settings(**scram(tmp_path)))
    timeout = KafkaConnectionError("request timed out")
    assert watch.filter(_record("kafka.net.connection", logging.ERROR, "after Handshake failed: retrying: %s", timeout))
    assert watch.current() is None  # the exception is a timeout, whatever the message says
    refused = SaslAuthenticationFailedError("invalid credentials")
    logged = _record("kafka.net.connection", logging.ERROR, "authentication error")
    logged.exc_info = (type(refused), refused, None)  # log.exception
    assert not watch.filter(logged)
    assert (watch.current() or "").startswith("kafka_auth_failed: SCRAM-SHA-512 authentication failed for user svc")


def test_a_secured_listener_s_retry_noise_is_dropped_and_the_rest_kept(tmp_path: Path) -> None:
    watch = AuthWatch(load_settings(**scram(tmp_path)))
    for noise in ("socket disconnected", "Node 1 not ready; waiting", "Bootstrap connection to b-0 failed",
                  "Bootstrap failed", "Connection failed to b-0"):  # fmt: skip
        assert not watch.filter(_record("kafka.net.manager", logging.WARNING, noise)), noise
    assert watch.filter(_record("kafka.net.manager", logging.WARNING, "Closing idle connection 3"))
    assert not watch.filter(_record("kafka.cluster", logging.WARNING, "Topic t is not authorized for this client"))
    assert watch.filter(_record("kafka.cluster", logging.WARNING, "Topic t has 3 partitions"))


def test_a_learned_failure_is_current_for_two_minutes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    now = [60.0]  # a machine booted a minute ago: nothing learned is nothing current
    monkeypatch.setattr(kafka_security, "time", SimpleNamespace(monotonic=lambda: now[0]))
    watch = AuthWatch(load_settings(**scram(tmp_path)))
    assert watch.current() is None
    now[0] = 5000.0
    watch.filter(_record("kafka.net.manager", logging.WARNING, "%s", SaslAuthenticationFailedError("no")))
    now[0] += 120.0
    assert watch.current() is not None and watch.current(max_age_s=119.0) is None
    now[0] += 0.5
    assert watch.current() is None


def test_the_process_has_one_watch_on_every_kafka_logger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kafka_security, "_WATCH", None)
    assert kafka_security.current_failure() is None
    first, second = load_settings(), load_settings(**scram(tmp_path))
    installed = kafka_security.watch(first)
    try:
        assert installed.settings is first
        assert kafka_security.watch(second) is installed and installed.settings is second
        for name in kafka_security.NETWORK_LOGGERS + kafka_security.REFUSAL_LOGGERS:
            assert installed in logging.getLogger(name).filters, name
        assert kafka_security.current_failure() is None
        installed.filter(_record("kafka.net.manager", logging.WARNING, "%s", SaslAuthenticationFailedError("no")))
        assert (kafka_security.current_failure() or "").startswith("kafka_auth_failed: SCRAM-SHA-512")
    finally:
        for name in kafka_security.NETWORK_LOGGERS + kafka_security.REFUSAL_LOGGERS:
            logging.getLogger(name).removeFilter(installed)


def test_a_failure_only_a_log_message_names_is_learned_from_the_message(tmp_path: Path) -> None:
    watch = AuthWatch(load_settings(**scram(tmp_path)))
    text = "Bootstrap connection to b-0 failed: SaslAuthenticationFailedError: invalid credentials"
    assert not watch.filter(_record("kafka.net.manager", logging.WARNING, text))
    assert watch.current() == (
        "kafka_auth_failed: SCRAM-SHA-512 authentication failed for user svc (the broker refused the credentials)"
    )
