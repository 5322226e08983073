"""Kafka security: the ``KAFKA_SECURITY_*`` / ``KAFKA_SASL_*`` / ``KAFKA_SSL_*`` settings as kafka-python options.

Every Kafka client the project creates (the consumer, the dead-letter producer, the admin
client, ``streamtrain simulate``, every scale-out rank) gets its security options from
:func:`client_options` and nowhere else; TLS, SASL and the token refresh are kafka-python's
own. The settings themselves live in ``config.py`` (docs/contract.md, sections 4 and 5).

Failures become readiness reasons with the contract's prefixes: ``kafka_auth_failed:``
(credentials, TLS trust, a protocol mismatch) and ``kafka_authorization_failed:`` (an ACL
missing, with the operation and the resource). kafka-python keeps a failed authentication to
itself: a client constructor only says ``Unable to bootstrap``, while its network loggers
write the cause on every retry. :class:`AuthWatch` reads those records, remembers the cause
and drops the repeats, so a wrong password is one line in the log and one reason in
``/readyz``, not a line per retry. No secret is ever part of a reason or a log line.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka.errors import (
    AuthorizationError,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    SaslAuthenticationFailedError,
    TopicAuthorizationFailedError,
)
from kafka.net.sasl.oauth import AbstractTokenProvider
from pydantic import SecretStr, TypeAdapter, ValidationError

log = logging.getLogger(__name__)

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
AUTH_FAILED = "kafka_auth_failed"
AUTHORIZATION_FAILED = "kafka_authorization_failed"
#: The readiness reasons' prefixes, and the ``kind`` label of ``streamtrain_kafka_security_failing``.
FAILURE_KINDS = (AUTH_FAILED, AUTHORIZATION_FAILED)
FAILURE_PREFIXES = tuple(kind + ":" for kind in FAILURE_KINDS)

#: kafka-python's loggers that report connection and authentication failures, once per retry.
NETWORK_LOGGERS = ("kafka.net.manager", "kafka.net.connection", "kafka.net.transport")
#: kafka-python's loggers that report authorization refusals, once per retry; the service reports them itself.
REFUSAL_LOGGERS = (
    "kafka.coordinator",
    "kafka.coordinator.consumer",
    "kafka.cluster",
    "kafka.consumer.fetcher",
    "kafka.consumer.group",
    "kafka.producer.kafka",
    "kafka.producer.sender",
)


def _env(name: str) -> str:
    return f"STREAMTRAIN_{name.upper()}"


def check(s: Any) -> None:
    """Refuse settings that cannot work, with one line naming the setting and the fix.

    ``s`` has the ``kafka_*`` security attributes of :class:`streamtrain.config.Settings`.
    """
    protocol, mechanism = s.kafka_security_protocol, s.kafka_sasl_mechanism
    if protocol not in PROTOCOLS:
        raise ValueError(f"kafka_security_protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
    if mechanism is not None and mechanism not in MECHANISMS:
        raise ValueError(f"kafka_sasl_mechanism={mechanism!r} is not one of {', '.join(MECHANISMS)}")
    sasl = protocol.startswith("SASL_")
    if mechanism is not None and not sasl:
        raise ValueError(
            f"kafka_sasl_mechanism={mechanism} needs a SASL protocol, but kafka_security_protocol={protocol}: "
            f"set STREAMTRAIN_KAFKA_SECURITY_PROTOCOL=SASL_SSL (or SASL_PLAINTEXT), "
            f"or unset STREAMTRAIN_KAFKA_SASL_MECHANISM"
        )
    if sasl and mechanism is None:
        raise ValueError(
            f"kafka_security_protocol={protocol} needs STREAMTRAIN_KAFKA_SASL_MECHANISM "
            f"(one of {', '.join(MECHANISMS)})"
        )
    if s.kafka_sasl_password is not None and s.kafka_sasl_password_file is not None:
        raise ValueError(
            "set one of STREAMTRAIN_KAFKA_SASL_PASSWORD and STREAMTRAIN_KAFKA_SASL_PASSWORD_FILE, not both"
        )
    if s.kafka_sasl_password_file is not None:
        _read_secret_file(s.kafka_sasl_password_file, "kafka_sasl_password_file")
    if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        if not s.kafka_sasl_username:
            raise ValueError(f"kafka_sasl_mechanism={mechanism} needs STREAMTRAIN_KAFKA_SASL_USERNAME")
        if s.kafka_sasl_password is None and s.kafka_sasl_password_file is None:
            raise ValueError(
                f"kafka_sasl_mechanism={mechanism} needs STREAMTRAIN_KAFKA_SASL_PASSWORD "
                f"or STREAMTRAIN_KAFKA_SASL_PASSWORD_FILE"
            )
    if mechanism == "OAUTHBEARER" and s.kafka_sasl_password_file is None:
        raise ValueError(
            "kafka_sasl_mechanism=OAUTHBEARER reads its token from STREAMTRAIN_KAFKA_SASL_PASSWORD_FILE "
            "(re-read whenever the file changes): set it to the token file your identity provider's agent renews"
        )
    tls = protocol in ("SSL", "SASL_SSL")
    files = {
        "kafka_ssl_cafile": s.kafka_ssl_cafile,
        "kafka_ssl_certfile": s.kafka_ssl_certfile,
        "kafka_ssl_keyfile": s.kafka_ssl_keyfile,
    }
    for name, path in files.items():
        if path is None:
            continue
        if not tls:
            raise ValueError(
                f"{name} is set but kafka_security_protocol={protocol} does not use TLS: set SSL or SASL_SSL"
            )
        if not Path(path).is_file() or not os.access(path, os.R_OK):
            raise ValueError(f"{name}={str(path)!r} is not a readable file")
    if (s.kafka_ssl_certfile is None) != (s.kafka_ssl_keyfile is None):
        raise ValueError(
            "mutual TLS needs both STREAMTRAIN_KAFKA_SSL_CERTFILE and STREAMTRAIN_KAFKA_SSL_KEYFILE, or neither"
        )


@dataclass(frozen=True)
class KafkaSecurity:
    """The security settings on their own, for a client without the service's settings (``simulate``)."""

    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_sasl_password_file: Path | None = None
    kafka_ssl_cafile: Path | None = None
    kafka_ssl_certfile: Path | None = None
    kafka_ssl_keyfile: Path | None = None
    kafka_ssl_check_hostname: bool = True

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> KafkaSecurity:
        """From the service's ``STREAMTRAIN_KAFKA_*`` variables; ValueError (one line, no secret) if invalid."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, kind in cls.__annotations__.items():
            raw = environ.get(_env(name))
            if raw is None or raw == "":
                continue
            if name in ("kafka_security_protocol", "kafka_sasl_mechanism"):
                values[name] = raw.strip().upper()
            elif name == "kafka_ssl_check_hostname":
                try:
                    values[name] = TypeAdapter(bool).validate_python(raw)
                except ValidationError:
                    raise ValueError(f"{_env(name)}={raw!r} is not a boolean (true or false)") from None
            elif name == "kafka_sasl_password":
                values[name] = SecretStr(raw)
            elif "Path" in str(kind):
                values[name] = Path(raw)
            else:
                values[name] = raw
        security = cls(**values)
        check(security)
        return security


def _read_secret_file(path: Path | str, setting: str) -> str:
    """The file's content without surrounding whitespace; the error never shows the content."""
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        # a UnicodeDecodeError has no strerror, and its text would quote the file's bytes
        why = (err.strerror if isinstance(err, OSError) else None) or "not UTF-8"
        raise ValueError(f"{setting}={str(path)!r} cannot be read ({type(err).__name__}: {why})") from None
    if not value:
        raise ValueError(f"{setting}={str(path)!r} is empty")
    return value


def sasl_password(s: Any) -> str | None:
    """The SASL password, read now (a mounted secret that was rotated is picked up by the next client)."""
    if s.kafka_sasl_password_file is not None:
        return _read_secret_file(s.kafka_sasl_password_file, "kafka_sasl_password_file")
    if s.kafka_sasl_password is not None:
        return s.kafka_sasl_password.get_secret_value()
    return None


class FileTokenProvider(AbstractTokenProvider):
    """OAUTHBEARER: the token in a file, re-read whenever the file changes.

    An identity provider's agent (a Kubernetes projected token, a sidecar) renews the file
    before the token expires; kafka-python asks for the token at every authentication.
    """

    def __init__(self, path: Path | str) -> None:
        super().__init__()
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[float, int] | None = None
        self._token = ""

    def token(self) -> str:
        with self._lock:
            stat = self.path.stat()
            stamp = (stat.st_mtime, stat.st_size)
            if stamp != self._stamp:
                self._token = _read_secret_file(self.path, "kafka_sasl_password_file")
                self._stamp = stamp
            return self._token


def client_options(s: Any) -> dict[str, Any]:
    """kafka-python keyword options for the security settings of ``s`` (any client kind)."""
    protocol = s.kafka_security_protocol
    options: dict[str, Any] = {"security_protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        options["ssl_check_hostname"] = bool(s.kafka_ssl_check_hostname)
        if s.kafka_ssl_cafile is not None:
            options["ssl_cafile"] = str(s.kafka_ssl_cafile)
        if s.kafka_ssl_certfile is not None:
            options["ssl_certfile"] = str(s.kafka_ssl_certfile)
            options["ssl_keyfile"] = str(s.kafka_ssl_keyfile)
    if protocol.startswith("SASL_"):
        mechanism = s.kafka_sasl_mechanism
        options["sasl_mechanism"] = mechanism
        if mechanism == "OAUTHBEARER":
            options["sasl_oauth_token_provider"] = FileTokenProvider(s.kafka_sasl_password_file)
        else:
            options["sasl_plain_username"] = s.kafka_sasl_username
            options["sasl_plain_password"] = sasl_password(s)
    return options


def describe(s: Any) -> str:
    """How the clients connect, for the start-up log line (no secret)."""
    parts = [s.kafka_security_protocol]
    if s.kafka_sasl_mechanism:
        who = f" as {s.kafka_sasl_username}" if s.kafka_sasl_username else ""
        parts.append(f"{s.kafka_sasl_mechanism}{who}")
    if s.kafka_ssl_certfile is not None:
        parts.append(f"client certificate {s.kafka_ssl_certfile}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------- failures


class KafkaAccessError(Exception):
    """A security failure the service reports as a readiness reason; ``str()`` is the reason."""


def authorization_failed(operation: str, kind: str, name: str, hint: str = "") -> KafkaAccessError:
    """``kafka_authorization_failed: OPERATION on KIND NAME`` (plus a hint on what to grant or create)."""
    return KafkaAccessError(f"{AUTHORIZATION_FAILED}: {operation} on {kind} {name}" + (f" ({hint})" if hint else ""))


def authorization_reason(
    err: BaseException, operation: str, *, topic: str | None = None, group: str | None = None
) -> str | None:
    """The reason for a kafka-python authorization error (None for any other error).

    ``operation`` is what the failing call needed; the resource is the one the error names.
    """
    if isinstance(err, KafkaAccessError):
        return str(err)
    named = str(err.args[0]) if getattr(err, "args", None) and isinstance(err.args[0], str) else None
    if isinstance(err, GroupAuthorizationFailedError):
        return f"{AUTHORIZATION_FAILED}: READ on group {named or group}"
    if isinstance(err, TopicAuthorizationFailedError):
        name = named if named and " " not in named else topic
        return f"{AUTHORIZATION_FAILED}: {operation} on topic {name}"
    if isinstance(err, ClusterAuthorizationFailedError):
        return f"{AUTHORIZATION_FAILED}: {operation} on cluster"
    if isinstance(err, AuthorizationError):
        return f"{AUTHORIZATION_FAILED}: {operation} ({type(err).__name__})"
    return None


#: TLS alerts a broker sends when it refuses the client's certificate (mutual TLS).
_CLIENT_CERTIFICATE_ALERTS = (
    "ALERT_CERTIFICATE_UNKNOWN",
    "ALERT_CERTIFICATE_EXPIRED",
    "ALERT_BAD_CERTIFICATE",
    "ALERT_UNKNOWN_CA",
    "ALERT_CERTIFICATE_REQUIRED",
)


def _auth_reason(exc: BaseException, s: Any) -> str | None:
    """A ``kafka_auth_failed:`` reason for an exception kafka-python's network layer logged."""
    text = str(exc)
    if isinstance(exc, SaslAuthenticationFailedError) or "SaslAuthenticationFailed" in text:
        who = f" for user {s.kafka_sasl_username}" if s.kafka_sasl_username else ""
        return (
            f"{AUTH_FAILED}: {s.kafka_sasl_mechanism} authentication failed{who} (the broker refused the credentials)"
        )
    if isinstance(exc, ssl.SSLError) or "Handshake failed" in text or "CERTIFICATE_VERIFY_FAILED" in text:
        detail = text.split("Handshake failed: ", 1)[-1]
        if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
            return (
                f"{AUTH_FAILED}: TLS handshake failed ({detail}): is the listener PLAINTEXT? "
                "check KAFKA_SECURITY_PROTOCOL"
            )
        refused = any(alert in text for alert in _CLIENT_CERTIFICATE_ALERTS)
        if refused and s.kafka_ssl_certfile is not None:  # the broker's TLS alert about our certificate
            return (
                f"{AUTH_FAILED}: the broker refused the client certificate ({detail}): it has expired, or is "
                "not signed by a CA the broker trusts; check KAFKA_SSL_CERTFILE"
            )
        if "certificate has expired" in text:  # our verification of the broker's certificate
            return (
                f"{AUTH_FAILED}: the broker's certificate has expired ({detail}): renew it on the broker; "
                "the service connects again by itself once it is renewed"
            )
        return (
            f"{AUTH_FAILED}: TLS handshake failed ({detail}): "
            "check KAFKA_SSL_CAFILE, KAFKA_SSL_CHECK_HOSTNAME and the client certificate"
        )
    if "Invalid frame length" in text or "Unsupported SASL mechanism" in text:
        return (
            f"{AUTH_FAILED}: protocol mismatch ({text}): "
            f"the listener speaks another protocol than KAFKA_SECURITY_PROTOCOL={s.kafka_security_protocol}"
        )
    return None


#: What kafka-python's network loggers write on every retry of a connection that fails.
_RETRY_NOISE = (
    "socket disconnected",
    "not ready; waiting",
    "Bootstrap connection to",
    "Bootstrap failed",
    "Connection failed",
)


class AuthWatch(logging.Filter):
    """Learns authentication failures from kafka-python's network log records and drops their repeats.

    Installed on :data:`NETWORK_LOGGERS` once per process (:func:`watch`). ``current()``
    is the latest ``kafka_auth_failed:`` reason until :meth:`clear` (a client got through).
    """

    def __init__(self, settings: Any) -> None:
        super().__init__()
        self.settings = settings
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._at = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        errors = [a for a in args if isinstance(a, BaseException)]
        if record.exc_info and record.exc_info[1] is not None:
            errors.append(record.exc_info[1])
        if errors:  # the exceptions say what failed; the message around them is only context
            reason = next((r for r in (_auth_reason(e, self.settings) for e in errors) if r), None)
        else:
            reason = _auth_reason(Exception(record.getMessage()), self.settings)
        if reason is not None:
            with self._lock:
                self._reason, self._at = reason, time.monotonic()
            return False  # the service reports it once, as a state change
        message = record.getMessage()
        if "AuthorizationFailed" in message or "is not authorized" in message:
            return False  # a readiness reason (kafka_authorization_failed:) and one service log line say it
        if record.name not in NETWORK_LOGGERS:
            return True
        # While a refusal is current, the network layer's retries (the broker hanging up, a
        # bootstrap that times out, a node not ready) are repeats of it: the reason says it.
        # On a secured listener a refusal often shows first as the broker hanging up, before
        # kafka-python reads its answer: those retries are the service's to report (once).
        if self.current() is not None:
            return False
        secured = self.settings.kafka_security_protocol != "PLAINTEXT"
        return not (secured and any(noise in message for noise in _RETRY_NOISE))

    def current(self, max_age_s: float = 120.0) -> str | None:
        with self._lock:
            if self._reason is not None and time.monotonic() - self._at <= max_age_s:
                return self._reason
            return None

    def clear(self) -> None:
        with self._lock:
            self._reason = None


_WATCH: AuthWatch | None = None
_WATCH_LOCK = threading.Lock()


def watch(settings: Any) -> AuthWatch:
    """This process's :class:`AuthWatch` (installed on first use)."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None:
            _WATCH = AuthWatch(settings)
            for name in NETWORK_LOGGERS + REFUSAL_LOGGERS:
                logging.getLogger(name).addFilter(_WATCH)
        else:
            _WATCH.settings = settings
        return _WATCH


def current_failure() -> str | None:
    """The authentication failure this process's clients last met, if one is current."""
    return None if _WATCH is None else _WATCH.current()
