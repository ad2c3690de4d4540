"""Consumer sessions: one per Session stream, tying a consumer's membership to its connection.

The servicer opens a :class:`Session` when a stream starts and feeds it the stream's heartbeats;
the first one joins the group and is answered with the group's member list, later ones renew.
The session's events are what the stream sends back:

- :class:`MembersChanged` - the group's member list, on the first heartbeat and at every change
  (join, leave, expiry); only the latest list is kept while the client is slow to read, so a
  burst of changes is one event;
- :class:`OffsetsReset` - an administrator moved the group's offsets of a topic (ResetOffsets).

A session ends (and the member leaves at once) when the stream ends for any reason: the client
closed it or its connection was lost (the servicer calls :meth:`SessionHub.close`), a heartbeat
was bad, the member expired, a newer session of the same client took it over, or the broker is
stopping (:meth:`SessionHub.stop`, which ends every stream with UNAVAILABLE so that clients
reconnect elsewhere at once). A session's :attr:`~Session.error` says why it ended, when that was
not the client's own doing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Final

from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from apogee_broker.core.clients.groups import ConsumerGroups, Heartbeat, Member, check_heartbeat

log = logging.getLogger(__name__)

#: Offset resets kept for a session that does not read; older ones are dropped (and logged).
MAX_PENDING_RESETS: Final = 1024


@dataclass(frozen=True, slots=True)
class MembersChanged:
    group: str
    client_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class OffsetsReset:
    group: str
    topic: str
    #: (queue id, offset) per queue
    offsets: tuple[tuple[int, int], ...]


SessionEvent = MembersChanged | OffsetsReset


class Session:
    """One consumer's stream. ``group`` and ``client_id`` are set by its first heartbeat."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.group: str | None = None
        self.client_id: str | None = None
        self.closed = False
        #: why the broker ended the session (None: not ended, or ended by the client)
        self.error: ApogeeError | None = None
        self._members: tuple[str, ...] | None = None
        self._offered: tuple[str, ...] | None = None
        self._resets: deque[OffsetsReset] = deque()
        self._wake = asyncio.Event()

    def __repr__(self) -> str:
        return f"Session({self.client_id!r} of {self.group!r} from {self.host!r})"

    async def events(self) -> AsyncIterator[SessionEvent]:
        """The events to send, as they come; ends when the session ends."""
        while not self.closed:
            if self._members is not None:
                ids, self._members = self._members, None
                assert self.group is not None
                yield MembersChanged(self.group, ids)
            elif self._resets:
                yield self._resets.popleft()
            else:
                self._wake.clear()
                await self._wake.wait()

    def offer_members(self, client_ids: list[str]) -> None:
        """Send the member list unless it is the one last offered."""
        ids = tuple(client_ids)
        if ids != self._offered:
            self._offered = ids
            self._members = ids
            self._wake.set()

    def offer_reset(self, event: OffsetsReset) -> None:
        if len(self._resets) >= MAX_PENDING_RESETS:
            dropped = self._resets.popleft()
            log.warning("%r reads no events; an offset reset of %s dropped", self, dropped.topic)
        self._resets.append(event)
        self._wake.set()

    def end(self, error: ApogeeError | None = None) -> None:
        """End the stream (``error``: why, when the broker ends it)."""
        if not self.closed:
            self.closed = True
            self.error = error
            self._wake.set()


class SessionHub:
    """Every open session of this broker, by group; methods run on the event loop."""

    def __init__(
        self,
        groups: ConsumerGroups,
        *,
        broker_name: str,
        first_heartbeat_timeout_s: float,
        on_join: Callable[[Heartbeat], None] | None = None,
    ) -> None:
        #: called with a session's first heartbeat (the broker creates the group's retry topic)
        self.on_join = on_join
        self.groups = groups
        self.broker_name = broker_name
        #: how long a new stream may take to send its first heartbeat
        self.first_heartbeat_timeout_s = first_heartbeat_timeout_s
        self._sessions: set[Session] = set()
        self._by_group: dict[str, set[Session]] = {}
        self._stopping = False
        groups.add_listener(self._members_changed)
        groups.add_removal_listener(self._member_removed)

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, host: str) -> Session:
        """A new session for a stream from ``host``; UNAVAILABLE while the broker stops."""
        if self._stopping:
            raise self._stopping_error()
        session = Session(host)
        self._sessions.add(session)
        return session

    def heartbeat(self, session: Session, hb: Heartbeat) -> None:
        """Join (first heartbeat) or renew; raises the error naming a bad field."""
        check_heartbeat(hb)
        if session.closed:
            return
        first = session.group is None
        if not first and hb.group != session.group:
            raise InvalidArgumentError(
                field="heartbeat.group",
                rule=f"a session belongs to one group: it began with {session.group!r}, got "
                f"{hb.group!r}; open one session per group",
            )
        if not first and hb.client_id != session.client_id:
            raise InvalidArgumentError(
                field="heartbeat.client_id",
                rule=f"a session belongs to one client: it began with {session.client_id!r}, "
                f"got {hb.client_id!r}",
            )
        if first:
            if self.on_join is not None:
                self.on_join(hb)
            session.group = hb.group
            session.client_id = hb.client_id
            self._by_group.setdefault(hb.group, set()).add(session)
        displaced = self.groups.heartbeat(hb, session.host, session)
        if isinstance(displaced, Session) and displaced is not session:
            self._forget(displaced)
            displaced.end(
                UnavailableError(
                    what="this session",
                    detail=f"client {hb.client_id} opened a newer session with broker "
                    f"{self.broker_name}",
                )
            )
        if first:
            session.offer_members(self.groups.client_ids(hb.group))

    def close(self, session: Session) -> None:
        """The stream ended: forget the session; its member leaves at once."""
        self._forget(session)
        session.end()
        if session.group is not None and session.client_id is not None:
            self.groups.leave(session.group, session.client_id, owner=session)

    def reset_offsets(self, group: str, topic: str, offsets: list[tuple[int, int]]) -> int:
        """Tell every connected member of ``group``; returns how many were told."""
        event = OffsetsReset(group, topic, tuple(offsets))
        sessions = [s for s in self._by_group.get(group, ()) if not s.closed]
        for s in sessions:
            s.offer_reset(event)
        return len(sessions)

    def stop(self) -> None:
        """End every stream with UNAVAILABLE and refuse new ones."""
        self._stopping = True
        for s in list(self._sessions):
            s.end(self._stopping_error())

    def _stopping_error(self) -> UnavailableError:
        return UnavailableError(
            what=f"broker {self.broker_name}", detail="it is stopping; reconnect to another broker"
        )

    def _forget(self, session: Session) -> None:
        self._sessions.discard(session)
        if session.group is not None:
            peers = self._by_group.get(session.group)
            if peers is not None:
                peers.discard(session)
                if not peers:
                    del self._by_group[session.group]

    def _members_changed(self, group: str, client_ids: list[str]) -> None:
        for s in self._by_group.get(group, ()):
            s.offer_members(client_ids)

    def _member_removed(self, member: Member, reason: str) -> None:
        owner = member.owner
        if reason == "expired" and isinstance(owner, Session):
            self._forget(owner)
            owner.end(
                DeadlineExceededError(
                    what=f"the next heartbeat of client {member.client_id} in group {member.group}",
                    timeout_s=self.groups.expiry_s,
                )
            )
