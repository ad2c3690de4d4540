"""Registration with the nameservers: at start, every heartbeat interval, at once after a topic
change, and an unregistration from all of them on a graceful stop.

Every broker registers with every nameserver (they never talk to each other). A round registers
with all of them concurrently, each call bounded by ``timeout_s``, so one unreachable nameserver
delays nobody; a failure is logged at WARNING with its address and retried after 1 s, then
2 s, 4 s ... up to the heartbeat interval.
Topic changes during a round are coalesced into one more round right after it.

The transport is a :class:`NameServerLink` per nameserver (gRPC in
:mod:`apogee_broker.nameserver_link`), so this loop knows nothing of the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from apogee_broker.core.topics import TopicConfig

log = logging.getLogger(__name__)

#: first retry delay after a failed registration; doubles up to the heartbeat interval
RETRY_FIRST_S = 1.0


class NameServerLink(Protocol):
    """One nameserver, as the registration loop sees it."""

    @property
    def address(self) -> str: ...

    async def register(self, topics: Sequence[TopicConfig], timeout: float) -> None:
        """Register (or heartbeat) with the current topic table; raises on failure."""
        ...

    async def unregister(self, timeout: float) -> None: ...

    async def close(self) -> None: ...


class RegistrationLoop:
    """Keeps this broker registered with every nameserver; ``start()`` / ``stop()``."""

    def __init__(
        self,
        links: Sequence[NameServerLink],
        topics: Callable[[], list[TopicConfig]],
        *,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.links = list(links)
        self._topics = topics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: address -> whether its last registration succeeded (None: not tried yet)
        self.healthy: dict[str, bool | None] = {link.address: None for link in self.links}
        #: completed rounds, for observers and tests
        self.rounds = 0

    async def start(self) -> None:
        """Register with every nameserver (bounded by ``timeout_s``; failures are logged, not
        raised), then keep doing so in the background."""
        if self._task is not None:
            return
        await self.register_all()
        self._task = asyncio.create_task(self._run(), name="apogee-broker-registration")

    def topics_changed(self) -> None:
        """Register again at once (a topic was created, changed or deleted)."""
        self._changed.set()

    async def stop(self, unregister: bool = True) -> None:
        """Stop the heartbeats (no registration is in flight afterwards), then unregister from
        every nameserver concurrently, each within ``timeout_s``, and close the links."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, self.timeout_s + 1)
        if unregister and self.links:
            await asyncio.gather(*(self._unregister(link) for link in self.links))
        for link in self.links:
            try:
                await asyncio.wait_for(link.close(), self.timeout_s)
            except Exception as exc:
                log.warning("closing the link to nameserver %s failed: %s", link.address, exc)

    async def register_all(self) -> None:
        """One round: register with every nameserver at once."""
        self._changed.clear()
        if self.links:
            topics = self._topics()
            await asyncio.gather(*(self._register(link, topics) for link in self.links))
        self.rounds += 1

    async def _run(self) -> None:
        retry = RETRY_FIRST_S
        while True:
            # A nameserver that failed (not started yet, restarting) is retried sooner than the
            # heartbeat interval, backing off from 1 s, so a broker started before its
            # nameservers is routable within seconds, not at its next heartbeat.
            failing = any(ok is False for ok in self.healthy.values())
            wait = min(self.interval_s, retry) if failing else self.interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait)
            await self.register_all()
            retry = min(retry * 2, self.interval_s) if failing else RETRY_FIRST_S

    async def _register(self, link: NameServerLink, topics: list[TopicConfig]) -> None:
        try:
            await asyncio.wait_for(link.register(topics, self.timeout_s), self.timeout_s + 1)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "registration with nameserver %s failed (retrying within %.0fs): %s",
                link.address,
                self.interval_s,
                _text(exc),
            )
            self.healthy[link.address] = False
            return
        if self.healthy.get(link.address) is not True:
            log.info("registered with nameserver %s (%d topics)", link.address, len(topics))
        else:
            log.debug("heartbeat to nameserver %s", link.address)
        self.healthy[link.address] = True

    async def _unregister(self, link: NameServerLink) -> None:
        try:
            await asyncio.wait_for(link.unregister(self.timeout_s), self.timeout_s + 1)
        except Exception as exc:
            log.warning("unregistration from nameserver %s failed: %s", link.address, _text(exc))
        else:
            log.info("unregistered from nameserver %s", link.address)


def _text(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return str(exc) or type(exc).__name__
