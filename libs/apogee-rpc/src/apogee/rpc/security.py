"""How a client reaches Apogee's services: TLS (:class:`~apogee.rpc.tls.ClientTls`) and the
access key it signs every call with (:class:`~apogee.common.auth.Credentials`).

:class:`ClientSecurity` holds both; :meth:`ClientSecurity.channel` opens a channel with them.
Signing adds ``x-mq-date-time`` and ``authorization`` (``MQv2-HMAC-SHA1``, as RocketMQ 5 clients
sign) to the metadata of each call, unary and streaming alike; the pair is made once per
second of the clock and reused within it.

:meth:`ClientSecurity.from_env` reads what the SDK, the CLI and the Spark source take from the
environment when no security is given in code (never from the command line, which other users
of the machine can read):

==============================  ===============================================================
``APOGEE_CREDENTIALS_FILE``     a TOML file with ``access_key`` and ``secret_key``
``APOGEE_ACCESS_KEY``           the access key (with ``APOGEE_SECRET_KEY``; the file wins)
``APOGEE_SECRET_KEY``           its secret key
``APOGEE_TLS_CA_FILE``          CA certificates (PEM) that verify the servers; set, or
                                ``APOGEE_TLS=1``, to connect over TLS
``APOGEE_TLS``                  ``1``: TLS with the system's CA certificates
``APOGEE_TLS_CERT_FILE``        a client certificate (PEM) for mutual TLS
``APOGEE_TLS_KEY_FILE``         its private key
``APOGEE_TLS_SERVER_NAME``      the name expected in the servers' certificates
==============================  ===============================================================
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from apogee.common.auth import Credentials, signed_metadata
from apogee.common.auth.signature import access_key_rule
from apogee.common.errors import InvalidArgumentError
from apogee.rpc.tls import ClientTls, client_tls_from, open_channel

_TRUE = {"1", "true", "yes", "on"}


class Signer:
    """The signed metadata of ``credentials`` for the current second of ``clock``."""

    def __init__(self, credentials: Credentials, clock: Callable[[], float] = time.time) -> None:
        self.credentials = credentials
        self._clock = clock
        self._second = -1
        self._pairs: tuple[tuple[str, str], ...] = ()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        now = self._clock()
        second = int(now)
        if second != self._second:
            creds = self.credentials
            self._pairs = signed_metadata(
                creds.access_key, creds.secret_key, datetime.fromtimestamp(second, UTC)
            )
            self._second = second
        return self._pairs


def _signed(details: grpc.aio.ClientCallDetails, signer: Signer) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *signer.metadata())
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_signed(details, self.signer), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_signed(details, self.signer), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_signed(details, self.signer), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_signed(details, self.signer), requests)


def signing_interceptors(credentials: Credentials) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that sign every call with ``credentials``."""
    return signer_interceptors(Signer(credentials))


def signer_interceptors(signer: Signer) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add ``signer.metadata()`` to every call, unary and streaming."""
    return [_UnaryUnary(signer), _UnaryStream(signer), _StreamUnary(signer), _StreamStream(signer)]


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """TLS and credentials of a client; both optional (neither: plaintext, unsigned)."""

    tls: ClientTls | None = None
    credentials: Credentials | None = None

    def channel(
        self, address: str, options: Sequence[tuple[str, Any]] | None = None
    ) -> grpc.aio.Channel:
        interceptors = (
            signing_interceptors(self.credentials) if self.credentials is not None else None
        )
        return open_channel(address, self.tls, options, interceptors)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSecurity:
        """What the environment sets (the module's docstring); nothing set: plain."""
        e = os.environ if env is None else env
        return cls(tls=_tls_from_env(e), credentials=_credentials_from_env(e))


def _credentials_from_env(env: Mapping[str, str]) -> Credentials | None:
    path = env.get("APOGEE_CREDENTIALS_FILE", "").strip()
    if path:
        return Credentials.load(Path(path))
    access_key = env.get("APOGEE_ACCESS_KEY", "").strip()
    secret_key = env.get("APOGEE_SECRET_KEY", "")
    if not access_key and not secret_key:
        return None
    if not access_key or not secret_key:
        missing = "APOGEE_SECRET_KEY" if access_key else "APOGEE_ACCESS_KEY"
        raise InvalidArgumentError(
            field=missing,
            rule="an access key needs its secret key (APOGEE_ACCESS_KEY and APOGEE_SECRET_KEY "
            "together, or APOGEE_CREDENTIALS_FILE)",
        )
    rule = access_key_rule(access_key)
    if rule is not None:
        raise InvalidArgumentError(field="APOGEE_ACCESS_KEY", rule=rule)
    return Credentials(access_key, secret_key)


def _tls_from_env(env: Mapping[str, str]) -> ClientTls | None:
    ca = env.get("APOGEE_TLS_CA_FILE", "").strip()
    cert = env.get("APOGEE_TLS_CERT_FILE", "").strip()
    key = env.get("APOGEE_TLS_KEY_FILE", "").strip()
    name = env.get("APOGEE_TLS_SERVER_NAME", "").strip()
    on = env.get("APOGEE_TLS", "").strip().lower() in _TRUE
    if not (on or ca or cert or key):
        return None
    return ClientTls(ca_file=ca, cert_file=cert, key_file=key, server_name=name)


#: no TLS, no signing
PLAIN = ClientSecurity()


def service_security(settings: object) -> ClientSecurity:
    """How a service calls the others: TLS as its settings say (:func:`client_tls_from`), and
    signed with its ``auth_credentials_file`` when ``auth_enabled`` (read once, at start)."""
    credentials = None
    path = str(getattr(settings, "auth_credentials_file", "") or "")
    if getattr(settings, "auth_enabled", False) and path:
        credentials = Credentials.load(Path(path))
    return ClientSecurity(tls=client_tls_from(settings), credentials=credentials)
