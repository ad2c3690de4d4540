"""Certificate and key files on disk: read, checked, and watched for changes (standard library
only: the services need no ``cryptography``).

A TLS setting names PEM files (``tls_cert_file``, ``tls_key_file``, ``tls_ca_file``) that an
operator, cert-manager or Kubernetes may replace while the service runs. Kubernetes updates a
Secret volume by swapping a symlink (``tls.crt -> ..data/tls.crt``, ``..data`` -> a new folder),
so a file's identity is taken through the link: :func:`stamp` is ``os.stat`` (which follows
links) reduced to device, inode, size and modification time; a swap, a rename over the file or
a rewrite in place each change it.

- :class:`PemFile`: a setting's name and its path.
- :func:`read_pem`: the bytes of a PEM file, or :class:`~apogee.common.errors.InvalidArgumentError`
  naming the setting and what is wrong (missing, unreadable, empty, not PEM of that kind, an
  encrypted key).
- :func:`check_key_pair`: a server :class:`ssl.SSLContext` loaded with a certificate and its key
  (the check that they match, and that OpenSSL can parse both), and the CA when given.
- :func:`stamp`: the identity of several files at once (None for a file that cannot be stat'ed).

Error messages never carry key material: they name the setting, the path and the rule.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from apogee.common.errors import InvalidArgumentError

#: The identity of one file: (device, inode, size, mtime in ns); None when it cannot be stat'ed.
FileStamp = tuple[int, int, int, int] | None

CERT_MARK: Final = b"-----BEGIN CERTIFICATE-----"
KEY_MARKS: Final = (
    b"-----BEGIN PRIVATE KEY-----",
    b"-----BEGIN RSA PRIVATE KEY-----",
    b"-----BEGIN EC PRIVATE KEY-----",
)
ENCRYPTED_MARKS: Final = (b"-----BEGIN ENCRYPTED PRIVATE KEY-----", b"Proc-Type: 4,ENCRYPTED")


@dataclass(frozen=True, slots=True)
class PemFile:
    """The file a setting names: ``field`` (``tls_cert_file``) and its ``path``."""

    field: str
    path: str


def stamp(files: Sequence[PemFile]) -> tuple[FileStamp, ...]:
    """The identity of each of ``files`` (through symlinks), in order."""
    out: list[FileStamp] = []
    for f in files:
        try:
            st = os.stat(f.path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def read_pem(pem: PemFile, kind: str) -> bytes:
    """The bytes of ``pem``, checked to hold PEM of ``kind`` (``"certificate"``, ``"key"``;
    ``"ca"`` is certificates too)."""
    try:
        with open(pem.path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise InvalidArgumentError(field=pem.field, rule=f"{pem.path!r} does not exist") from None
    except IsADirectoryError:
        raise InvalidArgumentError(
            field=pem.field, rule=f"{pem.path!r} is a directory, not a file"
        ) from None
    except OSError as exc:
        raise InvalidArgumentError(
            field=pem.field, rule=f"{pem.path!r} cannot be read: {exc.strerror or exc}"
        ) from None
    if not data.strip():
        raise InvalidArgumentError(field=pem.field, rule=f"{pem.path!r} is empty")
    if kind == "key":
        if any(m in data for m in ENCRYPTED_MARKS):
            raise InvalidArgumentError(
                field=pem.field,
                rule=f"{pem.path!r} holds an encrypted key; give the key unencrypted",
            )
        if not any(m in data for m in KEY_MARKS):
            raise InvalidArgumentError(
                field=pem.field, rule=f"{pem.path!r} is not a PEM private key"
            )
    elif CERT_MARK not in data:
        raise InvalidArgumentError(
            field=pem.field, rule=f"{pem.path!r} is not a PEM certificate (BEGIN CERTIFICATE)"
        )
    return data


def _no_password() -> bytes:
    return b""  # an encrypted key fails instead of OpenSSL asking on the terminal


def check_key_pair(cert: PemFile, key: PemFile, ca: PemFile | None = None) -> ssl.SSLContext:
    """A TLS server context holding ``cert`` and ``key`` (and trusting ``ca`` for client
    certificates when given): OpenSSL parsed them and the key matches the certificate.
    :class:`InvalidArgumentError` names the setting at fault."""
    check_certificate(cert, read_pem(cert, "certificate"))
    read_pem(key, "key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert.path, key.path, password=_no_password)
    except ssl.SSLError as exc:
        reason = exc.reason or ""
        if "MISMATCH" in reason:
            rule = f"{key.path!r} is not the key of the certificate {cert.path!r}"
        else:
            rule = f"{key.path!r} cannot be loaded as the key of {cert.path!r} ({reason or exc})"
        raise InvalidArgumentError(field=key.field, rule=rule) from None
    except OSError as exc:  # gone between the read and the load
        raise InvalidArgumentError(
            field=cert.field, rule=f"cannot be read: {exc.strerror or exc}"
        ) from None
    if ca is not None:
        load_ca(ctx, ca)
    return ctx


def check_certificate(pem: PemFile, data: bytes) -> None:
    """``data`` (read from ``pem``) holds certificates OpenSSL can parse (not, say, a file
    caught half-written)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(
            cadata=data.decode("ascii", errors="replace")
        )
    except (ssl.SSLError, ValueError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise InvalidArgumentError(
            field=pem.field, rule=f"{pem.path!r} is not a usable PEM certificate ({why})"
        ) from None


def load_ca(ctx: ssl.SSLContext, ca: PemFile) -> bytes:
    """Trust the certificates of ``ca`` in ``ctx``; returns the file's bytes."""
    data = read_pem(ca, "ca")
    try:
        ctx.load_verify_locations(cadata=data.decode("ascii", errors="replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise InvalidArgumentError(
            field=ca.field, rule=f"{ca.path!r} holds no usable CA certificate ({exc})"
        ) from None
    return data
