"""A replica group's leader registers with its epoch; while it is live an older leader cannot
take the routes back (RocketMQ #7017): its registration is refused, its unregistration
ignored."""

from __future__ import annotations

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import StaleEpochError
from apogee.common.topics import TopicConfig
from apogee_nameserver.core.registry import RouteRegistry

pytestmark = pytest.mark.unit

ORDERS = TopicConfig("Orders", read_queues=4, write_queues=4, perm=6)
OLD, NEW = "10.0.0.1:10911", "10.0.0.2:10911"


def lead(registry: RouteRegistry, address: str, epoch: int) -> bool:
    return registry.register_broker("c", "broker-a", address, [ORDERS], epoch=epoch)


def routed_to(registry: RouteRegistry) -> str:
    (broker,) = registry.route("Orders").brokers
    return broker.address


def test_a_higher_epoch_moves_the_route_at_once() -> None:
    registry = RouteRegistry(clock=ManualClock(0))
    lead(registry, OLD, 1)
    lead(registry, NEW, 2)
    assert routed_to(registry) == NEW
    assert [b.epoch for b in registry.cluster_info()] == [2]


def test_an_older_leader_cannot_take_the_route_back() -> None:
    registry = RouteRegistry(clock=ManualClock(0))
    lead(registry, OLD, 1)
    lead(registry, NEW, 2)
    with pytest.raises(StaleEpochError) as refused:
        lead(registry, OLD, 1)
    assert str(refused.value) == (
        f"the registration of {OLD} carries epoch 1, but the replica group of 'broker-a' is "
        "at epoch 2"
    )
    assert routed_to(registry) == NEW
    # its unregistration at its stop changes nothing either
    assert registry.unregister_broker("c", "broker-a", OLD, 1) is False
    assert registry.unregister_broker("c", "broker-a", NEW, 1) is False
    assert routed_to(registry) == NEW
    assert registry.unregister_broker("c", "broker-a", NEW, 2) is True


def test_the_fence_lasts_as_long_as_the_registration() -> None:
    clock = ManualClock(0)
    registry = RouteRegistry(expiry_s=10.0, clock=clock)
    lead(registry, NEW, 5)
    clock.advance(9.0)
    with pytest.raises(StaleEpochError):
        lead(registry, OLD, 4)  # the leader of epoch 5 is live: it fences
    clock.advance(2.0)
    # silent past the expiry, it fences no more: a stray high epoch cannot lock a name out
    assert lead(registry, OLD, 0) is True
    assert routed_to(registry) == OLD


def test_lone_brokers_register_at_epoch_zero_as_before() -> None:
    registry = RouteRegistry(clock=ManualClock(0))
    assert lead(registry, OLD, 0) is True
    assert lead(registry, NEW, 0) is False  # moved, as a lone broker may
    assert routed_to(registry) == NEW
