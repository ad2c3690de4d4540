"""The official RocketMQ 5 Python client (``rocketmq-python-client`` 5.1.2) against a cluster of
real processes with TLS on every port and authentication on (:mod:`e2e.secure_support`). The
client signs with an access key (``Credentials(ak, sk)``) and speaks TLS (``tls_enable=True``),
trusting the cluster's test CA through ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``; each runs in a
process of its own, through its public API only (:mod:`e2e.rocketmq_support`).

1. the user with PUB|SUB on the topic and SUB on the group sends, and a SimpleConsumer of the
   group receives the message and acks it;
2. a wrong secret key is refused as UNAUTHORIZED (40100): the send fails, and the client's log
   has the broker's answer;
3. the user with only SUB on the topic is refused as FORBIDDEN (40300): the send fails with the
   client's ``ForbiddenException``, whose text names the user, the topic and PUB;
4. a plain-text client does not get through to a TLS broker.

No refused send is stored: the authorised user's next message is the next one its group
receives. Afterwards the broker still serves, and no broker log has a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.local.cluster import pid_alive
from e2e.rocketmq_support import (
    CLIENT_LOG,
    JSON,
    Access,
    ClientCallError,
    ClientProcess,
    OfficialClients,
    by_body,
    endpoints,
    receive_until,
    unique,
)
from e2e.secure_support import SecureCluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPIC = "RmqSecure"
GROUP = "rmq-secure"
APP = ("rmq-app", "rmq-app-secret-0123456789")
READER = ("rmq-reader", "rmq-reader-secret-0123456789")
OPS = ("rmq-ops", "rmq-ops-secret-0123456789")
USERS = f"""
[[users]]
access_key = "{APP[0]}"
secret_key = "{APP[1]}"
[users.topics]
"{TOPIC}" = "PUB|SUB"
[users.groups]
"{GROUP}" = "SUB"

[[users]]
access_key = "{READER[0]}"
secret_key = "{READER[1]}"
[users.topics]
"{TOPIC}" = "SUB"

[[users]]
access_key = "{OPS[0]}"
secret_key = "{OPS[1]}"
admin = "write"
"""
#: The shortest invisible time a receive may ask for, and how long receiving may take.
INVISIBLE_S = 10
RECEIVE_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    cluster = SecureCluster.start_secure(tmp_path_factory.mktemp("rmq-secure"), USERS)
    try:
        # one queue: the group receives the topic's messages in the order they were stored
        cluster.create_topic(TOPIC, OPS, queues=1)
        yield cluster
    finally:
        cluster.close()


def access(secure: SecureCluster, user: tuple[str, str], *, tls: bool = True) -> Access:
    """``user`` (access key, secret key) over TLS trusting the cluster's CA (or plain text)."""
    return Access(*user, tls=tls, ca_file=secure.ca.cert_file)


@pytest.fixture(scope="module")
def receiver(
    secure: SecureCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClientProcess]:
    """The authorised user's SimpleConsumer of the group, started before anything is sent (a
    group's first contact is where it starts reading)."""
    official = OfficialClients(tmp_path_factory.mktemp("rmq-receiver"))
    try:
        yield official.simple(endpoints(secure), GROUP, TOPIC, access=access(secure, APP))
    finally:
        official.close()


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[OfficialClients]:
    official = OfficialClients(tmp_path / "clients")
    try:
        yield official
    finally:
        official.close()


def broker_tracebacks(secure: SecureCluster) -> list[str]:
    """The brokers whose log has a traceback."""
    return [
        b.name for b in secure.brokers if "Traceback" in Path(b.log).read_text(errors="replace")
    ]


def receive_next(receiver: ClientProcess, body: str) -> list[JSON]:
    """What the group receives (acked) until ``body`` came."""
    return receive_until(
        receiver,
        lambda got: body in by_body(got),
        invisible_s=INVISIBLE_S,
        timeout=RECEIVE_TIMEOUT,
        what=f"{body!r} received",
        ack=True,
    )


def assert_not_stored(
    secure: SecureCluster, clients: OfficialClients, receiver: ClientProcess, refused: str
) -> None:
    """The authorised user's next message is the next one the group receives: ``refused``
    was not stored (the topic has one queue), and the broker still serves."""
    producer = clients.producer(endpoints(secure), [TOPIC], access=access(secure, APP))
    marker = unique("after")
    producer.call("send", topic=TOPIC, body=marker)
    got = receive_next(receiver, marker)
    assert [m["body"] for m in got] == [marker], f"received besides the marker: {got}"
    assert refused not in by_body(got)
    assert broker_tracebacks(secure) == []


def test_the_authorised_user_sends_over_tls_and_its_group_receives_and_acks(
    secure: SecureCluster, receiver: ClientProcess, clients: OfficialClients
) -> None:
    producer = clients.producer(endpoints(secure), [TOPIC], access=access(secure, APP))
    body = unique("signed")
    receipt = producer.call("send", topic=TOPIC, body=body, tag="paid", keys=["order-1"])
    got = receive_next(receiver, body)
    [m] = by_body(got)[body]
    assert (m["topic"], m["message_id"], m["tag"], m["keys"]) == (
        TOPIC,
        receipt["message_id"],
        "paid",
        ["order-1"],
    ), m
    assert m["delivery_attempt"] == 1, m


def test_a_wrong_secret_key_is_refused_as_unauthorized(
    secure: SecureCluster, receiver: ClientProcess, clients: OfficialClients
) -> None:
    wrong = access(secure, (APP[0], "not-the-secret-key-0123"))
    producer = clients.producer(endpoints(secure), [TOPIC], access=wrong)
    body = unique("badly-signed")
    with pytest.raises(ClientCallError) as info:
        producer.call("send", topic=TOPIC, body=body)
    # the client asks for the topic's route first; refused, it has none to send by
    assert f"failed to fetch topic:{TOPIC} route" in info.value.error, info.value.error
    log = (producer.home / CLIENT_LOG).read_text(errors="replace")
    answer = f"40100, the signature does not match access key {APP[0]!r}"
    assert answer in log, f"the client's log lacks {answer!r}\n{producer.detail()}"
    assert_not_stored(secure, clients, receiver, body)


def test_a_user_without_the_pub_right_is_forbidden_to_send(
    secure: SecureCluster, receiver: ClientProcess, clients: OfficialClients
) -> None:
    producer = clients.producer(endpoints(secure), [TOPIC], access=access(secure, READER))
    body = unique("not-mine")
    with pytest.raises(ClientCallError) as info:
        producer.call("send", topic=TOPIC, body=body)
    error = info.value.error
    assert error.startswith("ForbiddenException: 40300, "), error
    assert f"user {READER[0]!r}: has no PUB right on topic {TOPIC!r}" in error, error
    assert_not_stored(secure, clients, receiver, body)


def test_a_plain_text_client_does_not_get_through_to_a_tls_broker(
    secure: SecureCluster, receiver: ClientProcess, clients: OfficialClients
) -> None:
    plain = access(secure, APP, tls=False)
    producer = clients.producer(endpoints(secure), [TOPIC], access=plain)
    body = unique("plain-text")
    with pytest.raises(ClientCallError):
        producer.call("send", topic=TOPIC, body=body)
    assert_not_stored(secure, clients, receiver, body)


def test_the_brokers_serve_on_and_logged_no_traceback(
    secure: SecureCluster, receiver: ClientProcess, clients: OfficialClients
) -> None:
    assert all(pid_alive(b.pid) for b in secure.brokers)
    producer = clients.producer(endpoints(secure), [TOPIC], access=access(secure, APP))
    body = unique("still-serving")
    producer.call("send", topic=TOPIC, body=body)
    assert [m["body"] for m in receive_next(receiver, body)] == [body]
    assert broker_tracebacks(secure) == []
