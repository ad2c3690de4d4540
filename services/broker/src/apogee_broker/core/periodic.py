"""A small background loop: one step every interval, on the event loop, until stopped.

A failing step is logged and the loop goes on. :meth:`PeriodicLoop.stop` lets a step in progress
finish (it may be writing a file on a worker thread; cancelling the await would not stop the
thread) and waits for it at most ``timeout`` seconds before cancelling.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class PeriodicLoop:
    """Runs ``step()`` (a plain or async function) every ``interval_s`` seconds."""

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
                log.exception(
                    "%s: a step failed; trying again in %.1fs", self.name, self.interval_s
                )
