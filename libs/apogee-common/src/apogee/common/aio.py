"""asyncio helpers shared by services and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)


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


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: nothing) and wait until it has ended. Its end is not raised: a
    cancellation is what was asked for, and a loop that failed has said so where it ran."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


class PeriodicLoop:
    """Runs ``step()`` (a plain or async function) every ``interval_s`` seconds, on the event
    loop, until stopped. A failing step is logged (``"<name> failed"``) and the loop goes on.
    :meth:`stop` lets a step in progress finish (it may be writing a file on a worker thread;
    cancelling the await would not stop the thread) and waits for it at most ``timeout``
    seconds before cancelling."""

    def __init__(
        self, name: str, interval_s: float, step: Callable[[], Awaitable[object] | object]
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self._step = step
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop (on the running event loop); starting twice is harmless."""
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop after the step in progress, if any (at most ``timeout`` seconds, then cancel)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            log.error("%s did not stop within %.1fs; cancelling it", self.name, timeout)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)
            if self._stopping.is_set():
                return
            try:
                result = self._step()
                if inspect.isawaitable(result):
                    await result
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; trying again in %.1fs", self.name, self.interval_s)
