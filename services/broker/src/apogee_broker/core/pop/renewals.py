"""Auto-renewal: a PushConsumer receives without an invisible time and asks the broker to keep
what it received invisible while it works (``auto_renew``). The broker gives each such message
:data:`RENEW_INVISIBLE_MS` and, while the client that received it is alive, extends it by as
much whenever less than :data:`RENEW_AHEAD_MS` is left, keeping its receipt handle, for at most
:data:`MAX_RENEW_MS` in all. An ack, a re-arm or a dead-lettering ends the renewal (the handle
no longer matches); a client that left or went silent is renewed no more, so what it held comes
back when its time runs out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from apogee.common.aio import PeriodicLoop
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee_broker.core.pop.service import PopService

log = logging.getLogger(__name__)

#: Invisible time of an auto-renewed message, and of each renewal.
RENEW_INVISIBLE_MS: Final = 60_000
#: A renewal happens when less than this is left.
RENEW_AHEAD_MS: Final = 20_000
#: No message is renewed for longer than this (upstream's limit).
MAX_RENEW_MS: Final = 3 * 3_600_000
#: How often renewals are looked for.
RENEW_INTERVAL_S: Final = 5.0


@dataclass(slots=True)
class _Held:
    client_id: str
    group: str
    topic: str
    first_ms: int
    due_ms: int


class Renewals:
    """The auto-renewed messages of one broker, by receipt handle."""

    def __init__(
        self,
        pop: PopService,
        alive: Callable[[str], bool],
        clock: Clock = SYSTEM_CLOCK,
        interval_s: float = RENEW_INTERVAL_S,
    ) -> None:
        self.pop = pop
        self.alive = alive
        self.clock = clock
        self._held: dict[str, _Held] = {}
        self._loop = PeriodicLoop("POP auto-renewal", interval_s, self.renew_due)

    def __len__(self) -> int:
        return len(self._held)

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    def add(self, client_id: str, group: str, topic: str, handle: str) -> None:
        now = self.clock.time_ms()
        self._held[handle] = _Held(client_id, group, topic, now, now + RENEW_INVISIBLE_MS)

    def drop(self, handle: str) -> None:
        self._held.pop(handle, None)

    def renew_due(self) -> int:
        """Extend what is due; returns how many were extended."""
        now = self.clock.time_ms()
        renewed = 0
        for handle, h in list(self._held.items()):
            if h.due_ms - now > RENEW_AHEAD_MS:
                continue
            if (
                now - h.first_ms >= MAX_RENEW_MS
                or not self.alive(h.client_id)
                or not self.pop.extend(h.group, h.topic, handle, RENEW_INVISIBLE_MS)
            ):
                del self._held[handle]
                continue
            h.due_ms = now + RENEW_INVISIBLE_MS
            renewed += 1
        return renewed
