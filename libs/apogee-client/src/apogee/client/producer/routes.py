"""The producer's route cache: which queues of which brokers a topic can be written to.

A route comes from any reachable nameserver (:class:`~apogee.client._rpc.NameServerClient`). Its
queue list holds, for every broker with write permission on the topic and a known address,
queue ids ``0 .. write_queues - 1``, sorted by broker name then queue id — a stable order, so
the sharding-key selector maps a key to the same queue while the route is unchanged.

Routes are fetched on first use (concurrent lookups of one topic share one request), refreshed
every ``interval`` seconds by the producer (:meth:`RouteCache.refresh_all` in a
:class:`~apogee.common.aio.PeriodicLoop`), and refreshed in the background after a
send fails (:meth:`RouteCache.refresh_soon`). A refresh that fails keeps the route it had.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from apogee.client._rpc import NameServerClient
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import ApogeeError, PermissionDeniedError
from apogee.common.topics import Perm
from apogee.v1 import nameserver_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MessageQueue:
    topic: str
    broker_name: str
    queue_id: int


@dataclass(frozen=True, slots=True)
class TopicRoute:
    """A topic's writable queues, in stable order, and the addresses of their brokers."""

    topic: str
    queues: tuple[MessageQueue, ...]
    addresses: dict[str, str]
    by_broker: dict[str, tuple[MessageQueue, ...]] = field(default_factory=dict)

    @property
    def broker_names(self) -> list[str]:
        return list(self.by_broker)

    @classmethod
    def build(
        cls, topic: str, queue_data: Iterable[tuple[str, int, int]], addresses: dict[str, str]
    ) -> TopicRoute:
        """From (broker name, write queues, perm) triples and broker addresses."""
        by_broker: dict[str, tuple[MessageQueue, ...]] = {}
        for name, write_queues, perm in sorted(queue_data):
            if not perm & Perm.WRITE or name not in addresses or write_queues <= 0:
                continue
            by_broker[name] = tuple(MessageQueue(topic, name, q) for q in range(write_queues))
        queues = tuple(q for name in sorted(by_broker) for q in by_broker[name])
        return cls(topic, queues, dict(addresses), by_broker)

    @classmethod
    def from_pb(cls, topic: str, resp: nameserver_pb2.GetRouteResponse) -> TopicRoute:
        addresses = {b.broker_name: b.address for b in resp.brokers if b.address}
        return cls.build(
            topic, ((q.broker_name, q.write_queues, q.perm) for q in resp.queues), addresses
        )


class RouteCache:
    """Routes by topic; addresses by broker name (the latest any route reported)."""

    def __init__(
        self,
        namesrv: NameServerClient,
        clock: Clock = SYSTEM_CLOCK,
        min_refresh_interval: float = 0.5,
    ) -> None:
        self._namesrv = namesrv
        self._clock = clock
        self._min_refresh_interval = min_refresh_interval
        self._refreshing: set[str] = set()
        self._routes: dict[str, TopicRoute] = {}
        self._fetched_at: dict[str, float] = {}
        self._fetching: dict[str, asyncio.Future[TopicRoute]] = {}
        self._addresses: dict[str, str] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.fetches = 0

    def cached(self, topic: str) -> TopicRoute | None:
        return self._routes.get(topic)

    def topics(self) -> list[str]:
        return list(self._routes)

    def address_of(self, broker_name: str) -> str | None:
        return self._addresses.get(broker_name)

    async def get(self, topic: str) -> TopicRoute:
        """The cached route, else one fetched now. Raises when the topic has no route, or no
        writable queue."""
        route = self._routes.get(topic)
        if route is None:
            route = await self.fetch(topic)
        if not route.queues:
            raise PermissionDeniedError(
                what=f"topic {topic!r}", rule="no live broker accepts writes to it (perm)"
            )
        return route

    async def fetch(self, topic: str) -> TopicRoute:
        """A fresh route; concurrent calls for one topic share one nameserver request."""
        pending = self._fetching.get(topic)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._fetching[topic] = pending
            try:
                route = await self._fetch(topic)
            except BaseException as exc:
                if isinstance(exc, Exception):
                    pending.set_exception(exc)
                    pending.exception()  # retrieved: waiters re-raise it, none may exist
                else:
                    pending.cancel()
                raise
            else:
                pending.set_result(route)
                return route
            finally:
                del self._fetching[topic]
        return await asyncio.shield(pending)

    async def _fetch(self, topic: str) -> TopicRoute:
        self.fetches += 1
        resp = await self._namesrv.get_route(topic)
        route = TopicRoute.from_pb(topic, resp)
        self._addresses.update(route.addresses)
        old = self._routes.get(topic)
        if old is None or old.queues != route.queues or old.addresses != route.addresses:
            log.info(
                "route of %s: %d writable queues on %s",
                topic,
                len(route.queues),
                ", ".join(f"{n}@{a}" for n, a in sorted(route.addresses.items())) or "no broker",
            )
        self._routes[topic] = route
        self._fetched_at[topic] = self._clock.monotonic()
        return route

    def refresh_soon(self, topic: str) -> None:
        """Refresh ``topic``'s route in the background: once however often it is asked, and
        not again within ``min_refresh_interval`` seconds of the last fetch (a burst of failed
        sends costs one nameserver call)."""
        if topic in self._refreshing or topic in self._fetching:
            return
        last = self._fetched_at.get(topic)
        if last is not None and self._clock.monotonic() - last < self._min_refresh_interval:
            return
        self._refreshing.add(topic)
        task = asyncio.get_running_loop().create_task(self._refresh_quietly(topic))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda _: self._refreshing.discard(topic))

    async def _refresh_quietly(self, topic: str) -> None:
        try:
            await self.fetch(topic)
        except ApogeeError as err:
            log.warning("refreshing the route of %s failed: %s", topic, err)

    async def refresh_all(self) -> None:
        """Refresh every cached route; failures are logged and keep the old route."""
        topics = self.topics()
        if topics:
            await asyncio.gather(*(self._refresh_quietly(t) for t in topics))

    async def close(self) -> None:
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
