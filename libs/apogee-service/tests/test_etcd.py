"""EtcdClient against a real etcd (apogee.testkit.etcd: Debian's etcd on free ports): keys and
their revisions, compare-and-set txns, leases, several endpoints and an etcd that cannot be
reached."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest

from apogee.common.errors import InvalidArgumentError, UnavailableError
from apogee.service.etcd import EtcdClient, Guard, Put, prefix_end
from apogee.testkit import etcd as etcd_kit
from apogee.testkit.etcd import EtcdServer
from apogee.testkit.ports import free_port

pytestmark = pytest.mark.integration

#: one etcd for the module
etcd_server = etcd_kit.etcd_server


@pytest.fixture
async def client(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd_server.endpoint], timeout_s=2.0) as c:
        yield c


@pytest.fixture
def prefix() -> str:
    """Keys of this test only (the etcd is the module's)."""
    return f"/test/{uuid.uuid4().hex}/"


async def test_put_get_delete_and_revisions(client: EtcdClient, prefix: str) -> None:
    key = prefix + "k"
    assert await client.get(key) is None
    first = await client.put(key, "one")
    assert await client.get(key) == (b"one", first, first)
    second = await client.put(key, b"two")
    assert second > first
    assert await client.get(key) == (b"two", second, first)
    assert await client.delete(key) == 1
    assert await client.get(key) is None
    assert await client.delete(key) == 0


async def test_get_prefix_reads_only_the_prefix(client: EtcdClient, prefix: str) -> None:
    await client.put(prefix + "a", "1")
    await client.put(prefix + "b", "2")
    await client.put(prefix[:-1] + "x", "outside")
    found = await client.get_prefix(prefix)
    assert sorted(found) == [(prefix + "a").encode(), (prefix + "b").encode()]
    assert found[(prefix + "b").encode()].value == b"2"


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_txn_writes_only_when_every_guard_holds(client: EtcdClient, prefix: str) -> None:
    key, other = prefix + "record", prefix + "other"
    created = await client.txn([Guard.absent(key)], [Put(key, "v1"), Put(other, "x")], [other])
    assert created.succeeded
    assert created.found == {other.encode(): (b"x", created.revision, created.revision)}
    assert await client.get(key) == (b"v1", created.revision, created.revision)

    again = await client.txn([Guard.absent(key)], [Put(key, "lost")])
    assert not again.succeeded
    assert again.found == {}
    stale = await client.txn([Guard.mod_revision(key, created.revision - 1)], [Put(key, "lost")])
    assert not stale.succeeded
    moved = await client.txn([Guard.mod_revision(key, created.revision)], [Put(key, "v2")])
    assert moved.succeeded
    assert await client.get(key) == (b"v2", moved.revision, created.revision)


async def test_lease_keep_alive_and_revoke(client: EtcdClient, prefix: str) -> None:
    key = prefix + "leased"
    lease = await client.grant(5)
    done = await client.txn([Guard.absent(key)], [Put(key, "me", lease=lease)])
    assert done.succeeded
    assert await client.keep_alive(lease) == 5
    assert await client.keep_alive(lease) == 5  # a stream per renewal, each closed after it
    await client.revoke(lease)
    assert await client.get(key) is None  # the key went with its lease
    assert await client.keep_alive(lease) == 0
    await client.revoke(lease)  # gone already: no error


async def test_a_dead_endpoint_is_skipped(etcd_server: EtcdServer, prefix: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with EtcdClient([dead, f"http://{etcd_server.endpoint}"], timeout_s=2.0) as c:
        await c.put(prefix + "k", "v")
        assert (await c.get(prefix + "k")) is not None
        lease = await c.grant(3)
        assert await c.keep_alive(lease) == 3
        await c.revoke(lease)


async def test_no_endpoint_answers(etcd_server: EtcdServer) -> None:
    refused = f"127.0.0.1:{free_port()}"
    async with EtcdClient([refused, etcd_server.endpoint], timeout_s=0.5) as c:
        with etcd_server.paused():
            started = time.monotonic()
            with pytest.raises(UnavailableError) as caught:
                await c.get("/any")
            took = time.monotonic() - started
    assert took < 0.5 + 0.3
    message = str(caught.value)
    assert refused in message
    assert etcd_server.endpoint in message
    assert "get b'/any'" in message
    assert "UNAVAILABLE" in message
    assert "DEADLINE_EXCEEDED" in message


@pytest.mark.parametrize(
    ("endpoints", "timeout_s", "field"),
    [
        ([], 1.0, "endpoints"),
        (["localhost"], 1.0, "endpoints"),
        (["https://127.0.0.1:2379"], 1.0, "endpoints"),
        (["127.0.0.1:1"], 0.0, "timeout_s"),
    ],
)
def test_bad_settings(endpoints: list[str], timeout_s: float, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        EtcdClient(endpoints, timeout_s)
