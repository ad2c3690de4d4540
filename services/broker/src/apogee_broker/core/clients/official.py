"""The official RocketMQ 5 clients connected to this broker (over ``apache.rocketmq.v2``): who
they are (client id, language, version, type, group, topics), when they were last heard of, and
the outbox of their Telemetry stream, through which the broker sends them commands (a
transaction check).

A client is alive while its Telemetry stream is open or it sent a heartbeat within
:data:`EXPIRY_S`; NotifyClientTermination forgets it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Final

from apogee.common.clock import SYSTEM_CLOCK, Clock

#: A client without a Telemetry stream is forgotten after this long without a heartbeat.
EXPIRY_S: Final = 30.0
#: Commands kept for a client that does not read its stream.
MAX_OUTBOX: Final = 1024


@dataclass(slots=True)
class OfficialClient:
    client_id: str
    language: str = ""
    version: str = ""
    client_type: str = ""
    group: str = ""
    topics: tuple[str, ...] = ()
    host: str = ""
    last_seen: float = 0.0
    streams: int = 0
    #: its producer sessions (one per topic it publishes to), kept alive by its heartbeats
    sessions: list[Any] = field(default_factory=list)
    #: commands for its Telemetry stream (the protocol's messages; None ends the stream)
    outbox: asyncio.Queue[Any] = field(default_factory=lambda: asyncio.Queue(MAX_OUTBOX))


class OfficialClients:
    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._clients: dict[str, OfficialClient] = {}

    def seen(self, client_id: str, host: str = "") -> OfficialClient:
        c = self._clients.get(client_id)
        if c is None:
            c = self._clients[client_id] = OfficialClient(client_id, host=host)
        c.last_seen = self.clock.monotonic()
        if host:
            c.host = host
        return c

    def get(self, client_id: str) -> OfficialClient | None:
        return self._clients.get(client_id)

    def forget(self, client_id: str) -> OfficialClient | None:
        return self._clients.pop(client_id, None)

    def live(self) -> list[OfficialClient]:
        now = self.clock.monotonic()
        for cid, c in list(self._clients.items()):
            if c.streams == 0 and now - c.last_seen > EXPIRY_S:
                del self._clients[cid]
        return sorted(self._clients.values(), key=lambda c: c.client_id)

    def alive(self, client_id: str) -> bool:
        """Whether the client has its Telemetry stream open or heartbeat lately."""
        c = self._clients.get(client_id)
        return c is not None and (c.streams > 0 or self.clock.monotonic() - c.last_seen <= EXPIRY_S)

    def of_group(self, group: str) -> list[OfficialClient]:
        return [c for c in self.live() if c.group == group]

    def end_streams(self) -> None:
        """The broker stops: end every Telemetry stream."""
        for c in self._clients.values():
            for _ in range(c.streams):
                with contextlib.suppress(asyncio.QueueFull):
                    c.outbox.put_nowait(None)
