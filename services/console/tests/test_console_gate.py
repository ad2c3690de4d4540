"""The console's gate (:mod:`apogee_console.gate`) against ``python -m apogee_console`` as a real
process, with no cluster behind it (every refusal here comes before the cluster is called):

- a hostile client: 20 concurrent 200 MB POSTs without a login and 20 with an admin's login
  and CSRF token (half declared by Content-Length, half chunked) are each refused (401, 413)
  after a few megabytes, and the console's peak RSS stays within 50 MB of its idle RSS;
- body caps: 64 KiB for everything but ``POST /api/v1/messages``, which takes a 4 MiB message
  in base64; 413 problem+json naming the cap, also for clients that send the whole body before
  they read the answer;
- allowed hosts: a foreign Host gets 421 and no CSRF token, an action from a foreign Origin 403,
  the loopback names, the configured names and a wildcard's subdomains pass, the probes answer
  any host.

The parsing of ``allowed_hosts`` is unit-tested at the end.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_support import assert_problem
from starlette.responses import PlainTextResponse
from starlette.types import Message, Receive, Scope, Send

from apogee.client.producer.validation import MAX_MESSAGE_SIZE, MAX_PROPERTIES_SIZE
from apogee.common.errors import InvalidArgumentError
from apogee.common.metrics import Samples, scrape
from apogee.testkit.ports import free_port
from apogee.testkit.processes import ServiceProcess
from apogee.testkit.waiting import eventually, wait_until
from apogee_console import gate
from apogee_console.api.state import Console as ConsoleState
from apogee_console.core.access import users_entry
from apogee_console.core.hosts import AllowedHosts, check_allowed_hosts, host_of
from apogee_console.gate import BODY_CAP, MESSAGE_BODY_CAP
from apogee_console.settings import load_settings

MB = 1_000_000
MiB = 1024 * 1024
#: The hostile client: this many requests of each kind at once, each of this many bytes.
FLOOD = 20
FLOOD_BYTES = 200 * MB
#: How far above its idle RSS the console may go while refusing them.
RSS_HEADROOM = 50 * MB
#: What a refused request may have pushed before its answer came: the cap, and the sockets'
#: buffers on both sides.
SENT_BEFORE_ANSWER = 32 * MB
PIECE = b"x" * 65536
PASSWORD = "gate-password-1"
FOREIGN = "attacker.rebind.test"
METRICS_LOGGED = re.compile(r"console serving /metrics on (127\.0\.0\.1:\d+)")


# -- a console process, and a client that reads the answer while it sends -------------------------


@dataclass
class Console:
    proc: ServiceProcess
    port: int
    metrics: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self, field: str) -> int:
        """A byte count of /proc/<pid>/status (VmRSS, VmHWM)."""
        text = Path(f"/proc/{self.proc.proc.pid}/status").read_text()
        m = re.search(rf"^{field}:\s+(\d+) kB$", text, re.MULTILINE)
        assert m is not None, text
        return int(m.group(1)) * 1024

    def reset_peak(self) -> None:
        """Start VmHWM (the peak RSS) again from the RSS of now."""
        Path(f"/proc/{self.proc.proc.pid}/clear_refs").write_text("5")

    async def refusals(self) -> Samples:
        return await asyncio.to_thread(scrape, self.metrics)


@contextmanager
def console_process(
    folder: Path, *args: str, env: Mapping[str, str] | None = None
) -> Iterator[Console]:
    """``python -m apogee_console`` on a free port of 127.0.0.1 for a nameserver that is not
    there; stopped however the test ends."""
    port = free_port()
    proc = ServiceProcess(
        "apogee_console",
        ["--listen", f"127.0.0.1:{port}", "--namesrv", "127.0.0.1:1", *args],
        folder / "console.log",
        {"APOGEE_CONSOLE_REQUEST_TIMEOUT_S": "0.5", **(env or {})},
    )
    try:

        def serving() -> bool:
            assert proc.proc.poll() is None, f"the console exited:\n{proc.output()}"
            return METRICS_LOGGED.search(proc.output()) is not None

        wait_until(serving, 30, "the console serving", every=0.05, detail=proc.output)
        match = METRICS_LOGGED.search(proc.output())
        assert match is not None
        yield Console(proc, port, match.group(1))
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def open_console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    """An open console (no login) that answers the loopback names, ``console.example.com``
    and the subdomains of ``apogee.test``."""
    args = ("--allowed-hosts", "console.example.com, *.apogee.test")
    with console_process(tmp_path_factory.mktemp("open-console"), *args) as console:
        yield console


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    #: body bytes sent when the answer had come
    sent: int

    def problem(self) -> dict[str, Any]:
        assert self.headers["content-type"] == "application/problem+json", self
        problem: dict[str, Any] = json.loads(self.body)
        assert problem["status"] == self.status
        return problem


def pieces(size: int) -> Iterator[bytes]:
    """``size`` bytes, a piece at a time (never held at once)."""
    for start in range(0, size, len(PIECE)):
        yield PIECE[: size - start]


async def post(
    port: int, path: str, size: int, *, chunked: bool, headers: Mapping[str, str] | None = None
) -> Answer:
    """POST ``size`` bytes to ``path`` on a connection of its own, read the answer while the
    body goes out, and stop sending once it has come (as curl does)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", framing]
    head += ["Content-Type: application/json", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    sent = 0

    async def push() -> None:
        nonlocal sent
        for piece in pieces(size):
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
            sent += len(piece)
        if chunked:
            writer.write(b"0\r\n\r\n")

    pusher = asyncio.create_task(push())
    try:
        async with asyncio.timeout(60):
            status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
            done_at = sent
            fields = dict(line.split(": ", 1) for line in lines if line)
            got = {k.lower(): v for k, v in fields.items()}
            body = await reader.readexactly(int(got.get("content-length", "0")))
    finally:
        pusher.cancel()
        with suppress(asyncio.CancelledError, ConnectionError):
            await pusher
        writer.close()
        with suppress(ConnectionError):
            await writer.wait_closed()
    return Answer(int(status_line.split()[1]), got, body, done_at)


def refused(samples: Samples, reason: str) -> float:
    return samples.get_sample("apogee_console_refusals_total", reason=reason) or 0.0


# -- a hostile client ------------------------------------------------------------------------------


@pytest.mark.integration
async def test_concurrent_200_mb_posts_with_and_without_a_login_are_refused_and_rss_stays_flat(
    tmp_path: Path,
) -> None:
    users = tmp_path / "console-users.toml"
    users.write_text(users_entry("ada", PASSWORD, "admin"))
    users.chmod(0o600)
    env = {"APOGEE_CONSOLE_CONSOLE_USERS_FILE": str(users)}
    with console_process(tmp_path, env=env) as console:
        async with httpx.AsyncClient(base_url=console.url) as client:
            login = await client.post("/api/v1/session", json={"user": "ada", "password": PASSWORD})
            assert login.status_code == 200, login.text
            admin = {
                "Cookie": f"apogee_session={login.cookies['apogee_session']}",
                "X-CSRF-Token": login.json()["csrf"],
            }
            idle = console.status("VmRSS")
            console.reset_peak()
            answers = await asyncio.gather(
                *(
                    post(
                        console.port, "/api/v1/messages", FLOOD_BYTES, chunked=i % 2 == 1, headers=h
                    )
                    for h in ({}, admin)
                    for i in range(FLOOD)
                )
            )
            peak = console.status("VmHWM")
            assert [a.status for a in answers] == [401] * FLOOD + [413] * FLOOD
            assert max(a.sent for a in answers) < SENT_BEFORE_ANSWER, [a.sent for a in answers]
            assert peak - idle < RSS_HEADROOM, f"idle {idle / MB:.0f} MB, peak {peak / MB:.0f} MB"
            assert answers[0].problem()["kind"] == "UNAUTHENTICATED"
            too_large = answers[-1].problem()
            assert too_large["kind"] == "CONTENT_TOO_LARGE"
            assert too_large["limit"] == MESSAGE_BODY_CAP
            assert f"at most {MESSAGE_BODY_CAP} bytes (6 MiB)" in too_large["detail"]
            samples = await console.refusals()
            assert refused(samples, "unauthenticated") == FLOOD
            assert refused(samples, "too_large") == FLOOD
            # and the console goes on serving its users
            assert (await client.get("/api/v1/session", headers=admin)).status_code == 200


# -- body caps -------------------------------------------------------------------------------------


@pytest.mark.integration
async def test_bodies_are_capped_at_what_each_route_takes(open_console: Console) -> None:
    console = open_console
    before = refused(await console.refusals(), "too_large")
    async with httpx.AsyncClient(base_url=console.url, timeout=30) as client:
        login = await client.post("/api/v1/session", content=b" " * (BODY_CAP + 1), headers=_json())
        problem = assert_problem(login, 413, "CONTENT_TOO_LARGE")
        assert problem["limit"] == BODY_CAP == 64 * 1024
        assert "POST /api/v1/session takes at most 65536 bytes (64 KiB)" in problem["detail"]

        async def chunked(size: int) -> AsyncIterator[bytes]:
            for piece in pieces(size):
                yield piece

        h = {**_json(), "X-CSRF-Token": (await client.get("/api/v1/session")).json()["csrf"]}
        topic = await client.post("/api/v1/topics", content=chunked(100 * 1024), headers=h)
        assert_problem(topic, 413, "CONTENT_TOO_LARGE")

        # a 4 MiB message, base64 in JSON, passes (and fails only for want of a cluster)
        body = base64.b64encode(bytes(range(256)) * (MAX_MESSAGE_SIZE // 256)).decode()
        message = {"topic": "T", "body": body, "encoding": "base64"}
        sent = await client.post("/api/v1/messages", json=message, headers=h)
        assert_problem(sent, 503, "UNAVAILABLE")
        # 7 MB is refused, also to a client that sends it all before it reads the answer
        for content in (b" " * (7 * MB), chunked(7 * MB)):
            big = await client.post("/api/v1/messages", content=content, headers=h)
            assert assert_problem(big, 413, "CONTENT_TOO_LARGE")["limit"] == MESSAGE_BODY_CAP
        assert refused(await console.refusals(), "too_large") - before == 4


def _json() -> dict[str, str]:
    return {"Content-Type": "application/json"}


@pytest.mark.unit
def test_the_message_cap_holds_the_largest_message_the_console_sends() -> None:
    payload = bytes(range(256)) * (MAX_MESSAGE_SIZE // 256)
    largest = {
        "topic": "T" * 127,
        "body": base64.b64encode(payload).decode(),
        "encoding": "base64",
        "tags": "t" * 128,
        "keys": ["k" * 128] * 8,
        "properties": {"p": "v" * MAX_PROPERTIES_SIZE},
    }
    assert len(json.dumps(largest)) <= MESSAGE_BODY_CAP


# -- allowed hosts ---------------------------------------------------------------------------------


@pytest.mark.integration
async def test_the_open_console_answers_its_own_names_only(open_console: Console) -> None:
    """A DNS-rebinding page reaches the console under its own name: 421, no CSRF token."""
    console, port = open_console, open_console.port
    before = await console.refusals()
    async with httpx.AsyncClient(base_url=console.url) as client:
        rebound = {"Host": f"{FOREIGN}:{port}"}
        page = await client.get("/api/v1/session", headers=rebound)
        problem = assert_problem(page, 421, "HOST_NOT_ALLOWED")
        assert "csrf" not in page.json()
        assert problem["detail"] == (
            f"host '{FOREIGN}:{port}': the console does not answer to this name; if it is "
            "reached by it, add it to allowed_hosts (APOGEE_CONSOLE_ALLOWED_HOSTS or "
            "--allowed-hosts; in the Helm chart console.allowedHosts)"
        )
        for path in ("/", "/ui/topics", "/static/js/app.js", "/api/v1/topics"):
            assert (await client.get(path, headers=rebound)).status_code == 421, path
        csrf = (await client.get("/api/v1/session")).json()["csrf"]
        action = {"X-CSRF-Token": csrf, "Origin": f"http://{FOREIGN}:{port}"}
        made = await client.post(
            "/api/v1/topics", json={"name": "Rebound"}, headers={**action, **rebound}
        )
        assert_problem(made, 421, "HOST_NOT_ALLOWED")
        # the right host, but sent by a foreign page: 403
        made = await client.post("/api/v1/topics", json={"name": "Rebound"}, headers=action)
        problem = assert_problem(made, 403, "ORIGIN_NOT_ALLOWED")
        assert f"origin 'http://{FOREIGN}:{port}'" in problem["detail"]
        assert "allowed_hosts" in problem["detail"]

        for host in (
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            f"[::1]:{port}",
            "console.example.com",
            "Console.Example.COM.:443",
            "ops.apogee.test",
            "a.b.apogee.test:8080",
        ):
            page = await client.get("/api/v1/session", headers={"Host": host})
            assert page.status_code == 200, (host, page.text)
            assert page.json()["csrf"] == csrf
        for host in (
            "apogee.test",
            "console.example.com.evil.test",
            "localhost.evil.test",
            "[::2]",
        ):
            page = await client.get("/api/v1/session", headers={"Host": host})
            assert_problem(page, 421, "HOST_NOT_ALLOWED")
        # an action from the console's own page, and one with no Origin (a script), pass
        # the gate (and fail only for want of a cluster)
        for origin in ({"Origin": f"http://localhost:{port}"}, {}):
            made = await client.post(
                "/api/v1/topics",
                json={"name": "Mine"},
                headers={"X-CSRF-Token": csrf, **origin},
            )
            assert_problem(made, 503, "UNAVAILABLE")

        # kubelet probes by the pod's IP
        assert (await client.get("/healthz", headers=rebound)).text == "ok"
        assert (await client.get("/readyz", headers=rebound)).status_code == 503
        after = await console.refusals()
        assert refused(after, "host") - refused(before, "host") == 1 + 4 + 1 + 4
        assert refused(after, "origin") - refused(before, "origin") == 1


@pytest.mark.unit
def test_allowed_hosts_entries() -> None:
    hosts = AllowedHosts.of("Console.Example.com., *.apogee.test, 10.0.0.5:8080, fd00::5", "")
    allowed = ["localhost", "127.0.0.1", "[::1]", "console.example.com", "x.apogee.test"]
    allowed += ["10.0.0.5", "[fd00::5]", "[fd00:0::5]"]
    for host in allowed:
        assert hosts.allows(host_of(host)), host
    for host in ("apogee.test", "xapogee.test", "10.0.0.6", "[::2]", "evil.test"):
        assert not hosts.allows(host_of(host)), host
    assert not hosts.allows(None)
    assert hosts.allows_origin("https://x.apogee.test:8443")
    for origin in ("null", "http://evil.test", "file://", "ftp://console.example.com"):
        assert not hosts.allows_origin(origin), origin

    # the host of listen when it is one address, never 0.0.0.0 or ::
    assert AllowedHosts.of("", "192.168.1.5:8080").allows("192.168.1.5")
    assert AllowedHosts.of("", "[fd00::7]:8080").allows("[fd00::7]")
    assert AllowedHosts.of("", "0.0.0.0:8080").names == AllowedHosts.of("", "[::]:8080").names
    assert AllowedHosts.of("*", "").allows(host_of("anything.at.all"))


@pytest.mark.unit
@pytest.mark.parametrize(
    "header", ["", "a b", "host:port", "[::1", "[::1]x", "user@host", "http://h", "::1"]
)
def test_a_host_header_that_names_no_host(header: str) -> None:
    assert host_of(header) is None


@pytest.mark.unit
@pytest.mark.parametrize("value", ["https://console.example.com", "a b", "*example.com", "**"])
def test_a_bad_allowed_hosts_says_which_entry_and_the_rule(value: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        check_allowed_hosts(f"localhost,{value}")
    assert "allowed_hosts" in str(err.value)
    assert repr(value) in str(err.value)
    assert "*.<domain>" in str(err.value)
    with pytest.raises(InvalidArgumentError, match="allowed_hosts"):
        load_settings(env={"APOGEE_CONSOLE_ALLOWED_HOSTS": value})


@pytest.mark.unit
async def test_large_bodies_take_turns_and_one_that_waits_too_long_gets_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two clients that stop sending hold both turns: a third large body waits, then gets 503;
    once they are gone, the next one is read."""
    monkeypatch.setattr(gate, "LARGE_BODY_WAIT_S", 0.2)
    console = ConsoleState(load_settings(env={}, metrics_listen=""))
    read: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        read.append(len((await receive())["body"]))
        await PlainTextResponse("sent")(scope, receive, send)

    door = gate.Gate(app, console)
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/messages",
        "headers": [(b"host", b"localhost"), (b"transfer-encoding", b"chunked")],
    }
    never = asyncio.Event()

    async def stalls() -> Message:
        await never.wait()
        return {"type": "http.disconnect"}

    def sends(into: list[Message]) -> Send:
        async def send(message: Message) -> None:
            into.append(message)

        return send

    stalled = [asyncio.create_task(door(scope, stalls, sends([]))) for _ in range(2)]
    await eventually(door.large.locked, 5, "both turns taken")
    answer: list[Message] = []
    body = [{"type": "http.request", "body": b"{" * (BODY_CAP + 1), "more_body": False}]

    async def once() -> Message:
        return body.pop() if body else {"type": "http.disconnect"}

    await door(scope, once, sends(answer))
    assert answer[0]["status"] == 503
    assert b"waited 0.2 s for its turn; try again" in answer[1]["body"]
    assert (b"retry-after", b"1") in answer[0]["headers"]
    assert read == []
    for task in stalled:
        task.cancel()
    await asyncio.gather(*stalled, return_exceptions=True)
    body.append({"type": "http.request", "body": b"{" * (BODY_CAP + 1), "more_body": False})
    answer.clear()
    await door(scope, once, sends(answer))
    assert answer[0]["status"] == 200
    assert read == [BODY_CAP + 1]
    busy = {"reason": "busy"}
    assert console.metrics.registry.get_sample_value("apogee_console_refusals_total", busy) == 1
