"""ConsumerGroups and SessionHub: joins, renewals, leaving at once, expiry on the injected clock,
listeners, conflicts reported by name, takeover by a newer session, and heartbeat checks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import InvalidArgumentError
from apogee_broker.core.clients.groups import (
    ConsumeMode,
    ConsumerGroups,
    Heartbeat,
    Member,
    Subscription,
    check_heartbeat,
)
from apogee_broker.core.clients.sessions import MembersChanged, OffsetsReset, Session, SessionHub

pytestmark = pytest.mark.unit

CL = ConsumeMode.CLUSTERING


def hb(
    client: str,
    group: str = "g",
    mode: ConsumeMode | None = CL,
    subs: tuple[tuple[str, str], ...] = (("T", "*"),),
) -> Heartbeat:
    return Heartbeat(client, group, mode, tuple(Subscription(t, e) for t, e in subs))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def groups(clock: ManualClock) -> ConsumerGroups:
    return ConsumerGroups(expiry_ms=120_000, clock=clock)


def test_join_renew_leave_and_listeners(groups: ConsumerGroups, clock: ManualClock) -> None:
    seen: list[tuple[str, list[str]]] = []
    removed: list[tuple[str, str]] = []
    groups.add_listener(lambda g, ids: seen.append((g, ids)))
    groups.add_removal_listener(lambda m, why: removed.append((m.client_id, why)))
    a, b = object(), object()
    groups.heartbeat(hb("c2"), "10.0.0.2:1", a)
    groups.heartbeat(hb("c1"), "10.0.0.1:1", b)
    assert seen == [("g", ["c2"]), ("g", ["c1", "c2"])]
    clock.advance(5)
    groups.heartbeat(hb("c1"), "10.0.0.1:1", b)  # a renewal changes no membership
    assert len(seen) == 2
    [m1, m2] = groups.members("g")
    assert (m1.client_id, m1.host, m1.mode, m1.last_heartbeat_ms) == (
        "c1",
        "10.0.0.1:1",
        CL,
        clock.time_ms(),
    )
    assert m2.client_id == "c2"
    assert not groups.leave("g", "c1", owner=a)  # not its session
    assert groups.leave("g", "c1", owner=b)
    assert seen[-1] == ("g", ["c2"])
    assert removed == [("c1", "left")]
    assert groups.leave("g", "c2")
    assert groups.groups() == []
    assert seen[-1] == ("g", [])


def test_expiry_after_the_configured_time_without_heartbeat(
    groups: ConsumerGroups, clock: ManualClock
) -> None:
    removed: list[tuple[str, str]] = []
    groups.add_removal_listener(lambda m, why: removed.append((m.client_id, why)))
    groups.heartbeat(hb("old"), "", object())
    clock.advance(60)
    groups.heartbeat(hb("young"), "", object())
    clock.advance(59.9)
    assert groups.expire() == []
    clock.advance(0.1)  # old: 120 s without a heartbeat
    assert [m.client_id for m in groups.expire()] == ["old"]
    assert groups.client_ids("g") == ["young"]
    assert removed == [("old", "expired")]


@pytest.mark.parametrize(
    ("beat", "message"),
    [
        (hb("c", group=""), "heartbeat.group: must not be empty"),
        (
            hb("c", group="a b"),
            "heartbeat.group: 'a b' has a character outside [%|a-zA-Z0-9_-]",
        ),
        (hb(""), "heartbeat.client_id: must not be empty"),
        (hb("c\n"), "heartbeat.client_id: 'c\\n' has a control character; use printable text"),
        (hb("c", mode=None), "heartbeat.mode: must be CLUSTERING or BROADCASTING, got unspecified"),
        (
            hb("c", subs=(("T", "*"), ("bad topic", "*"))),
            "heartbeat.subscriptions[1].topic: 'bad topic' has a character outside [%|a-zA-Z0-9_-]",
        ),
        (
            hb("c", subs=(("T", "*"), ("T", "A"))),
            "heartbeat.subscriptions[1].topic: 'T' is subscribed twice (also subscriptions[0]); "
            "join the tags with '||'",
        ),
        (
            hb("c", subs=(("T", "A || || B"),)),
            "heartbeat.subscriptions[0].tag_expression: 'A || || B' has an empty tag",
        ),
    ],
)
def test_bad_heartbeats_name_the_field(
    groups: ConsumerGroups, beat: Heartbeat, message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        groups.heartbeat(beat, "", object())
    assert str(caught.value).startswith(message)
    assert groups.groups() == []


def test_retry_topics_and_no_subscription_are_fine() -> None:
    check_heartbeat(hb("c", subs=(("%RETRY%g", "*"), ("%DLQ%g", "A || B"))))
    check_heartbeat(hb("c", subs=()))


def test_conflicts_are_named(groups: ConsumerGroups, caplog: pytest.LogCaptureFixture) -> None:
    groups.heartbeat(hb("c1", subs=(("A", "x || y"), ("B", "*"))), "", object())
    groups.heartbeat(hb("c2", subs=(("A", "y||x"), ("B", ""))), "", object())
    assert groups.warnings("g") == []  # the same selections, written differently
    groups.heartbeat(hb("c3", subs=(("A", "x"),)), "", object())
    groups.heartbeat(
        hb("c4", mode=ConsumeMode.BROADCASTING, subs=(("A", "x || y"), ("B", "*"))), "", object()
    )
    warnings = groups.warnings("g")
    assert warnings == [
        "members consume in different modes: BROADCASTING by c4; CLUSTERING by c1, c2, c3",
        "members subscribe to different topics (each topic's queues are shared only among its "
        "subscribers): [A, B] by c1, c2, c4; [A] by c3",
        "members select different messages of topic A (messages of a queue assigned to a client "
        "that does not select them are skipped): 'x || y' by c1, c2, c4; 'x' by c3",
    ]
    assert any("group g: members consume in different modes" in r.message for r in caplog.records)
    groups.leave("g", "c3")
    groups.leave("g", "c4")
    assert groups.warnings("g") == []


# -- sessions -------------------------------------------------------------------------------------


@pytest.fixture
def hub(groups: ConsumerGroups) -> SessionHub:
    return SessionHub(groups, broker_name="b1", first_heartbeat_timeout_s=5)


async def next_event(session: Session, events: AsyncIterator[object]) -> object:
    return await asyncio.wait_for(anext(events), 2)


async def test_sessions_get_the_member_list_and_its_changes(
    hub: SessionHub, groups: ConsumerGroups
) -> None:
    s1, s2 = hub.open("h1"), hub.open("h2")
    e1, e2 = s1.events(), s2.events()
    hub.heartbeat(s1, hb("c1"))
    assert await next_event(s1, e1) == MembersChanged("g", ("c1",))
    hub.heartbeat(s1, hb("c1"))  # a renewal: no event
    hub.heartbeat(s2, hb("c2"))
    assert await next_event(s2, e2) == MembersChanged("g", ("c1", "c2"))
    assert await next_event(s1, e1) == MembersChanged("g", ("c1", "c2"))
    assert hub.reset_offsets("g", "T", [(0, 5), (1, 7)]) == 2
    assert await next_event(s1, e1) == OffsetsReset("g", "T", ((0, 5), (1, 7)))
    hub.close(s2)  # the stream ended: c2 leaves at once
    assert groups.client_ids("g") == ["c1"]
    assert await next_event(s1, e1) == MembersChanged("g", ("c1",))
    assert len(hub) == 1


async def test_a_burst_of_changes_is_one_event(hub: SessionHub) -> None:
    s1 = hub.open("h")
    e1 = s1.events()
    hub.heartbeat(s1, hb("c1"))
    others = [hub.open("h") for _ in range(5)]
    for i, s in enumerate(others):
        hub.heartbeat(s, hb(f"c{i + 2}"))
    assert await next_event(s1, e1) == MembersChanged("g", ("c1", "c2", "c3", "c4", "c5", "c6"))


async def test_one_session_one_consumer(hub: SessionHub) -> None:
    s = hub.open("h")
    hub.heartbeat(s, hb("c1"))
    with pytest.raises(InvalidArgumentError, match=r"^heartbeat\.group: a session belongs to one"):
        hub.heartbeat(s, hb("c1", group="other"))
    with pytest.raises(InvalidArgumentError, match=r"^heartbeat\.client_id: a session belongs"):
        hub.heartbeat(s, hb("c9"))


async def test_a_newer_session_takes_the_member_over(
    hub: SessionHub, groups: ConsumerGroups
) -> None:
    old, new = hub.open("h"), hub.open("h")
    hub.heartbeat(old, hb("c1"))
    hub.heartbeat(new, hb("c1"))
    assert old.closed
    assert old.error is not None
    assert "client c1 opened a newer session with broker b1" in str(old.error)
    hub.close(old)  # the old stream's end does not drop the member
    assert groups.client_ids("g") == ["c1"]
    assert [m.owner for m in groups.members("g")] == [new]


async def test_expiry_ends_the_session_and_stop_ends_them_all(
    hub: SessionHub, groups: ConsumerGroups, clock: ManualClock
) -> None:
    s1, s2 = hub.open("h"), hub.open("h")
    hub.heartbeat(s1, hb("c1"))
    clock.advance(100)
    hub.heartbeat(s2, hb("c2"))
    clock.advance(20)
    expired: list[Member] = groups.expire()
    assert [m.client_id for m in expired] == ["c1"]
    assert s1.closed
    assert str(s1.error) == "the next heartbeat of client c1 in group g took longer than 120.0s"
    events = [e async for e in s1.events()]
    assert events == []  # an ended session yields nothing more
    hub.stop()
    assert s2.closed
    assert str(s2.error) == (
        "broker b1 is unavailable: it is stopping; reconnect to another broker"
    )
    with pytest.raises(Exception, match="is stopping"):
        hub.open("h")


async def test_the_expiry_loop_runs_in_the_background() -> None:
    clock = ManualClock()
    groups = ConsumerGroups(expiry_ms=1000, clock=clock, check_interval_s=0.01)
    gone = asyncio.Event()
    groups.add_removal_listener(lambda m, why: gone.set())
    groups.heartbeat(hb("c1"), "", object())
    groups.start()
    try:
        clock.advance(2)
        await asyncio.wait_for(gone.wait(), 5)
    finally:
        await groups.stop()
    assert groups.groups() == []
