"""The loop that drops brokers silent for longer than the expiry.

Every ``scan_interval_s`` it calls :meth:`RouteRegistry.expire` and logs each dropped broker at
WARNING. Routes already leave out a silent broker before the scan drops it (the registry checks
liveness on every query); the scan frees its entry and says so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from apogee.common.aio import PeriodicLoop
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import InvalidArgumentError
from apogee_nameserver.core.registry import RouteRegistry

log = logging.getLogger(__name__)


class ExpiryLoop:
    """Scan ``registry`` every ``scan_interval_s`` until :meth:`stop`."""

    def __init__(
        self,
        registry: RouteRegistry,
        scan_interval_s: float,
        clock: Clock = SYSTEM_CLOCK,
        on_dropped: Callable[[int], None] | None = None,
    ) -> None:
        if not scan_interval_s > 0:
            raise InvalidArgumentError(
                field="scan_interval_s", rule=f"must be greater than 0, got {scan_interval_s!r}"
            )
        self._registry = registry
        self._clock = clock
        #: told how many brokers each scan dropped (the expiries metric)
        self._on_dropped = on_dropped
        self._loop = PeriodicLoop("the expiry scan", scan_interval_s, self.scan_once)
        self.scans = 0
        """How many scans have run (tests wait on it)."""

    def start(self) -> None:
        if self._loop.running:
            raise RuntimeError("the expiry loop is already started")
        self._loop.start()

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop scanning; waits at most ``timeout`` seconds, then cancels the scan."""
        await self._loop.stop(timeout)

    def scan_once(self) -> int:
        """Drop the silent brokers now; returns how many were dropped."""
        dropped = self._registry.expire()
        now_ms = self._clock.time_ms()
        for b in dropped:
            log.warning(
                "broker %s (%s, cluster %s) dropped: no heartbeat for %.1fs "
                "(expiry %.1fs); its routes are gone until it registers again",
                b.broker_name,
                b.address,
                b.cluster,
                (now_ms - b.last_heartbeat_ms) / 1000,
                self._registry.expiry_s,
            )
        if dropped and self._on_dropped is not None:
            self._on_dropped(len(dropped))
        self.scans += 1
        return len(dropped)
