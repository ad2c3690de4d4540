"""Certificates for tests: a CA, server certificates (SAN ``localhost`` and ``127.0.0.1``) and
client certificates, written as PEM files into a folder. Needs the ``cryptography`` package
(in the workspace's dev dependencies; the services do not need it)::

    ca = TestCa.create(tmp_path / "ca")
    server = ca.issue("server", tmp_path / "server")          # server.crt, server.key
    client = ca.issue("client", tmp_path / "client", client=True)
    replace_files(server, ca.issue("server-2", tmp_path / "next"))  # a rotation, atomically

Keys are EC P-256 (fast to make); certificates are valid from a minute ago for a day.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: The names a server certificate is for, unless told otherwise.
LOCAL_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as files; ``serial`` is the certificate's serial number."""

    name: str
    cert_file: Path
    key_file: Path
    serial: int


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


@dataclass(frozen=True)
class TestCa:
    """A certificate authority of its own; its certificate is :attr:`cert_file`."""

    __test__ = False  # not a test class, for pytest

    name: str
    cert_file: Path
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, folder: Path, name: str = "Apogee test CA") -> TestCa:
        """A new CA, its certificate written to ``folder/ca.crt`` (its key stays in memory)."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        path = folder / "ca.crt"
        _write(path, cert.public_bytes(serialization.Encoding.PEM))
        return cls(name, path, cert, key)

    def issue(
        self,
        name: str,
        folder: Path,
        hosts: Sequence[str] = LOCAL_HOSTS,
        client: bool = False,
    ) -> Issued:
        """A certificate for ``name`` (its common name) signed by this CA, written to
        ``folder/<name>.crt`` and ``folder/<name>.key``. A server certificate (the default)
        holds ``hosts`` as DNS or IP names; ``client``: a client certificate (and a server one
        too, so that a service can present it both ways)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        usages = [ExtendedKeyUsageOID.SERVER_AUTH]
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        serial = x509.random_serial_number()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_file, key_file = folder / f"{name}.crt", folder / f"{name}.key"
        _write(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        _write(key_file, _key_pem(key), 0o600)
        return Issued(name, cert_file, key_file, serial)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` the way a Secret update does: write a new file beside
    it, then rename it over the old one (a reader sees the old file or the new, never half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def replace_files(current: Issued, new: Issued) -> None:
    """Put ``new``'s certificate and key in place of ``current``'s files (each atomically;
    the key first, as a rotation may be caught between the two)."""
    write_atomically(current.key_file, new.key_file.read_bytes())
    write_atomically(current.cert_file, new.cert_file.read_bytes())
