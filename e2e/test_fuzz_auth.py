"""The fuzz pass of :mod:`e2e.test_fuzz` with authentication on: every RPC of the internal
protocol, against a cluster of real processes whose nameserver and broker authenticate every
call, from three kinds of caller in turn:

- a signed user with rights on the fuzz topic and group only (no admin, not a service): its
  calls reach the handlers, and what it lacks is refused as PERMISSION_DENIED;
- an unsigned caller: every call is refused, as UNAUTHENTICATED (or INVALID_ARGUMENT for bytes
  that do not parse, which are refused before anything else);
- a caller with hostile ``authorization`` and ``x-mq-date-time`` metadata (built from the seed:
  empty, very long, control characters, near-valid signatures, other algorithms, dates far off
  and malformed): refused as the unsigned are.

What must hold, beyond what the plain pass checks (no UNKNOWN or INTERNAL, no hang, every
refusal the server's own answer with a sentence): nothing unsigned or badly signed gets
through, and the cluster still serves the real users afterwards."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Final

import grpc
import grpc.aio
import pytest

from apogee.client import AdminClient, Producer
from apogee.client import Message as ClientMessage
from apogee.common.auth import Credentials
from apogee.rpc.security import ClientSecurity, Signer, signer_interceptors
from apogee.rpc.server import check_health
from e2e.fuzzing import Answer, Call, all_rpcs
from e2e.harness import Cluster, ClusterFactory
from e2e.test_fuzz import (
    BROKER_ENV,
    CALLS_PER_METHOD,
    GROUP,
    SEED,
    TOPIC,
    fuzz,
    log_problems,
    seed_cluster,
    servers_of,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: calls per method and kind of caller (a third of the plain pass's each)
CALLS: Final = max(8, CALLS_PER_METHOD // 3)

USERS: Final = f"""
[[users]]
access_key = "fuzz-service"
secret_key = "fuzz-service-secret"
service = true

[[users]]
access_key = "fuzz-user"
secret_key = "fuzz-user-secret"
[users.topics]
"{TOPIC}" = "PUB|SUB"
[users.groups]
"{GROUP}" = "SUB"
"""
USER = Credentials("fuzz-user", "fuzz-user-secret")
SERVICE_CREDENTIALS: Final = 'access_key = "fuzz-service"\nsecret_key = "fuzz-service-secret"\n'
REFUSED_UNSIGNED: Final = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT}


class HostileSigner(Signer):
    """``authorization`` and ``x-mq-date-time`` values that are wrong in every way the seed
    can find; :meth:`metadata` gives another pair each call."""

    def __init__(self, seed: int) -> None:
        super().__init__(USER)
        self.rng = random.Random(seed)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        r = self.rng
        good = super().metadata()
        date = dict(good)["x-mq-date-time"]
        auth = dict(good)["authorization"]
        printable = "".join(chr(r.randrange(32, 127)) for _ in range(r.randrange(0, 60)))
        dates = [
            date,
            "",
            "19700101T000000Z",
            "99991231T235959Z",
            date[:-1],
            date.replace("T", " "),
            printable,
            "2" * 2000,  # gRPC itself refuses metadata over 8 KiB in all; stay below
        ]
        auths = [
            "",
            printable,
            auth.replace("MQv2-HMAC-SHA1", "MQv2-HMAC-SHA256"),
            auth[:-1] + ("0" if auth[-1] != "0" else "1"),  # one hex digit off
            auth.replace("fuzz-user", "fuzz-service"),  # another user's name, this signature
            auth.replace("Credential=", "Credential= "),
            "MQv2-HMAC-SHA1 " + ", ".join(["Credential=x"] * r.randrange(1, 50)),
            "MQv2-HMAC-SHA1 Credential=" + "A" * 3000 + ", SignedHeaders=x-mq-date-time",
            auth.replace("SignedHeaders=x-mq-date-time", "SignedHeaders=host"),
            "Basic Zm9vOmJhcg==",
        ]
        return (("x-mq-date-time", r.choice(dates)), ("authorization", r.choice(auths)))


def hostile_channel(address: str) -> grpc.aio.Channel:
    interceptors = signer_interceptors(HostileSigner(SEED))
    return grpc.aio.insecure_channel(address, interceptors=interceptors)


def nothing_gets_through(call: Call, answer: Answer) -> list[str]:
    if answer.lost or answer.code in REFUSED_UNSIGNED:
        return []
    return [f"an unsigned or badly signed call got {answer.code.name}: {answer.details[:200]!r}"]


async def test_fuzzing_with_authentication_on_refuses_the_unsigned_and_breaks_nothing(
    start_cluster: ClusterFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    users = tmp_path / "users.toml"
    users.write_text(USERS)
    creds = tmp_path / "service.toml"
    creds.write_text(SERVICE_CREDENTIALS)
    auth = {
        "AUTH_ENABLED": "true",
        "AUTH_USERS_FILE": str(users),
        "AUTH_CREDENTIALS_FILE": str(creds),
    }
    # the cluster's own waits, the seeding and the checks after: as the service identity
    monkeypatch.setenv("APOGEE_CREDENTIALS_FILE", str(creds))
    cluster = await asyncio.to_thread(
        lambda: start_cluster(
            "fuzz-auth",
            brokers=1,
            nameservers=1,
            nameserver_env={f"APOGEE_NAMESERVER_{k}": v for k, v in auth.items()},
            broker_env={**BROKER_ENV, **{f"APOGEE_BROKER_{k}": v for k, v in auth.items()}},
            txn_checker_env={f"APOGEE_TXN_CHECKER_{k}": v for k, v in auth.items()},
            schedule_env={f"APOGEE_SCHEDULE_{k}": v for k, v in auth.items()},
        )
    )
    known = await seed_cluster(cluster)
    rpcs = all_rpcs()
    servers, wrong = await servers_of(cluster, rpcs)
    assert not wrong, wrong
    served = [r for r in rpcs if servers[r.service]]

    signed = ClientSecurity(credentials=USER)
    made = 0
    for name, open_channel, extra in (
        ("signed as a user with data rights only", signed.channel, None),
        ("unsigned", grpc.aio.insecure_channel, nothing_gets_through),
        ("with hostile signatures", hostile_channel, nothing_gets_through),
    ):
        n, lost, findings = await fuzz(servers, served, known, open_channel, CALLS, extra)
        made += n
        print(f"{name}: {n} calls to {len(served)} methods ({lost} statuses lost)")
        assert not findings, f"{len(findings)} problems ({name}):\n" + "\n\n".join(
            str(f) for f in findings[:20]
        )
    assert made >= 3 * len(served) * CALLS

    for p in cluster.state.all():
        assert await check_health(p.address, 5.0), f"{p.name} does not answer its health check"
    # the real users are still served: the service identity, and the fuzz user on its topic
    async with AdminClient(cluster.namesrv) as admin:
        assert TOPIC in await admin.list_topics()
    async with Producer(cluster.namesrv, group="fuzz-auth-after", security=signed) as producer:
        await producer.send(ClientMessage(TOPIC, b"after the fuzz"))
    problems = log_problems(cluster)
    assert not problems, "\n\n".join(problems[:10])
    # no secret reached a log
    text = all_logs(cluster)
    assert "fuzz-user-secret" not in text
    assert "fuzz-service-secret" not in text


def all_logs(cluster: Cluster) -> str:
    return "".join(Path(p.log).read_text(errors="replace") for p in cluster.state.all())
