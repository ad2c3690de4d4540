"""Registration with the nameservers: at start, every heartbeat interval, at once after a topic
change, and an unregistration from all of them on a graceful stop.

Every broker registers with every nameserver (they never talk to each other). A round registers
with all of them concurrently, each call bounded by ``timeout_s``, so one unreachable nameserver
delays nobody; a failure is logged at WARNING with its address and retried after 1 s, then
2 s, 4 s ... up to the heartbeat interval.
Topic changes during a round are coalesced into one more round right after it.

A heartbeat with nothing changed carries no topics. The loop sends with every registration the
version of its topic table (:attr:`RegistrationLoop.topics_version`: the table's digest,
:attr:`~apogee_broker.core.topics.TopicManager.digest`, which changes with every change and is
the same for the same table in any process). Once a nameserver has accepted the table in full
and said it takes the short form, the next registrations to it say only "my topics are those you
hold at this version"; after a change, it gets them all again. A nameserver that does not hold
them at that version (it restarted, the broker expired there) refuses the short form, changing
nothing, and gets the full list at once, in the same round. A nameserver that never says it
takes the short form (an older one, which would read an empty list as "no topics") always gets
the full list, and so does one whose last registration failed, until it says so again.

A broker that restarts (after a crash, or a quick restart) is usually still registered, with the
same table: before its first registration with a nameserver it asks which version that one holds
for it (:meth:`NameServerLink.held_version`, from ``GetClusterInfo``), and when it is the
current one, sends the short form rather than the whole table, so a restart with 50,000 topics
neither waits for them to be sent and read nor holds the nameserver up while it reads them. A
nameserver that does not report the version (an older one) is sent the table.

The transport is a :class:`NameServerLink` per nameserver (gRPC in
:mod:`apogee_broker.nameserver_link`), so this loop knows nothing of the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from apogee_broker.core.topics import TopicConfig

log = logging.getLogger(__name__)

#: first retry delay after a failed registration; doubles up to the heartbeat interval
RETRY_FIRST_S = 1.0


@dataclass(frozen=True, slots=True)
class RegistrationReply:
    """What a nameserver answers to a registration."""

    #: it takes the short form (a heartbeat that says the topics are unchanged)
    knows_topics_unchanged: bool = False
    #: it refused the short form, changing nothing: it wants the topics
    topics_needed: bool = False


class NameServerLink(Protocol):
    """One nameserver, as the registration loop sees it."""

    @property
    def address(self) -> str: ...

    async def register(
        self, topics: Sequence[TopicConfig] | None, version: int, timeout: float
    ) -> RegistrationReply:
        """Register (or heartbeat) with the topic table numbered ``version``: its ``topics``,
        or, when None, the short form ("the topics you accepted at ``version``"); raises on
        failure."""
        ...

    async def held_version(self, timeout: float) -> int:
        """The version of this broker's topic table the nameserver holds, as registered by this
        broker's name, cluster, address and epoch; 0 when it holds none or does not say
        (an older nameserver). Raises on failure."""
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
        version: Callable[[], int],
    ) -> None:
        """``topics``: the table to send; ``version``: its version (a digest: the same for the
        same table, never 0)."""
        self.links = list(links)
        self._topics = topics
        self._version = version
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: address -> whether its last registration succeeded (None: not tried yet)
        self.healthy: dict[str, bool | None] = {link.address: None for link in self.links}
        #: completed rounds, for observers and tests
        self.rounds = 0
        #: address -> the table version it accepted in full, when it takes the short form
        self._accepted: dict[str, int | None] = {link.address: None for link in self.links}
        #: the table of this round, read once for every nameserver that needs it
        self._table: tuple[int, list[TopicConfig]] | None = None

    @property
    def topics_version(self) -> int:
        """The version of the topic table now."""
        return self._version()

    async def start(self) -> None:
        """Register with every nameserver (bounded by ``timeout_s``; failures are logged, not
        raised), then keep doing so in the background."""
        if self._task is not None:
            return
        await self.register_all()
        self._task = asyncio.create_task(self._run(), name="apogee-broker-registration")

    def topics_changed(self, name: str = "") -> None:
        """Register again at once, with the topics (topic ``name`` was created, changed or
        deleted)."""
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
        try:
            if self.links:
                await asyncio.gather(*(self._register(link) for link in self.links))
        finally:
            self._table = None
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

    async def _register(self, link: NameServerLink) -> None:
        try:
            sent = await self._send(link)
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
            self._accepted[link.address] = None  # it may come back as another nameserver
            return
        what = "topics unchanged" if sent is None else f"{sent} topics"
        if self.healthy.get(link.address) is not True:
            log.info("registered with nameserver %s (%s)", link.address, what)
        else:
            log.debug("heartbeat to nameserver %s (%s)", link.address, what)
        self.healthy[link.address] = True

    async def _send(self, link: NameServerLink) -> int | None:
        """Register with one nameserver: the short form when it holds the current table, else
        (or when it refuses the short form) the topics. Returns how many topics were sent
        (None: none, the short form was accepted)."""
        address = link.address
        version = self.topics_version
        # the first registration of this process: a restarted broker may still be held
        first = self.healthy.get(address) is None and self._accepted.get(address) is None
        if first and await self._held(link) == version:
            self._accepted[address] = version
        if self._accepted.get(address) == version:
            reply = await self._call(link, None, version)
            if reply.knows_topics_unchanged and not reply.topics_needed:
                return None
            self._accepted[address] = None
            log.info(
                "nameserver %s %s: sending the topics",
                address,
                "does not hold this broker's topics (it restarted, or the broker expired there)"
                if reply.knows_topics_unchanged
                else "no longer takes heartbeats without topics",
            )
        if self._table is None or self._table[0] != self.topics_version:
            self._table = (self.topics_version, self._topics())
        version, topics = self._table
        reply = await self._call(link, topics, version)
        self._accepted[address] = version if reply.knows_topics_unchanged else None
        return len(topics)

    async def _held(self, link: NameServerLink) -> int:
        """The version ``link`` holds for this broker; 0 when it cannot say."""
        try:
            return await asyncio.wait_for(link.held_version(self.timeout_s), self.timeout_s + 1)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("nameserver %s: the topic version it holds is unknown: %s", link.address, exc)
            return 0

    async def _call(
        self, link: NameServerLink, topics: list[TopicConfig] | None, version: int
    ) -> RegistrationReply:
        return await asyncio.wait_for(
            link.register(topics, version, self.timeout_s), self.timeout_s + 1
        )

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
