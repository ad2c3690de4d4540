"""Test helpers for code that uses the SDK: an in-process Apogee cluster.

:class:`InProcessCluster` runs nameservers and brokers inside the current event loop, each a
real gRPC server on a free port of 127.0.0.1, the brokers' stores on small files under a folder
of yours (``apogee-cli`` depends on ``apogee-nameserver`` and ``apogee-broker`` for this)::

    async with InProcessCluster(tmp_path) as cluster:
        await cluster.create_topic("Orders")
        async with Producer(cluster.namesrv) as producer:
            await producer.send(Message("Orders", b"..."))

Brokers register with every nameserver when they start and again whenever their topics change;
:meth:`InProcessCluster.start` returns once every nameserver lists every broker.
:func:`~apogee.testkit.waiting.eventually` (polls with a deadline) is importable from here too.

:func:`wait_committed` waits until a group has committed the end of every queue of a topic: a
test that must see that nothing more arrives (no duplicate, nothing filtered out) waits for
that, not for a while - whatever the group's consumers were given reached them before its
offset was committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from apogee.client.admin import AdminClient
from apogee.common.errors import NotFoundError
from apogee.testkit.waiting import eventually
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc

if TYPE_CHECKING:
    from apogee_broker.app import BrokerApp
    from apogee_nameserver.app import NameServerApp

__all__ = [
    "DEFAULT_BROKERS",
    "DEFAULT_CLUSTER",
    "InProcessCluster",
    "eventually",
    "wait_committed",
]

DEFAULT_CLUSTER = "TestCluster"
DEFAULT_BROKERS = ("broker-a", "broker-b")


class InProcessCluster:
    """Nameservers and brokers in this process; stopped on exit even when the body fails."""

    def __init__(
        self,
        root: Path,
        nameservers: int = 2,
        brokers: Sequence[str] = DEFAULT_BROKERS,
        cluster: str = DEFAULT_CLUSTER,
        **broker_options: Any,
    ) -> None:
        self.root = Path(root)
        self.cluster = cluster
        self._nameserver_count = nameservers
        self._broker_names = tuple(brokers)
        self.broker_options = broker_options
        self.nameservers: list[NameServerApp] = []
        self.brokers: dict[str, BrokerApp] = {}

    async def __aenter__(self) -> InProcessCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def namesrv(self) -> str:
        """The nameservers' addresses, ``host:port;host:port``."""
        return ";".join(f"127.0.0.1:{ns.port}" for ns in self.nameservers)

    async def start(self) -> None:
        try:
            for _ in range(self._nameserver_count):
                await self.start_nameserver()
            for name in self._broker_names:
                await self.start_broker(name)
            await self.wait_registered(set(self._broker_names))
        except BaseException:
            await self.stop()
            raise

    async def start_nameserver(self) -> NameServerApp:
        from apogee.common.settings import load  # noqa: PLC0415
        from apogee_nameserver.app import NameServerApp  # noqa: PLC0415
        from apogee_nameserver.settings import NameServerSettings  # noqa: PLC0415

        settings = load(
            NameServerSettings,
            "nameserver",
            None,
            None,
            listen="127.0.0.1:0",
            metrics_listen="127.0.0.1:0",
            shutdown_grace_s=0.5,
        )
        app = NameServerApp(settings)
        await app.start()
        self.nameservers.append(app)
        return app

    async def start_broker(self, name: str, **overrides: Any) -> BrokerApp:
        """Start (or restart, on its old data) broker ``name``."""
        from apogee.testkit.broker import small_settings  # noqa: PLC0415
        from apogee_broker.app import BrokerApp  # noqa: PLC0415

        options = {
            "cluster": self.cluster,
            "broker_name": name,
            "namesrv": self.namesrv,
            "shutdown_grace_s": 0.5,
            **self.broker_options,
            **overrides,
        }
        settings = small_settings(self.root / name, **options)
        app = BrokerApp(settings)
        await app.start()
        self.brokers[name] = app
        return app

    async def stop_broker(self, name: str) -> None:
        await self.brokers.pop(name).stop()

    async def stop(self) -> None:
        for name in list(self.brokers):
            await self.stop_broker(name)
        nameservers, self.nameservers = self.nameservers, []
        for ns in nameservers:
            await ns.stop()

    async def wait_registered(self, names: set[str], timeout: float = 5.0) -> None:
        """Until every nameserver lists exactly ``names`` as its live brokers."""

        async def registered() -> bool:
            for ns in self.nameservers:
                async with AdminClient(f"127.0.0.1:{ns.port}") as admin:
                    if {b.broker_name for b in await admin.cluster_info()} != names:
                        return False
            return True

        await eventually(registered, timeout, f"registration of {sorted(names)}")

    async def create_topic(self, name: str, queues: int = 4) -> None:
        """Create ``name`` on every running broker; return once every nameserver routes it to
        all of them."""
        async with AdminClient(self.namesrv) as admin:
            await admin.create_or_update_topic(name, queues=queues)
        await self.wait_route(name, set(self.brokers))

    async def wait_route(self, topic: str, brokers: set[str], timeout: float = 5.0) -> None:
        """Until every nameserver routes ``topic`` to exactly ``brokers``."""

        async def routed() -> bool:
            for ns in self.nameservers:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{ns.port}") as ch:
                    stub = nameserver_pb2_grpc.NameServerStub(ch)
                    try:
                        resp = await stub.GetRoute(
                            nameserver_pb2.GetRouteRequest(topic=topic), timeout=1.0
                        )
                    except grpc.aio.AioRpcError:
                        return False
                    if {q.broker_name for q in resp.queues} != brokers:
                        return False
            return True

        await eventually(routed, timeout, f"the route of {topic} to {sorted(brokers)}")


async def wait_committed(
    namesrv: str, group: str, topic: str, queues: int, timeout: float = 15.0
) -> None:
    """Until ``group`` has committed the end of each of the ``queues`` queues of ``topic`` (as
    every broker's DescribeGroup tells): everything in them consumed, or filtered out."""

    async with AdminClient(namesrv) as admin:

        async def caught_up() -> bool:
            try:
                found = await admin.describe_group(group)
            except NotFoundError:
                return False
            mine = [q for q in found.queues if q.topic == topic]
            # an empty queue needs no commit
            return len(mine) == queues and all(
                q.broker_offset in (q.consumer_offset, 0) for q in mine
            )

        await eventually(
            caught_up, timeout, f"{group} committed the end of the {queues} queues of {topic}"
        )
