"""asyncio helpers shared by services and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable


class LoopBridge:
    """Settles an event loop's futures from another thread (a store's flush thread, say) with
    one ``call_soon_threadsafe`` per burst: results that arrive while a drain is pending join
    it, so a flush that answers 64 writers wakes the loop once, not 64 times."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[asyncio.Future[None], BaseException | None]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, fut: asyncio.Future[None], err: BaseException | None) -> None:
        """Called from any thread: settle ``fut`` (with ``err`` if given) on the loop."""
        with self._lock:
            self._items.append((fut, err))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for fut, err in items:
            if fut.done():  # the caller gave up (cancelled)
                continue
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)


def event_setter(event: asyncio.Event) -> Callable[[], None]:
    """A callback that sets ``event`` (of the running loop) from any thread: directly when
    called on the loop's own thread, through ``call_soon_threadsafe`` from another; once the
    loop is closed nobody waits, and the call does nothing. Create it on the loop's thread."""
    loop = asyncio.get_running_loop()
    own = threading.get_ident()

    def wake() -> None:
        if threading.get_ident() == own:
            event.set()
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(event.set)

    return wake
