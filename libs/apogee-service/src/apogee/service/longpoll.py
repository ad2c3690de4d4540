"""Long polls: a call that finds nothing new is held until something arrives, its time is up,
or the service stops.

:class:`HeldWaits` keeps the holds of one service part (a broker's pulls, its schedule scans).
:meth:`HeldWaits.hold` arms the caller's watches with a ``wake`` callback, waits, and disarms
them however the hold ends (woken, timed out, cancelled, or stopped). ``wake`` may be called
from any thread (a store's dispatcher thread calls it when an entry lands) and any number of
times. :meth:`HeldWaits.stop` ends every hold at once and refuses new ones, so a stopping
service never waits a hold out. The timeout is a timer on the event loop (``call_later``),
which tests inject to fire it themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from apogee.common.aio import event_setter

#: ``arm(wake)`` starts watching (calling ``wake()`` on an arrival) and returns what stops it.
Arm = Callable[[Callable[[], None]], Callable[[], None]]


class Timer(Protocol):
    def cancel(self) -> None: ...


#: ``call_later(delay_s, callback)``, as :meth:`asyncio.AbstractEventLoop.call_later`.
CallLater = Callable[[float, Callable[[], None]], Timer]


class HeldWaits:
    """The holds of one service part; ``call_later`` sets the timeouts (the running event
    loop's when None)."""

    def __init__(self, call_later: CallLater | None = None) -> None:
        self._call_later = call_later
        self._held: set[asyncio.Event] = set()
        self._stopping = False

    @property
    def held(self) -> int:
        """Holds waiting now."""
        return len(self._held)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """End every hold now (each answers False), and hold no more."""
        self._stopping = True
        for ring in list(self._held):
            ring.set()

    async def hold(self, timeout_s: float, arm: Arm) -> bool:
        """Wait until ``arm``'s watches call ``wake`` (True), at most ``timeout_s`` seconds
        or until :meth:`stop` (False). After a stop, or with no time left, answers False at
        once without arming. A cancelled hold disarms too, and lets the cancellation through."""
        if self._stopping or timeout_s <= 0:
            return False
        ring = asyncio.Event()
        expired = False

        def expire() -> None:
            nonlocal expired
            if not ring.is_set():  # a wake-up that came first wins
                expired = True
                ring.set()

        call_later = self._call_later or asyncio.get_running_loop().call_later
        self._held.add(ring)
        timer = call_later(timeout_s, expire)
        disarm: Callable[[], None] | None = None
        try:
            disarm = arm(event_setter(ring))
            await ring.wait()
        finally:
            timer.cancel()
            if disarm is not None:
                disarm()
            self._held.discard(ring)
        return not expired and not self._stopping
