"""Latency fault tolerance (with a manual clock) and queue selection."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from apogee.client.producer.fault import (
    FaultStrategy,
    LatencyFaultTolerance,
    compute_not_available_duration,
)
from apogee.client.producer.routes import MessageQueue, TopicRoute
from apogee.client.producer.selector import RoundRobinSelector, select_by_key
from apogee.common.clock import ManualClock
from apogee.common.errors import InvalidArgumentError, PermissionDeniedError
from apogee.v1 import common_pb2

pytestmark = pytest.mark.unit

RW = common_pb2.PERM_READ | common_pb2.PERM_WRITE


def route(*brokers: tuple[str, int], topic: str = "T", perm: int = RW) -> TopicRoute:
    return TopicRoute.build(
        topic,
        [(name, n, perm) for name, n in brokers],
        {name: f"10.0.0.{i}:10911" for i, (name, _) in enumerate(brokers)},
    )


@pytest.mark.parametrize(
    ("latency", "duration"),
    [
        (0, 0),
        (49, 0),
        (50, 0),
        (100, 0),
        (549, 0),
        (550, 30_000),
        (999, 30_000),
        (1000, 60_000),
        (2000, 120_000),
        (3000, 180_000),
        (14_999, 180_000),
        (15_000, 600_000),
        (30_000, 600_000),
    ],
)
def test_latency_bands(latency: int, duration: int) -> None:
    assert compute_not_available_duration(latency) == duration


def test_slow_broker_is_avoided_for_its_band_then_comes_back() -> None:
    clock = ManualClock()
    strategy = FaultStrategy(clock)
    strategy.update("a", 1200, isolation=False)  # >= 1000 ms: 60 s
    assert not strategy.is_available("a")
    assert strategy.is_available("b")  # no record: available
    clock.advance(59.9)
    assert not strategy.is_available("a")
    clock.advance(0.1)
    assert strategy.is_available("a")


def test_failure_isolates_a_broker_for_ten_minutes_until_a_fast_success() -> None:
    clock = ManualClock()
    strategy = FaultStrategy(clock)
    strategy.update("a", 5, isolation=True)
    clock.advance(599.0)
    assert not strategy.is_available("a")
    clock.advance(1.0)
    assert strategy.is_available("a")
    strategy.update("a", 5, isolation=True)
    strategy.update("a", 20, isolation=False)  # a quick success overwrites the record
    assert strategy.is_available("a")


def test_fast_brokers_stay_available() -> None:
    clock = ManualClock()
    strategy = FaultStrategy(clock)
    strategy.update("a", 99, isolation=False)
    assert strategy.is_available("a")


def test_disabled_strategy_records_nothing() -> None:
    strategy = FaultStrategy(ManualClock(), enabled=False)
    strategy.update("a", 0, isolation=True)
    assert strategy.is_available("a")
    assert strategy.pick_one_at_least(["a"]) is None


def test_pick_one_at_least_prefers_available_then_fast_then_soonest() -> None:
    clock = ManualClock()
    tolerance = LatencyFaultTolerance(clock)
    tolerance.update("down-long", 30_000, 600_000)
    tolerance.update("down-short", 30_000, 30_000)
    tolerance.update("slow", 2000, 120_000)
    tolerance.update("ok", 10, 0)
    # sorted: ok, slow, down-short, down-long; picks rotate over the better half
    picks = {tolerance.pick_one_at_least() for _ in range(4)}
    assert picks == {"ok", "slow"}
    assert tolerance.pick_one_at_least(["down-long", "down-short"]) == "down-short"
    assert tolerance.pick_one_at_least(["unknown"]) is None


def test_route_lists_writable_queues_in_stable_order() -> None:
    r = TopicRoute.build(
        "T",
        [("b", 2, RW), ("a", 3, RW), ("c", 4, common_pb2.PERM_READ), ("d", 2, RW)],
        {"a": "h:1", "b": "h:2", "c": "h:3"},  # d has no address: skipped
    )
    assert [(q.broker_name, q.queue_id) for q in r.queues] == [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("b", 0),
        ("b", 1),
    ]
    assert r.broker_names == ["a", "b"]


def test_round_robin_walks_every_queue_in_turn() -> None:
    sel = RoundRobinSelector(FaultStrategy(ManualClock()), random.Random(7))
    r = route(("a", 2), ("b", 2))
    picks = [sel.select(r) for _ in range(8)]
    assert Counter(picks) == {q: 2 for q in r.queues}
    # consecutive picks follow the queue order
    i = r.queues.index(picks[0])
    assert picks[:4] == [r.queues[(i + k) % 4] for k in range(4)]


def test_round_robin_skips_unavailable_brokers() -> None:
    clock = ManualClock()
    fault = FaultStrategy(clock)
    sel = RoundRobinSelector(fault, random.Random(1))
    r = route(("a", 4), ("b", 4))
    fault.update("a", 0, isolation=True)
    assert {sel.select(r).broker_name for _ in range(20)} == {"b"}
    clock.advance(600)
    assert {sel.select(r).broker_name for _ in range(20)} == {"a", "b"}


def test_a_retry_skips_the_broker_that_just_failed() -> None:
    fault = FaultStrategy(ManualClock(), enabled=False)  # even without fault records
    sel = RoundRobinSelector(fault, random.Random(3))
    r = route(("a", 4), ("b", 4), ("c", 4))
    for _ in range(30):
        assert sel.select(r, exclude="b").broker_name != "b"


def test_a_retry_with_every_other_broker_down_takes_the_best_of_them() -> None:
    clock = ManualClock()
    fault = FaultStrategy(clock)
    sel = RoundRobinSelector(fault, random.Random(3))
    r = route(("a", 2), ("b", 2), ("c", 2))
    fault.update("a", 0, isolation=True)
    fault.update("b", 3500, isolation=False)  # slow, but better than isolated
    fault.update("c", 0, isolation=True)
    for _ in range(10):
        assert sel.select(r, exclude="c").broker_name == "b"


def test_a_single_broker_topic_retries_on_that_broker() -> None:
    sel = RoundRobinSelector(FaultStrategy(ManualClock()), random.Random(3))
    r = route(("only", 2))
    assert sel.select(r, exclude="only").broker_name == "only"


def test_no_writable_queue_is_refused() -> None:
    sel = RoundRobinSelector(FaultStrategy(ManualClock()))
    r = route(("a", 2), perm=common_pb2.PERM_READ)
    with pytest.raises(PermissionDeniedError) as info:
        sel.select(r)
    assert str(info.value) == "topic 'T': no live broker accepts writes to it (perm)"


def test_a_sharding_key_always_maps_to_the_same_queue() -> None:
    r = route(("a", 4), ("b", 4))
    again = route(("b", 4), ("a", 4))  # the same route, listed in another order
    for key in ["order-1", "order-2", "customer-77", "", "ключ"]:
        q = select_by_key(r, key)
        assert all(select_by_key(r, key) == q for _ in range(5))
        assert select_by_key(again, key) == q
        assert select_by_key(r, key.encode()) == q


def test_sharding_keys_spread_over_the_queues() -> None:
    r = route(("a", 4), ("b", 4))
    used = Counter(select_by_key(r, f"key-{i}") for i in range(800))
    assert set(used) == set(r.queues)
    assert min(used.values()) > 50


def test_sharding_with_failover_avoids_the_failed_broker() -> None:
    r = route(("a", 4), ("b", 4))
    for i in range(50):
        assert select_by_key(r, f"k{i}", exclude="a").broker_name == "b"
    # crc32(b"k") % 4 == 1: with no other broker, the key keeps its queue
    assert select_by_key(route(("a", 4)), "k", exclude="a") == MessageQueue("T", "a", 1)


def test_a_sharding_key_must_be_text_or_bytes() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        select_by_key(route(("a", 1)), 42)  # type: ignore[arg-type]
    assert str(info.value) == "sharding_key: must be str or bytes, got int"
