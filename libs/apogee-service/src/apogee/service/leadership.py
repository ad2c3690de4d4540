"""Which replica of a service is active: one leads, the others wait as standbys.

Services that may run several replicas with one doing the work (schedule, the transaction
checker) share this seam.

:class:`Leadership` is the seam: :meth:`~Leadership.try_acquire` makes one attempt,
:meth:`~Leadership.acquire` waits until it succeeds, :meth:`~Leadership.wait_lost` returns if
leadership is lost while held (never, for a file lock), :meth:`~Leadership.release` gives it
up. :class:`FileLockLeadership` uses ``flock`` on a file, for replicas on one machine (or on a
file system that supports it); the lock dies with its process, so a replica killed with
``kill -9`` frees it at once. A Kubernetes Lease implementation fits the same interface.
"""

from __future__ import annotations

import abc
import asyncio
import fcntl
import logging
import os
import socket
from pathlib import Path

log = logging.getLogger(__name__)


class Leadership(abc.ABC):
    poll_s: float = 1.0

    @abc.abstractmethod
    async def try_acquire(self) -> bool:
        """One attempt to lead; True when this replica now leads (or already did). Raises
        OSError when the attempt itself is impossible (the lock cannot be opened)."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Stop leading (nothing happens when not leading)."""

    @abc.abstractmethod
    def holder(self) -> str:
        """Who leads, as far as can be told (for logs)."""

    @property
    @abc.abstractmethod
    def held(self) -> bool:
        """Whether this replica leads now, as far as it knows (a Lease it has not renewed in
        time is no longer held)."""

    async def acquire(self) -> None:
        """Wait until this replica leads, trying every ``poll_s`` seconds."""
        standby_logged = False
        while not await self.try_acquire():
            if not standby_logged:
                log.info("standby: %s leads; trying again every %.1fs", self.holder(), self.poll_s)
                standby_logged = True
            await asyncio.sleep(self.poll_s)  # the lock is another process's: poll it

    async def wait_lost(self) -> None:
        """Returns when leadership held so far is lost; a file lock is never lost. Callers
        wait on it only while leading: after :meth:`release` what it does is not defined."""
        await asyncio.Future()


class FileLockLeadership(Leadership):
    """An exclusive ``flock`` on ``path`` (created when missing); the holder writes its pid and
    host into the file for others' logs."""

    def __init__(self, path: Path, poll_s: float = 1.0) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._fd: int | None = None
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    async def try_acquire(self) -> bool:
        if self._held:
            return True
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._held = True
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        log.info("active: holding the lock %s", self.path)
        return True

    def holder(self) -> str:
        try:
            text = self.path.read_text().strip()
        except OSError:
            text = ""
        return f"the holder of {self.path} ({text or 'unknown'})"

    async def release(self) -> None:
        fd, self._fd = self._fd, None
        held, self._held = self._held, False
        if fd is None:
            return
        try:
            if held:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
                log.info("released the lock %s", self.path)
        finally:
            os.close(fd)
