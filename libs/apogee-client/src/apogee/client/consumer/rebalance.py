"""Which queues a consumer reads: routes of the subscribed topics, the group's members, and
the allocation strategy (RocketMQ's RebalanceImpl).

Each consumer computes its share on its own, from the same inputs as every other member: the
topic's readable queues sorted by broker and queue id, and the member list of the first broker
(by name) that answers. In broadcasting mode every consumer reads every queue.

The :class:`Rebalancer` does it: at start, every ``rebalance_interval``, and at once when woken
(the group's members changed, a subscription changed, a fetch found its topic gone). It asks a
:class:`GroupDirectory` for routes and members, and tells a :class:`QueueOwner` which queues to
take and which to release. A rebalance woken because the members changed reads no route: the
routes read last still hold (a member joining or leaving changes no route), so that a join in
a group of hundreds does not send each of them to the nameservers at once. The member lists come
with the brokers' ``Session`` streams (each change is pushed, and the first event of a stream is
the whole list): :class:`ClusterDirectory` asks a broker by RPC only while it has no stream open
with it. A topic whose route or members cannot be read keeps its queues as
they are; so does a topic whose member list does not list this consumer yet (its session has
not reached that broker). The group's retry topic has no route until a broker makes it: it is
looked for again at each rebalance, quietly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from apogee.client._rpc import ChannelPool, NameServerClient, rpc
from apogee.client.consumer.allocate import AllocateStrategy
from apogee.client.consumer.config import ConsumeMode, ConsumerConfig
from apogee.client.producer.routes import MessageQueue
from apogee.common.aio import cancel_and_wait
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


class GroupDirectory(Protocol):
    """Where a rebalance reads routes and members."""

    async def route(self, topic: str) -> ReadRoute:
        """The topic's readable queues; raises when it cannot be read (or is unknown)."""
        ...

    async def members(self, route: ReadRoute) -> list[str]:
        """The group's client ids, sorted; raises when no broker of ``route`` answers."""
        ...


class ClusterDirectory:
    """Routes from the nameservers, members from the topic's brokers: the list the first of
    them (by name) pushed on this consumer's session with it, else (no session open there) by
    asking them in turn."""

    def __init__(
        self, namesrv: NameServerClient, pool: ChannelPool, group: str, timeout: float
    ) -> None:
        self._namesrv = namesrv
        self._pool = pool
        self._group = group
        self._timeout = timeout
        #: broker address -> the group's client ids, sorted, as its session stream last told
        self._pushed: dict[str, list[str]] = {}

    def members_pushed(self, address: str, client_ids: Sequence[str]) -> None:
        """The broker at ``address`` told this consumer's session the group's members."""
        self._pushed[address] = sorted(client_ids)

    def session_ended(self, address: str) -> None:
        """The session with ``address`` ended: what it pushed may be outdated from now on."""
        self._pushed.pop(address, None)

    async def route(self, topic: str) -> ReadRoute:
        return await fetch_route(self._namesrv, topic)

    async def members(self, route: ReadRoute) -> list[str]:
        if route.addresses:
            pushed = self._pushed.get(route.addresses[min(route.addresses)])
            if pushed is not None:
                return list(pushed)
        return await group_members(self._pool, route, self._group, self._timeout)


class QueueOwner(Protocol):
    """What a rebalance changes: the queues this consumer reads."""

    def owned(self) -> Collection[MessageQueue]: ...

    def take(self, mq: MessageQueue, address: str) -> None:
        """Start reading ``mq`` at its broker at ``address``."""
        ...

    async def release(self, mq: MessageQueue) -> None:
        """Stop reading ``mq`` (its offset is committed)."""
        ...


class Rebalancer:
    """Recomputes this consumer's share of the subscribed topics' queues and takes or
    releases the difference; :meth:`start` runs it in the background."""

    def __init__(
        self,
        cfg: ConsumerConfig,
        directory: GroupDirectory,
        owner: QueueOwner,
        subscriptions: Mapping[str, object],
        *,
        lock: asyncio.Lock,
        retry_topic: str | None = None,
        on_route: Callable[[ReadRoute], None] = lambda route: None,
    ) -> None:
        """``subscriptions``: the topics to read, as they are at each rebalance. ``lock``:
        held while the owned queues change (others that change them take it too).
        ``on_route``: told of every route read (to open sessions with new brokers)."""
        self.cfg = cfg
        self._directory = directory
        self._owner = owner
        self._subscriptions = subscriptions
        self.lock = lock
        self.retry_topic = retry_topic
        self._on_route = on_route
        #: the last route read of each topic
        self.routes: dict[str, ReadRoute] = {}
        self.rebalances = 0
        self._wake = asyncio.Event()
        #: the next rebalance in the background reads the routes again
        self._read_routes = False
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        #: queues are being released (each commits its offset when done)
        self._releasing = False

    def wake(self, read_routes: bool = True) -> None:
        """Rebalance now rather than at the next interval; with the routes read last unless
        ``read_routes`` (the members changed: the routes did not)."""
        self._read_routes |= read_routes
        self._wake.set()

    def address_of(self, broker_name: str) -> str | None:
        """A broker's address from the routes read so far."""
        for route in self.routes.values():
            address = route.addresses.get(broker_name)
            if address is not None:
                return address
        return None

    async def rebalance(self, read_routes: bool = True) -> None:
        """Recompute this consumer's queues and take or release the difference; with the
        routes read last (a topic without one is looked up) unless ``read_routes``."""
        async with self.lock:
            if self._stopped:
                return
            await self._rebalance_locked(read_routes)

    async def _rebalance_locked(self, read_routes: bool) -> None:
        cfg = self.cfg
        self.rebalances += 1
        wanted: set[MessageQueue] = set()
        keep_topics: set[str] = set()
        for topic in list(self._subscriptions):
            route = None if read_routes else self.routes.get(topic)
            if route is None:
                try:
                    route = await self._directory.route(topic)
                except ApogeeError as err:
                    if topic == self.retry_topic and err.kind.name == "UNKNOWN_TOPIC":
                        log.debug(
                            "route of %s: %s; looking again at the next rebalance", topic, err
                        )
                        continue
                    log.warning("route of %s: %s; keeping its queues as they are", topic, err)
                    keep_topics.add(topic)
                    continue
                self.routes[topic] = route
                self._on_route(route)
            if cfg.mode is ConsumeMode.BROADCASTING:
                wanted |= set(route.queues)
                continue
            try:
                members = await self._directory.members(route)
            except ApogeeError as err:
                log.warning("members of group %s: %s", cfg.group, err)
                keep_topics.add(topic)
                continue
            if cfg.client_id not in members:
                log.debug("%s not yet among the members of %s", cfg.client_id, members)
                keep_topics.add(topic)
                continue
            wanted |= allocate(cfg.allocate, cfg.group, cfg.client_id, route.queues, members)
        owned = self._owner.owned()
        drop = [mq for mq in owned if mq not in wanted and mq.topic not in keep_topics]
        if drop:
            self._releasing = True
            try:
                await asyncio.gather(*(self._owner.release(mq) for mq in drop))
            finally:
                self._releasing = False
            if self._stopped:
                return  # stopped meanwhile: nothing is taken any more
        add = sorted(wanted - set(self._owner.owned()), key=queue_order)
        for mq in add:
            address = self.routes[mq.topic].addresses.get(mq.broker_name)
            if address is not None:
                self._owner.take(mq, address)
        if drop or add:
            log.info(
                "group %s: %s now reads %d queue(s)",
                cfg.group,
                cfg.client_id,
                len(self._owner.owned()),
            )

    # -- in the background -------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None and not self._stopped:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="apogee-rebalance"
            )

    async def stop(self) -> None:
        """Stop rebalancing: the loop ends, and :meth:`rebalance` does nothing any more. Queues
        being released finish first (each within ``close_timeout`` and a commit): one cut short
        would be neither owned nor committed."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None and self._releasing:
            self._wake.set()
            await asyncio.wait((task,))  # the loop ends after this rebalance
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            read_routes = False
            try:
                async with asyncio.timeout(self.cfg.rebalance_interval):
                    await self._wake.wait()
            except TimeoutError:
                read_routes = True  # the periodic rebalance looks for route changes
            self._wake.clear()
            read_routes |= self._read_routes
            self._read_routes = False
            if self._stopped:
                return
            try:
                await self.rebalance(read_routes)
            except Exception:
                log.exception("rebalance of group %s failed; trying again", self.cfg.group)
                await asyncio.sleep(1.0)


def queue_order(mq: MessageQueue) -> tuple[str, str, int]:
    """Queues sorted by topic, broker and queue id."""
    return (mq.topic, mq.broker_name, mq.queue_id)
