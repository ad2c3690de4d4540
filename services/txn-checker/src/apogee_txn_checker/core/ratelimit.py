"""Checks to one producer group are rate limited: a token bucket per group, shared by every
broker's loop of the process (a group's producers are connected to every broker, so the limit
is the group's, not a broker's).

A bucket holds at most ``burst`` tokens and gains ``rate`` a second; each check to the group
takes one. A check that finds the bucket empty waits until a token is due plus a random jitter
of up to ``jitter_s``, so that the lanes of several brokers waiting on one group do not wake in
step. Time and randomness are injected (a :class:`~apogee.common.clock.Clock`, a
``random.Random`` and a ``sleep``), so tests drive them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from apogee.common.clock import Clock

Sleep = Callable[[float], Awaitable[None]]

#: Buckets kept before full ones (which a new bucket equals) are forgotten.
PRUNE_ABOVE: Final = 1024


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class GroupLimiter:
    """``rate`` checks a second per producer group, bursts of ``burst``."""

    def __init__(
        self,
        rate: float,
        burst: int,
        clock: Clock,
        rng: random.Random,
        jitter_s: float = 0.0,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be positive and burst at least 1")
        self.rate = rate
        self.burst = burst
        self.jitter_s = jitter_s
        self._clock = clock
        self._rng = rng
        self._sleep = sleep
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, group: str) -> _Bucket:
        now = self._clock.monotonic()
        b = self._buckets.get(group)
        if b is None:
            if len(self._buckets) >= PRUNE_ABOVE:
                self._prune(now)
            b = self._buckets[group] = _Bucket(float(self.burst), now)
        else:
            b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate)
            b.at = now
        return b

    def _prune(self, now: float) -> None:
        full = [
            g for g, b in self._buckets.items() if b.tokens + (now - b.at) * self.rate >= self.burst
        ]
        for g in full:
            del self._buckets[g]

    def available(self, group: str) -> float:
        """Tokens the group has now."""
        return self._bucket(group).tokens

    def try_take(self, group: str) -> float:
        """Take a token when there is one (answers 0.0); else the seconds until one is due."""
        b = self._bucket(group)
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return 0.0
        return (1.0 - b.tokens) / self.rate

    async def acquire(self, group: str) -> None:
        """Take a token, waiting (with jitter) until there is one."""
        while (wait := self.try_take(group)) > 0.0:
            await self._sleep(wait + self._rng.uniform(0.0, self.jitter_s))
