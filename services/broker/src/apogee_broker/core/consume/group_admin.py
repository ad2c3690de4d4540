"""Group administration: the groups this broker knows, each group's lag, offset resets.

A group is known here when it has members online (sessions) or committed offsets. Describing a
group lists, for every read queue of each topic it subscribes to or has offsets in (topics on
this broker), the queue's max offset (broker offset), the group's committed offset, the lag in
messages and in time (now minus the store time of the oldest unconsumed message; 0 when caught
up, -1 when unknown: nothing committed, or the message cannot be read), and the client holding
the queue's lock. A group this broker knows nothing of is described as empty, not as an error,
so that tools can ask every broker of a cluster.

A reset moves the offsets (:meth:`ConsumerOffsets.reset`) and then tells every connected member
of the group on its session stream, so consumers continue from the new offsets at once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import ApogeeError, UnsupportedError
from apogee.store import GetStatus, MessageStore
from apogee_broker.core.checks import validate_group
from apogee_broker.core.clients.groups import ConsumeMode, ConsumerGroups, Member
from apogee_broker.core.clients.official import OfficialClient, OfficialClients
from apogee_broker.core.clients.sessions import SessionHub
from apogee_broker.core.consume.locks import QueueLocks
from apogee_broker.core.consume.offsets import ConsumerOffsets, ResetTo
from apogee_broker.core.pop.table import PopTable
from apogee_broker.core.topics import TopicManager


@dataclass(frozen=True, slots=True)
class GroupSummary:
    group: str
    members: int
    #: the mode most members declare (None: no member online)
    mode: ConsumeMode | None
    topics: list[str]


@dataclass(frozen=True, slots=True)
class QueueLag:
    topic: str
    queue_id: int
    broker_offset: int
    #: -1: nothing committed
    consumer_offset: int
    #: -1: unknown
    lag_messages: int
    #: -1: unknown
    lag_ms: int
    #: "" when nobody holds the queue's lock
    locked_by: str
    #: POP: handed out and not acked, and of those the ones still invisible
    in_flight: int = 0
    invisible: int = 0


@dataclass(frozen=True, slots=True)
class GroupDescription:
    group: str
    members: list[Member]
    queues: list[QueueLag]
    warnings: list[str]
    #: "POP", "OFFSETS" or "" (nothing known yet)
    consumption: str = ""
    #: POP groups: the official clients connected here
    clients: list[OfficialClient] = field(default_factory=list)


class GroupAdmin:
    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        groups: ConsumerGroups,
        offsets: ConsumerOffsets,
        locks: QueueLocks,
        sessions: SessionHub,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.topics = topics
        self.groups = groups
        self.offsets = offsets
        self.locks = locks
        self.sessions = sessions
        self.clock = clock
        #: POP consumption's state and the official clients (set once they are wired)
        self.pop: PopTable | None = None
        self.official: OfficialClients | None = None

    def check_offsets_join(self, group: str) -> None:
        """An Apogee SDK member joins ``group``: refused while the group is POP-consumed
        (official clients connected, or messages in flight)."""
        clients = self.official.of_group(group) if self.official is not None else []
        in_flight = self.pop.inflight_count(group) if self.pop is not None else 0
        if clients or in_flight:
            who = (
                f"official RocketMQ 5 clients ({', '.join(c.client_id for c in clients[:3])}) "
                "are connected"
                if clients
                else f"{in_flight} messages it received by POP are not acked yet"
            )
            raise UnsupportedError(
                what=f"consumer group {group!r}",
                detail=f"is consumed by POP here ({who}); a group is consumed either by POP "
                "(official clients) or by queue offsets (Apogee's SDK), not both, since each "
                "keeps its own record of what was consumed: use another group name",
            )

    def check_pop_receive(self, group: str) -> None:
        """An official client receives for ``group``: refused while Apogee SDK members of it
        consume by queue offsets."""
        members = self.groups.members(group)
        if members:
            raise UnsupportedError(
                what=f"consumer group {group!r}",
                detail=f"is consumed by queue offsets here by {len(members)} Apogee SDK "
                f"member(s) ({', '.join(m.client_id for m in members[:3])}); a group is "
                "consumed either by POP (official clients) or by queue offsets, not both, "
                "since each keeps its own record of what was consumed: use another group name",
            )

    def consumption(self, group: str) -> str:
        """How ``group`` consumes here: POP while official clients of it are connected or it
        has messages in flight, OFFSETS while Apogee SDK members are, else ""."""
        if self.official is not None and self.official.of_group(group):
            return "POP"
        if self.pop is not None and self.pop.inflight_count(group):
            return "POP"
        if self.groups.members(group):
            return "OFFSETS"
        if self.pop is not None and group in self.pop.groups():
            return "POP"
        return "OFFSETS" if self.offsets.group_offsets(group) else ""

    def list_groups(self) -> list[GroupSummary]:
        """Groups with members online or offsets committed here, sorted by name."""
        out: list[GroupSummary] = []
        for group in self.known_groups():
            members = self.groups.members(group)
            modes = [m.mode for m in members]
            mode = max(set(modes), key=lambda m: (modes.count(m), m.value)) if modes else None
            out.append(GroupSummary(group, len(members), mode, self._topics_of(group, members)))
        return out

    async def describe(self, group: str) -> GroupDescription:
        validate_group(group)
        members, wanted = self.lag_inputs(group)
        now = self.clock.time_ms()
        lags = await asyncio.to_thread(lambda: [self.queue_lag(t, q, c, now) for t, q, c in wanted])
        queues = [
            QueueLag(
                t,
                q,
                broker,
                consumer,
                lag,
                lag_ms,
                self.locks.holder(group, t, q) or "",
                *self._in_flight(group, t, q, now),
            )
            for (t, q, _), (broker, consumer, lag, lag_ms) in zip(wanted, lags, strict=True)
        ]
        clients = self.official.of_group(group) if self.official is not None else []
        return GroupDescription(
            group,
            members,
            queues,
            self.groups.warnings(group),
            self.consumption(group),
            clients,
        )

    def _in_flight(self, group: str, topic: str, q: int, now_ms: int) -> tuple[int, int]:
        queues = self.pop.queues(group, topic) if self.pop is not None else None
        qp = queues.get(q) if queues else None
        if qp is None:
            return 0, 0
        return len(qp.inflight), sum(e.visible_at_ms > now_ms for e in qp.inflight.values())

    async def reset(
        self, group: str, topic: str, to: ResetTo, timestamp_ms: int = 0
    ) -> list[tuple[int, int]]:
        """Move the offsets and tell the group's connected members; returns (queue, offset)."""
        moved = await self.offsets.reset(group, topic, to, timestamp_ms)
        self.sessions.reset_offsets(group, topic, moved)
        return moved

    def _topics_of(self, group: str, members: list[Member]) -> list[str]:
        names = {s.topic for m in members for s in m.subscriptions}
        names.update(t for t, _ in self.offsets.group_offsets(group))
        if self.pop is not None:
            names.update(self.pop.topics_of(group))
        return sorted(names)

    def lag_inputs(self, group: str) -> tuple[list[Member], list[tuple[str, int, int | None]]]:
        """The group's members, and (topic, queue, committed offset or None) of every read
        queue of each topic it subscribes to or has offsets in (topics on this broker), sorted.
        Runs on the loop; :meth:`queue_lag` of each may then run on a thread."""
        members = self.groups.members(group)
        committed = self.offsets.group_offsets(group)
        keys: set[tuple[str, int]] = set()
        for name in self._topics_of(group, members):
            topic = self.topics.get(name)
            if topic is not None:
                keys.update((name, q) for q in range(topic.read_queues))
        keys.update(k for k in committed if k[0] in self.topics)
        return members, [(t, q, committed.get((t, q))) for t, q in sorted(keys)]

    def known_groups(self) -> list[str]:
        """Groups with members online, offsets committed, POP state or official consumers
        connected here, sorted."""
        pop = self.pop.groups() if self.pop is not None else set()
        if self.official is not None:  # official consumers connected, nothing received yet
            pop |= {c.group for c in self.official.live() if c.group}
        return sorted(set(self.groups.groups()) | self.offsets.groups() | pop)

    def queue_lag(
        self, topic: str, queue_id: int, committed: int | None, now_ms: int
    ) -> tuple[int, int, int, int]:
        """(broker offset, consumer offset, lag in messages, lag in ms) of one queue (-1:
        unknown); reads the store (thread-safe), nothing else."""
        broker = self.store.max_offset(topic, queue_id)
        if committed is None:
            return broker, -1, -1, -1
        lag = max(0, broker - committed)
        if lag == 0:
            return broker, committed, 0, 0
        oldest = max(committed, self.store.min_offset(topic, queue_id))
        try:
            got = self.store.get(topic, queue_id, oldest, 1)
        except ApogeeError:  # a damaged record: the time is unknown, the rest still stands
            return broker, committed, lag, -1
        if got.status is not GetStatus.FOUND or not got.messages:
            return broker, committed, lag, -1
        return broker, committed, lag, max(0, now_ms - got.messages[0].store_timestamp)
