"""Consumer groups: who is in each group at this broker, from their heartbeats.

A consumer joins its group with its first heartbeat on a session stream (see
:mod:`apogee_broker.core.clients.sessions`) and renews its membership with each later one. It
leaves at once when its session ends, or after ``expiry_ms`` without a heartbeat (RocketMQ's 120 s,
checked by a small background loop). Every change of a group's member list (join, leave,
expiry) is told to the listeners with the new list sorted by client id: the sessions forward it
to every member, which rebalances.

A member is owned by the session it heartbeats on; a client that opens a new session (it
reconnected) takes its membership over, and the end of the old session then changes nothing.

Conflicts are reported, never silently accepted: members of one group that consume in different
modes, subscribe to different topics, or select different messages of a topic (tags, SQL92
condition) make a warning naming
the clients and what differs (logged when it appears, listed by DescribeGroup). RocketMQ lets
the last heartbeat win, and the group then loses messages without a word.

Heartbeats are checked before anything changes (the field names are the proto's):

==================================  =========================================================
field                               rule
==================================  =========================================================
heartbeat.group                     a group name (the topic name rule)
heartbeat.client_id                 non-empty printable text, at most 255 characters
heartbeat.mode                      CLUSTERING or BROADCASTING
heartbeat.subscriptions[i].topic    a topic name; each topic once
heartbeat.subscriptions[i].tag_...  a tag expression (:mod:`apogee.common.tags`)
heartbeat.subscriptions[i].sql_...  ``""`` or an SQL92 condition (:mod:`apogee.common.selector`)
==================================  =========================================================
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from apogee.common.aio import PeriodicLoop
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import InvalidArgumentError, InvalidTopicError
from apogee.common.filtering import parse_selection
from apogee.common.topics import validate_topic
from apogee_broker.core.checks import validate_client_id, validate_group

log = logging.getLogger(__name__)

#: Most subscriptions one heartbeat may carry.
MAX_SUBSCRIPTIONS: Final = 1024
#: Clients named in a warning before "and N more".
_NAMED: Final = 5


class ConsumeMode(enum.Enum):
    CLUSTERING = "CLUSTERING"
    BROADCASTING = "BROADCASTING"


@dataclass(frozen=True, slots=True)
class Subscription:
    topic: str
    tag_expression: str
    sql_expression: str = ""

    @property
    def selection(self) -> str:
        """What is selected, in one canonical form: ``*`` or the tags sorted, ``A || B``, and
        the SQL92 condition normalised after ``WHERE``."""
        sel = parse_selection(self.tag_expression, self.sql_expression)
        tags = "*" if sel.tags is None else " || ".join(sorted(sel.tags))
        return tags if sel.sql is None else f"{tags} WHERE {sel.sql.canonical}"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    client_id: str
    group: str
    mode: ConsumeMode | None
    subscriptions: tuple[Subscription, ...] = ()
    heartbeat_interval_ms: int = 0


@dataclass(slots=True)
class Member:
    """One consumer of a group, as its last heartbeat described it."""

    client_id: str
    group: str
    host: str
    mode: ConsumeMode
    subscriptions: tuple[Subscription, ...]
    #: wall-clock time of the last heartbeat (shown to users)
    last_heartbeat_ms: int
    #: monotonic time of the last heartbeat (expiry)
    seen: float = field(repr=False)
    #: the session the member heartbeats on
    owner: object = field(repr=False, compare=False)

    @property
    def topics(self) -> list[str]:
        return sorted(s.topic for s in self.subscriptions)


#: ``listener(group, client_ids)`` after a group's member list changed; ids sorted.
MembersListener = Callable[[str, list[str]], None]
#: ``listener(member, reason)`` after a member was removed; reason "left" or "expired".
RemovalListener = Callable[[Member, str], None]


def check_heartbeat(hb: Heartbeat) -> Heartbeat:
    """``hb`` if every field is valid (see the module docstring), else the error naming it."""
    validate_group(hb.group, "heartbeat.group")
    validate_client_id(hb.client_id, "heartbeat.client_id")
    if hb.mode is None:
        raise InvalidArgumentError(
            field="heartbeat.mode", rule="must be CLUSTERING or BROADCASTING, got unspecified"
        )
    if len(hb.subscriptions) > MAX_SUBSCRIPTIONS:
        raise InvalidArgumentError(
            field="heartbeat.subscriptions",
            rule=f"{len(hb.subscriptions)} subscriptions; at most {MAX_SUBSCRIPTIONS}",
        )
    seen: dict[str, int] = {}
    for i, sub in enumerate(hb.subscriptions):
        name = f"heartbeat.subscriptions[{i}]"
        try:
            validate_topic(sub.topic)
        except InvalidTopicError as err:
            raise InvalidArgumentError(
                field=f"{name}.topic", rule=f"{sub.topic!r} {err.details['rule']}"
            ) from None
        if sub.topic in seen:
            raise InvalidArgumentError(
                field=f"{name}.topic",
                rule=f"{sub.topic!r} is subscribed twice (also subscriptions[{seen[sub.topic]}]); "
                "join the tags with '||'",
            )
        seen[sub.topic] = i
        parse_selection(sub.tag_expression, sub.sql_expression, f"{name}.")
    return hb


class ConsumerGroups:
    """The members of every group at this broker; methods run on the event loop."""

    def __init__(
        self,
        *,
        expiry_ms: int = 120_000,
        clock: Clock = SYSTEM_CLOCK,
        check_interval_s: float | None = None,
    ) -> None:
        self.expiry_s = expiry_ms / 1000
        self.clock = clock
        self._groups: dict[str, dict[str, Member]] = {}
        self._listeners: list[MembersListener] = []
        self._removal_listeners: list[RemovalListener] = []
        self._warned: dict[str, list[str]] = {}
        interval = check_interval_s or min(10.0, max(self.expiry_s / 4, 0.05))
        self._loop = PeriodicLoop("apogee-broker-consumer-expiry", interval, self.expire)

    # -- life -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the expiry loop."""
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    def add_listener(self, listener: MembersListener) -> None:
        self._listeners.append(listener)

    def add_removal_listener(self, listener: RemovalListener) -> None:
        self._removal_listeners.append(listener)

    # -- membership -----------------------------------------------------------------------------

    def heartbeat(self, hb: Heartbeat, host: str, owner: object) -> object | None:
        """Join or renew ``hb.client_id`` in ``hb.group`` (checked first). Returns the session
        that owned the member before, when ``owner`` takes it over; else None."""
        check_heartbeat(hb)
        assert hb.mode is not None
        now_ms = self.clock.time_ms()
        seen = self.clock.monotonic()
        members = self._groups.setdefault(hb.group, {})
        member = members.get(hb.client_id)
        if member is None:
            members[hb.client_id] = Member(
                hb.client_id, hb.group, host, hb.mode, hb.subscriptions, now_ms, seen, owner
            )
            log.info("consumer %s joined group %s from %s", hb.client_id, hb.group, host or "?")
            self._changed(hb.group)
            self._check_conflicts(hb.group)
            return None
        displaced = member.owner if member.owner is not owner else None
        declared = (member.mode, member.subscriptions)
        member.host = host
        member.mode = hb.mode
        member.subscriptions = hb.subscriptions
        member.last_heartbeat_ms = now_ms
        member.seen = seen
        member.owner = owner
        if declared != (hb.mode, hb.subscriptions):
            self._check_conflicts(hb.group)
        return displaced

    def leave(self, group: str, client_id: str, owner: object | None = None) -> bool:
        """Remove the member (only if ``owner`` still owns it, when given); returns whether it
        was removed."""
        members = self._groups.get(group)
        member = members.get(client_id) if members else None
        if member is None or (owner is not None and member.owner is not owner):
            return False
        self._remove([member], "left")
        return True

    def expire(self) -> list[Member]:
        """Remove the members whose last heartbeat is ``expiry_ms`` old; returns them."""
        now = self.clock.monotonic()
        gone = [
            m
            for members in self._groups.values()
            for m in members.values()
            if now - m.seen >= self.expiry_s
        ]
        if gone:
            self._remove(gone, "expired")
        return gone

    def _remove(self, gone: Sequence[Member], reason: str) -> None:
        touched: list[str] = []
        for m in gone:
            members = self._groups.get(m.group)
            if members is None or members.get(m.client_id) is not m:
                continue
            del members[m.client_id]
            if not members:
                del self._groups[m.group]
            if m.group not in touched:
                touched.append(m.group)
            if reason == "expired":
                log.warning(
                    "consumer %s of group %s expired: no heartbeat for %.0fs",
                    m.client_id,
                    m.group,
                    self.expiry_s,
                )
            else:
                log.info("consumer %s left group %s", m.client_id, m.group)
            for listener in self._removal_listeners:
                try:
                    listener(m, reason)
                except Exception:
                    log.exception("member removal listener %r failed", listener)
        for group in touched:
            self._changed(group)
            self._check_conflicts(group)

    def _changed(self, group: str) -> None:
        ids = self.client_ids(group)
        for listener in self._listeners:
            try:
                listener(group, ids)
            except Exception:
                log.exception("membership listener %r failed", listener)

    # -- reading --------------------------------------------------------------------------------

    def members(self, group: str) -> list[Member]:
        """The group's members sorted by client id."""
        members = self._groups.get(group, {})
        return [members[c] for c in sorted(members)]

    def client_ids(self, group: str) -> list[str]:
        return sorted(self._groups.get(group, {}))

    def groups(self) -> list[str]:
        """Groups with at least one member, sorted."""
        return sorted(self._groups)

    def warnings(self, group: str) -> list[str]:
        """What the group's members declare differently (empty when they agree)."""
        return conflicts(self.members(group))

    def _check_conflicts(self, group: str) -> None:
        now = self.warnings(group)
        before = self._warned.get(group, [])
        for text in now:
            if text not in before:
                log.warning("group %s: %s", group, text)
        if now:
            self._warned[group] = now
        else:
            self._warned.pop(group, None)


def conflicts(members: Iterable[Member]) -> list[str]:
    """Readable sentences for what ``members`` (of one group) declare differently: modes,
    topic sets, and the tags selected of each topic."""
    members = list(members)
    out: list[str] = []
    modes: dict[str, list[str]] = {}
    topic_sets: dict[str, list[str]] = {}
    selections: dict[str, dict[str, list[str]]] = {}
    for m in members:
        modes.setdefault(m.mode.value, []).append(m.client_id)
        topic_sets.setdefault(", ".join(m.topics) or "no topic", []).append(m.client_id)
        for sub in m.subscriptions:
            selections.setdefault(sub.topic, {}).setdefault(sub.selection, []).append(m.client_id)
    if len(modes) > 1:
        out.append("members consume in different modes: " + _by(modes))
    if len(topic_sets) > 1:
        out.append(
            "members subscribe to different topics (each topic's queues are shared only among "
            "its subscribers): " + _by({f"[{k}]": v for k, v in topic_sets.items()})
        )
    for topic in sorted(selections):
        chosen = selections[topic]
        if len(chosen) > 1:
            out.append(
                f"members select different messages of topic {topic} (messages of a queue assigned "
                "to a client that does not select them are skipped): "
                + _by({f"'{k}'": v for k, v in chosen.items()})
            )
    return out


def _by(groups: dict[str, list[str]]) -> str:
    parts = []
    for what in sorted(groups):
        clients = sorted(groups[what])
        named = ", ".join(clients[:_NAMED])
        if len(clients) > _NAMED:
            named += f" and {len(clients) - _NAMED} more"
        parts.append(f"{what} by {named}")
    return "; ".join(parts)
