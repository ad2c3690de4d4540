"""The metrics endpoint over HTTPS (:class:`apogee.service.metrics.MetricsServer` with a
certificate): scraped with the CA, refused to plaintext and to clients trusting another CA,
client certificates when required, certificates rotated while it runs, unusable files refused at
the start naming the setting. (Here rather than beside apogee.common.metrics because the
certificate helper, :mod:`apogee.testkit.tls`, lives in this package.)"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import Counter

from apogee.common.errors import InvalidArgumentError
from apogee.common.metrics import scrape
from apogee.service import metrics as metrics_mod
from apogee.service.metrics import MetricsServer, new_registry, start_metrics
from apogee.testkit.tls import Issued, TestCa, replace_files
from apogee.testkit.waiting import wait_until

pytestmark = pytest.mark.integration

DEADLINE_S = 10.0


@pytest.fixture
def ca(tmp_path: Path) -> TestCa:
    return TestCa.create(tmp_path / "ca")


@pytest.fixture
def cert(ca: TestCa, tmp_path: Path) -> Issued:
    return ca.issue("metrics", tmp_path / "server")


@pytest.fixture
def https(cert: Issued, monkeypatch: pytest.MonkeyPatch) -> Iterator[MetricsServer]:
    monkeypatch.setattr(metrics_mod, "TLS_CHECK_INTERVAL_S", 0.0)  # look at every connection
    registry = new_registry()
    Counter("apogee_test_things", "Things.", registry=registry).inc(2)
    server = start_metrics(
        "127.0.0.1:0", registry, "test", cert_file=str(cert.cert_file), key_file=str(cert.key_file)
    )
    assert server is not None
    try:
        yield server
    finally:
        server.stop_now()


def peer_serial(port: int, ca_file: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(ca_file))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
        ctx.wrap_socket(sock, server_hostname="localhost") as conn,
    ):
        cert = conn.getpeercert()
    assert cert is not None
    return int(str(cert["serialNumber"]), 16)


def test_https_scrape_with_the_ca_works_and_plaintext_does_not(
    https: MetricsServer, ca: TestCa, tmp_path: Path
) -> None:
    got = scrape(https.address, ca_file=str(ca.cert_file))
    assert got.get_sample("apogee_test_things_total") == 2
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
        scrape(https.address, timeout=2)
    other = TestCa.create(tmp_path / "other", "Another CA")
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        scrape(https.address, ca_file=str(other.cert_file))
    # the endpoint still serves after the failed handshakes
    assert scrape(https.address, ca_file=str(ca.cert_file)).get_sample("apogee_test_things_total")


def test_a_stalled_handshake_holds_up_no_other_scrape(https: MetricsServer, ca: TestCa) -> None:
    with socket.create_connection(("127.0.0.1", https.port), timeout=5):
        # connected, never says hello: the next scrape is served all the same
        assert scrape(https.address, ca_file=str(ca.cert_file), timeout=5)


def test_a_rotated_certificate_is_served_to_new_connections(
    https: MetricsServer, ca: TestCa, cert: Issued, tmp_path: Path
) -> None:
    assert peer_serial(https.port, ca.cert_file) == cert.serial
    renewed = ca.issue("metrics-renewed", tmp_path / "renewed")
    replace_files(cert, renewed)
    wait_until(
        lambda: peer_serial(https.port, ca.cert_file) == renewed.serial,
        DEADLINE_S,
        "the renewed certificate served",
    )
    assert https.tls is not None
    assert https.tls.reloads >= 1
    # a half-written certificate keeps the current one
    text = cert.cert_file.read_bytes()
    cert.cert_file.write_bytes(text[: len(text) // 3])
    for _ in range(3):
        assert peer_serial(https.port, ca.cert_file) == renewed.serial
    assert scrape(https.address, ca_file=str(ca.cert_file)).get_sample("apogee_test_things_total")


def test_required_client_certificates(ca: TestCa, cert: Issued, tmp_path: Path) -> None:
    client = ca.issue("scraper", tmp_path / "client", hosts=(), client=True)
    server = start_metrics(
        "127.0.0.1:0",
        new_registry(),
        "test",
        cert_file=str(cert.cert_file),
        key_file=str(cert.key_file),
        ca_file=str(ca.cert_file),
        client_auth="require",
    )
    assert server is not None
    try:
        with pytest.raises((urllib.error.URLError, OSError)):
            scrape(server.address, ca_file=str(ca.cert_file), timeout=2)
        ctx = ssl.create_default_context(cafile=str(ca.cert_file))
        ctx.load_cert_chain(str(client.cert_file), str(client.key_file))
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=5)
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200
            assert b"process_" in resp.read()
        finally:
            conn.close()
    finally:
        server.stop_now()


def test_unusable_files_fail_the_start_naming_the_setting(
    cert: Issued, ca: TestCa, tmp_path: Path
) -> None:
    for kwargs, field in [
        ({"cert_file": str(tmp_path / "no.crt"), "key_file": str(cert.key_file)}, "tls_cert_file"),
        ({"cert_file": str(cert.cert_file), "key_file": str(cert.cert_file)}, "tls_key_file"),
        (
            {"cert_file": str(cert.cert_file), "key_file": str(cert.key_file), "client_auth": "x"},
            "tls_client_auth",
        ),
        (
            {
                "cert_file": str(cert.cert_file),
                "key_file": str(cert.key_file),
                "client_auth": "require",
            },
            "tls_ca_file",
        ),
    ]:
        server = MetricsServer("127.0.0.1:0", new_registry(), "test", **kwargs)
        with pytest.raises(InvalidArgumentError, match=f"^{field}: "):
            server.start()
        assert server.port == 0


async def test_stop_is_bounded_over_tls(https: MetricsServer) -> None:
    began = time.monotonic()
    await https.stop()
    assert time.monotonic() - began < metrics_mod.STOP_TIMEOUT_S + 1
