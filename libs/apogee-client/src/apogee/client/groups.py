"""Consumer groups as administration sees them: what :class:`~apogee.client.AdminClient`'s
:meth:`~apogee.client.AdminClient.list_groups`, :meth:`~apogee.client.AdminClient.describe_group`
and :meth:`~apogee.client.AdminClient.reset_offsets` return, and how the answers of several
brokers merge into one view.

A member keeps a session with every broker, so each broker reports it: members are merged by
client id (the latest heartbeat wins; different subscriptions on different brokers are a
warning). Queues are per broker, so their rows are simply gathered. The protocol's -1 for
"unknown" becomes ``None`` here, never a number.

A group is consumed either by queue offsets (Apogee's SDK: ``"OFFSETS"``) or by POP (the
official RocketMQ 5 clients: ``"POP"``). A POP group has no members; each broker names the
official clients connected to it instead (:class:`OfficialClientInfo`, one per broker that
reports the client), and each queue counts the messages handed out and not acked
(``in_flight``) and, of those, the ones still invisible (``invisible``).
"""

from __future__ import annotations

from dataclasses import dataclass

from apogee.client.producer.config import GROUP_RE
from apogee.common.errors import InvalidArgumentError
from apogee.v1 import consumer_pb2

__all__ = [
    "MODE_NAMES",
    "OFFSETS",
    "POP",
    "UNKNOWN_MODE",
    "GroupDescription",
    "GroupMember",
    "GroupSummary",
    "MemberSubscription",
    "OfficialClientInfo",
    "QueueLag",
    "ResetOffset",
    "check_group_name",
    "merge_descriptions",
    "merge_group_lists",
]

#: A group's consume mode as :class:`GroupSummary` and :class:`GroupMember` report it: the
#: values of :class:`apogee.client.consumer.config.ConsumeMode`, or ``"unknown"``.
MODE_NAMES: dict[int, str] = {
    consumer_pb2.CLUSTERING: "clustering",
    consumer_pb2.BROADCASTING: "broadcasting",
}
UNKNOWN_MODE = "unknown"

#: How a group consumes (:attr:`GroupDescription.consumption`): by POP (official RocketMQ 5
#: clients) or by queue offsets (Apogee's SDK); ``""`` when no broker knows yet.
POP = "POP"
OFFSETS = "OFFSETS"


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """A consumer group as the brokers know it: members online (the most any broker
    counts), mode, subscribed topics, and the brokers that know it."""

    group: str
    members: int
    mode: str
    topics: tuple[str, ...]
    brokers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class MemberSubscription:
    topic: str
    tag_expression: str
    #: "": no SQL92 condition
    sql_expression: str = ""


@dataclass(frozen=True, slots=True)
class GroupMember:
    """One consumer of a group, merged over the brokers it keeps a session with."""

    client_id: str
    host: str
    mode: str
    subscriptions: tuple[MemberSubscription, ...]
    last_heartbeat_ms: int
    brokers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class QueueLag:
    """How far a group is behind in one queue. ``None`` means unknown (nothing committed, or
    the broker could not tell), never a made-up 0."""

    broker_name: str
    topic: str
    queue_id: int
    broker_offset: int
    consumer_offset: int | None
    lag_messages: int | None
    lag_seconds: float | None
    locked_by: str | None
    #: POP groups: messages handed out and not acked yet
    in_flight: int = 0
    #: of those, the ones still invisible (the others are due to be handed out again)
    invisible: int = 0


@dataclass(frozen=True, slots=True)
class OfficialClientInfo:
    """An official RocketMQ 5 client of a POP group connected to broker ``broker_name``, as
    its headers and settings describe it (``""`` where it did not say)."""

    client_id: str
    #: ``JAVA``, ``PYTHON``, ``GOLANG``, ...
    language: str
    version: str
    #: ``PUSH_CONSUMER``, ``SIMPLE_CONSUMER``, ...
    client_type: str
    host: str
    broker_name: str


@dataclass(frozen=True, slots=True)
class GroupDescription:
    """A group's members and its per-queue progress, from every broker that answered;
    ``warnings`` holds what the brokers flagged and the brokers that did not answer.
    ``consumption`` is :data:`POP` when any broker says so, else :data:`OFFSETS` when any says
    so, else ``""``; ``clients`` are the official clients connected (by client id, then
    broker)."""

    group: str
    members: tuple[GroupMember, ...]
    queues: tuple[QueueLag, ...]
    warnings: tuple[str, ...]
    consumption: str = ""
    clients: tuple[OfficialClientInfo, ...] = ()

    @property
    def in_flight(self) -> int:
        """Messages handed out by POP and not acked, over every queue."""
        return sum(q.in_flight for q in self.queues)

    @property
    def invisible(self) -> int:
        """Of :attr:`in_flight`, the messages still invisible."""
        return sum(q.invisible for q in self.queues)

    @property
    def lag_messages(self) -> int | None:
        """Messages behind over every queue; None when any queue's lag is unknown."""
        total = 0
        for q in self.queues:
            if q.lag_messages is None:
                return None
            total += q.lag_messages
        return total

    @property
    def lag_seconds(self) -> float | None:
        """The longest any queue's oldest unconsumed message has waited; None when any
        queue's is unknown."""
        worst = 0.0
        for q in self.queues:
            if q.lag_seconds is None:
                return None
            worst = max(worst, q.lag_seconds)
        return worst


@dataclass(frozen=True, slots=True)
class ResetOffset:
    """Where :meth:`AdminClient.reset_offsets` moved a group's offset of one queue."""

    broker_name: str
    topic: str
    queue_id: int
    offset: int


def check_group_name(group: str) -> None:
    if not isinstance(group, str) or not GROUP_RE.fullmatch(group):
        raise InvalidArgumentError(
            field="group", rule=f"{group!r} must be 1 to 255 characters from [%|a-zA-Z0-9_-]"
        )


def _mode_name(mode: int) -> str:
    return MODE_NAMES.get(mode, UNKNOWN_MODE)


def merge_group_lists(
    answers: list[tuple[str, consumer_pb2.ListGroupsResponse]],
) -> list[GroupSummary]:
    members: dict[str, int] = {}
    modes: dict[str, str] = {}
    topics: dict[str, set[str]] = {}
    brokers: dict[str, set[str]] = {}
    for broker_name, resp in answers:
        for g in resp.groups:
            members[g.group] = max(members.get(g.group, 0), g.members)
            if modes.get(g.group, UNKNOWN_MODE) == UNKNOWN_MODE:
                modes[g.group] = _mode_name(g.mode)
            topics.setdefault(g.group, set()).update(g.topics)
            brokers.setdefault(g.group, set()).add(broker_name)
    return [
        GroupSummary(
            name,
            members[name],
            modes[name],
            tuple(sorted(topics[name])),
            tuple(sorted(brokers[name])),
        )
        for name in sorted(members)
    ]


def merge_descriptions(
    group: str, answers: list[consumer_pb2.DescribeGroupResponse], failures: list[str]
) -> GroupDescription:
    seen: dict[str, list[tuple[str, consumer_pb2.GroupMember]]] = {}
    warned: dict[str, list[str]] = {}
    queues: list[QueueLag] = []
    clients: list[OfficialClientInfo] = []
    consumptions: set[str] = set()
    for resp in answers:
        consumptions.add(resp.consumption)
        clients.extend(
            OfficialClientInfo(
                c.client_id, c.language, c.version, c.client_type, c.host, resp.broker_name
            )
            for c in resp.clients
        )
        for m in resp.members:
            seen.setdefault(m.client_id, []).append((resp.broker_name, m))
        for w in resp.warnings:
            warned.setdefault(w, []).append(resp.broker_name)
        queues.extend(_queue_lag(resp.broker_name, q) for q in resp.queues)
    warnings = [f"{', '.join(sorted(b))}: {w}" for w, b in warned.items()]
    members: list[GroupMember] = []
    for client_id in sorted(seen):
        views = seen[client_id]
        subs = {
            tuple(sorted((s.topic, s.tag_expression, s.sql_expression) for s in m.subscriptions))
            for _, m in views
        }
        if len(subs) > 1:
            warnings.append(
                f"member {client_id} declares different subscriptions to different brokers"
            )
        first = views[0][1]
        members.append(
            GroupMember(
                client_id=client_id,
                host=first.host,
                mode=_mode_name(first.mode),
                subscriptions=tuple(
                    MemberSubscription(*s) for s in sorted({s for sub in subs for s in sub})
                ),
                last_heartbeat_ms=max(m.last_heartbeat_ms for _, m in views),
                brokers=tuple(sorted({b for b, _ in views})),
            )
        )
    modes = {m.mode for m in members} - {UNKNOWN_MODE}
    if len(modes) > 1:
        warnings.append(f"members consume in different modes: {', '.join(sorted(modes))}")
    queues.sort(key=lambda q: (q.topic, q.broker_name, q.queue_id))
    clients.sort(key=lambda c: (c.client_id, c.broker_name))
    consumption = next((c for c in (POP, OFFSETS) if c in consumptions), "")
    return GroupDescription(
        group,
        tuple(members),
        tuple(queues),
        tuple(warnings + failures),
        consumption,
        tuple(clients),
    )


def _queue_lag(broker_name: str, q: consumer_pb2.QueueLag) -> QueueLag:
    return QueueLag(
        broker_name=broker_name,
        topic=q.topic,
        queue_id=q.queue_id,
        broker_offset=q.broker_offset,
        consumer_offset=q.consumer_offset if q.consumer_offset >= 0 else None,
        lag_messages=q.lag_messages if q.lag_messages >= 0 else None,
        lag_seconds=q.lag_ms / 1000 if q.lag_ms >= 0 else None,
        locked_by=q.locked_by or None,
        in_flight=q.in_flight,
        invisible=q.invisible,
    )
