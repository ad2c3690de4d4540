"""The route registry: which live broker serves which topic, kept in memory.

Every broker registers with every nameserver and repeats the registration as its heartbeat
(every 30 s by default). A full registration carries the broker's whole set of topic configs,
which replaces the set it sent before, and the number of that topic table (``topics_version``).
A heartbeat with nothing changed is short (:meth:`RouteRegistry.refresh_broker`): "my topics
are those you hold at this version". It refreshes a live broker held at the same cluster,
address, epoch and version and touches nothing else; anything else is refused, changing
nothing (an epoch below the live one's is refused as in a full registration), and the broker
sends the full list at once. A broker silent for longer than the
expiry (120 s by default) is no longer live: routes and cluster info leave it out at once, and
:meth:`RouteRegistry.expire` (called by the expiry loop) drops it. Nameservers never talk to
each other; a nameserver that restarts learns the whole cluster again within one heartbeat
interval.

A route lists, for one topic, the queue config of each live broker that has it and the address
of each such broker. A topic that no live broker has gets, as in RocketMQ, the route of the
template topic ``TBW102`` of the live brokers that create topics automatically (its queue
config, under the asked-for name): the producer's first send then makes the broker create the
topic from that template. Without such a broker the topic has no route
(:class:`~apogee.common.errors.UnknownTopicError`).

Brokers are identified by name (names are unique across clusters, as in RocketMQ). A
registration under a known name with a new address or cluster moves the broker there.

A broker name may be a replica group (docs/replication.md): only its leader registers, with the
group's epoch. While a registration is live, one with a lower epoch is refused
(:class:`~apogee.common.errors.StaleEpochError`) and an unregistration with another epoch is
ignored, so an old leader that has not yet noticed its replacement cannot take the routes back
from the new one, which heartbeats (RocketMQ #7017). The fence ends with the registration: a
name whose leader went silent for the expiry takes any epoch again (else a stray registration
with a high epoch would lock the name out for the nameserver's life). A lone broker registers
with epoch 0. A nameserver that restarts learns the epochs again from the leaders' heartbeats.
Liveness is measured on the clock's monotonic time, so a step of the wall clock neither drops
nor revives brokers; the wall clock only stamps ``last_heartbeat_ms`` for display.

For the metrics, the registry also remembers every broker and every cluster that registered
since it was made, after they expire or unregister: :meth:`RouteRegistry.broker_liveness` lists
such a broker as not live (under the cluster it registered in last) until it registers again,
and :meth:`RouteRegistry.live_counts` counts 0 brokers for a cluster whose last broker left.

The registry is not thread-safe: the service's event loop owns it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import InvalidArgumentError, StaleEpochError, UnknownTopicError
from apogee.common.topics import (
    ALL_PERMS,
    AUTO_CREATE_TEMPLATE_TOPIC,
    Perm,
    TopicConfig,
    is_system_topic,
    validate_topic,
)

log = logging.getLogger(__name__)

DEFAULT_EXPIRY_S: Final = 120.0

#: Queue counts above this are refused (RocketMQ's queue ids are small; this guards typos).
MAX_QUEUES: Final = 65_535
MAX_NAME_LENGTH: Final = 255

NO_ROUTE: Final = "has no route: no live broker serves it (create it with `apogee topic create`)"
NO_BROKER: Final = (
    "has no route: no broker is registered with this nameserver "
    "(are the brokers running, and is this nameserver in their list?)"
)


@dataclass(frozen=True, slots=True)
class QueueData:
    """A topic's queues on one broker."""

    broker_name: str
    read_queues: int
    write_queues: int
    perm: int
    #: what the topic accepts there (:class:`~apogee.common.topics.MessageType`'s value)
    message_type: str = "MIXED"


@dataclass(frozen=True, slots=True)
class BrokerData:
    """Where a broker is."""

    cluster: str
    broker_name: str
    address: str


@dataclass(frozen=True, slots=True)
class Route:
    """The answer to "who serves this topic": queue data and broker data, by broker name.

    ``auto_create`` is true when the route is that of the template topic ``TBW102``: the topic
    does not exist yet and the first send creates it.
    """

    topic: str
    queues: tuple[QueueData, ...]
    brokers: tuple[BrokerData, ...]
    auto_create: bool = False


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """A registered broker, as cluster info shows it."""

    cluster: str
    broker_name: str
    address: str
    last_heartbeat_ms: int
    topic_count: int
    auto_create_topics: bool
    epoch: int = 0
    #: the version of the broker's topic table held (what its registration said)
    topics_version: int = 0


@dataclass(frozen=True, slots=True)
class BrokerLiveness:
    """A broker registered since the registry was made: whether it is live now."""

    cluster: str
    broker_name: str
    live: bool


@dataclass(slots=True)
class _Broker:
    cluster: str
    name: str
    address: str
    topics: dict[str, TopicConfig]
    auto_create_topics: bool
    last_heartbeat_ms: int
    last_seen: float  # clock.monotonic() seconds
    epoch: int = 0
    #: the number of the broker's topic table these topics are (a short heartbeat must match)
    topics_version: int = 0

    def data(self) -> BrokerData:
        return BrokerData(self.cluster, self.name, self.address)

    def info(self) -> BrokerInfo:
        return BrokerInfo(
            cluster=self.cluster,
            broker_name=self.name,
            address=self.address,
            last_heartbeat_ms=self.last_heartbeat_ms,
            topic_count=len(self.topics),
            auto_create_topics=self.auto_create_topics,
            epoch=self.epoch,
            topics_version=self.topics_version,
        )


class RouteRegistry:
    """Brokers, their topics and their liveness. See the module docstring."""

    def __init__(self, expiry_s: float = DEFAULT_EXPIRY_S, clock: Clock = SYSTEM_CLOCK) -> None:
        if not expiry_s > 0:
            raise InvalidArgumentError(
                field="broker_expiry_s", rule=f"must be greater than 0, got {expiry_s!r}"
            )
        self.expiry_s = expiry_s
        self._clock = clock
        self._brokers: dict[str, _Broker] = {}
        #: every broker registered since the start -> the cluster it registered in last
        self._known: dict[str, str] = {}
        #: every cluster a broker registered in since the start
        self._clusters: set[str] = set()

    @property
    def expiry_ms(self) -> int:
        return round(self.expiry_s * 1000)

    # -- brokers ------------------------------------------------------------------------------

    def register_broker(
        self,
        cluster: str,
        broker_name: str,
        address: str,
        topics: Sequence[TopicConfig],
        auto_create_topics: bool = False,
        heartbeat_interval_ms: int = 0,
        epoch: int = 0,
        topics_version: int = 0,
    ) -> bool:
        """Register a broker or refresh it (the registration is its heartbeat); its topic set
        becomes exactly ``topics``, held as the broker's table ``topics_version``. Returns
        whether the broker is new (first registration, or first since it expired or
        unregistered). Raises :class:`~apogee.common.errors.InvalidArgumentError` for bad input and
        :class:`~apogee.common.errors.StaleEpochError` for an epoch below the highest seen
        for the name, changing nothing."""
        _check_name("cluster", cluster)
        _check_name("broker_name", broker_name)
        _check_address(address)
        table = _check_topics(topics)
        now_ms, now = self._clock.time_ms(), self._clock.monotonic()
        old = self._brokers.get(broker_name)
        is_new = old is None or not self._live(old, now)
        known_epoch = 0 if old is None or is_new else old.epoch
        if epoch < known_epoch:
            raise StaleEpochError(
                what=f"the registration of {address}",
                epoch=epoch,
                broker=broker_name,
                current=known_epoch,
            )
        if is_new and heartbeat_interval_ms >= self.expiry_ms:
            log.warning(
                "broker %s heartbeats every %d ms, not less than the expiry of %d ms: "
                "it will be dropped between heartbeats",
                broker_name,
                heartbeat_interval_ms,
                self.expiry_ms,
            )
        if epoch > known_epoch:
            if old is not None and not is_new:
                log.info(
                    "broker %s: epoch %d (leader at %s) replaces epoch %d (at %s)",
                    broker_name,
                    epoch,
                    address,
                    known_epoch,
                    old.address,
                )
        elif old is not None and not is_new and (old.address, old.cluster) != (address, cluster):
            log.warning(
                "broker %s moved from %s (cluster %s) to %s (cluster %s)",
                broker_name,
                old.address,
                old.cluster,
                address,
                cluster,
            )
        self._brokers[broker_name] = _Broker(
            cluster=cluster,
            name=broker_name,
            address=address,
            topics=table,
            auto_create_topics=auto_create_topics,
            last_heartbeat_ms=now_ms,
            last_seen=now,
            epoch=epoch,
            topics_version=topics_version,
        )
        self._known[broker_name] = cluster
        self._clusters.add(cluster)
        if is_new:
            log.info(
                "broker %s registered: cluster %s, address %s, %d topics, auto-create %s",
                broker_name,
                cluster,
                address,
                len(table),
                "on" if auto_create_topics else "off",
            )
        return is_new

    def refresh_broker(
        self,
        cluster: str,
        broker_name: str,
        address: str,
        topics_version: int,
        auto_create_topics: bool = False,
        epoch: int = 0,
    ) -> bool:
        """A short heartbeat: the broker says its topics are those it registered last, as its
        table ``topics_version``. Refreshes the broker, keeping its topics untouched, and returns
        True when it is live here under the same cluster, address, epoch, auto-creation and
        version; otherwise returns False and changes nothing (the broker must send its topics).
        Raises as :meth:`register_broker` for bad names and for an epoch below that of the
        live registration."""
        _check_name("cluster", cluster)
        _check_name("broker_name", broker_name)
        _check_address(address)
        now = self._clock.monotonic()
        old = self._brokers.get(broker_name)
        if old is None or not self._live(old, now):
            return False
        if epoch < old.epoch:
            raise StaleEpochError(
                what=f"the registration of {address}",
                epoch=epoch,
                broker=broker_name,
                current=old.epoch,
            )
        held = (old.cluster, old.address, old.epoch, old.auto_create_topics, old.topics_version)
        if held != (cluster, address, epoch, auto_create_topics, topics_version):
            return False
        old.last_seen = now
        old.last_heartbeat_ms = self._clock.time_ms()
        return True

    def unregister_broker(
        self, cluster: str, broker_name: str, address: str, epoch: int = 0
    ) -> bool:
        """Forget a broker that is shutting down. Only the registration with this exact cluster,
        address and epoch is removed (a late call from an old address or an old leader cannot
        remove the broker that replaced it). Returns whether one was removed; unregistering
        twice is not an error."""
        _check_name("cluster", cluster)
        _check_name("broker_name", broker_name)
        _check_address(address)
        entry = self._brokers.get(broker_name)
        if entry is None or (entry.cluster, entry.address, entry.epoch) != (
            cluster,
            address,
            epoch,
        ):
            return False
        del self._brokers[broker_name]
        log.info("broker %s (%s, cluster %s) unregistered", broker_name, address, cluster)
        return True

    def expire(self) -> list[BrokerInfo]:
        """Drop every broker silent for longer than the expiry; return what was dropped."""
        now = self._clock.monotonic()
        dropped = [b for b in self._brokers.values() if not self._live(b, now)]
        for b in dropped:
            del self._brokers[b.name]
        return [b.info() for b in dropped]

    # -- queries ------------------------------------------------------------------------------

    def route(self, topic: str) -> Route:
        """The route of ``topic`` over the live brokers (see the module docstring)."""
        validate_topic(topic)
        live = self._live_brokers()
        holders = [b for b in live if topic in b.topics]
        if holders:
            return Route(
                topic=topic,
                queues=tuple(_queue_data(b.name, b.topics[topic]) for b in holders),
                brokers=tuple(b.data() for b in holders),
            )
        creators = [
            b for b in live if b.auto_create_topics and AUTO_CREATE_TEMPLATE_TOPIC in b.topics
        ]
        if creators:
            # what the broker will create: the template's queues, without the inherit bit
            return Route(
                topic=topic,
                queues=tuple(
                    _queue_data(b.name, b.topics[AUTO_CREATE_TEMPLATE_TOPIC], inherit=False)
                    for b in creators
                ),
                brokers=tuple(b.data() for b in creators),
                auto_create=True,
            )
        raise UnknownTopicError(topic=topic, detail=NO_ROUTE if live else NO_BROKER)

    def cluster_info(self) -> list[BrokerInfo]:
        """The live brokers, by cluster then name."""
        return sorted(
            (b.info() for b in self._live_brokers()), key=lambda i: (i.cluster, i.broker_name)
        )

    def broker_liveness(self) -> list[BrokerLiveness]:
        """Every broker registered since the registry was made, by cluster then name, and
        whether it is live now: one that expired or unregistered stays listed, not live, until
        it registers again (a broker that moved is listed under its latest cluster only)."""
        now = self._clock.monotonic()
        out = []
        for name, cluster in self._known.items():
            b = self._brokers.get(name)
            out.append(BrokerLiveness(cluster, name, b is not None and self._live(b, now)))
        return sorted(out, key=lambda x: (x.cluster, x.broker_name))

    def live_counts(self) -> dict[str, int]:
        """Live brokers by cluster, sorted, for every cluster a broker registered in since the
        registry was made: 0 for a cluster whose brokers all expired, unregistered or moved."""
        counts = dict.fromkeys(sorted(self._clusters), 0)
        for b in self._live_brokers():
            counts[b.cluster] += 1
        return counts

    def list_topics(self) -> list[str]:
        """Sorted names of the topics of the live brokers, system topics left out (retry and
        dead-letter topics are listed: users inspect and redrive them)."""
        names = {
            t.name
            for b in self._live_brokers()
            for t in b.topics.values()
            if not (t.system or is_system_topic(t.name))
        }
        return sorted(names)

    # -- internals ----------------------------------------------------------------------------

    def _live(self, broker: _Broker, now: float) -> bool:
        return now - broker.last_seen <= self.expiry_s

    def _live_brokers(self) -> list[_Broker]:
        now = self._clock.monotonic()
        return sorted(
            (b for b in self._brokers.values() if self._live(b, now)), key=lambda b: b.name
        )


def _queue_data(broker_name: str, t: TopicConfig, inherit: bool = True) -> QueueData:
    perm = t.perm if inherit else t.perm & ~Perm.INHERIT
    return QueueData(broker_name, t.read_queues, t.write_queues, perm, t.message_type.value)


def _check_name(field: str, value: str) -> None:
    if not value:
        raise InvalidArgumentError(field=field, rule="must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidArgumentError(
            field=field,
            rule=f"is {len(value)} characters; at most {MAX_NAME_LENGTH} are allowed",
        )
    if any(c.isspace() or not c.isprintable() for c in value):
        raise InvalidArgumentError(
            field=field, rule=f"{value!r} must not contain spaces or control characters"
        )


def _check_address(address: str) -> None:
    if not address:
        raise InvalidArgumentError(field="address", rule="must not be empty")
    shape = f"{address!r} must be host:port, with a port from 1 to 65535"
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # [IPv6]:port
    elif ":" in host:
        raise InvalidArgumentError(
            field="address", rule=f"{address!r}: an IPv6 host must be in brackets, as [::1]:10911"
        )
    if not sep or not host or any(c.isspace() or not c.isprintable() for c in host):
        raise InvalidArgumentError(field="address", rule=shape)
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise InvalidArgumentError(field="address", rule=shape)


def _check_topics(topics: Sequence[TopicConfig]) -> dict[str, TopicConfig]:
    table: dict[str, TopicConfig] = {}
    for t in topics:
        validate_topic(t.name)
        if t.name in table:
            raise InvalidArgumentError(
                field="topics", rule=f"topic {t.name!r} appears more than once"
            )
        for field, count in (("read_queues", t.read_queues), ("write_queues", t.write_queues)):
            if not 0 <= count <= MAX_QUEUES:
                raise InvalidArgumentError(
                    field=f"topics[{t.name!r}].{field}",
                    rule=f"must be from 0 to {MAX_QUEUES}, got {count}",
                )
        if not 0 <= t.perm <= ALL_PERMS:
            raise InvalidArgumentError(
                field=f"topics[{t.name!r}].perm",
                rule=f"must be a bit set of 1 (inherit), 2 (write) and 4 (read), got {t.perm}",
            )
        table[t.name] = t
    return table
