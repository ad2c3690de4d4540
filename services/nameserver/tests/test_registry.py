"""The route registry on a manual clock: registration, heartbeats, expiry, routes, bad input."""

from __future__ import annotations

import logging

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import InvalidArgumentError, InvalidTopicError, UnknownTopicError
from apogee.common.topics import TopicConfig
from apogee_nameserver.core.registry import (
    BrokerData,
    BrokerInfo,
    BrokerLiveness,
    QueueData,
    Route,
    RouteRegistry,
)

pytestmark = pytest.mark.unit

START_MS = 1_700_000_000_000
ORDERS = TopicConfig("Orders", read_queues=4, write_queues=4, perm=6)
PAYMENTS = TopicConfig("Payments", read_queues=2, write_queues=2, perm=6)
TBW102 = TopicConfig("TBW102", read_queues=8, write_queues=8, perm=7, system=True)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(START_MS)


@pytest.fixture
def registry(clock: ManualClock) -> RouteRegistry:
    return RouteRegistry(expiry_s=120.0, clock=clock)


def register(
    registry: RouteRegistry,
    name: str = "broker-a",
    topics: list[TopicConfig] | None = None,
    *,
    cluster: str = "DefaultCluster",
    address: str | None = None,
    auto_create: bool = False,
) -> bool:
    return registry.register_broker(
        cluster,
        name,
        address or f"{name}.brokers:10911",
        [ORDERS] if topics is None else topics,
        auto_create_topics=auto_create,
    )


def test_registration_makes_the_broker_and_its_topics_routable(
    registry: RouteRegistry,
) -> None:
    assert register(registry) is True
    assert registry.route("Orders") == Route(
        topic="Orders",
        queues=(QueueData("broker-a", 4, 4, 6),),
        brokers=(BrokerData("DefaultCluster", "broker-a", "broker-a.brokers:10911"),),
    )
    assert registry.cluster_info() == [
        BrokerInfo(
            cluster="DefaultCluster",
            broker_name="broker-a",
            address="broker-a.brokers:10911",
            last_heartbeat_ms=START_MS,
            topic_count=1,
            auto_create_topics=False,
        )
    ]


def test_route_lists_every_broker_that_has_the_topic_by_name(registry: RouteRegistry) -> None:
    register(registry, "broker-b", [ORDERS, PAYMENTS])
    register(registry, "broker-a", [TopicConfig("Orders", 8, 2, 4)])
    route = registry.route("Orders")
    assert route.queues == (QueueData("broker-a", 8, 2, 4), QueueData("broker-b", 4, 4, 6))
    assert [b.broker_name for b in route.brokers] == ["broker-a", "broker-b"]
    assert registry.route("Payments").queues == (QueueData("broker-b", 2, 2, 6),)
    assert not route.auto_create


def test_a_repeated_registration_is_a_heartbeat(
    registry: RouteRegistry, clock: ManualClock
) -> None:
    assert register(registry) is True
    clock.advance(30)
    assert register(registry) is False  # the same broker, refreshed
    [info] = registry.cluster_info()
    assert info.last_heartbeat_ms == START_MS + 30_000
    # four heartbeats 30 s apart keep it alive well past the expiry
    for _ in range(4):
        clock.advance(30)
        register(registry)
    clock.advance(120)
    assert registry.expire() == []
    assert registry.route("Orders").brokers[0].broker_name == "broker-a"


def test_a_registration_replaces_the_brokers_topic_set(registry: RouteRegistry) -> None:
    register(registry, topics=[ORDERS, PAYMENTS])
    register(registry, topics=[PAYMENTS, TopicConfig("Audit", 1, 1, 6)])
    assert registry.list_topics() == ["Audit", "Payments"]
    with pytest.raises(UnknownTopicError):
        registry.route("Orders")
    [info] = registry.cluster_info()
    assert info.topic_count == 2
    register(registry, topics=[])
    assert registry.list_topics() == []


def test_a_broker_expires_exactly_after_the_configured_silence(clock: ManualClock) -> None:
    registry = RouteRegistry(expiry_s=90.0, clock=clock)
    register(registry)
    clock.advance(90.0)
    assert registry.expire() == []  # silent for exactly the expiry: still live
    assert registry.route("Orders").brokers
    clock.advance(0.001)
    dropped = registry.expire()
    assert [(d.broker_name, d.last_heartbeat_ms) for d in dropped] == [("broker-a", START_MS)]
    assert registry.cluster_info() == []
    assert registry.expire() == []  # dropped once


def test_a_silent_broker_leaves_routes_before_the_scan_drops_it(
    registry: RouteRegistry, clock: ManualClock
) -> None:
    register(registry, "broker-a", [ORDERS])
    clock.advance(60)
    register(registry, "broker-b", [ORDERS])
    clock.advance(60.5)  # broker-a silent for 120.5 s, broker-b for 60.5 s
    assert [b.broker_name for b in registry.route("Orders").brokers] == ["broker-b"]
    assert [i.broker_name for i in registry.cluster_info()] == ["broker-b"]
    assert [d.broker_name for d in registry.expire()] == ["broker-a"]


def test_an_expired_broker_that_registers_again_is_new(
    registry: RouteRegistry, clock: ManualClock
) -> None:
    register(registry)
    clock.advance(121)
    assert register(registry) is True
    assert registry.route("Orders").brokers


def test_routes_come_only_from_live_brokers(registry: RouteRegistry, clock: ManualClock) -> None:
    register(registry, "broker-a", [ORDERS])
    clock.advance(121)
    with pytest.raises(UnknownTopicError) as caught:
        registry.route("Orders")
    assert "no broker is registered with this nameserver" in str(caught.value)
    assert registry.list_topics() == []


def test_an_unknown_topic_has_no_route(registry: RouteRegistry) -> None:
    register(registry, topics=[ORDERS, TBW102])  # TBW102 present, but auto-create is off
    with pytest.raises(UnknownTopicError) as caught:
        registry.route("Invoices")
    assert str(caught.value) == (
        "topic 'Invoices' has no route: no live broker serves it "
        "(create it with `apogee topic create`)"
    )
    assert caught.value.code == "NOT_FOUND"
    assert caught.value.kind.name == "UNKNOWN_TOPIC"


def test_with_no_broker_at_all_the_error_says_so(registry: RouteRegistry) -> None:
    with pytest.raises(UnknownTopicError) as caught:
        registry.route("Orders")
    assert str(caught.value) == (
        "topic 'Orders' has no route: no broker is registered with this nameserver "
        "(are the brokers running, and is this nameserver in their list?)"
    )


def test_an_unknown_topic_routes_to_the_auto_create_template(registry: RouteRegistry) -> None:
    register(registry, "broker-a", [ORDERS, TBW102], auto_create=True)
    register(registry, "broker-b", [ORDERS, TBW102], auto_create=False)
    register(registry, "broker-c", [ORDERS], auto_create=True)  # no template: cannot create
    route = registry.route("Invoices")
    assert route.topic == "Invoices"
    assert route.auto_create
    # TBW102's queues on the brokers that create topics, without the inherit bit
    assert route.queues == (QueueData("broker-a", 8, 8, 6),)
    assert route.brokers == (BrokerData("DefaultCluster", "broker-a", "broker-a.brokers:10911"),)
    # a topic that exists somewhere is routed to where it is, not to the template
    assert not registry.route("Orders").auto_create


def test_an_auto_create_broker_without_the_template_gives_no_route(
    registry: RouteRegistry,
) -> None:
    register(registry, topics=[ORDERS], auto_create=True)
    with pytest.raises(UnknownTopicError, match="has no route: no live broker serves it"):
        registry.route("Invoices")


def test_cluster_info_lists_live_brokers_by_cluster_then_name(
    registry: RouteRegistry, clock: ManualClock
) -> None:
    register(registry, "b2", [ORDERS], cluster="east", auto_create=True)
    clock.advance(1)
    register(registry, "b1", [ORDERS, PAYMENTS, TBW102], cluster="west")
    register(registry, "a9", [], cluster="west")
    info = registry.cluster_info()
    assert [(i.cluster, i.broker_name) for i in info] == [
        ("east", "b2"),
        ("west", "a9"),
        ("west", "b1"),
    ]
    assert info[0] == BrokerInfo("east", "b2", "b2.brokers:10911", START_MS, 1, True)
    assert info[2] == BrokerInfo("west", "b1", "b1.brokers:10911", START_MS + 1000, 3, False)


def test_brokers_that_left_stay_known_as_not_live_until_they_return(
    registry: RouteRegistry, clock: ManualClock
) -> None:
    assert registry.broker_liveness() == []
    assert registry.live_counts() == {}
    register(registry, "b1", cluster="west")
    register(registry, "b2", cluster="west")
    register(registry, "c1", cluster="east")
    assert registry.live_counts() == {"east": 1, "west": 2}
    clock.advance(60)
    register(registry, "b2", cluster="west")
    clock.advance(61)  # b1 and c1 silent for 121 s: expired (before the scan drops them)
    assert registry.unregister_broker("west", "b2", "b2.brokers:10911") is True
    assert registry.broker_liveness() == [
        BrokerLiveness("east", "c1", False),
        BrokerLiveness("west", "b1", False),
        BrokerLiveness("west", "b2", False),
    ]
    assert registry.live_counts() == {"east": 0, "west": 0}
    registry.expire()
    assert registry.live_counts() == {"east": 0, "west": 0}

    register(registry, "b1", cluster="west")
    register(registry, "c1", cluster="north")  # back, in another cluster
    assert registry.broker_liveness() == [
        BrokerLiveness("north", "c1", True),
        BrokerLiveness("west", "b1", True),
        BrokerLiveness("west", "b2", False),
    ]
    assert registry.live_counts() == {"east": 0, "north": 1, "west": 1}


def test_list_topics_is_sorted_distinct_and_hides_system_topics(registry: RouteRegistry) -> None:
    register(
        registry,
        "broker-a",
        [
            PAYMENTS,
            TBW102,
            TopicConfig("SCHEDULE_TOPIC_XXXX", 18, 18, 6),  # system by name, flag not set
            TopicConfig("RMQ_SYS_TRANS_HALF_TOPIC", 1, 1, 6, system=True),
            TopicConfig("%RETRY%billing", 1, 1, 6),
            TopicConfig("%DLQ%billing", 1, 1, 6),
            TopicConfig("internal-stats", 1, 1, 6, system=True),  # system by flag
        ],
    )
    register(registry, "broker-b", [ORDERS, PAYMENTS])
    assert registry.list_topics() == ["%DLQ%billing", "%RETRY%billing", "Orders", "Payments"]
    # system topics still have routes: the schedule and transaction services need them
    assert registry.route("SCHEDULE_TOPIC_XXXX").queues == (QueueData("broker-a", 18, 18, 6),)


def test_a_broker_that_moves_keeps_its_name(
    registry: RouteRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    register(registry, address="10.0.0.1:10911")
    with caplog.at_level(logging.WARNING):
        assert register(registry, address="broker-a-0.brokers:10911") is False
    assert registry.route("Orders").brokers == (
        BrokerData("DefaultCluster", "broker-a", "broker-a-0.brokers:10911"),
    )
    assert "broker broker-a moved from 10.0.0.1:10911" in caplog.text


def test_unregister_removes_only_the_matching_registration(registry: RouteRegistry) -> None:
    register(registry, address="new:10911")
    assert registry.unregister_broker("DefaultCluster", "broker-a", "old:10911") is False
    assert registry.unregister_broker("OtherCluster", "broker-a", "new:10911") is False
    assert registry.unregister_broker("DefaultCluster", "nobody", "new:10911") is False
    assert registry.cluster_info() != []
    assert registry.unregister_broker("DefaultCluster", "broker-a", "new:10911") is True
    assert registry.cluster_info() == []
    with pytest.raises(UnknownTopicError):
        registry.route("Orders")
    assert registry.unregister_broker("DefaultCluster", "broker-a", "new:10911") is False


def test_ipv6_addresses_in_brackets_are_accepted(registry: RouteRegistry) -> None:
    register(registry, address="[fd00::1]:10911")
    assert registry.route("Orders").brokers[0].address == "[fd00::1]:10911"


def test_a_heartbeat_slower_than_the_expiry_is_warned_about(
    registry: RouteRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        registry.register_broker("c", "b", "h:1", [], heartbeat_interval_ms=120_000)
    assert "heartbeats every 120000 ms, not less than the expiry of 120000 ms" in caplog.text


BAD_REGISTRATIONS: list[tuple[dict[str, object], type[Exception], str]] = [
    ({"cluster": ""}, InvalidArgumentError, "cluster: must not be empty"),
    ({"broker_name": ""}, InvalidArgumentError, "broker_name: must not be empty"),
    (
        {"broker_name": "broker a"},
        InvalidArgumentError,
        "broker_name: 'broker a' must not contain spaces or control characters",
    ),
    (
        {"cluster": "c" * 256},
        InvalidArgumentError,
        "cluster: is 256 characters; at most 255 are allowed",
    ),
    ({"address": ""}, InvalidArgumentError, "address: must not be empty"),
    (
        {"address": "broker-a"},
        InvalidArgumentError,
        "address: 'broker-a' must be host:port, with a port from 1 to 65535",
    ),
    (
        {"address": ":10911"},
        InvalidArgumentError,
        "address: ':10911' must be host:port, with a port from 1 to 65535",
    ),
    (
        {"address": "broker-a:"},
        InvalidArgumentError,
        "address: 'broker-a:' must be host:port, with a port from 1 to 65535",
    ),
    (
        {"address": "broker-a:0"},
        InvalidArgumentError,
        "address: 'broker-a:0' must be host:port, with a port from 1 to 65535",
    ),
    (
        {"address": "broker-a:65536"},
        InvalidArgumentError,
        "address: 'broker-a:65536' must be host:port, with a port from 1 to 65535",
    ),
    (
        {"address": "broker-a:http"},
        InvalidArgumentError,
        "address: 'broker-a:http' must be host:port, with a port from 1 to 65535",
    ),
    (
        {"address": "bro ker:10911"},
        InvalidArgumentError,
        "address: 'bro ker:10911' must be host:port, with a port from 1 to 65535",
    ),
    (
        {"address": "fd00::1:10911"},
        InvalidArgumentError,
        "address: 'fd00::1:10911': an IPv6 host must be in brackets, as [::1]:10911",
    ),
    (
        {"topics": [TopicConfig("a b", 1, 1, 6)]},
        InvalidTopicError,
        "topic 'a b': has a character outside [%|a-zA-Z0-9_-]",
    ),
    ({"topics": [TopicConfig("", 1, 1, 6)]}, InvalidTopicError, "topic '': must not be empty"),
    (
        {"topics": [TopicConfig("t" * 128, 1, 1, 6)]},
        InvalidTopicError,
        f"topic {'t' * 128!r}: is 128 characters; at most 127 are allowed",
    ),
    (
        {"topics": [ORDERS, PAYMENTS, ORDERS]},
        InvalidArgumentError,
        "topics: topic 'Orders' appears more than once",
    ),
    (
        {"topics": [TopicConfig("Orders", 1, 1, 8)]},
        InvalidArgumentError,
        "topics['Orders'].perm: must be a bit set of 1 (inherit), 2 (write) and 4 (read), got 8",
    ),
    (
        {"topics": [TopicConfig("Orders", 70_000, 1, 6)]},
        InvalidArgumentError,
        "topics['Orders'].read_queues: must be from 0 to 65535, got 70000",
    ),
    (
        {"topics": [TopicConfig("Orders", 1, 65_536, 6)]},
        InvalidArgumentError,
        "topics['Orders'].write_queues: must be from 0 to 65535, got 65536",
    ),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD_REGISTRATIONS)
def test_a_bad_registration_is_refused_with_field_and_rule(
    registry: RouteRegistry, change: dict[str, object], error: type[Exception], message: str
) -> None:
    register(registry, topics=[PAYMENTS])
    args: dict[str, object] = {
        "cluster": "DefaultCluster",
        "broker_name": "broker-a",
        "address": "broker-a:10911",
        "topics": [ORDERS],
    }
    args.update(change)
    with pytest.raises(error) as caught:
        registry.register_broker(**args)  # type: ignore[arg-type]
    assert str(caught.value) == message
    # nothing changed: the earlier registration stands
    assert registry.list_topics() == ["Payments"]
    assert registry.cluster_info()[0].address == "broker-a.brokers:10911"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "b", "h:1"), "cluster: must not be empty"),
        (("c", "", "h:1"), "broker_name: must not be empty"),
        (("c", "b", "h"), "address: 'h' must be host:port, with a port from 1 to 65535"),
    ],
)
def test_a_bad_unregistration_is_refused(
    registry: RouteRegistry, args: tuple[str, str, str], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        registry.unregister_broker(*args)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("topic", "message"),
    [
        ("", "topic '': must not be empty"),
        ("a/b", "topic 'a/b': has a character outside [%|a-zA-Z0-9_-]"),
    ],
)
def test_a_route_for_an_invalid_name_is_refused(
    registry: RouteRegistry, topic: str, message: str
) -> None:
    with pytest.raises(InvalidTopicError) as caught:
        registry.route(topic)
    assert str(caught.value) == message


@pytest.mark.parametrize("expiry", [0.0, -1.0, float("nan")])
def test_the_expiry_must_be_positive(expiry: float) -> None:
    with pytest.raises(InvalidArgumentError, match="broker_expiry_s: must be greater than 0"):
        RouteRegistry(expiry_s=expiry)


def test_the_expiry_is_reported_in_milliseconds(clock: ManualClock) -> None:
    assert RouteRegistry(expiry_s=120.0, clock=clock).expiry_ms == 120_000
    assert RouteRegistry(expiry_s=0.25, clock=clock).expiry_ms == 250
