"""TLS on a real grpc.aio server (:class:`GrpcServer` with its health service): who gets in
(TLS clients trusting the CA; not plaintext clients, not clients trusting another CA; with
``require``, only clients with a certificate), certificates rotated while the server runs (files
renamed over, a Kubernetes-style symlink swap, a half-written file that keeps the old one), the
settings and files checked with the setting named, the health probe over TLS, and a
leader-elected service's health and metrics ports over TLS from its settings."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2

from apogee.common.errors import InvalidArgumentError
from apogee.common.metrics import scrape
from apogee.common.settings import SecuritySettings
from apogee.rpc import probe
from apogee.rpc.server import GrpcServer, check_health
from apogee.rpc.tls import (
    ClientTls,
    ServerTls,
    client_tls_from,
    open_channel,
    server_credentials,
    server_tls_from,
)
from apogee.service.leader_app import LeaderApp
from apogee.service.leader_settings import LeaderServiceSettings
from apogee.testkit.tls import Issued, TestCa, replace_files, write_atomically
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

DEADLINE_S = 10.0


@dataclass
class Pki:
    ca: TestCa
    other_ca: TestCa
    server: Issued
    client: Issued
    root: Path


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = TestCa.create(tmp_path / "ca")
    return Pki(
        ca=ca,
        other_ca=TestCa.create(tmp_path / "other-ca", "Another CA"),
        server=ca.issue("server", tmp_path / "server"),
        client=ca.issue("client", tmp_path / "client", hosts=(), client=True),
        root=tmp_path,
    )


async def serve(tls: ServerTls, interceptors: Any = ()) -> GrpcServer:
    srv = GrpcServer("127.0.0.1:0", "test", tls=tls, interceptors=interceptors)
    await srv.start(["apogee.test.Process"])
    return srv


@pytest.fixture
async def tls_server(pki: Pki) -> AsyncIterator[GrpcServer]:
    srv = await serve(ServerTls(str(pki.server.cert_file), str(pki.server.key_file)))
    try:
        yield srv
    finally:
        await srv.stop(0)


def peer_serial(port: int, ca_file: Path) -> int:
    """The serial number of the certificate a fresh TLS connection to ``port`` is shown."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        ctx.wrap_socket(sock, server_hostname="localhost") as conn,
    ):
        cert = conn.getpeercert()
    assert cert is not None
    return int(str(cert["serialNumber"]), 16)


async def eventually_serial(port: int, ca_file: Path, want: int) -> None:
    """Poll fresh connections until one is shown certificate ``want`` (or fail)."""
    got: list[int] = []

    async def shown() -> bool:
        got[:] = [await asyncio.to_thread(peer_serial, port, ca_file)]
        return got[0] == want

    await eventually(
        shown, DEADLINE_S, f"serial {want:x} shown", detail=lambda: f"still serial {got[0]:x}"
    )


def address(srv: GrpcServer) -> str:
    return f"127.0.0.1:{srv.port}"


async def health(channel: grpc.aio.Channel) -> int:
    """One health Check on ``channel``: the status answered."""
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    reply = await check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


async def test_a_tls_client_gets_in_and_plaintext_or_another_ca_does_not(
    pki: Pki, tls_server: GrpcServer
) -> None:
    trusting = ClientTls(ca_file=str(pki.ca.cert_file))
    assert await check_health(address(tls_server), 5, tls=trusting)
    assert await check_health(address(tls_server), 5, "apogee.test.Process", tls=trusting)
    assert not await check_health(address(tls_server), 2)
    assert not await check_health(
        address(tls_server), 2, tls=ClientTls(ca_file=str(pki.other_ca.cert_file))
    )
    # the name checked can be overridden: a certificate for "localhost" reached as 127.0.0.1
    # passes either way, a wrong name fails
    assert await check_health(
        address(tls_server),
        5,
        tls=ClientTls(ca_file=str(pki.ca.cert_file), server_name="localhost"),
    )
    assert not await check_health(
        address(tls_server),
        2,
        tls=ClientTls(ca_file=str(pki.ca.cert_file), server_name="elsewhere.example"),
    )


async def test_required_client_certificates(pki: Pki) -> None:
    srv = await serve(
        ServerTls(
            str(pki.server.cert_file),
            str(pki.server.key_file),
            ca_file=str(pki.ca.cert_file),
            client_auth="require",
        )
    )
    try:
        ca = str(pki.ca.cert_file)
        assert not await check_health(address(srv), 2, tls=ClientTls(ca_file=ca))
        with_cert = ClientTls(
            ca_file=ca, cert_file=str(pki.client.cert_file), key_file=str(pki.client.key_file)
        )
        assert await check_health(address(srv), 5, tls=with_cert)
        stranger = pki.other_ca.issue("stranger", pki.root / "stranger", client=True)
        assert not await check_health(
            address(srv),
            2,
            tls=ClientTls(
                ca_file=ca, cert_file=str(stranger.cert_file), key_file=str(stranger.key_file)
            ),
        )
    finally:
        await srv.stop(0)


async def test_optional_client_auth_lets_clients_without_a_certificate_in(pki: Pki) -> None:
    srv = await serve(
        ServerTls(
            str(pki.server.cert_file),
            str(pki.server.key_file),
            ca_file=str(pki.ca.cert_file),
            client_auth="optional",
        )
    )
    try:
        assert await check_health(address(srv), 5, tls=ClientTls(ca_file=str(pki.ca.cert_file)))
    finally:
        await srv.stop(0)


async def test_a_rotated_certificate_serves_new_connections_without_a_restart(
    pki: Pki, tls_server: GrpcServer
) -> None:
    port = tls_server.port
    assert await asyncio.to_thread(peer_serial, port, pki.ca.cert_file) == pki.server.serial
    trusting = ClientTls(ca_file=str(pki.ca.cert_file))
    async with open_channel(address(tls_server), trusting) as old_channel:
        assert await health(old_channel) == health_pb2.HealthCheckResponse.SERVING
        renewed = pki.ca.issue("server-renewed", pki.root / "renewed")
        replace_files(pki.server, renewed)
        await eventually_serial(port, pki.ca.cert_file, renewed.serial)
        # the connection opened before keeps working, and new clients get in
        assert await health(old_channel) == health_pb2.HealthCheckResponse.SERVING
    assert await check_health(address(tls_server), 5, tls=trusting)


async def test_a_kubernetes_style_symlink_swap_is_followed(pki: Pki) -> None:
    # a Secret volume: tls.crt -> ..data/tls.crt, ..data -> ..<timestamp>/; an update writes a
    # new folder and swaps ..data
    vol = pki.root / "secret"
    first = vol / "..v1"
    first.mkdir(parents=True)
    (first / "tls.crt").write_bytes(pki.server.cert_file.read_bytes())
    (first / "tls.key").write_bytes(pki.server.key_file.read_bytes())
    (vol / "..data").symlink_to("..v1")
    (vol / "tls.crt").symlink_to("..data/tls.crt")
    (vol / "tls.key").symlink_to("..data/tls.key")
    srv = await serve(ServerTls(str(vol / "tls.crt"), str(vol / "tls.key")))
    try:
        assert await asyncio.to_thread(peer_serial, srv.port, pki.ca.cert_file) == pki.server.serial
        renewed = pki.ca.issue("server-v2", pki.root / "v2")
        second = vol / "..v2"
        second.mkdir()
        (second / "tls.crt").write_bytes(renewed.cert_file.read_bytes())
        (second / "tls.key").write_bytes(renewed.key_file.read_bytes())
        (vol / "..data_tmp").symlink_to("..v2")
        (vol / "..data_tmp").replace(vol / "..data")
        await eventually_serial(srv.port, pki.ca.cert_file, renewed.serial)
    finally:
        await srv.stop(0)


async def test_a_half_written_certificate_keeps_the_old_one_and_warns_once(
    pki: Pki, tls_server: GrpcServer, caplog: pytest.LogCaptureFixture
) -> None:
    port, ca_file = tls_server.port, pki.ca.cert_file
    renewed = pki.ca.issue("server-next", pki.root / "next")
    good = renewed.cert_file.read_bytes()
    caplog.set_level(logging.WARNING, "apogee.rpc.tls")
    pki.server.cert_file.write_bytes(good[: len(good) // 2])  # caught mid-write
    for _ in range(3):
        assert await asyncio.to_thread(peer_serial, port, ca_file) == pki.server.serial
    warnings = [r for r in caplog.records if "cannot be used" in r.getMessage()]
    assert len(warnings) == 1
    assert "tls_cert_file" in warnings[0].getMessage()
    assert "PRIVATE KEY" not in caplog.text
    # a key that does not match the certificate is kept out too
    write_atomically(pki.server.cert_file, good)  # the new certificate, the old key
    for _ in range(2):
        assert await asyncio.to_thread(peer_serial, port, ca_file) == pki.server.serial
    assert any("tls_key_file" in r.getMessage() for r in caplog.records)
    # once the key follows, the new pair is served
    write_atomically(pki.server.key_file, renewed.key_file.read_bytes())
    await eventually_serial(port, ca_file, renewed.serial)
    assert await check_health(f"127.0.0.1:{port}", 5, tls=ClientTls(ca_file=str(ca_file)))


def test_unusable_files_are_refused_at_the_start_naming_the_setting(pki: Pki) -> None:
    cert, key = str(pki.server.cert_file), str(pki.server.key_file)
    not_pem = pki.root / "not.pem"
    not_pem.write_text("hello\n")
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: ServerTls(str(pki.root / "missing.crt"), key), "tls_cert_file"),
        (lambda: ServerTls(str(not_pem), key), "tls_cert_file"),
        (lambda: ServerTls(cert, str(not_pem)), "tls_key_file"),
        (lambda: ServerTls(cert, str(pki.client.key_file)), "tls_key_file"),
        (lambda: ServerTls(cert, key, ca_file=str(not_pem), client_auth="require"), "tls_ca_file"),
        (lambda: ServerTls(cert, str(pki.root)), "tls_key_file"),
    ]
    for build, field in cases:
        with pytest.raises(InvalidArgumentError) as err:
            server_credentials(build())  # type: ignore[arg-type]
        assert str(err.value).startswith(f"{field}: "), str(err.value)
    for kwargs, field in [
        ({"client_auth": "sometimes"}, "tls_client_auth"),
        ({"client_auth": "require"}, "tls_ca_file"),
        ({"key_file": ""}, "tls_key_file"),
    ]:
        with pytest.raises(InvalidArgumentError, match=f"^{field}: "):
            ServerTls(**{"cert_file": cert, "key_file": key, **kwargs})
    with pytest.raises(InvalidArgumentError, match=r"^tls_key_file: "):
        ClientTls(cert_file=cert)
    with pytest.raises(InvalidArgumentError, match=r"^tls_cert_file: "):
        ClientTls(key_file=key)


async def test_a_server_with_unusable_files_does_not_bind(pki: Pki) -> None:
    srv = GrpcServer("127.0.0.1:0", "test", tls=ServerTls(str(pki.root / "no.crt"), "no.key"))
    with pytest.raises(InvalidArgumentError, match=r"^tls_cert_file: .*does not exist"):
        srv.bind()
    assert srv.port == 0


async def test_client_credentials_follow_changed_files(pki: Pki) -> None:
    tls = ClientTls(ca_file=str(pki.ca.cert_file))
    first = tls.credentials()
    assert tls.credentials() is first  # nothing changed: the same credentials
    write_atomically(pki.ca.cert_file, pki.ca.cert_file.read_bytes())
    second = tls.credentials()
    assert second is not first
    pki.ca.cert_file.write_text("garbage")  # a broken file keeps the last good credentials
    assert tls.credentials() is second
    with pytest.raises(InvalidArgumentError, match=r"^tls_ca_file: "):
        ClientTls(ca_file=str(pki.ca.cert_file)).credentials()


class Counting(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        self.calls.append(handler_call_details.method)
        return await continuation(handler_call_details)


class Tagging(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        self.methods.append(client_call_details.method)
        return await continuation(client_call_details, request)


async def test_interceptors_are_passed_through_on_both_sides(pki: Pki) -> None:
    counting = Counting()
    srv = await serve(
        ServerTls(str(pki.server.cert_file), str(pki.server.key_file)), interceptors=[counting]
    )
    tagging = Tagging()
    try:
        tls = ClientTls(ca_file=str(pki.ca.cert_file))
        async with open_channel(address(srv), tls, interceptors=[tagging]) as channel:
            await health(channel)
    finally:
        await srv.stop(0)
    assert counting.calls == ["/grpc.health.v1.Health/Check"]
    assert tagging.methods in (["/grpc.health.v1.Health/Check"], [b"/grpc.health.v1.Health/Check"])


def test_the_tls_of_a_services_settings(pki: Pki) -> None:
    assert server_tls_from(SecuritySettings()) is None
    assert client_tls_from(SecuritySettings()) is None
    assert server_tls_from(object()) is None
    s = SecuritySettings(
        tls_cert_file="c.pem",
        tls_key_file="k.pem",
        tls_ca_file="ca.pem",
        tls_client_auth="require",
        tls_server_name="apogee.internal",
    )
    assert server_tls_from(s) == ServerTls("c.pem", "k.pem", "ca.pem", "require")
    client = client_tls_from(s)
    assert client == ClientTls("ca.pem", "c.pem", "k.pem", "apogee.internal")
    assert client is not None
    assert client.channel_options() == [("grpc.ssl_target_name_override", "apogee.internal")]


async def test_the_probe_over_tls(
    pki: Pki, tls_server: GrpcServer, capsys: pytest.CaptureFixture[str]
) -> None:
    addr = address(tls_server)
    ca = str(pki.ca.cert_file)
    assert await asyncio.to_thread(probe.main, [addr, "--tls-ca", ca], {}) == 0
    assert capsys.readouterr().out == f"{addr} (overall): SERVING\n"
    env = {"APOGEE_PROBE_TLS_CA": ca, "APOGEE_PROBE_TLS_SERVER_NAME": "localhost"}
    assert await asyncio.to_thread(probe.main, [addr, "apogee.test.Process"], env) == 0
    assert capsys.readouterr().out == f"{addr} apogee.test.Process: SERVING\n"
    # plaintext against a TLS port, or the wrong CA: status 1, saying so
    assert await asyncio.to_thread(probe.main, [addr, "--timeout", "2"], {}) == 1
    assert capsys.readouterr().out == f"{addr} (overall): UNAVAILABLE\n"
    other = str(pki.other_ca.cert_file)
    assert await asyncio.to_thread(probe.main, [addr, "--timeout", "2", "--tls-ca", other], {}) == 1
    capsys.readouterr()
    # files that cannot be used: status 2, naming the setting
    assert await asyncio.to_thread(probe.main, [addr, "--tls-cert", ca], {}) == 2
    assert "tls_key_file" in capsys.readouterr().err


async def test_the_probe_with_a_client_certificate(
    pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    srv = await serve(
        ServerTls(
            str(pki.server.cert_file),
            str(pki.server.key_file),
            ca_file=str(pki.ca.cert_file),
            client_auth="require",
        )
    )
    try:
        addr = address(srv)
        env = {
            "APOGEE_PROBE_TLS_CA": str(pki.ca.cert_file),
            "APOGEE_PROBE_TLS_CERT": str(pki.client.cert_file),
            "APOGEE_PROBE_TLS_KEY": str(pki.client.key_file),
        }
        assert await asyncio.to_thread(probe.main, [addr], env) == 0
        bare = {"APOGEE_PROBE_TLS_CA": str(pki.ca.cert_file)}
        assert await asyncio.to_thread(probe.main, [addr, "--timeout", "2"], bare) == 1
    finally:
        await srv.stop(0)
    capsys.readouterr()


@dataclass(frozen=True, slots=True)
class LeaderTlsSettings(LeaderServiceSettings, SecuritySettings):
    namesrv: str = "127.0.0.1:9876"
    listen: str = "127.0.0.1:0"
    metrics_listen: str = "127.0.0.1:0"
    lock_file: Path = Path("demo.lock")
    lock_poll_s: float = 0.05
    broker_refresh_s: float = 1.0
    rpc_timeout_s: float = 1.0
    shutdown_grace_s: float = 1.0
    log_level: str = "INFO"


class Idle:
    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class LeaderTlsApp(LeaderApp[LeaderTlsSettings, Idle]):
    name = "demo"
    title = "the demo service"
    process_health = "apogee.demo.Process"

    def _new_work(self) -> Idle:
        return Idle()

    def _log_active(self, work: Idle) -> None:
        pass

    def _log_stopped(self) -> None:
        pass


async def test_a_leader_elected_service_serves_health_and_metrics_over_tls(pki: Pki) -> None:
    settings = LeaderTlsSettings(
        lock_file=pki.root / "demo.lock",
        tls_cert_file=str(pki.server.cert_file),
        tls_key_file=str(pki.server.key_file),
        tls_ca_file=str(pki.ca.cert_file),
    )
    app = LeaderTlsApp(settings)
    await app.start()
    try:
        addr = f"127.0.0.1:{app.port}"
        tls = ClientTls(ca_file=str(pki.ca.cert_file))
        await asyncio.wait_for(app.wait_active(), DEADLINE_S)
        assert await check_health(addr, 5, tls=tls)
        assert not await check_health(addr, 2)
        assert app.metrics_server is not None
        got = await asyncio.to_thread(
            scrape, app.metrics_server.address, 5.0, str(pki.ca.cert_file)
        )
        assert got.names()
    finally:
        await app.stop()
