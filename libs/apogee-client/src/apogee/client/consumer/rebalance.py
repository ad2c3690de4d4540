"""Which queues a consumer reads: routes of the subscribed topics, the group's members, and
the allocation strategy (RocketMQ's RebalanceImpl).

Each consumer computes its share on its own, from the same inputs as every other member: the
topic's readable queues sorted by broker and queue id, and the member list of the first broker
(by name) that answers. In broadcasting mode every consumer reads every queue.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from apogee.client._rpc import ChannelPool, NameServerClient, rpc
from apogee.client.consumer.allocate import AllocateStrategy
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import ApogeeError, UnavailableError
from apogee.v1 import common_pb2, consumer_pb2, nameserver_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReadRoute:
    """A topic's readable queues, sorted, and the addresses of their brokers."""

    topic: str
    queues: tuple[MessageQueue, ...]
    addresses: dict[str, str]

    @classmethod
    def from_pb(cls, topic: str, resp: nameserver_pb2.GetRouteResponse) -> ReadRoute:
        addresses = {b.broker_name: b.address for b in resp.brokers if b.address}
        queues = sorted(
            (
                MessageQueue(topic, q.broker_name, i)
                for q in resp.queues
                if q.perm & common_pb2.PERM_READ and q.broker_name in addresses
                for i in range(q.read_queues)
            ),
            key=lambda mq: (mq.broker_name, mq.queue_id),
        )
        return cls(topic, tuple(queues), addresses)


async def fetch_route(namesrv: NameServerClient, topic: str) -> ReadRoute:
    return ReadRoute.from_pb(topic, await namesrv.get_route(topic))


async def group_members(
    pool: ChannelPool, route: ReadRoute, group: str, timeout: float
) -> list[str]:
    """The group's client ids from the first broker of the route (by name) that answers."""
    last: ApogeeError | None = None
    for name in sorted(route.addresses):
        address = route.addresses[name]
        try:
            resp = await rpc(
                f"broker {name} ({address})",
                pool.consumer(address).GetMembers(
                    consumer_pb2.GetMembersRequest(group=group), timeout=timeout
                ),
            )
        except ApogeeError as err:
            if not err.retriable:
                raise
            last = err
            continue
        return sorted(m.client_id for m in resp.members)
    raise UnavailableError(
        what=f"every broker of topic {route.topic!r}", detail=f"members of {group!r}: {last}"
    )


def allocate(
    strategy: AllocateStrategy,
    group: str,
    client_id: str,
    queues: Sequence[MessageQueue],
    members: Sequence[str],
) -> set[MessageQueue]:
    """This client's share; a strategy that returns queues outside the route is ignored with
    a warning rather than trusted."""
    if client_id not in members:
        return set()
    mine = set(strategy.allocate(group, client_id, queues, members))
    stray = mine - set(queues)
    if stray:
        log.warning(
            "allocation strategy %s returned %d queue(s) not in the route; ignored",
            strategy.name,
            len(stray),
        )
        mine -= stray
    return mine
