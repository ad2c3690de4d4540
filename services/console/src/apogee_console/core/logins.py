"""How often a visitor may try to log in, and how many passwords are checked at once.

- :class:`LoginLimits`: failed logins counted per user name (per way of logging in: a console
  user and an access key of the same name are counted apart) and per client address (the
  peer's). A name with ``user_failures`` failed logins within ``window_s`` of the first of
  them (an address with ``address_failures``) is locked out for ``lockout_s``; each further
  lock-out before ``window_s`` pass without a failure doubles it, up to ``lockout_max_s``.
  While locked out, every attempt is refused before any password is checked (the right one
  too) and does not lengthen the lock-out, which so ends at most ``lockout_max_s`` after it
  began. Attempts in flight count: no more passwords of one name than its limit are checked in
  a window, however many arrive at once. A successful login forgets its name's failures (not
  its address's). Each side keeps at most ``max_keys`` names (addresses), the one touched least
  recently dropped first, so spraying names or addresses does not grow the memory.
- :class:`PasswordChecks`: password checks (scrypt: about 50 ms of CPU and 16 MiB each) on
  ``running`` threads of their own, off the event loop, with at most ``waiting`` more in line;
  beyond that :class:`Busy`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

T = TypeVar("T")

Side = Literal["user", "address"]
#: Most names (and most addresses) whose failures are remembered.
MAX_KEYS: Final = 10_000
#: Password checks running at once (each takes scrypt's memory, 16 MiB by default) ...
CHECKS_RUNNING: Final = 2
#: ... and waiting for a thread; beyond them :class:`Busy`.
CHECKS_WAITING: Final = 32
#: Seconds to wait when too many attempts of a name are in flight, or checks are busy.
RETRY_SOON_S: Final = 1


@dataclass(slots=True)
class _Count:
    failures: int = 0
    #: the first failure counted (its window's start) and the last
    since: float = 0.0
    last: float = 0.0
    in_flight: int = 0
    #: lock-outs in a row (each doubles the next)
    lockouts: int = 0
    locked_until: float = 0.0


class FailureCounts:
    """Failed logins of one side (names or addresses), see the module docstring."""

    def __init__(
        self, limit: int, window_s: float, lockout_s: float, lockout_max_s: float, max_keys: int
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.lockout_s = lockout_s
        self.lockout_max_s = lockout_max_s
        self.max_keys = max_keys
        self._counts: OrderedDict[str, _Count] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def wait_s(self, key: str, now: float) -> tuple[float, bool]:
        """Seconds before ``key`` may try (0: now), and whether it is locked out (else too
        many of its attempts are in flight)."""
        c = self._counts.get(key)
        if c is None:
            return 0.0, False
        if c.locked_until > now:
            return c.locked_until - now, True
        self._age(c, now)
        if c.failures + c.in_flight >= self.limit:
            return float(RETRY_SOON_S), False
        return 0.0, False

    def begin(self, key: str) -> None:
        self._touch(key).in_flight += 1

    def end(self, key: str, now: float, failed: bool) -> float:
        """An attempt of ``key`` is over; the lock-out a failure begins, in seconds (0: none)."""
        c = self._touch(key)
        c.in_flight = max(0, c.in_flight - 1)
        if not failed:
            self._age(c, now)
            if not (c.failures or c.in_flight or c.lockouts or c.locked_until > now):
                del self._counts[key]  # nothing to remember
            return 0.0
        self._age(c, now)
        if not c.failures:
            c.since = now
        c.failures += 1
        c.last = now
        if c.failures < self.limit:
            return 0.0
        c.failures = 0
        c.lockouts += 1
        length = min(self.lockout_s * 2.0 ** min(c.lockouts - 1, 32), self.lockout_max_s)
        c.locked_until = now + length
        return length

    def forget(self, key: str) -> None:
        """A successful login of ``key``: its failures and lock-outs are forgotten."""
        c = self._counts.get(key)
        if c is None:
            return
        if c.in_flight <= 1:
            del self._counts[key]
        else:
            self._counts[key] = _Count(in_flight=c.in_flight - 1)

    def _touch(self, key: str) -> _Count:
        c = self._counts.get(key)
        if c is not None:
            self._counts.move_to_end(key)
            return c
        c = self._counts[key] = _Count()
        while len(self._counts) > self.max_keys:
            self._counts.popitem(last=False)
        return c

    def _age(self, c: _Count, now: float) -> None:
        """Forget failures older than the window, and lock-outs a quiet window ago."""
        if c.failures and now - c.since >= self.window_s:
            c.failures = 0
        if c.lockouts and now - max(c.last, c.locked_until) >= self.window_s:
            c.lockouts = 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an attempt may not be made now."""

    side: Side
    retry_after_s: int
    #: locked out (else: too many attempts of the name in flight)
    locked: bool


@dataclass(frozen=True, slots=True)
class Lockout:
    """A lock-out a failure began."""

    side: Side
    seconds: float


class LoginLimits:
    """Failed logins per name and per address, and their lock-outs (see the module
    docstring); time from ``clock``. Call :meth:`begin` before checking a password and, when
    it allowed the attempt, :meth:`end` after, whatever happened."""

    def __init__(
        self,
        *,
        user_failures: int,
        address_failures: int,
        window_s: float,
        lockout_s: float,
        lockout_max_s: float,
        clock: Callable[[], float] = time.time,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.clock = clock
        self.users = FailureCounts(user_failures, window_s, lockout_s, lockout_max_s, max_keys)
        self.addresses = FailureCounts(
            address_failures, window_s, lockout_s, lockout_max_s, max_keys
        )

    def begin(self, user: str, address: str) -> Refusal | None:
        """None: the attempt may check its password (and is counted in flight); else why not,
        and for how long."""
        now = self.clock()
        for side, counts, key in self._sides(user, address):
            wait, locked = counts.wait_s(key, now)
            if wait > 0:
                return Refusal(side, max(1, math.ceil(wait)), locked)
        self.users.begin(user)
        self.addresses.begin(address)
        return None

    def end(self, user: str, address: str, ok: bool | None) -> list[Lockout]:
        """The attempt :meth:`begin` allowed is over: ``ok`` True (the name's failures are
        forgotten), False (a failure on both sides; the lock-outs it began), or None (no
        password was checked: nothing counted)."""
        now = self.clock()
        if ok:
            self.users.forget(user)
            self.addresses.end(address, now, failed=False)
            return []
        out = []
        for side, counts, key in self._sides(user, address):
            seconds = counts.end(key, now, failed=ok is False)
            if seconds:
                out.append(Lockout(side, seconds))
        return out

    def _sides(self, user: str, address: str) -> tuple[tuple[Side, FailureCounts, str], ...]:
        return (("user", self.users, user), ("address", self.addresses, address))


class Busy(Exception):
    """Too many password checks running and waiting."""


class PasswordChecks:
    """Password checks off the event loop, bounded (see the module docstring)."""

    def __init__(self, running: int = CHECKS_RUNNING, waiting: int = CHECKS_WAITING) -> None:
        self.running = running
        self.limit = running + waiting
        self._pool = ThreadPoolExecutor(max_workers=running, thread_name_prefix="console-login")
        self._pending = 0

    @property
    def pending(self) -> int:
        """Checks running or waiting."""
        return self._pending

    async def run(self, check: Callable[[], T]) -> T:
        """``check()`` on one of the threads; :class:`Busy` when ``running + waiting`` are
        pending already."""
        if self._pending >= self.limit:
            raise Busy(f"{self._pending} password checks are pending")
        future = asyncio.get_running_loop().run_in_executor(self._pool, check)
        self._pending += 1
        future.add_done_callback(self._done)
        return await future

    def _done(self, _future: Any) -> None:
        self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
