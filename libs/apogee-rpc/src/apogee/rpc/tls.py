"""TLS for Apogee's gRPC servers and channels, with certificates reloaded while running.

Server side: :class:`ServerTls` names the PEM files (certificate chain, key, and the CA that
client certificates must chain to) and whether clients must present a certificate;
:func:`server_credentials` turns it into :func:`grpc.dynamic_ssl_server_credentials`. gRPC asks
its fetcher before every new connection's handshake; the fetcher stats the files (through
symlinks: Kubernetes rotates a Secret by swapping one) and, when one changed, reads and checks
them again, so new connections get the new certificate without a restart; connections already
open keep theirs. A file caught half-written (not PEM, a key that does not match the
certificate) keeps the previous certificate, with one WARNING per change of the files (naming the
setting and the rule, never key material); the next change is tried again.

``client_auth``:

- ``none``: no client certificate is asked for.
- ``require``: every client presents a certificate that chains to ``ca_file``; others are
  refused at the handshake.
- ``optional``: on the metrics port (Python's ``ssl``), a client certificate is asked for and
  checked when presented; gRPC's Python runtime can only require a client certificate or not
  ask for one, so the gRPC port then accepts every client without asking (as ``none``).
  Identity then comes from request signatures (``auth_enabled``).

Client side: :class:`ClientTls` names the CA to verify servers with (empty: the system's roots),
the client certificate and key for mutual TLS, and the name expected in the servers'
certificates; :meth:`ClientTls.credentials` re-reads the files when they changed since the last
call, so a channel opened after a rotation uses the new files (an open channel keeps the
credentials it was opened with). :func:`open_channel` opens a secure channel when TLS is on and
an insecure one otherwise.

A service's settings (:class:`apogee.common.settings.SecuritySettings`) give both:
:func:`server_tls_from` and :func:`client_tls_from` (TLS is on when ``tls_cert_file`` is set;
the service presents its own certificate as its client certificate).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import grpc.aio

from apogee.common.errors import InvalidArgumentError
from apogee.common.tls_files import FileStamp, PemFile, check_key_pair, read_pem, stamp

log = logging.getLogger(__name__)

#: The values of ``client_auth`` (``tls_client_auth``).
CLIENT_AUTH_MODES: Final = ("none", "optional", "require")


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The TLS of a server port: PEM files and client authentication (see the module
    docstring). The values are checked here; the files when credentials are built."""

    cert_file: str
    key_file: str
    ca_file: str = ""
    client_auth: str = "none"

    def __post_init__(self) -> None:
        if not self.cert_file:
            raise InvalidArgumentError(field="tls_cert_file", rule="must name a PEM file")
        if not self.key_file:
            raise InvalidArgumentError(
                field="tls_key_file", rule="must name the PEM key of tls_cert_file"
            )
        if self.client_auth not in CLIENT_AUTH_MODES:
            raise InvalidArgumentError(
                field="tls_client_auth",
                rule=f"{self.client_auth!r} is not one of {', '.join(CLIENT_AUTH_MODES)}",
            )
        if self.client_auth != "none" and not self.ca_file:
            raise InvalidArgumentError(
                field="tls_ca_file",
                rule=f"must name the CA of client certificates when tls_client_auth is "
                f"{self.client_auth}",
            )

    @property
    def files(self) -> tuple[PemFile, ...]:
        """The files, as their settings name them (the CA only when given)."""
        out = (PemFile("tls_cert_file", self.cert_file), PemFile("tls_key_file", self.key_file))
        return (*out, PemFile("tls_ca_file", self.ca_file)) if self.ca_file else out

    def load(self) -> grpc.ServerCertificateConfiguration:
        """Read and check the files (:class:`InvalidArgumentError` names the setting at fault)
        into a gRPC certificate configuration."""
        cert_pem, key_pem, *ca = self.files
        check_key_pair(cert_pem, key_pem, ca[0] if ca else None)
        cert = read_pem(cert_pem, "certificate")
        key = read_pem(key_pem, "key")
        roots = read_pem(ca[0], "ca") if ca and self.client_auth == "require" else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=roots)


class _CertificateFetcher:
    """gRPC's ``certificate_configuration_fetcher``: a new configuration when the files
    changed and check out, else None (keep the current one). Called by gRPC's threads (with
    the GIL) before each handshake; cheap when nothing changed (a stat of each file)."""

    def __init__(self, tls: ServerTls) -> None:
        self.tls = tls
        self._files = tls.files
        self._lock = threading.Lock()
        self._stamp = stamp(self._files)
        self.initial = tls.load()
        if stamp(self._files) != self._stamp:  # changed while read: take it as it is now
            self._stamp = stamp(self._files)
            self.initial = tls.load()
        #: how many times new files were taken (for tests and logs)
        self.reloads = 0

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        now = stamp(self._files)
        if now == self._stamp:
            return None
        if not self._lock.acquire(blocking=False):
            return None  # another handshake is reading them
        try:
            return self._reload(now)
        finally:
            self._lock.release()

    def _reload(self, before: tuple[FileStamp, ...]) -> grpc.ServerCertificateConfiguration | None:
        try:
            config = self.tls.load()
        except InvalidArgumentError as err:
            if stamp(self._files) != before:
                return None  # still being written: look again at the next handshake
            self._stamp = before  # warn once per change
            log.warning("TLS files changed but cannot be used, keeping the previous: %s", err)
            return None
        if stamp(self._files) != before:
            return None  # changed while read: read again at the next handshake
        self._stamp = before
        self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.tls.cert_file)
        return config


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port`` that follow changes of ``tls``'s files (see the
    module docstring). :class:`InvalidArgumentError` when the files are not usable now."""
    fetcher = _CertificateFetcher(tls)
    if tls.client_auth == "optional":
        log.info(
            "tls_client_auth optional: the gRPC port does not ask for client certificates "
            "(gRPC can only require one or not ask); the metrics port checks one when presented"
        )
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial,
        fetcher,  # type: ignore[arg-type]  # the stubs forget that None means "unchanged"
        require_client_authentication=tls.client_auth == "require",
    )


@dataclass(slots=True)
class _ClientCache:
    lock: threading.Lock = field(default_factory=threading.Lock)
    stamp: tuple[FileStamp, ...] | None = None
    credentials: grpc.ChannelCredentials | None = None


@dataclass(frozen=True, slots=True)
class ClientTls:
    """The TLS of a client: ``ca_file`` verifies the servers (empty: the system's roots),
    ``cert_file`` and ``key_file`` (both or neither) are the client certificate for mutual TLS,
    ``server_name`` (when set) is the name checked in the servers' certificates instead of the
    host of the address."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    _cache: _ClientCache = field(
        default_factory=_ClientCache, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            missing = "tls_key_file" if self.cert_file else "tls_cert_file"
            raise InvalidArgumentError(
                field=missing,
                rule="a client certificate needs both tls_cert_file and tls_key_file",
            )

    @property
    def files(self) -> tuple[PemFile, ...]:
        out: list[PemFile] = []
        if self.ca_file:
            out.append(PemFile("tls_ca_file", self.ca_file))
        if self.cert_file:
            out += [
                PemFile("tls_cert_file", self.cert_file),
                PemFile("tls_key_file", self.key_file),
            ]
        return tuple(out)

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files as they are now (read again only when one
        changed since the last call). :class:`InvalidArgumentError` names a file that is not
        usable; after a rotation that left a file unusable, the previous credentials are kept
        (a WARNING says so)."""
        files = self.files
        now = stamp(files)
        cache = self._cache
        with cache.lock:
            if cache.credentials is not None and now == cache.stamp:
                return cache.credentials
            try:
                creds = self._load()
            except InvalidArgumentError as err:
                if cache.credentials is None:
                    raise
                if cache.stamp != now:
                    log.warning(
                        "TLS client files changed but cannot be used, keeping the previous: %s",
                        err,
                    )
                    cache.stamp = now
                return cache.credentials
            cache.stamp, cache.credentials = now, creds
            return creds

    def _load(self) -> grpc.ChannelCredentials:
        roots = read_pem(PemFile("tls_ca_file", self.ca_file), "ca") if self.ca_file else None
        if not self.cert_file:
            return grpc.ssl_channel_credentials(root_certificates=roots)
        cert_pem = PemFile("tls_cert_file", self.cert_file)
        key_pem = PemFile("tls_key_file", self.key_file)
        check_key_pair(cert_pem, key_pem)
        return grpc.ssl_channel_credentials(
            root_certificates=roots,
            private_key=read_pem(key_pem, "key"),
            certificate_chain=read_pem(cert_pem, "certificate"),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """Channel options TLS adds: the name checked in the servers' certificates."""
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def open_channel(
    address: str,
    tls: ClientTls | None,
    options: Sequence[tuple[str, Any]] | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    """A channel to ``address``: over TLS when ``tls`` is set, plaintext otherwise."""
    opts = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        tls.credentials(),
        options=opts + tls.channel_options(),
        interceptors=interceptors,
    )


def server_tls_from(settings: object) -> ServerTls | None:
    """The server TLS a service's settings ask for (``tls_cert_file``, ``tls_key_file``,
    ``tls_ca_file``, ``tls_client_auth``), or None when ``tls_cert_file`` is empty or absent."""
    cert = getattr(settings, "tls_cert_file", "")
    if not cert:
        return None
    return ServerTls(
        cert_file=cert,
        key_file=getattr(settings, "tls_key_file", ""),
        ca_file=getattr(settings, "tls_ca_file", ""),
        client_auth=getattr(settings, "tls_client_auth", "none"),
    )


def client_tls_from(settings: object) -> ClientTls | None:
    """The TLS a service uses when it calls other Apogee services: on when its
    ``tls_cert_file`` is set, verifying them with ``tls_ca_file`` (empty: the system's roots)
    and ``tls_server_name``, presenting its own certificate and key; None otherwise."""
    cert = getattr(settings, "tls_cert_file", "")
    if not cert:
        return None
    return ClientTls(
        ca_file=getattr(settings, "tls_ca_file", ""),
        cert_file=cert,
        key_file=getattr(settings, "tls_key_file", ""),
        server_name=getattr(settings, "tls_server_name", ""),
    )
