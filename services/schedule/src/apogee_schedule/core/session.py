"""One broker's schedule work: a session per connection.

A :class:`BrokerSession` starts from the broker's state (GetScheduleState: the layout and the
committed progress), works out the catch-up slots (those whose windows passed since the
progress was last committed), and runs three loops: :class:`~.scanning.Scanner`,
:class:`~.resolving.Resolver` and :class:`~.resolving.Committer`. Any failed call ends it.
A :class:`apogee.service.workers.BrokerWorker` keeps one session running per broker
(:func:`broker_worker`): after a failure it drops the session's entries in memory (they come
back from the committed progress) and starts a new one after a backoff (0.25 s doubling to 5 s,
reset once a session starts).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from opentelemetry.trace import Tracer

from apogee.common.clock import Clock
from apogee.common.errors import ApogeeError
from apogee.service.workers import BrokerSessionBase, BrokerWorker, counted_worker
from apogee_schedule.core.client import ScheduleClient
from apogee_schedule.core.progress import ProgressBook
from apogee_schedule.core.resolving import Committer, Resolver
from apogee_schedule.core.scanning import Scanner, SessionState
from apogee_schedule.core.stats import ScheduleStats
from apogee_schedule.settings import ScheduleSettings

log = logging.getLogger(__name__)

ClientFactory = Callable[[str], ScheduleClient]


class BrokerSession(BrokerSessionBase[ScheduleClient]):
    """One broker from its state until it fails or is stopped."""

    def __init__(
        self,
        broker: str,
        client: ScheduleClient,
        settings: ScheduleSettings,
        clock: Clock,
        stats: ScheduleStats,
        tracer: Tracer | None = None,
    ) -> None:
        super().__init__(broker, client)
        self.tracer = tracer
        self.settings = settings
        self.clock = clock
        self.stats = stats
        self.state: SessionState | None = None
        self.scanner: Scanner | None = None
        self.resolver: Resolver | None = None
        self.committer: Committer | None = None

    async def start(self) -> None:
        """Read the broker's state and start the loops; raises ApogeeError when the broker
        does not answer."""
        s = self.settings
        st = await self.client.get_state()
        book = ProgressBook(st.queues)
        state = self.state = SessionState(st.layout, book)
        bounds = {q.queue_id: q.max_offset for q in st.queues}
        catch_up: dict[int, int | None] = {}
        for q in st.layout.catch_up_queues(st.progress_updated_ms, st.now_ms):
            if q in bounds and book.cursor(q) < bounds[q]:
                catch_up[q] = bounds[q]
        self.resolver = Resolver(
            self.broker,
            self.client,
            state,
            self.stats,
            self.clock,
            max_batch=s.max_batch,
            on_error=self._fail,
            tracer=self.tracer,
        )
        self.scanner = Scanner(
            self.broker,
            self.client,
            state,
            self.stats,
            self.clock,
            lead_ms=s.lead_ms,
            hold_ms=s.scan_hold_ms,
            catch_up=catch_up,
            wake_resolver=self.resolver.wake,
            on_error=self._fail,
        )
        self.committer = Committer(
            self.broker,
            self.client,
            state,
            interval_s=s.progress_interval_s,
            on_error=self._fail,
        )
        layout = st.layout
        log.info(
            "broker %s (%s): %d delay levels, timer wheel of %d slots of %d ms; progress "
            "committed %s; %d slots to catch up",
            self.broker,
            st.broker_name,
            len(layout.delay_ms),
            layout.slots,
            layout.slot_ms,
            f"{(st.now_ms - st.progress_updated_ms) / 1000:.1f}s ago"
            if st.progress_updated_ms
            else "never",
            len(catch_up),
        )
        self.resolver.start()
        self.scanner.start()
        self.committer.start()

    async def _wind_down(self, grace_s: float) -> None:
        """Stop scanning; let deliveries in flight finish; hand back what is held (deliver
        what is due, park the rest); commit the progress (then the client is closed). Each
        step is bounded by ``grace_s``; never raises for a broker that does not answer (what
        was not handed back stays below the progress, and is delivered by the next session:
        at-least-once)."""
        if self.scanner is not None:
            await self.scanner.stop()
        if self.committer is not None:
            await self.committer.stop()
        if self.resolver is not None:
            await self.resolver.stop(grace_s)
            if not self.failed.done():  # after a failure, do not wait for the broker twice
                try:
                    await asyncio.wait_for(self.resolver.hand_back(), grace_s)
                except (ApogeeError, TimeoutError) as err:
                    log.warning(
                        "broker %s: entries held in memory could not be handed back (%s); "
                        "they will be delivered from the committed progress",
                        self.broker,
                        err,
                    )
        if self.committer is not None:
            try:
                await asyncio.wait_for(self.committer.commit(), grace_s)
            except (ApogeeError, TimeoutError) as err:
                log.warning("broker %s: the final progress commit failed: %s", self.broker, err)
        if self.state is not None and self.state.waiting:
            log.info(
                "broker %s: %d entries in memory left for the next session (from the "
                "committed progress)",
                self.broker,
                self.state.waiting,
            )


def broker_worker(
    broker: str,
    address: str,
    settings: ScheduleSettings,
    clock: Clock,
    stats: ScheduleStats,
    client_factory: ClientFactory,
    tracer: Tracer | None = None,
) -> BrokerWorker[BrokerSession]:
    """The worker that keeps a :class:`BrokerSession` running for ``broker``."""

    def new_session(address: str) -> BrokerSession:
        return BrokerSession(broker, client_factory(address), settings, clock, stats, tracer)

    return counted_worker(
        broker,
        address,
        new_session,
        shutdown_grace_s=settings.shutdown_grace_s,
        stats=stats,
        failure_note="its entries in memory are dropped, ",
    )
