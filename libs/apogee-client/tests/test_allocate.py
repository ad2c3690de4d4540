"""Queue allocation strategies: every member computes its own share, and together the shares
must cover each queue exactly once, evenly (average, round robin), and stably (consistent
hash)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apogee.client.consumer.allocate import (
    AllocateStrategy,
    AverageAllocation,
    ConfigAllocation,
    ConsistentHashAllocation,
    RoundRobinAllocation,
    stable_hash,
    strategy_by_name,
)
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import InvalidArgumentError

pytestmark = pytest.mark.unit

GROUP = "g"


def queues(n: int) -> list[MessageQueue]:
    """``n`` queues over two brokers, sorted as the consumer sorts them."""
    qs = [MessageQueue("T", ("broker-a", "broker-b")[i % 2], i // 2) for i in range(n)]
    return sorted(qs, key=lambda q: (q.broker_name, q.queue_id))


def members(n: int) -> list[str]:
    return sorted(f"client-{i:03d}" for i in range(n))


def shares(
    strategy: AllocateStrategy, qs: list[MessageQueue], ms: list[str]
) -> dict[str, list[MessageQueue]]:
    return {m: strategy.allocate(GROUP, m, qs, ms) for m in ms}


def owners(
    strategy: AllocateStrategy, qs: list[MessageQueue], ms: list[str]
) -> dict[MessageQueue, str]:
    return {q: m for m, share in shares(strategy, qs, ms).items() for q in share}


def ids(qs: list[MessageQueue]) -> list[int]:
    return [q.queue_id for q in qs]


def test_average_gives_contiguous_ranges_like_rocketmq() -> None:
    qs = [MessageQueue("T", "b", i) for i in range(8)]
    got = shares(AverageAllocation(), qs, ["a", "b", "c"])
    assert [ids(got[m]) for m in "abc"] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    two = shares(AverageAllocation(), qs[:2], ["a", "b", "c"])
    assert [ids(two[m]) for m in "abc"] == [[0], [1], []]


def test_round_robin_goes_by_circle() -> None:
    qs = [MessageQueue("T", "b", i) for i in range(8)]
    got = shares(RoundRobinAllocation(), qs, ["a", "b", "c"])
    assert [ids(got[m]) for m in "abc"] == [[0, 3, 6], [1, 4, 7], [2, 5]]


@pytest.mark.parametrize(
    "strategy",
    [AverageAllocation(), RoundRobinAllocation(), ConsistentHashAllocation(), ConfigAllocation([])],
)
def test_a_client_outside_the_group_gets_nothing(strategy: AllocateStrategy) -> None:
    assert strategy.allocate(GROUP, "stranger", queues(4), ["a", "b"]) == []
    assert strategy.allocate(GROUP, "a", queues(4), []) == []


@settings(max_examples=200, deadline=None)
@given(
    n_queues=st.integers(0, 64),
    n_members=st.integers(1, 20),
    name=st.sampled_from(["average", "round-robin", "consistent-hash"]),
)
def test_members_partition_the_queues(n_queues: int, n_members: int, name: str) -> None:
    strategy = strategy_by_name(name)
    qs, ms = queues(n_queues), members(n_members)
    got = shares(strategy, qs, ms)
    every = [q for share in got.values() for q in share]
    assert len(every) == len(set(every)), "a queue went to two members"
    assert set(every) == set(qs), "a queue went to nobody"
    for share in got.values():  # each share keeps the sorted order
        assert share == sorted(share, key=qs.index)
    if name != "consistent-hash":
        sizes = [len(s) for s in got.values()]
        assert max(sizes) - min(sizes) <= 1, sizes


@settings(max_examples=100, deadline=None)
@given(n_queues=st.integers(1, 64), n_members=st.integers(1, 12), joiner=st.integers(0, 10_000))
def test_consistent_hash_moves_queues_only_to_a_member_who_joins(
    n_queues: int, n_members: int, joiner: int
) -> None:
    strategy = ConsistentHashAllocation()
    qs, before = queues(n_queues), members(n_members)
    newcomer = f"joiner-{joiner}"
    after = sorted([*before, newcomer])
    old, new = owners(strategy, qs, before), owners(strategy, qs, after)
    moved = [q for q in qs if old[q] != new[q]]
    assert all(new[q] == newcomer for q in moved)


def test_consistent_hash_moves_about_one_share_when_a_member_joins() -> None:
    strategy = ConsistentHashAllocation()
    qs = [MessageQueue("T", f"broker-{b}", q) for b in "abcd" for q in range(64)]  # 256 queues
    before, after = members(8), members(9)
    old, new = owners(strategy, qs, before), owners(strategy, qs, after)
    moved = sum(old[q] != new[q] for q in qs)
    # a fair share is 256 / 9 = 28; the average strategy moves most queues
    assert 5 <= moved <= 60, moved
    avg_old, avg_new = (
        owners(AverageAllocation(), qs, before),
        owners(AverageAllocation(), qs, after),
    )
    assert sum(avg_old[q] != avg_new[q] for q in qs) > 2 * moved
    sizes = [len(s) for s in shares(strategy, qs, after).values()]
    assert min(sizes) > 0  # with 160 virtual nodes nobody is left without a queue


def test_consistent_hash_is_the_same_in_every_process() -> None:
    # fixed values: Python's hash() would differ from one interpreter to the next
    assert stable_hash("broker-a") == 0xB69DC6D5B2C0C31F  # md5("broker-a")[:8]
    strategy = ConsistentHashAllocation(virtual_nodes=10)
    qs = [MessageQueue("T", "broker-a", q) for q in range(8)]
    assert ids(strategy.allocate(GROUP, "c1", qs, ["c1", "c2"])) == [0, 2, 3, 5, 6]
    assert ids(strategy.allocate(GROUP, "c2", qs, ["c1", "c2"])) == [1, 4, 7]


def test_config_allocation_returns_its_queues_of_this_topic() -> None:
    mine = [MessageQueue("T", "broker-b", 1), MessageQueue("T", "broker-a", 0)]
    other_topic = MessageQueue("U", "broker-a", 0)
    strategy = ConfigAllocation([*mine, other_topic, MessageQueue("T", "broker-z", 0)])
    got = strategy.allocate(GROUP, "me", queues(6), ["me", "you"])
    assert got == sorted(mine, key=lambda q: (q.broker_name, q.queue_id))
    with pytest.raises(InvalidArgumentError, match="is not a MessageQueue"):
        ConfigAllocation(["T@broker-a@0"])  # type: ignore[list-item]
    assert strategy.name == "config"


def test_strategy_by_name_names_the_choices() -> None:
    assert isinstance(strategy_by_name("average"), AverageAllocation)
    assert strategy_by_name("round-robin").name == "round-robin"
    assert strategy_by_name("consistent-hash").name == "consistent-hash"
    with pytest.raises(InvalidArgumentError) as info:
        strategy_by_name("fastest")
    assert str(info.value) == (
        "allocate: 'fastest' is not a strategy; use one of: average, consistent-hash, round-robin"
    )
    with pytest.raises(InvalidArgumentError, match=r"pass ConfigAllocation\(queues\)"):
        strategy_by_name("config")
    with pytest.raises(InvalidArgumentError, match="virtual_nodes: must be an integer"):
        ConsistentHashAllocation(virtual_nodes=0)
