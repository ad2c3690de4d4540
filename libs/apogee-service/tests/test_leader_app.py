"""LeaderApp: a standby is alive but not SERVING; leading starts the work and goes SERVING;
losing leadership stops it; stop is bounded, releases the lock and says so once; the leader
gauge follows the leadership (of two replicas on one lock file exactly one reads 1, the standby
goes to 1 when the leader stops); a metrics port in use fails the start. Through a real health
server and metrics endpoint, with a leadership the test grants and takes away."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from apogee.common.metrics import scrape
from apogee.rpc.server import check_health
from apogee.service.leader_app import LeaderApp
from apogee.service.leader_settings import LeaderServiceSettings
from apogee.service.leadership import FileLockLeadership, Leadership
from apogee.testkit.processes import taken_address
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

PROCESS = "apogee.demo.Process"


@dataclass(frozen=True, slots=True)
class DemoSettings(LeaderServiceSettings):
    namesrv: str = "127.0.0.1:9876"
    listen: str = "127.0.0.1:0"
    metrics_listen: str = "127.0.0.1:0"
    lock_file: Path = Path("demo.lock")
    lock_poll_s: float = 0.05
    broker_refresh_s: float = 1.0
    rpc_timeout_s: float = 1.0
    shutdown_grace_s: float = 1.0
    log_level: str = "INFO"


class GrantedLeadership(Leadership):
    """Leads once :meth:`grant` is called, until :meth:`take_away`."""

    def __init__(self, error: OSError | None = None) -> None:
        self.error = error
        self.released = 0
        self._lead = asyncio.Event()
        self._lost = asyncio.Event()

    def grant(self) -> None:
        self._lead.set()

    def take_away(self) -> None:
        self._lead.clear()
        self._lost.set()

    async def try_acquire(self) -> bool:
        if self.error is not None:
            raise self.error
        return self._lead.is_set()

    async def acquire(self) -> None:
        await self._lead.wait()
        self._lost.clear()

    async def wait_lost(self) -> None:
        await self._lost.wait()

    async def release(self) -> None:
        self.released += 1

    def holder(self) -> str:
        return "the other replica"

    @property
    def held(self) -> bool:
        return self._lead.is_set()


class Work:
    def __init__(self) -> None:
        self.started = False
        self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


class DemoApp(LeaderApp[DemoSettings, Work]):
    name = "demo"
    title = "the demo service"
    process_health = PROCESS

    def __init__(self, leadership: Leadership, settings: DemoSettings | None = None) -> None:
        super().__init__(settings or DemoSettings(), leadership=leadership)
        self.terms: list[Work] = []

    def _new_work(self) -> Work:
        self.terms.append(Work())
        return self.terms[-1]

    def _log_active(self, work: Work) -> None:
        self.log.info("active: %d terms", len(self.terms))

    def _log_stopped(self) -> None:
        self.log.info("demo stopped")


def work_of(app: DemoApp) -> Work | None:
    return app.work


async def serving(app: DemoApp, service: str = "") -> bool:
    return await check_health(f"127.0.0.1:{app.port}", 1, service)


async def test_a_standby_is_alive_and_serves_only_while_it_leads(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=DemoApp.__module__)
    leadership = GrantedLeadership()
    app = DemoApp(leadership)
    port = await app.start()
    try:
        assert port == app.port > 0
        assert await serving(app, PROCESS)
        assert not await serving(app)
        assert (app.active, work_of(app)) == (False, None)

        leadership.grant()
        await asyncio.wait_for(app.wait_active(), 5)
        assert await serving(app)
        [first] = app.terms
        assert work_of(app) is first
        assert first.started

        async def standby() -> bool:
            return not app.active

        leadership.take_away()
        await eventually(standby, 5, "the replica a standby again")
        assert first.stopped
        assert work_of(app) is None
        assert not await serving(app)
        assert await serving(app, PROCESS)

        leadership.grant()
        await asyncio.wait_for(app.wait_active(), 5)
        assert len(app.terms) == 2
    finally:
        await app.stop()
    assert app.terms[-1].stopped
    assert leadership.released == 1
    assert not await check_health(f"127.0.0.1:{port}", 0.5, PROCESS)
    await app.stop()  # twice: nothing more
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    mine = DemoApp.__module__
    assert (mine, "INFO", f"demo health service listening on port {port}") in lines
    assert (mine, "WARNING", "leadership lost: this replica becomes a standby") in lines
    assert [m for _, _, m in lines if m.startswith("active: ")] == [
        "active: 1 terms",
        "active: 2 terms",
    ]
    assert [m for _, _, m in lines if m == "demo stopped"] == ["demo stopped"]


async def test_starting_twice_is_refused() -> None:
    app = DemoApp(GrantedLeadership())
    await app.start()
    try:
        with pytest.raises(RuntimeError, match=r"^the demo service is already started$"):
            await app.start()
    finally:
        await app.stop()


async def test_an_unusable_lock_fails_the_start_and_frees_the_port() -> None:
    leadership = GrantedLeadership(OSError("cannot open demo.lock"))
    app = DemoApp(leadership)
    with pytest.raises(OSError, match=r"cannot open demo\.lock"):
        await app.start()
    assert not await check_health(f"127.0.0.1:{app.port}", 0.5, PROCESS)
    assert leadership.released == 1
    assert app.metrics_server is None  # the metrics endpoint was stopped with the rest


def serves_metrics(app: DemoApp) -> bool:
    return app.metrics_server is not None


async def test_the_leader_gauge_reads_1_only_while_the_replica_leads() -> None:
    leadership = GrantedLeadership()
    app = DemoApp(leadership)
    await app.start()
    try:
        assert app.metrics_server is not None
        address = app.metrics_server.address

        async def gauge() -> float | None:
            return (await asyncio.to_thread(scrape, address)).get_sample("apogee_demo_leader")

        async def standby() -> bool:
            return await gauge() == 0

        assert await gauge() == 0
        leadership.grant()
        await asyncio.wait_for(app.wait_active(), 5)
        assert await gauge() == 1
        leadership.take_away()
        await eventually(standby, 5, "the gauge at 0 once the leadership is lost")
        leadership.grant()
        await asyncio.wait_for(app.wait_active(), 5)
    finally:
        await app.stop()
    assert app.registry.get_sample_value("apogee_demo_leader") == 0  # stopped: not leading
    [family] = [m for m in app.registry.collect() if m.name == "apogee_demo_leader"]
    assert family.documentation == DemoApp.leader_help


async def leader(app: DemoApp) -> float | None:
    """``apogee_demo_leader`` as the replica's /metrics serves it."""
    assert app.metrics_server is not None
    m = await asyncio.to_thread(scrape, app.metrics_server.address)
    return m.get_sample("apogee_demo_leader")


async def test_of_two_replicas_on_one_lock_one_leads_and_the_standby_takes_over(
    tmp_path: Path,
) -> None:
    def replica() -> DemoApp:
        return DemoApp(FileLockLeadership(tmp_path / "demo.lock", DemoSettings().lock_poll_s))

    first, second = replica(), replica()
    await first.start()
    try:
        await asyncio.wait_for(first.wait_active(), 5)
        await second.start()  # tried the lock once: a standby
        assert (await leader(first), await leader(second)) == (1, 0)

        await first.stop()  # releases the lock
        assert first.registry.get_sample_value("apogee_demo_leader") == 0

        async def second_leads() -> bool:
            return await leader(second) == 1

        await eventually(second_leads, 5, "the standby's gauge at 1")
        assert second.active
    finally:
        await first.stop()
        await second.stop()


async def test_a_metrics_port_in_use_fails_the_start_naming_it() -> None:
    with taken_address() as taken:
        leadership = GrantedLeadership()
        app = DemoApp(leadership, replace(DemoSettings(), metrics_listen=taken))
        with pytest.raises(OSError, match=f"demo cannot serve metrics on {taken}"):
            await app.start()
        assert not await check_health(f"127.0.0.1:{app.port}", 0.5, PROCESS)  # freed
        await app.stop()
    assert leadership.released == 1


def test_the_metrics_are_named_after_the_service() -> None:
    class Dashed(DemoApp):
        name = "demo-two"

    assert Dashed(GrantedLeadership()).metrics_prefix == "apogee_demo_two"


async def test_metrics_are_served_from_the_start_to_the_stop() -> None:
    app = DemoApp(GrantedLeadership())
    await app.start()
    try:
        assert app.metrics_server is not None
        address = app.metrics_server.address
        names = (await asyncio.to_thread(scrape, address)).names()
        assert "process_cpu_seconds_total" in names
    finally:
        await app.stop()
    assert not serves_metrics(app)
    with pytest.raises(OSError, match="Connection refused"):  # nobody listens any more
        await asyncio.to_thread(scrape, address, 0.5)
