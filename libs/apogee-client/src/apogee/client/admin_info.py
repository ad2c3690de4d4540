"""What :class:`~apogee.client.admin.AdminClient` learns of the cluster's members: the brokers
registered with the nameservers (:class:`BrokerInfo`), what each broker says of itself
(:class:`BrokerDetails`, with its :class:`LastRecovery`), the delayed and timer messages it
holds for the schedule service (:class:`ScheduleState`), whether each nameserver answers its
health check (:class:`NameServerHealth`), and the topics each broker has with their configs
(:class:`TopicListing`: queues, permissions, the type of messages each accepts).

A question put to every broker at once gets a :class:`BrokerAnswer` from each: its value, or
the :class:`~apogee.common.errors.ApogeeError` that broker failed with, so that one broker that
does not answer hides nothing of the others. :func:`on_each`, :func:`all_or_first_error` and
:func:`drop_not_found` are how the admin client puts a question to every broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from apogee.client._rpc import ChannelPool, rpc
from apogee.common.errors import ApogeeError, InvalidArgumentError
from apogee.common.topics import (
    MESSAGE_TYPE_NAMES,
    MessageType,
    TopicConfig,
    parse_message_type,
)
from apogee.rpc.security import ClientSecurity
from apogee.rpc.server import check_health
from apogee.v1 import broker_pb2, schedule_pb2, schedule_pb2_grpc

__all__ = [
    "BrokerAnswer",
    "BrokerDetails",
    "BrokerInfo",
    "LastRecovery",
    "NameServerHealth",
    "ScheduleQueue",
    "ScheduleState",
    "TopicListing",
    "all_or_first_error",
    "answers",
    "broker_details",
    "drop_not_found",
    "nameserver_health",
    "on_each",
    "schedule_state",
    "topic_listings",
    "wire_message_type",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """A live broker as the nameservers list it (it registers every few seconds)."""

    cluster: str
    broker_name: str
    address: str
    last_heartbeat_ms: int
    topic_count: int
    auto_create_topics: bool

    @property
    def where(self) -> str:
        """How errors name it: ``broker <name> at <host:port>``."""
        return f"broker {self.broker_name} at {self.address}"


@dataclass(frozen=True, slots=True)
class BrokerAnswer(Generic[T]):
    """One broker's answer to a question put to every live broker: ``value``, or ``error``
    when it did not answer (unreachable, timed out, refused)."""

    broker: BrokerInfo
    value: T | None
    error: ApogeeError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class LastRecovery:
    """What a broker's store did to recover when the broker last started."""

    broker_name: str
    #: when recovery finished, ms since the epoch (the broker's clock)
    finished_ms: int
    #: after a clean stop; False after a crash
    clean: bool
    files_checked: int
    records_checked: int
    bytes_truncated: int
    files_quarantined: tuple[str, ...]
    entries_redispatched: int
    seconds: float
    #: the report in one line, as the broker logged it
    summary: str

    @classmethod
    def from_pb(cls, broker_name: str, r: broker_pb2.RecoveryReport) -> LastRecovery:
        return cls(
            broker_name=broker_name,
            finished_ms=r.finished_ms,
            clean=r.clean,
            files_checked=r.files_checked,
            records_checked=r.records_checked,
            bytes_truncated=r.bytes_truncated,
            files_quarantined=tuple(r.files_quarantined),
            entries_redispatched=r.entries_redispatched,
            seconds=r.seconds,
            summary=r.summary,
        )


@dataclass(frozen=True, slots=True)
class BrokerDetails:
    """What one broker says of itself (``BrokerAdmin/GetBrokerInfo``)."""

    broker_name: str
    cluster: str
    address: str
    #: how its CommitLog reaches the disk: ``"sync"`` or ``"async"``
    flush_mode: str
    auto_create_topics: bool
    #: the CommitLog's first and next physical offsets
    commitlog_min_offset: int
    commitlog_max_offset: int
    topic_count: int
    last_recovery: LastRecovery


@dataclass(frozen=True, slots=True)
class ScheduleQueue:
    """One queue of a broker's schedule topic (``SCHEDULE_TOPIC_XXXX``): its bounds and how
    far the schedule service has delivered it."""

    queue_id: int
    min_offset: int
    max_offset: int
    #: the offset the schedule service committed; -1: nothing committed
    progress: int

    @property
    def waiting(self) -> int:
        """Messages stored and not delivered yet (those removed by retention aside)."""
        return max(0, self.max_offset - max(self.progress, self.min_offset))


@dataclass(frozen=True, slots=True)
class ScheduleState:
    """The delayed and timer messages one broker holds (``Schedule/GetScheduleState``).

    Delay level ``L`` is stored in queue ``L - 1`` and waits ``delay_ms[L - 1]``; timer messages
    (a delivery time) are stored in the ``slots`` queues from ``first_slot_queue`` on, one per
    ``slot_ms`` of the wheel."""

    broker_name: str
    delay_ms: tuple[int, ...]
    first_slot_queue: int
    slots: int
    slot_ms: int
    queues: tuple[ScheduleQueue, ...]
    #: when the schedule service last committed its progress (the broker's clock); 0: never
    progress_updated_ms: int
    #: the broker's clock when it answered
    now_ms: int

    def level_of(self, queue_id: int) -> int | None:
        """The delay level stored in ``queue_id``; None for a timer queue (or another)."""
        return queue_id + 1 if 0 <= queue_id < len(self.delay_ms) else None

    def is_timer_queue(self, queue_id: int) -> bool:
        return self.first_slot_queue <= queue_id < self.first_slot_queue + self.slots

    @classmethod
    def from_pb(cls, broker_name: str, r: schedule_pb2.GetScheduleStateResponse) -> ScheduleState:
        return cls(
            broker_name=r.broker_name or broker_name,
            delay_ms=tuple(r.delay_ms),
            first_slot_queue=r.first_slot_queue,
            slots=r.slots,
            slot_ms=r.slot_ms,
            queues=tuple(
                ScheduleQueue(q.queue_id, q.min_offset, q.max_offset, q.progress)
                for q in sorted(r.queues, key=lambda q: q.queue_id)
            ),
            progress_updated_ms=r.progress_updated_ms,
            now_ms=r.now_ms,
        )


@dataclass(frozen=True, slots=True)
class NameServerHealth:
    """Whether the nameserver at ``address`` answered its gRPC health check as SERVING."""

    address: str
    ok: bool


# -- one broker ---------------------------------------------------------------------------------


async def broker_details(pool: ChannelPool, b: BrokerInfo, timeout: float) -> BrokerDetails:
    """What broker ``b`` says of itself."""
    resp = await rpc(
        b.where,
        pool.broker_admin(b.address).GetBrokerInfo(
            broker_pb2.GetBrokerInfoRequest(), timeout=timeout
        ),
    )
    return BrokerDetails(
        broker_name=b.broker_name,
        cluster=resp.cluster or b.cluster,
        address=b.address,
        flush_mode=resp.flush_mode,
        auto_create_topics=resp.auto_create_topics,
        commitlog_min_offset=resp.commitlog_min_offset,
        commitlog_max_offset=resp.commitlog_max_offset,
        topic_count=resp.topic_count,
        last_recovery=LastRecovery.from_pb(b.broker_name, resp.last_recovery),
    )


async def schedule_state(pool: ChannelPool, b: BrokerInfo, timeout: float) -> ScheduleState:
    """The delayed and timer messages broker ``b`` holds."""
    stub = schedule_pb2_grpc.ScheduleStub(pool.channel(b.address))
    resp = await rpc(
        b.where, stub.GetScheduleState(schedule_pb2.GetScheduleStateRequest(), timeout=timeout)
    )
    return ScheduleState.from_pb(b.broker_name, resp)


async def nameserver_health(
    addresses: Sequence[str], security: ClientSecurity, timeout: float
) -> list[NameServerHealth]:
    """Each nameserver's health check, all at once, in the order given (a channel of its own
    for each check: a nameserver that comes back answers at once)."""
    found = await asyncio.gather(*(check_health(a, timeout, tls=security.tls) for a in addresses))
    return [NameServerHealth(a, ok) for a, ok in zip(addresses, found, strict=True)]


# -- every broker -------------------------------------------------------------------------------


async def on_each(
    brokers: Sequence[BrokerInfo], fn: Callable[[BrokerInfo], Awaitable[T]]
) -> list[T | ApogeeError]:
    """``fn`` on every broker at once; Apogee errors are returned in place of results."""

    async def one(b: BrokerInfo) -> T | ApogeeError:
        try:
            return await fn(b)
        except ApogeeError as err:
            return err

    return list(await asyncio.gather(*(one(b) for b in brokers)))


async def answers(
    brokers: Sequence[BrokerInfo], fn: Callable[[BrokerInfo], Awaitable[T]]
) -> list[BrokerAnswer[T]]:
    """``fn`` on every broker at once, each outcome as a :class:`BrokerAnswer`."""
    outcomes = await on_each(brokers, fn)
    return [
        BrokerAnswer(b, None, o) if isinstance(o, ApogeeError) else BrokerAnswer(b, o)
        for b, o in zip(brokers, outcomes, strict=True)
    ]


def drop_not_found(outcomes: list[T | ApogeeError]) -> list[T | ApogeeError]:
    """``outcomes`` without the brokers that answered NOT_FOUND (they do not have it)."""
    return [o for o in outcomes if not (isinstance(o, ApogeeError) and o.kind.code == "NOT_FOUND")]


def all_or_first_error(outcomes: list[T | ApogeeError]) -> list[T]:
    """The results, or the first error among them raised."""
    out: list[T] = []
    for o in outcomes:
        if isinstance(o, ApogeeError):
            raise o
        out.append(o)
    return out


@dataclass(frozen=True, slots=True)
class TopicListing:
    """A topic with its config on each live broker that has it (read and write queues,
    permissions, the type of messages it accepts)."""

    name: str
    #: (broker name, the topic's config there), by broker name
    configs: tuple[tuple[str, TopicConfig], ...]

    @property
    def message_types(self) -> tuple[MessageType, ...]:
        """The types of messages it accepts: one, unless an update reached only some of its
        brokers (in :class:`MessageType`'s order)."""
        found = {c.message_type for _, c in self.configs}
        return tuple(t for t in MessageType if t in found)


async def topic_listings(
    pool: ChannelPool, brokers: Sequence[BrokerInfo], timeout: float
) -> list[TopicListing]:
    """Every topic of ``brokers`` (system topics left out), sorted by name; raises the first
    broker's error when one does not answer."""

    async def one(b: BrokerInfo) -> tuple[str, list[TopicConfig]]:
        resp = await rpc(
            b.where,
            pool.broker_admin(b.address).ListTopics(
                broker_pb2.BrokerListTopicsRequest(), timeout=timeout
            ),
        )
        return b.broker_name, [TopicConfig.from_pb(t) for t in resp.topics]

    by_name: dict[str, list[tuple[str, TopicConfig]]] = {}
    for broker, configs in all_or_first_error(await on_each(brokers, one)):
        for c in configs:
            by_name.setdefault(c.name, []).append((broker, c))
    return [
        TopicListing(name, tuple(sorted(found, key=lambda bc: bc[0])))
        for name, found in sorted(by_name.items())
    ]


def wire_message_type(value: MessageType | str | None) -> str:
    """A topic's message type as a topic config carries it: ``""`` for None (a new topic is
    MIXED, an updated one keeps its type), else the type named (any case)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgumentError(
            field="message_type",
            rule=f"must be a MessageType or one of {', '.join(MESSAGE_TYPE_NAMES)}, got {value!r}",
        )
    return parse_message_type(value, "message_type").value
