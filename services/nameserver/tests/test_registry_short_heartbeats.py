"""A heartbeat with nothing changed carries no topics: it refreshes a live broker held at the
same cluster, address, epoch and topic table version, keeping its topics; anything else is
refused and changes nothing, so the broker sends its topics."""

from __future__ import annotations

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import InvalidArgumentError, StaleEpochError, UnknownTopicError
from apogee.common.topics import TopicConfig
from apogee_nameserver.core.registry import RouteRegistry

pytestmark = pytest.mark.unit

START_MS = 1_700_000_000_000
ORDERS = TopicConfig("Orders", read_queues=4, write_queues=4, perm=6)
ADDRESS = "broker-a.brokers:10911"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def registry(clock: ManualClock) -> RouteRegistry:
    return RouteRegistry(expiry_s=120.0, clock=clock)


def full(registry: RouteRegistry, version: int, *, epoch: int = 0) -> bool:
    return registry.register_broker(
        "c", "broker-a", ADDRESS, [ORDERS], epoch=epoch, topics_version=version
    )


def short(
    registry: RouteRegistry,
    version: int,
    *,
    cluster: str = "c",
    address: str = ADDRESS,
    epoch: int = 0,
    auto_create: bool = False,
) -> bool:
    return registry.refresh_broker(
        cluster, "broker-a", address, version, auto_create_topics=auto_create, epoch=epoch
    )


def routed(registry: RouteRegistry) -> list[tuple[str, int]]:
    """Where Orders goes: (address, write queues) per broker; [] when it has no route."""
    try:
        route = registry.route("Orders")
    except UnknownTopicError:
        return []
    return [(b.address, q.write_queues) for b, q in zip(route.brokers, route.queues, strict=True)]


def test_a_short_heartbeat_keeps_the_topics_and_the_broker_alive(
    registry: RouteRegistry, clock: ManualClock
) -> None:
    full(registry, 3)
    clock.advance(100)
    assert short(registry, 3) is True
    clock.advance(100)  # 200 s after the full registration, 100 s after the short one
    assert routed(registry) == [(ADDRESS, 4)]
    [info] = registry.cluster_info()
    assert (info.topic_count, info.last_heartbeat_ms) == (1, START_MS + 100_000)
    clock.advance(21)  # silent for 121 s: the short heartbeat counted, nothing more
    assert routed(registry) == []


def test_a_nameserver_that_never_held_the_broker_refuses_and_holds_nothing(
    registry: RouteRegistry,
) -> None:
    assert short(registry, 1) is False  # as after a restart
    assert registry.cluster_info() == []
    assert registry.broker_liveness() == []
    assert routed(registry) == []


def test_another_version_is_refused_and_does_not_refresh(
    registry: RouteRegistry, clock: ManualClock
) -> None:
    full(registry, 3)
    clock.advance(100)
    assert short(registry, 4) is False
    assert short(registry, 2) is False
    assert routed(registry) == [(ADDRESS, 4)]  # the topics held stay as they were
    clock.advance(21)
    assert routed(registry) == []  # and the refused heartbeats did not keep it alive
    # the full registration that follows takes the new version
    assert full(registry, 4) is True
    assert short(registry, 3) is False
    assert short(registry, 4) is True


def test_a_broker_that_expired_must_send_its_topics(
    registry: RouteRegistry, clock: ManualClock
) -> None:
    full(registry, 3)
    clock.advance(121)
    assert short(registry, 3) is False  # not dropped yet by the expiry loop, but not live
    assert routed(registry) == []
    assert [b.live for b in registry.broker_liveness()] == [False]


def test_another_cluster_address_or_auto_creation_is_refused(registry: RouteRegistry) -> None:
    full(registry, 3)
    assert short(registry, 3, cluster="other") is False
    assert short(registry, 3, address="elsewhere:10911") is False
    assert short(registry, 3, auto_create=True) is False
    assert routed(registry) == [(ADDRESS, 4)]
    [info] = registry.cluster_info()
    assert (info.cluster, info.auto_create_topics) == ("c", False)


def test_epochs_are_fenced_as_in_a_full_registration(registry: RouteRegistry) -> None:
    full(registry, 3, epoch=5)
    with pytest.raises(StaleEpochError):
        short(registry, 3, epoch=4)
    # a new leader at a higher epoch sends its topics: the ones held are another leader's
    assert short(registry, 3, epoch=6) is False
    assert [b.epoch for b in registry.cluster_info()] == [5]
    assert short(registry, 3, epoch=5) is True


def test_bad_names_are_refused_as_in_a_full_registration(registry: RouteRegistry) -> None:
    with pytest.raises(InvalidArgumentError, match="address"):
        short(registry, 1, address="no-port")
    with pytest.raises(InvalidArgumentError, match="cluster"):
        short(registry, 1, cluster="")
