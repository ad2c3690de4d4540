"""A cluster of real processes with TLS and authentication on: two nameservers, two brokers, the
schedule service and the transaction checker, every port over TLS, every call signed.

What the audit found open is refused (a broker unregistered or registered by someone who is not
a service, topics deleted and offsets reset without the admin right), clients without a key,
with a wrong signature or a stale date are refused, each user gets exactly its rights, the
users file and the certificates are reloaded without a restart, and every refusal has its code
and sentence, an audit line, and a count in the metrics."""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
from cryptography import x509

from apogee.client import (
    AdminClient,
    EndOutcome,
    Message,
    Producer,
    PushConsumer,
    ReceivedMessage,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionProducer,
)
from apogee.common.auth import Credentials, signed_metadata
from apogee.common.auth.signature import sign
from apogee.common.errors import ApogeeError, PermissionDeniedError
from apogee.common.metrics import scrape
from apogee.local import cluster as local_cluster
from apogee.rpc.security import ClientSecurity
from apogee.rpc.tls import ClientTls
from apogee.testkit.tls import Issued, TestCa, replace_files
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc, nameserver_pb2, nameserver_pb2_grpc
from e2e.harness import BROKER_ENV, NAMESERVER_ENV, SCHEDULE_ENV, in_thread, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPIC = "Orders"
GROUP = "billing"

USERS = """
[[users]]
access_key = "apogee-service"
secret_key = "service-secret-0123456789"
service = true

[[users]]
access_key = "orders-producer"
secret_key = "producer-secret-0123456789"
[users.topics]
"Orders" = "PUB"

[[users]]
access_key = "billing-consumer"
secret_key = "consumer-secret-0123456789"
[users.topics]
"Orders" = "SUB"
[users.groups]
"billing" = "SUB"

[[users]]
access_key = "ops"
secret_key = "ops-secret-0123456789"
admin = "write"

[[users]]
access_key = "viewer"
secret_key = "viewer-secret-0123456789"
admin = "read"
"""

KEYS = {
    "service": ("apogee-service", "service-secret-0123456789"),
    "producer": ("orders-producer", "producer-secret-0123456789"),
    "consumer": ("billing-consumer", "consumer-secret-0123456789"),
    "ops": ("ops", "ops-secret-0123456789"),
    "viewer": ("viewer", "viewer-secret-0123456789"),
}


@dataclass
class Secure:
    """The running cluster and what its clients need."""

    namesrv: str
    nameservers: list[str]
    brokers: dict[str, str]
    ca: TestCa
    certs: dict[str, Issued]
    users_file: Path
    state: local_cluster.ClusterState
    data: Path

    def tls(self) -> ClientTls:
        return ClientTls(ca_file=str(self.ca.cert_file))

    def as_user(self, who: str) -> ClientSecurity:
        ak, sk = KEYS[who]
        return ClientSecurity(tls=self.tls(), credentials=Credentials(ak, sk))

    def unsigned(self) -> ClientSecurity:
        return ClientSecurity(tls=self.tls())


def _service_env(prefix: str, cert: Issued, ca: TestCa, users: Path, creds: Path) -> dict[str, str]:
    p = f"APOGEE_{prefix}_"
    return {
        f"{p}TLS_CERT_FILE": str(cert.cert_file),
        f"{p}TLS_KEY_FILE": str(cert.key_file),
        f"{p}TLS_CA_FILE": str(ca.cert_file),
        f"{p}AUTH_ENABLED": "true",
        f"{p}AUTH_USERS_FILE": str(users),
        f"{p}AUTH_CREDENTIALS_FILE": str(creds),
    }


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    root = tmp_path_factory.mktemp("secure")
    ca = TestCa.create(root / "pki")
    certs = {
        name: ca.issue(name, root / "pki", client=True)
        for name in ("nameserver", "broker", "schedule", "txn-checker")
    }
    users = root / "users.toml"
    users.write_text(USERS)
    creds = root / "service-credentials.toml"
    creds.write_text('access_key = "apogee-service"\nsecret_key = "service-secret-0123456789"\n')
    creds.chmod(0o600)
    # what the cluster's own waits use (local_cluster reads the environment): the CA, and the
    # service identity (cluster info is for signed callers only)
    saved = {k: os.environ.get(k) for k in ("APOGEE_TLS_CA_FILE", "APOGEE_CREDENTIALS_FILE")}
    os.environ["APOGEE_TLS_CA_FILE"] = str(ca.cert_file)
    os.environ["APOGEE_CREDENTIALS_FILE"] = str(creds)
    data = root / "cluster"
    try:
        state = in_thread(
            lambda: local_cluster.up(
                data,
                brokers=2,
                nameservers=2,
                timeout=90.0,
                nameserver_env={
                    **NAMESERVER_ENV,
                    **_service_env("NAMESERVER", certs["nameserver"], ca, users, creds),
                },
                broker_env={
                    **BROKER_ENV,
                    "APOGEE_BROKER_AUTO_CREATE_TOPICS": "false",
                    **_service_env("BROKER", certs["broker"], ca, users, creds),
                },
                schedule_env={
                    **SCHEDULE_ENV,
                    **_service_env("SCHEDULE", certs["schedule"], ca, users, creds),
                },
                txn_checker_env={
                    "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1",
                    **_service_env("TXN_CHECKER", certs["txn-checker"], ca, users, creds),
                },
                console=False,
            )
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        s = Secure(
            namesrv=state.namesrv,
            nameservers=[n.address for n in state.nameservers],
            brokers={b.name: b.address for b in state.brokers},
            ca=ca,
            certs=certs,
            users_file=users,
            state=state,
            data=data,
        )

        async def create() -> None:
            async with AdminClient(s.namesrv, security=s.as_user("ops")) as admin:
                await admin.create_or_update_topic(TOPIC, queues=2)

        asyncio.run(create())
        yield s
    finally:
        in_thread(lambda: local_cluster.down(data))


def _refusal(err: BaseException) -> tuple[str, str]:
    if isinstance(err, ApogeeError):
        return err.kind.name, str(err)
    assert isinstance(err, grpc.aio.AioRpcError), repr(err)
    return err.code().name, err.details() or ""


async def _raw_call(
    address: str, tls: ClientTls, metadata: tuple[tuple[str, str], ...]
) -> nameserver_pb2.GetClusterInfoResponse:
    """GetClusterInfo over TLS with exactly ``metadata`` (no SDK signing)."""
    async with grpc.aio.secure_channel(address, tls.credentials()) as channel:
        stub = nameserver_pb2_grpc.NameServerStub(channel)
        return await stub.GetClusterInfo(
            nameserver_pb2.GetClusterInfoRequest(), metadata=metadata, timeout=5
        )


# -- the audit's attacks -----------------------------------------------------------------------


async def test_the_spoofing_attacks_of_the_audit_are_refused(secure: Secure) -> None:
    broker_name, address = next(iter(secure.brokers.items()))
    spoof = nameserver_pb2.RegisterBrokerRequest(
        cluster="DefaultCluster", broker_name=broker_name, address="10.66.66.66:10911"
    )
    gone = nameserver_pb2.UnregisterBrokerRequest(
        cluster="DefaultCluster", broker_name=broker_name, address=address
    )
    for who in (None, "ops", "producer"):
        security = secure.unsigned() if who is None else secure.as_user(who)
        async with security.channel(secure.nameservers[0]) as channel:
            stub = nameserver_pb2_grpc.NameServerStub(channel)
            attacks = (
                stub.RegisterBroker(spoof, timeout=5),
                stub.UnregisterBroker(gone, timeout=5),
            )
            for attack in attacks:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await attack
                if who is None:
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "the request is not signed" in (info.value.details() or "")
                else:
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert f"user {KEYS[who][0]!r}: is not an Apogee service identity" in (
                        info.value.details() or ""
                    )
    # the route still leads to the real broker, and sends still work
    async with secure.as_user("producer").channel(secure.nameservers[0]) as channel:
        route = await nameserver_pb2_grpc.NameServerStub(channel).GetRoute(
            nameserver_pb2.GetRouteRequest(topic=TOPIC), timeout=5
        )
    addresses = {b.address for b in route.brokers}
    assert "10.66.66.66:10911" not in addresses
    assert address in addresses
    async with Producer(secure.namesrv, security=secure.as_user("producer")) as producer:
        await producer.send(Message(TOPIC, b"still here"))


async def test_admin_actions_need_the_admin_write_right(secure: Secure) -> None:
    for who, code in (("producer", "PERMISSION_DENIED"), ("viewer", "PERMISSION_DENIED")):
        async with AdminClient(secure.namesrv, security=secure.as_user(who)) as admin:
            with pytest.raises(ApogeeError) as info:
                await admin.delete_topic(TOPIC)
            assert _refusal(info.value)[0] == code
            assert f"user {KEYS[who][0]!r}: has no admin write right (needed to delete topics)" in (
                str(info.value)
            )
            with pytest.raises(ApogeeError) as info:
                await admin.reset_offsets(GROUP, TOPIC, earliest=True)
            assert "has no admin write right (needed to reset a group's offsets)" in str(info.value)
    # the viewer reads; the unsigned do not even list
    async with AdminClient(secure.namesrv, security=secure.as_user("viewer")) as admin:
        assert TOPIC in await admin.list_topics()
    async with AdminClient(secure.namesrv, security=secure.unsigned()) as admin:
        with pytest.raises(ApogeeError) as info:
            await admin.list_topics()
        assert info.value.kind.name == "UNAUTHENTICATED"
    # the topic is still there
    async with AdminClient(secure.namesrv, security=secure.as_user("ops")) as admin:
        assert TOPIC in await admin.list_topics()


# -- authentication ----------------------------------------------------------------------------


async def test_unsigned_badly_signed_and_stale_calls_are_refused_with_their_reason(
    secure: Secure,
) -> None:
    ns = secure.nameservers[0]
    tls = secure.tls()
    ak, sk = KEYS["viewer"]
    now = datetime.datetime.now(datetime.UTC)
    stale = now - datetime.timedelta(hours=1)
    date = now.strftime("%Y%m%dT%H%M%SZ")
    old = stale.strftime("%Y%m%dT%H%M%SZ")

    def auth(key: str, signature: str) -> str:
        return (
            f"MQv2-HMAC-SHA1 Credential={key}, SignedHeaders=x-mq-date-time, Signature={signature}"
        )

    cases: list[tuple[tuple[tuple[str, str], ...], str]] = [
        ((), "the request is not signed"),
        (
            (("x-mq-date-time", date), ("authorization", auth(ak, sign("not-the-secret", date)))),
            f"the signature does not match access key {ak!r}",
        ),
        (
            (("x-mq-date-time", date), ("authorization", auth("nobody", sign(sk, date)))),
            "'nobody'",
        ),
        (
            (("x-mq-date-time", old), ("authorization", auth(ak, sign(sk, old)))),
            "from the server's clock",
        ),
        ((("x-mq-date-time", date), ("authorization", "Basic dXNlcjpwYXNz")), "MQv2-HMAC-SHA1"),
    ]
    for metadata, says in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _raw_call(ns, tls, metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert says in (info.value.details() or ""), (says, info.value.details())
    # the same call, signed right, is answered (the official client's form: local date, 'Z')
    reply = await _raw_call(ns, tls, signed_metadata(ak, sk))
    assert {b.broker_name for b in reply.brokers} == set(secure.brokers)


async def test_plaintext_and_untrusted_clients_do_not_get_through(
    secure: Secure, tmp_path: Path
) -> None:
    ns = secure.nameservers[0]
    async with grpc.aio.insecure_channel(ns) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await nameserver_pb2_grpc.NameServerStub(channel).GetClusterInfo(
                nameserver_pb2.GetClusterInfoRequest(),
                metadata=signed_metadata(*KEYS["ops"]),
                timeout=5,
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    other = TestCa.create(tmp_path, "Another CA")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _raw_call(ns, ClientTls(ca_file=str(other.cert_file)), signed_metadata(*KEYS["ops"]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# -- permissions -------------------------------------------------------------------------------


async def test_each_user_gets_exactly_its_rights(secure: Secure) -> None:
    # the consumer (SUB only) cannot send
    async with Producer(secure.namesrv, security=secure.as_user("consumer")) as producer:
        with pytest.raises(PermissionDeniedError) as info:
            await producer.send(Message(TOPIC, b"not mine to send"))
    assert "user 'billing-consumer': has no PUB right on topic 'Orders'" in str(info.value)

    # the producer sends; the consumer receives as its group
    async with Producer(secure.namesrv, security=secure.as_user("producer")) as producer:
        sent = {
            (await producer.send(Message(TOPIC, f"m{i}".encode()))).message_id for i in range(5)
        }
    got: set[str] = set()
    done = asyncio.Event()

    async def on_message(messages: list[ReceivedMessage]) -> None:
        got.update(m.unique_id for m in messages)
        if sent <= got:
            done.set()

    consumer = PushConsumer(
        secure.namesrv,
        GROUP,
        on_message,
        consume_from="earliest",
        security=secure.as_user("consumer"),
    )
    consumer.subscribe(TOPIC)
    async with consumer:
        await consumer.start()
        await asyncio.wait_for(done.wait(), 30)
    assert sent <= got

    # the producer cannot read the topic, nor the consumer read as another group
    async with AdminClient(secure.namesrv, security=secure.as_user("producer")) as admin:
        with pytest.raises(PermissionDeniedError) as info:
            await admin.describe_group(GROUP)
    assert "has no admin read right (needed to describe group 'billing')" in str(info.value)


async def test_the_users_file_is_reloaded_without_a_restart(secure: Secure) -> None:
    original = secure.users_file.read_text()
    updated = original.replace('"Orders" = "SUB"\n', '"Orders" = "PUB|SUB"\n', 1)
    assert updated != original
    try:
        secure.users_file.write_text(updated)

        async with Producer(secure.namesrv, security=secure.as_user("consumer")) as producer:

            async def allowed() -> bool:
                try:
                    await producer.send(Message(TOPIC, b"now allowed"))
                except PermissionDeniedError:
                    return False
                return True

            await eventually(allowed, 30, "a send allowed after the reload", every=0.2)
    finally:
        secure.users_file.write_text(original)


# -- certificates ------------------------------------------------------------------------------


def _served_serial(address: str, ca: Path) -> int:
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def test_a_rotated_certificate_is_served_without_a_restart(
    secure: Secure, tmp_path: Path
) -> None:
    ns = secure.nameservers[1]
    before = _served_serial(ns, secure.ca.cert_file)
    assert before == secure.certs["nameserver"].serial
    fresh = secure.ca.issue("nameserver-next", tmp_path, client=True)
    replace_files(secure.certs["nameserver"], fresh)
    wait_until(
        lambda: _served_serial(ns, secure.ca.cert_file) == fresh.serial,
        30,
        "the nameserver serving its new certificate",
    )
    # still the same process, still answering signed calls over TLS
    reply = await _raw_call(ns, secure.tls(), signed_metadata(*KEYS["viewer"]))
    assert {b.broker_name for b in reply.brokers} == set(secure.brokers)


# -- what refusals leave behind ----------------------------------------------------------------


def test_refusals_are_audited_and_counted(secure: Secure) -> None:
    logs = [Path(p.log) for p in secure.state.nameservers]
    text = "".join(log.read_text(errors="replace") for log in logs)
    assert "refused /apogee.v1.NameServer/RegisterBroker from access key 'ops'" in text
    assert "refused /apogee.v1.NameServer/RegisterBroker from an unsigned or unknown caller" in text
    # no secret ever reaches a log
    for _, secret in KEYS.values():
        assert secret not in text
    counts: dict[str, float] = {}
    for member in secure.state.nameservers:
        samples = scrape(member.metrics, ca_file=str(secure.ca.cert_file))
        for (name, labels), value in samples.items():
            if name == "apogee_auth_refusals_total":
                reason = dict(labels)["reason"]
                counts[reason] = counts.get(reason, 0) + value
    assert counts.get("permission", 0) >= 4
    assert counts.get("missing", 0) >= 2


async def test_services_talk_to_each_other_as_the_service_identity(secure: Secure) -> None:
    # a delayed message goes through the schedule service (which reads and writes the brokers
    # as the service user) and comes back to a consumer allowed to read
    async with Producer(secure.namesrv, security=secure.as_user("producer")) as producer:
        result = await producer.send(Message(TOPIC, b"later", delay_level=1))
    async with AdminClient(secure.namesrv, security=secure.as_user("ops")) as admin:

        async def delivered() -> bool:
            try:
                found = await admin.get_messages(result.message_id)
            except ApogeeError:
                return False
            return any(m.topic == TOPIC for m in found)

        await eventually(delivered, 30, "the delayed message delivered", every=0.2)
    # and the broker's own admin listing works for the service identity only through TLS
    async with secure.as_user("service").channel(next(iter(secure.brokers.values()))) as ch:
        topics = await broker_pb2_grpc.BrokerAdminStub(ch).ListTopics(
            broker_pb2.BrokerListTopicsRequest(), timeout=5
        )
    assert TOPIC in {t.name for t in topics.topics}


def _cli(secure: Secure, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    return subprocess.run(
        [sys.executable, "-m", "apogee.cli", "--namesrv", secure.namesrv, *args],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=60,
        check=False,
    )


def test_the_cli_takes_its_credentials_from_a_file_named_in_the_environment(
    secure: Secure, tmp_path: Path
) -> None:
    creds = tmp_path / "ops.toml"
    creds.write_text(f'access_key = "{KEYS["ops"][0]}"\nsecret_key = "{KEYS["ops"][1]}"\n')
    tls = {"APOGEE_TLS_CA_FILE": str(secure.ca.cert_file)}
    done = _cli(secure, "topic", "list", env={**tls, "APOGEE_CREDENTIALS_FILE": str(creds)})
    assert done.returncode == 0, done.stderr
    assert TOPIC in done.stdout.split()
    # without credentials: one line, the server's sentence
    done = _cli(secure, "topic", "list", env=tls)
    assert done.returncode == 1
    assert "the request is not signed" in done.stderr.strip().splitlines()[-1]
    # a viewer cannot delete; the sentence names the user and the right
    viewer = tmp_path / "viewer.toml"
    viewer.write_text(f'access_key = "{KEYS["viewer"][0]}"\nsecret_key = "{KEYS["viewer"][1]}"\n')
    done = _cli(
        secure,
        "topic",
        "delete",
        TOPIC,
        env={**tls, "APOGEE_CREDENTIALS_FILE": str(viewer)},
    )
    assert done.returncode != 0
    assert "user 'viewer': has no admin write right (needed to delete topics)" in done.stderr


async def test_transactions_are_ended_by_their_producer_and_resolved_by_admins_only(
    secure: Secure,
) -> None:
    def commit(_message: Message, _arg: object) -> TransactionDecision:
        return TransactionDecision.COMMIT

    def undecided(_message: Message, _arg: object) -> TransactionDecision:
        return TransactionDecision.UNKNOWN

    async with TransactionProducer(
        secure.namesrv, "orders-txn", security=secure.as_user("producer")
    ) as producer:
        done = await producer.send_in_transaction(Message(TOPIC, b"paid"), commit)
        assert done.end_outcome is EndOutcome.COMMITTED, done
        pending = await producer.send_in_transaction(Message(TOPIC, b"maybe"), undecided)
    # the consumer may send nothing, transactional or not
    async with TransactionProducer(
        secure.namesrv, "orders-txn", security=secure.as_user("consumer")
    ) as producer:
        with pytest.raises(PermissionDeniedError) as info:
            await producer.send_in_transaction(Message(TOPIC, b"not mine"), commit)
    assert "has no PUB right on topic 'Orders'" in str(info.value)
    # resolving by hand is an admin's (write) action
    async with AdminClient(secure.namesrv, security=secure.as_user("viewer")) as admin:
        with pytest.raises(PermissionDeniedError) as info:
            await admin.resolve_transaction(pending.message_id, commit=False)
    assert "has no admin write right (needed to resolve transactions)" in str(info.value)
    async with AdminClient(secure.namesrv, security=secure.as_user("ops")) as admin:
        resolved = await admin.resolve_transaction(pending.message_id, commit=False)
    assert resolved.outcome == "rolled back", resolved


async def test_a_check_goes_only_to_a_producer_session_that_may_send_to_the_topic(
    secure: Secure,
) -> None:
    # an intruder names another application's producer group: the checks of its pending
    # transactions (with their bodies) must not reach it
    group = "orders-checked"
    owner_checks: list[str] = []
    intruder_checks: list[str] = []
    asked = asyncio.Event()

    def owner(message: TransactionCheckMessage) -> TransactionDecision:
        owner_checks.append(message.transaction_id)
        asked.set()
        return TransactionDecision.ROLLBACK

    def intruder(message: TransactionCheckMessage) -> TransactionDecision:
        intruder_checks.append(message.transaction_id)
        return TransactionDecision.UNKNOWN

    def undecided(_message: Message, _arg: object) -> TransactionDecision:
        return TransactionDecision.UNKNOWN

    async with (
        TransactionProducer(
            secure.namesrv,
            group,
            intruder,
            security=secure.as_user("consumer"),
            topics=[TOPIC],
            client_id="a-intruder",  # first in the broker's turn, were it eligible
        ),
        TransactionProducer(
            secure.namesrv,
            group,
            owner,
            security=secure.as_user("producer"),
            topics=[TOPIC],
            client_id="b-owner",
        ) as producer,
    ):
        pending = await producer.send_in_transaction(Message(TOPIC, b"secret order"), undecided)
        # the checker asks after the immunity (6 s): the owner answers, the intruder hears nothing
        await asyncio.wait_for(asked.wait(), 60)
    assert pending.message_id in owner_checks
    assert intruder_checks == []
