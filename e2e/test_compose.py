"""docker-compose.yml under ``podman-compose``, with the images built once for the session: one
stack for the module (profile ``monitoring`` included), under a project name, published ports
and a /24 network of its own, taken down with its volumes at the end whatever happened.

- Every service passes its health check; both brokers register, advertising the compose
  network's gateway and their published ports.
- A client on this machine (through the published ports) and a client in a container on the
  compose network (through ``nameserver:9876``) each send 10,000 messages and consume them all.
- A delayed message (delay level 1) arrives no earlier than a second later, through the schedule
  service; a transaction left undecided by its producer is checked back by the txn-checker
  (rounds every second here) and delivered once the producer says COMMIT.
- ``podman kill`` (SIGKILL) of broker-a while a producer keeps sending, then its restart: every
  message acknowledged before, during and after is consumed; its store says it recovered from a
  crash.
- The web console serves its pages and answers ready (a nameserver answers) on its published
  port, on 127.0.0.1 only.
- Prometheus scrapes every service.
- ``down -v`` leaves no container, volume or network of the project behind.

``docker-compose.secure.yml`` (TLS and authentication), without starting containers: its merged
configuration sets every Apogee service's TLS and auth settings and its probe's TLS;
``compose/secure/make-certs.sh`` writes the certificates, users, credentials and the console's
users it mounts; a nameserver and a broker run as processes with the environment compose gives
them (the mounted files where the script wrote them) pass their health checks over TLS, register
over TLS with signed calls, and serve a client that has the script's client credentials; and the
console, run so beside a nameserver, passes its health check over HTTPS, is ready, and lets the
script's console users and access keys log in, no one else.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from apogee.client import (
    AdminClient,
    Message,
    Producer,
    PullConsumer,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.codec import PROP_CHECK_IMMUNITY
from apogee.common.auth.users import Credentials, Users
from apogee.common.errors import ApogeeError
from apogee.common.settings import load
from apogee.local import processes
from apogee.rpc.security import ClientSecurity
from apogee_broker.settings import BrokerSettings
from apogee_console.core.access import parse_users
from apogee_console.settings import ConsoleSettings
from apogee_nameserver.settings import NameServerSettings
from apogee_schedule.settings import ScheduleSettings
from apogee_txn_checker.settings import TxnCheckerSettings
from e2e.compose_client import round_trip
from e2e.containers import (
    ROOT,
    ComposeStack,
    dockerfile_stages,
    free_port,
    inspect,
    podman,
    run,
    wait_for,
    wait_healthy,
    wait_scraped,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

SERVICES = ("nameserver", "broker-a", "broker-b", "schedule", "txn-checker", "console")
COUNT = 10_000
#: seconds to wait for deliveries and consumption
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def stack(images: float) -> Iterator[ComposeStack]:
    s = ComposeStack(
        profiles=["monitoring"], extra_env={"APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1"}
    )
    s.ports["CONSOLE"] = free_port()
    try:
        s.up()
        for service in SERVICES:
            wait_healthy(s.container(service))
        wait_for("both brokers registered", lambda: len(asyncio.run(_brokers(s))) == 2, 60)
        yield s
    finally:
        s.down()


async def _brokers(s: ComposeStack) -> dict[str, str]:
    async with AdminClient(s.namesrv) as admin:
        try:
            return {b.broker_name: b.address for b in await admin.cluster_info()}
        except ApogeeError:
            return {}


async def test_brokers_advertise_the_gateway_and_their_published_ports(
    stack: ComposeStack,
) -> None:
    assert await _brokers(stack) == {
        "broker-a": f"{stack.gateway}:{stack.ports['BROKER_A']}",
        "broker-b": f"{stack.gateway}:{stack.ports['BROKER_B']}",
    }


async def test_a_client_on_the_host_sends_and_consumes_10000_messages(
    stack: ComposeStack,
) -> None:
    summary = await round_trip(stack.namesrv, "ComposeFromHost", "compose-host", COUNT)
    assert summary["sent"] == COUNT
    assert summary["missing"] == 0, summary
    assert summary["brokers"] == ["broker-a", "broker-b"]


def test_a_client_on_the_compose_network_sends_and_consumes_10000_messages(
    stack: ComposeStack,
) -> None:
    """The client runs in the broker's image (the SDK's source mounted read-only: the image
    holds everything else it needs), as any container of the compose network would."""
    out = podman(
        "run",
        "--rm",
        "--network",
        stack.network,
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--cap-drop=ALL",
        "-e",
        "PYTHONPATH=/opt/client",
        "-v",
        f"{ROOT / 'libs/apogee-client/src'}:/opt/client:ro",
        "-v",
        f"{ROOT / 'e2e/compose_client.py'}:/opt/compose_client.py:ro",
        "--entrypoint",
        "python",
        "apogee/broker:dev",
        "/opt/compose_client.py",
        "nameserver:9876",
        "ComposeFromNetwork",
        "compose-net",
        str(COUNT),
        timeout=300,
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["sent"] == COUNT
    assert summary["missing"] == 0, summary
    assert summary["brokers"] == ["broker-a", "broker-b"]


async def test_a_delayed_and_a_transactional_message_are_delivered(stack: ComposeStack) -> None:
    topic = "ComposeSpecial"
    async with AdminClient(stack.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=2)
    checks: list[str] = []

    async def commit_when_asked(m: TransactionCheckMessage) -> TransactionDecision:
        checks.append(m.transaction_id)
        return TransactionDecision.COMMIT

    got: dict[bytes, float] = {}
    async with (
        PullConsumer(
            stack.namesrv, "compose-special", consume_from="earliest", rebalance_interval=1.0
        ) as consumer,
        Producer(stack.namesrv, group="compose-delays") as producer,
        TransactionProducer(stack.namesrv, "compose-txn", check_listener=commit_when_asked) as txn,
    ):
        consumer.subscribe(topic)
        await consumer.start()
        sent_at = time.time()
        await producer.send(Message(topic, b"delayed", delay_level=1))
        await txn.send_in_transaction(
            Message(topic, b"committed"), deciding(TransactionDecision.COMMIT)
        )
        undecided = Message(topic, b"checked", properties={PROP_CHECK_IMMUNITY: "1"})
        await txn.send_in_transaction(undecided, deciding(TransactionDecision.UNKNOWN))
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < 3 and time.monotonic() < deadline:
            for m in await consumer.poll(timeout=1.0):
                got.setdefault(m.body, time.time())
    assert set(got) == {b"delayed", b"committed", b"checked"}, got
    assert got[b"delayed"] - sent_at >= 0.9
    assert checks, "the txn-checker never asked the producer"


def deciding(
    decision: TransactionDecision,
) -> Callable[[TransactionMessage, object], Awaitable[TransactionDecision]]:
    async def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        return decision

    return executor


async def test_a_broker_killed_and_restarted_loses_no_acknowledged_message(
    stack: ComposeStack,
) -> None:
    topic = "ComposeKill"
    broker = stack.container("broker-a")
    async with AdminClient(stack.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=4)
    acked: set[str] = set()
    on_a = 0
    restarted = asyncio.Event()
    async with Producer(stack.namesrv, group="compose-kill", send_timeout=15.0) as producer:
        before = await asyncio.gather(
            *(producer.send_nowait(Message(topic, f"before-{i}".encode())) for i in range(2000))
        )
        acked.update(r.message_id for r in before)
        on_a = sum(r.broker_name == "broker-a" for r in before)

        async def keep_sending() -> None:
            i = 0
            while not restarted.is_set():
                try:
                    r = await producer.send(Message(topic, f"during-{i}".encode()))
                except ApogeeError:
                    pass  # not acknowledged: no promise made
                else:
                    acked.add(r.message_id)
                i += 1
                await asyncio.sleep(0.005)  # a steady trickle, not a flood

        sender = asyncio.create_task(keep_sending())
        await asyncio.to_thread(podman, "kill", "--signal", "KILL", broker)
        assert inspect(broker)["State"]["Running"] is False
        # podman counts a kill as the user's stop: the restart policy leaves it, an operator
        # (here the test) starts it again on the same volume
        await asyncio.to_thread(podman, "start", broker)
        await asyncio.to_thread(wait_healthy, broker)
        restarted.set()
        await sender
        after = await asyncio.gather(
            *(producer.send_nowait(Message(topic, f"after-{i}".encode())) for i in range(500))
        )
        acked.update(r.message_id for r in after)
    assert on_a > 0
    async with AdminClient(stack.namesrv) as admin:
        recoveries = {r.broker_name: r for r in await admin.last_recoveries()}
    assert recoveries["broker-a"].clean is False, recoveries["broker-a"].summary
    seen: set[str] = set()
    async with PullConsumer(
        stack.namesrv, "compose-kill-readers", consume_from="earliest", rebalance_interval=1.0
    ) as consumer:
        consumer.subscribe(topic)
        await consumer.start()
        deadline = time.monotonic() + DEADLINE_S
        while not acked <= seen and time.monotonic() < deadline:
            seen.update(m.unique_id for m in await consumer.poll(timeout=1.0))
    assert len(acked - seen) == 0, f"{len(acked - seen)} of {len(acked)} acknowledged lost"


def test_the_console_serves_its_pages_on_this_machine_only(stack: ComposeStack) -> None:
    base = f"http://127.0.0.1:{stack.ports['CONSOLE']}"
    with urllib.request.urlopen(f"{base}/", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/html")
    wait_for("the console ready", lambda: _status(f"{base}/readyz") == 200, 60)
    cluster: dict[str, Any] = {}

    def every_broker_ok() -> bool:
        with urllib.request.urlopen(f"{base}/api/v1/cluster", timeout=10) as resp:
            cluster.update(json.load(resp))
        return all(b["ok"] for b in cluster["brokers"])

    # the test before restarts broker-a: the console's connection to it comes back within its
    # reconnect backoff (at most 2 s), so a refresh or two may still show it down
    try:
        wait_for("every broker ok on the console", every_broker_ok, 30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {cluster}") from None
    assert sorted(b["name"] for b in cluster["brokers"]) == ["broker-a", "broker-b"]
    # published on the loopback address only: it runs open (every visitor an admin)
    bindings = inspect(stack.container("console"))["HostConfig"]["PortBindings"]["8080/tcp"]
    assert [b["HostIp"] for b in bindings] == ["127.0.0.1"]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            status: int = resp.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_prometheus_scrapes_every_service(stack: ComposeStack) -> None:
    wait_scraped(stack.ports["PROMETHEUS"], set(SERVICES))


def test_down_removes_every_container_volume_and_the_network(stack: ComposeStack) -> None:
    assert stack.down() == []
    label = f"label=io.podman.compose.project={stack.project}"
    assert podman("ps", "-a", "-q", "--filter", label) == ""
    assert podman("volume", "ls", "-q", "--filter", label) == ""


# -- docker-compose.secure.yml: TLS and authentication, without containers ------------------

SECURE_OVERRIDE = "docker-compose.secure.yml"
MAKE_CERTS = ROOT / "compose" / "secure" / "make-certs.sh"
#: The Apogee services of docker-compose.yml: settings class, settings prefix, whether it
#: calls other services (and so signs with credentials of its own).
SECURED: dict[str, tuple[type[Any], str, bool]] = {
    "nameserver": (NameServerSettings, "nameserver", False),
    "broker-a": (BrokerSettings, "broker", True),
    "broker-b": (BrokerSettings, "broker", True),
    "schedule": (ScheduleSettings, "schedule", True),
    "txn-checker": (TxnCheckerSettings, "txn_checker", True),
}


def _compose_config(*files: str, **env: str) -> dict[str, Any]:
    """``podman-compose -f ... config`` (profile ``monitoring`` on): the merged configuration,
    with ``env`` as the variables compose substitutes."""
    args = [sys.executable, "-m", "podman_compose"]
    for f in files:
        args += ["-f", f]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    done = run([*args, "--profile", "monitoring", "config"], env={**clean, **env}, timeout=60)
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def _make_certs(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run(
        ["bash", str(MAKE_CERTS), *args, str(folder)],
        env={"PATH": os.environ["PATH"], **env},
        timeout=60,
        check=False,
    )


def test_the_secure_override_turns_tls_and_auth_on_for_every_service(tmp_path: Path) -> None:
    config = _compose_config("docker-compose.yml", SECURE_OVERRIDE, APOGEE_SECURE_DIR=str(tmp_path))
    services = config["services"]
    apogee = {
        name
        for name, s in services.items()
        if re.match(r"apogee/(nameserver|broker|schedule|txn-checker):", s["image"])
    }
    assert apogee == set(SECURED)
    for name, (cls, prefix, calls_services) in SECURED.items():
        s = services[name]
        env = s["environment"]
        own = f"APOGEE_{prefix.upper()}_"
        assert env[own + "TLS_CERT_FILE"] == "/etc/apogee/tls/tls.crt", name
        assert env[own + "TLS_KEY_FILE"] == "/etc/apogee/tls/tls.key", name
        assert env[own + "TLS_CA_FILE"] == "/etc/apogee/tls/ca.crt", name
        assert env[own + "TLS_CLIENT_AUTH"] == "none", name
        assert env[own + "AUTH_ENABLED"] == "true", name
        assert env[own + "AUTH_USERS_FILE"] == "/etc/apogee/auth/users.toml", name
        if calls_services:
            assert env[own + "AUTH_CREDENTIALS_FILE"] == "/etc/apogee/auth/credentials.toml"
        else:
            assert own + "AUTH_CREDENTIALS_FILE" not in env
        assert f"{tmp_path}/tls:/etc/apogee/tls:ro" in s["volumes"], name
        assert f"{tmp_path}/auth:/etc/apogee/auth:ro" in s["volumes"], name
        # the service's own settings take the environment, and its security check passes
        settings = load(cls, prefix, env={k: v for k, v in env.items() if k.startswith(own)})
        settings.check_security(calls_services=calls_services)
        # the health check is docker-compose.yml's; the environment gives it TLS
        assert s["healthcheck"]["test"][1:4] == ["python", "-m", "apogee.rpc.probe"], name
        assert env["APOGEE_PROBE_TLS_CA"] == "/etc/apogee/tls/ca.crt", name
        assert env["APOGEE_PROBE_TLS_CERT"] == "/etc/apogee/tls/tls.crt", name
        assert env["APOGEE_PROBE_TLS_KEY"] == "/etc/apogee/tls/tls.key", name
    prometheus = services["prometheus"]
    assert "--config.file=/etc/prometheus/secure.yml" in prometheus["command"]
    assert "./compose/secure/prometheus.yml:/etc/prometheus/secure.yml:ro" in prometheus["volumes"]
    assert f"{tmp_path}/tls:/etc/prometheus/tls:ro" in prometheus["volumes"]
    mutual = _compose_config(
        "docker-compose.yml", SECURE_OVERRIDE, APOGEE_TLS_CLIENT_AUTH="require"
    )["services"]
    for name, (_, prefix, _) in SECURED.items():
        assert mutual[name]["environment"][f"APOGEE_{prefix.upper()}_TLS_CLIENT_AUTH"] == "require"
    # docker-compose.yml alone stays plaintext and open
    plain = _compose_config("docker-compose.yml")["services"]
    for name in SECURED:
        assert not [k for k in plain[name]["environment"] if "TLS" in k or "_AUTH_" in k], name


def _scrapes(path: Path) -> dict[str, tuple[list[str], str]]:
    config = yaml.safe_load(path.read_text())
    return {
        job["job_name"]: (
            [t for sc in job["static_configs"] for t in sc["targets"]],
            job.get("scheme", "http"),
        )
        for job in config["scrape_configs"]
    }


def test_make_certs_writes_what_the_secure_override_mounts(tmp_path: Path) -> None:
    """A CA, the services' certificate (server and client) for every compose service,
    localhost, 127.0.0.1 and the advertised host, the users with random secret keys, the
    services' and a client's credentials; keys of the CA and the client private; no overwrite
    without --force. Prometheus's secure configuration scrapes the plain one's targets over
    https with those files."""
    out = tmp_path / "secure"
    done = _make_certs(out, APOGEE_NET_PREFIX="10.89.201")
    assert done.returncode == 0, done.stdout + done.stderr
    cert = x509.load_pem_x509_certificate((out / "tls" / "tls.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(san.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert {*SECURED, "console", "prometheus", "localhost"} <= dns
    assert {"127.0.0.1", "10.89.201.1"} <= ips
    usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages
    verify = run(
        [
            "openssl",
            "verify",
            "-CAfile",
            str(out / "tls" / "ca.crt"),
            str(out / "tls" / "tls.crt"),
            str(out / "client" / "client.crt"),
        ],
        timeout=30,
    )
    assert verify.stdout.count(": OK") == 2
    users = Users.load(out / "auth" / "users.toml")
    service = Credentials.load(out / "auth" / "credentials.toml")
    client = Credentials.load(out / "client" / "credentials.toml")
    service_user, admin = users.get(service.access_key), users.get(client.access_key)
    assert service_user is not None
    assert service_user.secret_key == service.secret_key
    assert service_user.service is True
    assert admin is not None
    assert admin.secret_key == client.secret_key
    assert admin.may_admin(write=True)
    assert admin.service is False
    for secret in (service.secret_key, client.secret_key):
        assert re.fullmatch(r"[0-9a-f]{48}", secret)
    assert service.secret_key != client.secret_key
    # the console's own users: the passwords of client/console-passwords.txt, as scrypt
    console_users = parse_users((out / "auth" / "console-users.toml").read_text(), "console")
    passwords = _console_passwords(out)
    assert {name: u.role for name, u in console_users.items()} == {
        "admin": "admin",
        "viewer": "read",
    }
    for name, user in console_users.items():
        assert user.password is not None, name
        assert (user.password.n, user.password.r, user.password.p) == (16384, 8, 1)
        assert user.password.matches(passwords[name]), name
        assert not user.password.matches(passwords[name] + "x"), name
    assert console_users["admin"].password != console_users["viewer"].password
    assert (out / "client" / "console-passwords.txt").stat().st_mode & 0o777 == 0o600
    # private: the CA's key and the client's folder; readable by the containers' user: the rest
    assert (out / "ca" / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (out / "client").stat().st_mode & 0o777 == 0o700
    for mounted in (
        "tls/tls.key",
        "tls/ca.crt",
        "auth/users.toml",
        "auth/credentials.toml",
        "auth/console-users.toml",
    ):
        assert (out / mounted).stat().st_mode & 0o004, f"{mounted}: uid 10001 cannot read it"
    before = (out / "auth" / "users.toml").read_text()
    again = _make_certs(out)
    assert again.returncode == 1
    assert "--force" in again.stderr
    assert (out / "auth" / "users.toml").read_text() == before
    assert _make_certs(out, "--force").returncode == 0
    assert (out / "auth" / "users.toml").read_text() != before
    # Prometheus: the same targets, over https with the files above
    plain = _scrapes(ROOT / "compose" / "prometheus" / "prometheus.yml")
    secure_config = ROOT / "compose" / "secure" / "prometheus.yml"
    secure = _scrapes(secure_config)
    assert {job: targets for job, (targets, _) in secure.items()} == {
        job: targets for job, (targets, _) in plain.items()
    }
    assert {scheme for _, scheme in secure.values()} == {"https"}
    here = tmp_path / "prometheus.yml"
    here.write_text(
        secure_config.read_text()
        .replace("/etc/prometheus/tls", str(out / "tls"))
        .replace("/etc/prometheus/rules/*.yaml", str(ROOT / "charts/apogee/rules/*.yaml"))
    )
    checked = run(["promtool", "check", "config", str(here)], timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.integration
async def test_services_with_the_secure_override_environment_talk_tls_and_sign(
    tmp_path: Path,
) -> None:
    """A nameserver and broker-a as processes, each with the environment the merged
    configuration gives its container (APOGEE_TLS_CLIENT_AUTH=require), the files of
    make-certs.sh where compose mounts them, ports moved to free ones on 127.0.0.1: each
    health check passes over mutual TLS, the broker registers with its own credentials, and a
    client with the script's CA, client certificate and admin credentials sees it."""
    secure = tmp_path / "secure"
    made = _make_certs(secure)
    assert made.returncode == 0, made.stderr
    services = _compose_config(
        "docker-compose.yml", SECURE_OVERRIDE, APOGEE_TLS_CLIENT_AUTH="require"
    )["services"]

    def environment(name: str) -> dict[str, str]:
        env = {str(k): str(v) for k, v in services[name]["environment"].items()}
        return {k: v.replace("/etc/apogee", str(secure)) for k, v in env.items()}

    ns_port, broker_port = free_port(), free_port()
    ns_env = environment("nameserver") | {
        "APOGEE_NAMESERVER_LISTEN": f"127.0.0.1:{ns_port}",
        "APOGEE_NAMESERVER_METRICS_LISTEN": f"127.0.0.1:{free_port()}",
    }
    broker_env = environment("broker-a") | {
        "APOGEE_BROKER_LISTEN": f"127.0.0.1:{broker_port}",
        "APOGEE_BROKER_METRICS_LISTEN": f"127.0.0.1:{free_port()}",
        "APOGEE_BROKER_NAMESRV": f"127.0.0.1:{ns_port}",
        "APOGEE_BROKER_ADVERTISED_ADDRESS": f"127.0.0.1:{broker_port}",
        "APOGEE_BROKER_DATA_DIR": str(tmp_path / "data"),
    }
    members = [
        ("nameserver", ns_port, ns_env, ["-m", "apogee_nameserver"]),
        ("broker-a", broker_port, broker_env, ["-m", "apogee_broker"]),
    ]
    procs: list[subprocess.Popen[bytes]] = []

    def health(name: str, port: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        args = [f"127.0.0.1:{port}" if a.startswith("127.0.0.1:") else a for a in test[2:]]
        return subprocess.run(
            [sys.executable, *args],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def logs() -> str:
        return "\n".join(
            f"==> {n} <==\n{processes.tail(tmp_path / f'{n}.log', 30)}" for n, *_ in members
        )

    security = ClientSecurity.from_env(
        {
            "APOGEE_TLS_CA_FILE": str(secure / "tls" / "ca.crt"),
            "APOGEE_TLS_CERT_FILE": str(secure / "client" / "client.crt"),
            "APOGEE_TLS_KEY_FILE": str(secure / "client" / "client.key"),
            "APOGEE_CREDENTIALS_FILE": str(secure / "client" / "credentials.toml"),
        }
    )
    try:
        for name, port, env, argv in members:
            procs.append(processes.spawn(argv, tmp_path / f"{name}.log", env))
            deadline = time.monotonic() + 60
            while (done := await asyncio.to_thread(health, name, port, env)).returncode != 0:
                assert procs[-1].poll() is None, f"{name} exited\n{logs()}"
                assert time.monotonic() < deadline, f"{name}: {done.stdout}\n{logs()}"
                await asyncio.sleep(0.5)  # a health check's interval, shortened
            # plaintext, as the health check runs without the override, is refused
            plain = {k: v for k, v in env.items() if not k.startswith("APOGEE_PROBE_")}
            assert (await asyncio.to_thread(health, name, port, plain)).returncode == 1

        async def registered() -> bool:
            async with AdminClient(f"127.0.0.1:{ns_port}", security=security) as admin:
                try:
                    return [b.broker_name for b in await admin.cluster_info()] == ["broker-a"]
                except ApogeeError:
                    return False

        deadline = time.monotonic() + 60
        while not await registered():
            assert time.monotonic() < deadline, f"broker-a never registered\n{logs()}"
            await asyncio.sleep(0.5)
        unsigned = ClientSecurity(tls=security.tls)
        async with AdminClient(f"127.0.0.1:{ns_port}", security=unsigned) as admin:
            with pytest.raises(ApogeeError, match="not signed"):
                await admin.cluster_info()
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for proc in reversed(procs):
            try:
                codes.append(proc.wait(20))
            except subprocess.TimeoutExpired:
                codes.append(None)
        processes.kill_all(procs)
    assert codes == [0] * len(procs), logs()


def _console_passwords(folder: Path) -> dict[str, str]:
    """User -> password, from make-certs.sh's client/console-passwords.txt."""
    found = re.findall(
        r"user (\S+) \(role \w+\), password (\S+)$",
        (folder / "client" / "console-passwords.txt").read_text(),
        re.MULTILINE,
    )
    return dict(found)


def _console_healthcheck(config: dict[str, Any]) -> list[str]:
    """The console's compose health check command (after CMD), which must be its image's."""
    test: list[str] = config["services"]["console"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    (line,) = [x for x in dockerfile_stages()["console"] if x.startswith("HEALTHCHECK ")]
    command = json.loads(line[line.index(" CMD [") + len(" CMD ") :])
    assert command == test[1:], "compose and the image differ"
    return test[1:]


def test_the_console_in_compose_and_with_the_secure_override(tmp_path: Path) -> None:
    """docker-compose.yml: the console's image, after the nameserver is healthy, published on
    127.0.0.1 only, the image's own health check, settings its class accepts. With the
    override: HTTPS with the services' certificate, no client certificate asked of browsers
    even with APOGEE_TLS_CLIENT_AUTH=require, logins (users.toml and console-users.toml), the
    service credentials to sign its calls, all mounted read-only."""
    plain = _compose_config("docker-compose.yml")
    console = plain["services"]["console"]
    assert console["image"] == "apogee/console:dev"
    assert console["depends_on"]["nameserver"]["condition"] == "service_healthy"
    assert console["read_only"] is True
    assert console["cap_drop"] == ["ALL"]
    (port,) = console["ports"]
    assert str(port).startswith("127.0.0.1:8080:8080") or port == {
        "host_ip": "127.0.0.1",
        "published": "8080",
        "target": 8080,
    }, port
    _console_healthcheck(plain)
    env = {k: str(v) for k, v in console["environment"].items()}
    settings = load(ConsoleSettings, "console", env=env)
    assert settings.namesrv == "nameserver:9876"
    assert settings.listen == "0.0.0.0:8080"
    # it answers localhost and 127.0.0.1 (the published port) and its name on the network
    assert settings.allowed_hosts == "console"
    named = _compose_config("docker-compose.yml", APOGEE_CONSOLE_ALLOWED_HOSTS="mq.example.com")
    assert named["services"]["console"]["environment"]["APOGEE_CONSOLE_ALLOWED_HOSTS"] == (
        "mq.example.com"
    )
    assert not settings.login_required
    assert not [k for k in env if "TLS" in k or "_AUTH_" in k]

    secure = _compose_config(
        "docker-compose.yml",
        SECURE_OVERRIDE,
        APOGEE_SECURE_DIR=str(tmp_path),
        APOGEE_TLS_CLIENT_AUTH="require",
    )["services"]["console"]
    env = {k: str(v) for k, v in secure["environment"].items()}
    assert env["APOGEE_CONSOLE_TLS_CLIENT_AUTH"] == "none"
    assert env["APOGEE_CONSOLE_TLS_CERT_FILE"] == "/etc/apogee/tls/tls.crt"
    assert env["APOGEE_CONSOLE_AUTH_USERS_FILE"] == "/etc/apogee/auth/users.toml"
    assert env["APOGEE_CONSOLE_AUTH_CREDENTIALS_FILE"] == "/etc/apogee/auth/credentials.toml"
    assert env["APOGEE_CONSOLE_CONSOLE_USERS_FILE"] == "/etc/apogee/auth/console-users.toml"
    assert f"{tmp_path}/tls:/etc/apogee/tls:ro" in secure["volumes"]
    assert f"{tmp_path}/auth:/etc/apogee/auth:ro" in secure["volumes"]
    own = {k: v for k, v in env.items() if k.startswith("APOGEE_CONSOLE_")}
    settings = load(ConsoleSettings, "console", env=own)
    assert settings.https
    assert settings.login_required
    # Prometheus scrapes its metrics, over https with the override
    assert _scrapes(ROOT / "compose" / "prometheus" / "prometheus.yml")["console"] == (
        ["console:8081"],
        "http",
    )
    assert _scrapes(ROOT / "compose" / "secure" / "prometheus.yml")["console"] == (
        ["console:8081"],
        "https",
    )


@pytest.mark.integration
def test_the_console_with_the_secure_override_environment_serves_https_and_logins(
    tmp_path: Path,
) -> None:
    """A nameserver and the console as processes with the environment the merged
    configuration gives their containers (APOGEE_TLS_CLIENT_AUTH=require), make-certs.sh's
    files where compose mounts them, ports moved to free ones: the compose health check passes
    over HTTPS (and fails in plaintext), /readyz says the nameserver answers the console over
    mutual TLS, the script's console users and the admin's access key log in, a wrong password
    does not."""
    secure = tmp_path / "secure"
    made = _make_certs(secure)
    assert made.returncode == 0, made.stderr
    config = _compose_config(
        "docker-compose.yml", SECURE_OVERRIDE, APOGEE_TLS_CLIENT_AUTH="require"
    )
    services = config["services"]
    healthcheck = _console_healthcheck(config)

    def environment(name: str) -> dict[str, str]:
        env = {str(k): str(v) for k, v in services[name]["environment"].items()}
        return {k: v.replace("/etc/apogee", str(secure)) for k, v in env.items()}

    ns_port, console_port = free_port(), free_port()
    ns_env = environment("nameserver") | {
        "APOGEE_NAMESERVER_LISTEN": f"127.0.0.1:{ns_port}",
        "APOGEE_NAMESERVER_METRICS_LISTEN": f"127.0.0.1:{free_port()}",
    }
    console_env = environment("console") | {
        "APOGEE_CONSOLE_LISTEN": f"127.0.0.1:{console_port}",
        "APOGEE_CONSOLE_METRICS_LISTEN": f"127.0.0.1:{free_port()}",
        # the nameserver's certificate names `nameserver`, not 127.0.0.1's name here
        "APOGEE_CONSOLE_NAMESRV": f"127.0.0.1:{ns_port}",
        "APOGEE_CONSOLE_TLS_SERVER_NAME": "nameserver",
    }
    procs: list[subprocess.Popen[bytes]] = []

    def logs() -> str:
        return "\n".join(
            f"==> {n} <==\n{processes.tail(tmp_path / f'{n}.log', 30)}"
            for n in ("nameserver", "console")
        )

    def health(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *healthcheck[1:]],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    ca = ssl.create_default_context(cafile=str(secure / "tls" / "ca.crt"))
    base = f"https://localhost:{console_port}"

    def call(method: str, path: str, body: dict[str, str] | None = None) -> int:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            base + path, data, {"Content-Type": "application/json"}, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=10, context=ca) as resp:
                status: int = resp.status
                return status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        procs.append(
            processes.spawn(["-m", "apogee_nameserver"], tmp_path / "nameserver.log", ns_env)
        )
        procs.append(
            processes.spawn(["-m", "apogee_console"], tmp_path / "console.log", console_env)
        )
        deadline = time.monotonic() + 60
        while (done := health(console_env)).returncode != 0:
            assert procs[-1].poll() is None, f"the console exited\n{logs()}"
            assert time.monotonic() < deadline, f"{done.stderr}\n{logs()}"
            time.sleep(0.5)  # a health check's interval, shortened
        plain = {k: v for k, v in console_env.items() if not k.startswith("APOGEE_CONSOLE_TLS")}
        assert health(plain).returncode != 0  # it serves HTTPS only
        deadline = time.monotonic() + 60
        while call("GET", "/readyz") != 200:
            assert time.monotonic() < deadline, f"never ready\n{logs()}"
            time.sleep(0.5)
        assert call("GET", "/api/v1/cluster") == 401  # logins required
        for user, password in _console_passwords(secure).items():
            assert call("POST", "/api/v1/session", {"user": user, "password": password}) == 200
        assert call("POST", "/api/v1/session", {"user": "admin", "password": "wrong"}) == 401
        admin = Credentials.load(secure / "client" / "credentials.toml")
        keys = {"access_key": admin.access_key, "secret_key": admin.secret_key}
        assert call("POST", "/api/v1/session", keys) == 200
    finally:
        for proc in reversed(procs):
            proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for proc in reversed(procs):
            try:
                codes.append(proc.wait(20))
            except subprocess.TimeoutExpired:
                codes.append(None)
        processes.kill_all(procs)
    assert codes == [0] * len(procs), logs()
