"""TLS between real processes: a nameserver that requires client certificates and a broker, each
``python -m`` with ``APOGEE_<SERVICE>_TLS_*`` set. The broker registers with the nameserver over
mutual TLS; a TLS client sees it in the cluster info; plaintext clients and clients without a
certificate are refused; the broker's metrics are served over HTTPS; both stop gracefully."""

from __future__ import annotations

import asyncio
import http.client
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.common.metrics import scrape
from apogee.local import processes
from apogee.rpc.server import check_health
from apogee.rpc.tls import ClientTls, open_channel
from apogee.testkit.ports import free_port
from apogee.testkit.tls import Issued, TestCa
from apogee.testkit.waiting import eventually
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc
from e2e.harness import BROKER_ENV, NAMESERVER_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
BROKER = "broker-tls"


def tls_env(prefix: str, ca: TestCa, me: Issued, client_auth: str = "none") -> dict[str, str]:
    return {
        f"APOGEE_{prefix}_TLS_CERT_FILE": str(me.cert_file),
        f"APOGEE_{prefix}_TLS_KEY_FILE": str(me.key_file),
        f"APOGEE_{prefix}_TLS_CA_FILE": str(ca.cert_file),
        f"APOGEE_{prefix}_TLS_CLIENT_AUTH": client_auth,
    }


@dataclass
class Member:
    name: str
    address: str
    metrics: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class TlsCluster:
    ca: TestCa
    client: Issued
    nameserver: Member
    broker: Member

    @property
    def client_tls(self) -> ClientTls:
        return ClientTls(
            ca_file=str(self.ca.cert_file),
            cert_file=str(self.client.cert_file),
            key_file=str(self.client.key_file),
        )

    def logs(self) -> str:
        return "\n".join(
            f"==> {m.name} <==\n{processes.tail(m.log, 40)}" for m in (self.nameserver, self.broker)
        )


def spawn(name: str, argv: list[str], env: dict[str, str], root: Path) -> Member:
    log = root / f"{name}.log"
    metrics = f"127.0.0.1:{free_port()}"
    prefix = "NAMESERVER" if name == "nameserver" else "BROKER"
    proc = processes.spawn(argv, log, {**env, f"APOGEE_{prefix}_METRICS_LISTEN": metrics})
    return Member(name, argv[argv.index("--listen") + 1], metrics, proc, log)


def stop(members: list[Member]) -> list[int | None]:
    """SIGTERM each (in order), wait for it; returns the exit codes (None: killed)."""
    codes: list[int | None] = []
    for m in members:
        if m.proc.poll() is None:
            m.proc.send_signal(signal.SIGTERM)
        try:
            codes.append(m.proc.wait(STOP_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            codes.append(None)
    processes.kill_all([m.proc for m in members])
    return codes


@pytest.fixture
def tls_cluster(tmp_path: Path) -> Iterator[TlsCluster]:
    ca = TestCa.create(tmp_path / "ca")
    ns_cert = ca.issue("nameserver", tmp_path / "nameserver", client=True)
    broker_cert = ca.issue("broker", tmp_path / "broker", client=True)
    client = ca.issue("admin", tmp_path / "admin", hosts=(), client=True)
    ns_address = f"127.0.0.1:{free_port()}"
    members: list[Member] = []
    try:
        members.append(
            spawn(
                "nameserver",
                ["-m", "apogee_nameserver", "--listen", ns_address],
                {**NAMESERVER_ENV, **tls_env("NAMESERVER", ca, ns_cert, "require")},
                tmp_path,
            )
        )
        members.append(
            spawn(
                "broker",
                [
                    "-m",
                    "apogee_broker",
                    "--listen",
                    f"127.0.0.1:{free_port()}",
                    "--name",
                    BROKER,
                    "--data-dir",
                    str(tmp_path / "data"),
                    "--namesrv",
                    ns_address,
                ],
                {**BROKER_ENV, **tls_env("BROKER", ca, broker_cert)},
                tmp_path,
            )
        )
        yield TlsCluster(ca, client, members[0], members[1])
    finally:
        codes = stop(list(reversed(members)))
    logs = "\n".join(f"==> {m.name} <==\n{processes.tail(m.log, 40)}" for m in members)
    assert codes == [0] * len(members), f"did not stop gracefully: {codes}\n{logs}"


async def while_running(
    cluster: TlsCluster, what: str, check: Callable[[], Awaitable[bool]]
) -> None:
    """Poll ``check`` until it holds; fail at once when a member exits, and after the start
    timeout, with the members' logs."""

    async def holds() -> bool:
        if await check():
            return True
        for m in (cluster.nameserver, cluster.broker):
            assert m.proc.poll() is None, f"{m.name} exited\n{cluster.logs()}"
        return False

    await eventually(holds, START_TIMEOUT_S, what, every=0.1, detail=cluster.logs)


async def cluster_info(address: str, tls: ClientTls) -> nameserver_pb2.GetClusterInfoResponse:
    async with open_channel(address, tls) as channel:
        stub = nameserver_pb2_grpc.NameServerStub(channel)
        return await stub.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=5)


async def test_a_broker_registers_with_a_nameserver_over_mutual_tls(
    tls_cluster: TlsCluster,
) -> None:
    c = tls_cluster
    tls = c.client_tls
    ns, broker = c.nameserver.address, c.broker.address

    async def healthy() -> bool:
        return await check_health(ns, 2, tls=tls) and await check_health(broker, 2, tls=tls)

    await while_running(c, "healthy over TLS", healthy)

    async def registered() -> bool:
        info = await cluster_info(ns, tls)
        return any(b.broker_name == BROKER for b in info.brokers)

    await while_running(c, "the broker registered over TLS", registered)
    info = await cluster_info(ns, tls)
    assert [(b.broker_name, b.address) for b in info.brokers] == [(BROKER, broker)]

    # plaintext is refused on both; the nameserver also refuses a client without a certificate
    assert not await check_health(ns, 2)
    assert not await check_health(broker, 2)
    no_cert = ClientTls(ca_file=str(c.ca.cert_file))
    assert not await check_health(ns, 2, tls=no_cert)
    assert await check_health(broker, 2, tls=no_cert)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await cluster_info(ns, no_cert)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    # the broker's metrics over HTTPS, with the same CA
    samples = await asyncio.to_thread(scrape, c.broker.metrics, 5.0, str(c.ca.cert_file))
    assert samples.names()
    with pytest.raises((OSError, http.client.HTTPException)):
        await asyncio.to_thread(scrape, c.broker.metrics, 2.0)
