"""A background loop of a service, as one task, started and stopped.

A loop that fails (raises anything but a cancellation) reports the error to ``on_error``: in a
per-broker session (:mod:`apogee.service.workers`), the session then ends and is started again
later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

ErrorHandler = Callable[[BaseException], None]


class BackgroundLoop:
    """Subclasses implement :meth:`_run`; ``start`` runs it as a task, ``stop`` cancels it and
    waits for it (bounded)."""

    name = "loop"

    def __init__(self, on_error: ErrorHandler) -> None:
        self._on_error = on_error
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"{self.name} is already started")
        self._task = asyncio.create_task(self._run(), name=self.name)
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._on_error(exc)

    async def _run(self) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self, timeout_s: float = 5.0) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=timeout_s)
        if not task.done():
            log.warning("%s did not stop within %.1fs", self.name, timeout_s)
