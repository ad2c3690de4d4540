"""Transactional producers connected to this broker, and the checks sent to them.

A producer opens a session stream (``ProducerSession``), says who it is in its first message
(:class:`Hello`: its group and client id), then heartbeats. The broker sends checks of its
group's transactions on that stream (:class:`CheckEvent`), picking one live producer of the
group in turn (:meth:`ProducerRegistry.pick`). A producer is forgotten:

- when its stream ends (the client closed it, its connection was lost, a bad message), at once;
- after ``expiry_s`` without a heartbeat (the ``producer_expiry_s`` setting, or three of the
  producer's own heartbeat intervals when that is longer), by a small background loop;
- when the same client of the same group opens a newer session (its old stream ends);
- when the broker stops: every stream ends with UNAVAILABLE, so producers reconnect elsewhere.

Checks wait in the session for the stream to send them; a session that does not read keeps at
most :data:`MAX_PENDING_CHECKS` (older ones are dropped: the checker checks those halves again).

Hellos are checked before anything changes (the field names are the proto's):

==============================  ========================================================
field                           rule
==============================  ========================================================
hello.producer_group            a group name (the topic name rule)
hello.client_id                 non-empty printable text, at most 255 characters
hello.heartbeat_interval_ms     0 (not said) to 3,600,000
==============================  ========================================================

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Final

from apogee.codec import StoredMessage
from apogee.common.aio import PeriodicLoop
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidArgumentError,
    UnavailableError,
)
from apogee.service.rights import publisher
from apogee_broker.core.checks import validate_client_id, validate_group

log = logging.getLogger(__name__)

#: Checks kept for a session that does not read; older ones are dropped (and logged).
MAX_PENDING_CHECKS: Final = 1024
#: Longest heartbeat interval a producer may declare.
MAX_HEARTBEAT_INTERVAL_MS: Final = 3_600_000
#: A producer is forgotten after this many of its heartbeat intervals without one.
MISSED_HEARTBEATS: Final = 3


@dataclass(frozen=True, slots=True)
class Hello:
    producer_group: str
    client_id: str
    heartbeat_interval_ms: int = 0


@dataclass(frozen=True, slots=True)
class CheckEvent:
    """Ask a producer what became of a transaction."""

    #: the copy just put (the one to name in EndTransaction), body included
    half: StoredMessage
    unique_id: str
    half_offset: int
    #: how many checks this is (1 for the first)
    check_times: int
    #: the real topic
    topic: str


def check_hello(hello: Hello) -> Hello:
    """``hello`` if every field is valid (see the module docstring)."""
    validate_group(hello.producer_group, "hello.producer_group")
    validate_client_id(hello.client_id, "hello.client_id")
    if not 0 <= hello.heartbeat_interval_ms <= MAX_HEARTBEAT_INTERVAL_MS:
        raise InvalidArgumentError(
            field="hello.heartbeat_interval_ms",
            rule=f"must be between 0 (not said) and {MAX_HEARTBEAT_INTERVAL_MS}, got "
            f"{hello.heartbeat_interval_ms}",
        )
    return hello


class ProducerSession:
    """One producer's stream; ``group`` and ``client_id`` are set by its hello."""

    def __init__(
        self, host: str, seen: float, may_publish: Callable[[str], bool] = lambda _topic: True
    ) -> None:
        self.host = host
        #: whether the session's user may send to a topic (checks go only where it may)
        self.may_publish = may_publish
        self.group: str | None = None
        self.client_id: str | None = None
        self.expiry_s = 0.0
        #: monotonic time of the last message
        self.seen = seen
        self.closed = False
        #: why the broker ended the session (None: not ended, or ended by the client)
        self.error: ApogeeError | None = None
        self._checks: deque[CheckEvent] = deque()
        self._wake = asyncio.Event()

    def __repr__(self) -> str:
        return f"ProducerSession({self.client_id!r} of {self.group!r} from {self.host!r})"

    async def events(self) -> AsyncIterator[CheckEvent]:
        """The checks to send, as they come; ends when the session ends."""
        while not self.closed:
            if self._checks:
                yield self._checks.popleft()
            else:
                self._wake.clear()
                await self._wake.wait()

    def offer(self, event: CheckEvent) -> bool:
        """Queue a check for the stream; False when the session has ended."""
        if self.closed:
            return False
        if len(self._checks) >= MAX_PENDING_CHECKS:
            dropped = self._checks.popleft()
            log.warning(
                "%r reads no checks; the check of transaction %s dropped", self, dropped.unique_id
            )
        self._checks.append(event)
        self._wake.set()
        return True

    def end(self, error: ApogeeError | None = None) -> None:
        """End the stream (``error``: why, when the broker ends it)."""
        if not self.closed:
            self.closed = True
            self.error = error
            self._wake.set()


class ProducerRegistry:
    """Every producer session of this broker, by group."""

    def __init__(
        self,
        *,
        expiry_s: float,
        broker_name: str,
        clock: Clock = SYSTEM_CLOCK,
        check_interval_s: float | None = None,
    ) -> None:
        self.expiry_s = expiry_s
        self.broker_name = broker_name
        self.clock = clock
        self._sessions: set[ProducerSession] = set()
        #: group -> client id -> its session
        self._groups: dict[str, dict[str, ProducerSession]] = {}
        self._turn: dict[str, int] = {}
        self._stopping = False
        interval = check_interval_s or min(5.0, max(expiry_s / 4, 0.05))
        self._loop = PeriodicLoop("apogee-broker-producer-expiry", interval, self.expire)

    # -- life -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the expiry loop."""
        self._loop.start()

    def end_sessions(self) -> None:
        """End every stream with UNAVAILABLE and refuse new ones (the broker is stopping)."""
        self._stopping = True
        for s in list(self._sessions):
            s.end(self._stopping_error())

    async def stop(self) -> None:
        """:meth:`end_sessions`, and stop the expiry loop (bounded)."""
        self.end_sessions()
        await self._loop.stop()

    # -- sessions -------------------------------------------------------------------------------

    def open(self, host: str) -> ProducerSession:
        """A new session for a stream from ``host``; UNAVAILABLE while the broker stops."""
        if self._stopping:
            raise self._stopping_error()
        session = ProducerSession(host, self.clock.monotonic(), publisher())
        self._sessions.add(session)
        return session

    def hello(self, session: ProducerSession, hello: Hello) -> None:
        """Register the session's producer (checked first); a session of the same client of the
        same group that was there before ends."""
        check_hello(hello)
        if session.closed:
            return
        if session.group is not None:
            raise InvalidArgumentError(
                field="hello",
                rule="is sent once, as the first message of a session; later messages are "
                "heartbeats (heartbeat_ms)",
            )
        group, client = hello.producer_group, hello.client_id
        session.group, session.client_id = group, client
        session.expiry_s = max(
            self.expiry_s, MISSED_HEARTBEATS * hello.heartbeat_interval_ms / 1000
        )
        session.seen = self.clock.monotonic()
        members = self._groups.setdefault(group, {})
        old = members.get(client)
        members[client] = session
        if old is not None and old is not session:
            self._sessions.discard(old)
            old.end(
                UnavailableError(
                    what="this producer session",
                    detail=f"client {client} of group {group} opened a newer session with "
                    f"broker {self.broker_name}",
                )
            )
        log.info("producer %s of group %s connected from %s", client, group, session.host or "?")

    def heartbeat(self, session: ProducerSession) -> None:
        session.seen = self.clock.monotonic()

    def close(self, session: ProducerSession) -> None:
        """The stream ended: forget the session at once."""
        session.end()
        self._forget(session, "left")

    def expire(self) -> list[ProducerSession]:
        """End and forget the sessions silent for their expiry; returns them."""
        now = self.clock.monotonic()
        gone = [
            s
            for members in self._groups.values()
            for s in members.values()
            if now - s.seen >= s.expiry_s
        ]
        for s in gone:
            self._forget(s, "expired")
            s.end(
                DeadlineExceededError(
                    what=f"the next heartbeat of producer {s.client_id} in group {s.group}",
                    timeout_s=s.expiry_s,
                )
            )
        return gone

    def _forget(self, session: ProducerSession, reason: str) -> None:
        self._sessions.discard(session)
        if session.group is None or session.client_id is None:
            return
        members = self._groups.get(session.group)
        if members is None or members.get(session.client_id) is not session:
            return
        del members[session.client_id]
        if not members:
            del self._groups[session.group]
            self._turn.pop(session.group, None)
        if reason == "expired":
            log.warning(
                "producer %s of group %s expired: no heartbeat for %.0fs",
                session.client_id,
                session.group,
                session.expiry_s,
            )
        else:
            log.info("producer %s left group %s", session.client_id, session.group)

    # -- reading --------------------------------------------------------------------------------

    def pick(self, group: str, topic: str | None = None) -> ProducerSession | None:
        """The next live producer of ``group`` in turn (by client id), or None; with ``topic``,
        only one whose user may send to it (a session of another user naming the group gets
        no check, and so no half message, of a topic it may not send to)."""
        members = self._groups.get(group)
        if not members:
            return None
        ids = sorted(
            c
            for c, s in members.items()
            if not s.closed and (topic is None or s.may_publish(topic))
        )
        if not ids:
            return None
        turn = self._turn.get(group, 0)
        self._turn[group] = turn + 1
        return members[ids[turn % len(ids)]]

    def groups(self) -> dict[str, list[str]]:
        """Client ids of the connected producers, by group; both sorted."""
        return {g: sorted(m) for g, m in sorted(self._groups.items())}

    def __len__(self) -> int:
        return len(self._sessions)

    def _stopping_error(self) -> UnavailableError:
        return UnavailableError(
            what=f"broker {self.broker_name}", detail="it is stopping; reconnect to another broker"
        )
