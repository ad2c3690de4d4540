"""A cluster of real processes with TLS on every port and authentication on, for the end-to-end
tests that need one with users of their own (:mod:`e2e.test_rocketmq_security`).

:meth:`SecureCluster.start_secure` makes a test CA (:class:`apogee.testkit.tls.TestCa`) and a
certificate for each service (server and client use: the services call each other over mutual
TLS), writes the users file (the test's users after the service identity, :data:`SERVICE`) and
the services' credentials file, and starts nameservers, brokers, the schedule service and the
transaction checker with ``APOGEE_<SERVICE>_TLS_*`` and ``APOGEE_<SERVICE>_AUTH_*`` set
(:func:`service_env`). A :class:`SecureCluster` is an :class:`e2e.harness.Cluster`: stopped by
:meth:`~e2e.harness.Cluster.close`, its log tails in the report of a failed test.

The local cluster's own waits (health checks, registrations, routes) read the CA and the service
identity from the environment (``APOGEE_TLS_CA_FILE``, ``APOGEE_CREDENTIALS_FILE``): they are set
while it starts and while a route is awaited, and put back after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from apogee.client import AdminClient
from apogee.common.auth import Credentials
from apogee.common.topics import MessageType
from apogee.rpc.security import ClientSecurity
from apogee.rpc.tls import ClientTls
from apogee.testkit.tls import TestCa
from e2e.harness import Cluster, in_thread, wait_for_route

#: The services' own identity (they call each other as it), first in every users file.
SERVICE = ("apogee-service", "service-secret-0123456789")
SERVICE_USER = f"""
[[users]]
access_key = "{SERVICE[0]}"
secret_key = "{SERVICE[1]}"
service = true
"""
#: The services of a cluster, with the prefix of their settings.
SERVICES = {
    "nameserver": "NAMESERVER",
    "broker": "BROKER",
    "schedule": "SCHEDULE",
    "txn-checker": "TXN_CHECKER",
}


def service_env(service: str, ca: TestCa, pki: Path, users: Path, creds: Path) -> dict[str, str]:
    """The environment that puts ``service`` (a key of :data:`SERVICES`) on TLS with a
    certificate of its own from ``ca`` (written to ``pki``) and authentication on, with the
    users of ``users`` and its identity from ``creds``."""
    cert = ca.issue(service, pki, client=True)
    p = f"APOGEE_{SERVICES[service]}_"
    return {
        f"{p}TLS_CERT_FILE": str(cert.cert_file),
        f"{p}TLS_KEY_FILE": str(cert.key_file),
        f"{p}TLS_CA_FILE": str(ca.cert_file),
        f"{p}AUTH_ENABLED": "true",
        f"{p}AUTH_USERS_FILE": str(users),
        f"{p}AUTH_CREDENTIALS_FILE": str(creds),
    }


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment until the block ends; then as they were."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class SecureCluster(Cluster):
    """A running cluster with TLS and authentication; ``SecureCluster.start_secure(...)``, then
    :meth:`close` (always)."""

    #: the CA every member's certificate comes from (what a client must trust)
    ca: TestCa
    users_file: Path
    credentials_file: Path

    @classmethod
    def start_secure(
        cls,
        root: Path,
        users: str,
        *,
        brokers: int = 1,
        nameservers: int = 1,
        broker_env: Mapping[str, str] | None = None,
    ) -> SecureCluster:
        """Start it under ``root`` with the users of ``users`` (a users file's ``[[users]]``
        tables; the service identity is added before them)."""
        ca = TestCa.create(root / "pki")
        users_file = root / "users.toml"
        users_file.write_text(SERVICE_USER + users)
        creds = root / "service-credentials.toml"
        creds.write_text(f'access_key = "{SERVICE[0]}"\nsecret_key = "{SERVICE[1]}"\n')
        creds.chmod(0o600)
        env = {s: service_env(s, ca, root / "pki", users_file, creds) for s in SERVICES}
        with environment(_client_env(ca, creds)):
            cluster = cls.start(  # the test settings, and these
                root / "cluster",
                brokers=brokers,
                nameservers=nameservers,
                nameserver_env=env["nameserver"],
                broker_env={**(broker_env or {}), **env["broker"]},
                schedule_env=env["schedule"],
                txn_checker_env=env["txn-checker"],
            )
        assert isinstance(cluster, SecureCluster)
        cluster.ca = ca
        cluster.users_file = users_file
        cluster.credentials_file = creds
        return cluster

    def security(self, access_key: str, secret_key: str) -> ClientSecurity:
        """What Apogee's SDK needs to call this cluster as the user ``access_key``."""
        tls = ClientTls(ca_file=str(self.ca.cert_file))
        return ClientSecurity(tls=tls, credentials=Credentials(access_key, secret_key))

    def create_topic(
        self,
        topic: str,
        admin: tuple[str, str],
        *,
        queues: int,
        message_type: MessageType = MessageType.NORMAL,
        brokers: Sequence[str] | None = None,
    ) -> None:
        """``topic`` on ``brokers`` (by default every broker), created by the user ``admin``
        (access key, secret key: one with the admin write right); returns once every
        nameserver routes it."""
        names = list(brokers) if brokers is not None else [b.name for b in self.brokers]

        async def create() -> None:
            async with AdminClient(self.namesrv, security=self.security(*admin)) as client:
                await client.create_or_update_topic(
                    topic, queues=queues, brokers=names, message_type=message_type
                )
            await wait_for_route(self.nameservers, topic, set(names))

        with environment(_client_env(self.ca, self.credentials_file)):
            in_thread(lambda: asyncio.run(create()))


def _client_env(ca: TestCa, creds: Path) -> dict[str, str]:
    return {"APOGEE_TLS_CA_FILE": str(ca.cert_file), "APOGEE_CREDENTIALS_FILE": str(creds)}
