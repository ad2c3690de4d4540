"""The accumulator on its own: an injected send function instead of gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from apogee.client.producer.accumulator import SPLIT_MIN, Accumulator, BatchingConfig, Entry
from apogee.common.errors import InvalidArgumentError, UnavailableError

pytestmark = pytest.mark.unit


class FakeBroker:
    """Records each request; holds every request until released when ``gated``."""

    def __init__(self, gated: bool = False) -> None:
        self.requests: list[tuple[str, list[str]]] = []
        self.gated = gated
        self.gate = asyncio.Event()
        self.fail_request: dict[int, Exception] = {}
        self.fail_message: dict[str, Exception] = {}
        self.arrived = asyncio.Condition()

    async def send(self, dest: str, payloads: list[str]) -> Sequence[str | BaseException]:
        n = len(self.requests)
        self.requests.append((dest, list(payloads)))
        async with self.arrived:
            self.arrived.notify_all()
        if self.gated:
            await self.gate.wait()
        if n in self.fail_request:
            raise self.fail_request[n]
        return [self.fail_message.get(p, f"ok:{p}") for p in payloads]

    async def wait_requests(self, count: int) -> None:
        async with self.arrived:
            await asyncio.wait_for(self.arrived.wait_for(lambda: len(self.requests) >= count), 2.0)

    def batches(self) -> list[list[str]]:
        return [p for _, p in self.requests]


def make(broker: FakeBroker, **kw: int | float) -> Accumulator[str, str]:
    return Accumulator(broker.send, BatchingConfig(**kw))  # type: ignore[arg-type]


async def test_a_lone_send_goes_out_at_once() -> None:
    broker = FakeBroker()
    acc = make(broker)
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await asyncio.wait_for(acc.append("b1", "m1", 10), 1.0) == "ok:m1"
    assert broker.batches() == [["m1"]]
    assert loop.time() - start < 0.05
    await acc.close(1.0)


async def test_sends_in_one_loop_turn_share_a_request() -> None:
    broker = FakeBroker()
    acc = make(broker)
    futs = [acc.append("b1", f"m{i}", 10) for i in range(5)]
    assert await asyncio.gather(*futs) == [f"ok:m{i}" for i in range(5)]
    assert broker.batches() == [[f"m{i}" for i in range(5)]]
    await acc.close(1.0)


async def test_sends_while_every_slot_is_busy_leave_together() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=2)
    first = acc.append("b1", "a", 1)
    await broker.wait_requests(1)
    second = acc.append("b1", "b", 1)
    await broker.wait_requests(2)
    # both slots busy: these wait, then travel in one request
    rest = [acc.append("b1", f"c{i}", 1) for i in range(10)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(broker.requests) == 2
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(first, second, *rest), 2.0)
    assert broker.batches() == [["a"], ["b"], [f"c{i}" for i in range(10)]]
    assert acc.stats().requests == 3
    assert acc.stats().messages == 12
    await acc.close(1.0)


async def test_destinations_are_independent() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=1)
    a = acc.append("b1", "a", 1)
    await broker.wait_requests(1)
    b = acc.append("b2", "b", 1)  # b1 is busy, b2 is not
    await broker.wait_requests(2)
    assert broker.requests == [("b1", ["a"]), ("b2", ["b"])]
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(a, b), 1.0)
    await acc.close(1.0)


async def test_message_count_cap() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=1, batch_max_messages=256)
    first = acc.append("b1", "first", 1)
    await broker.wait_requests(1)
    futs = [acc.append("b1", f"m{i}", 1) for i in range(600)]
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *futs), 2.0)
    assert [len(b) for b in broker.batches()] == [1, 256, 256, 88]
    sent = [m for batch in broker.batches() for m in batch]
    assert sent == ["first"] + [f"m{i}" for i in range(600)]
    await acc.close(1.0)


async def test_byte_cap_and_an_oversized_message_goes_alone() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=1, batch_max_bytes=100)
    first = acc.append("b1", "first", 1)
    await broker.wait_requests(1)
    futs = [acc.append("b1", f"s{i}", 30) for i in range(5)]  # 3 fit in 100 bytes
    futs.append(acc.append("b1", "huge", 500))
    futs.append(acc.append("b1", "after", 30))
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *futs), 2.0)
    assert broker.batches() == [
        ["first"],
        ["s0", "s1", "s2"],
        ["s3", "s4"],
        ["huge"],
        ["after"],
    ]
    await acc.close(1.0)


async def test_free_slots_split_a_backlog_into_parallel_requests() -> None:
    broker = FakeBroker()
    acc = make(broker, max_in_flight=4, batch_max_messages=100)
    futs = [acc.append("b1", f"m{i}", 1) for i in range(350)]
    await asyncio.wait_for(asyncio.gather(*futs), 2.0)
    assert [len(b) for b in broker.batches()] == [100, 100, 100, 50]


async def test_a_backlog_that_fits_one_request_is_shared_among_free_slots() -> None:
    """64 sends of one loop turn travel as two requests of SPLIT_MIN when slots are free, so the
    broker stores the first half while the second is on its way; fewer travel together."""
    broker = FakeBroker()
    acc = make(broker, max_in_flight=4)
    await asyncio.wait_for(asyncio.gather(*(acc.append("b1", f"m{i}", 1) for i in range(64))), 2)
    assert [len(b) for b in broker.batches()] == [SPLIT_MIN, SPLIT_MIN]
    await asyncio.wait_for(asyncio.gather(*(acc.append("b1", f"n{i}", 1) for i in range(63))), 2)
    assert [len(b) for b in broker.batches()[2:]] == [63]
    await asyncio.wait_for(asyncio.gather(*(acc.append("b1", f"o{i}", 1) for i in range(100))), 2)
    assert [len(b) for b in broker.batches()[3:]] == [34, 34, 32]
    await acc.close(1.0)


async def test_one_free_slot_takes_the_whole_backlog() -> None:
    broker = FakeBroker()
    acc = make(broker, max_in_flight=1)
    await asyncio.wait_for(asyncio.gather(*(acc.append("b1", f"m{i}", 1) for i in range(64))), 2)
    assert [len(b) for b in broker.batches()] == [64]
    await acc.close(1.0)


class Recorder(Entry):
    """An entry that is its own sink, as the producer's deliveries are."""

    __slots__ = ("outcomes", "settled")

    def __init__(self, payload: str) -> None:
        super().__init__(payload, 1, 1, self, False)
        self.outcomes: list[object] = []
        self.settled = False

    def done(self) -> bool:
        return self.settled

    def set_result(self, result: object) -> None:
        self.outcomes.append(result)

    def set_exception(self, exception: BaseException) -> None:
        self.outcomes.append(exception)


async def test_an_entry_of_its_own_gets_its_outcome_and_can_go_again() -> None:
    broker = FakeBroker()
    broker.fail_message["bad"] = UnavailableError(what="b1", detail="down")
    acc = make(broker)
    good, bad, gone = Recorder("good"), Recorder("bad"), Recorder("gone")
    gone.settled = True  # its sender gave up: never sent
    for entry in (good, bad, gone):
        acc.append_entry("b1", entry)
    await asyncio.wait_for(acc.flush(1.0), 2.0)
    assert good.outcomes == ["ok:good"]
    assert [type(o) for o in bad.outcomes] == [UnavailableError]
    assert gone.outcomes == []
    good.payload = "again"
    acc.append_entry("b1", good)  # an entry goes again once it has its outcome (a retry)
    await asyncio.wait_for(acc.flush(1.0), 2.0)
    assert good.outcomes == ["ok:good", "ok:again"]
    assert broker.batches() == [["good", "bad"], ["again"]]
    await acc.close(1.0)


async def test_a_failed_request_fails_only_its_messages() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=1)
    broker.fail_request[1] = UnavailableError(what="broker b1", detail="connection reset")
    first = acc.append("b1", "a", 1)
    await broker.wait_requests(1)
    doomed = [acc.append("b1", f"d{i}", 1) for i in range(3)]
    broker.gate.set()
    assert await asyncio.wait_for(first, 1.0) == "ok:a"
    results = await asyncio.wait_for(asyncio.gather(*doomed, return_exceptions=True), 1.0)
    assert all(isinstance(r, UnavailableError) for r in results)
    assert str(results[0]) == "broker b1 is unavailable: connection reset"
    later = await asyncio.wait_for(acc.append("b1", "z", 1), 1.0)
    assert later == "ok:z"
    await acc.close(1.0)


async def test_a_per_message_error_fails_that_message_alone() -> None:
    broker = FakeBroker()
    acc = make(broker)
    bad = InvalidArgumentError(field="body", rule="must not be empty")
    broker.fail_message["m1"] = bad
    futs = [acc.append("b1", f"m{i}", 1) for i in range(3)]
    results = await asyncio.gather(*futs, return_exceptions=True)
    assert results == ["ok:m0", bad, "ok:m2"]
    assert len(broker.requests) == 1


async def test_a_group_travels_in_one_request() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=1, batch_max_messages=4)
    first = acc.append("b1", "a", 1)
    await broker.wait_requests(1)
    single = acc.append("b1", "s", 1)
    group = acc.append_group("b1", ["g0", "g1", "g2", "g3", "g4"], 5)  # over the cap: alone
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(first, single), 1.0)
    assert await asyncio.wait_for(group, 1.0) == ["ok:g0", "ok:g1", "ok:g2", "ok:g3", "ok:g4"]
    assert broker.batches() == [["a"], ["s"], ["g0", "g1", "g2", "g3", "g4"]]
    await acc.close(1.0)


async def test_given_up_messages_are_not_sent() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=1)
    first = acc.append("b1", "a", 1)
    await broker.wait_requests(1)
    dropped = acc.append("b1", "gone", 1)
    kept = acc.append("b1", "kept", 1)
    dropped.cancel()
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(first, kept), 1.0)
    assert broker.batches() == [["a"], ["kept"]]
    await acc.close(1.0)


async def test_linger_holds_a_request_to_fill_it() -> None:
    broker = FakeBroker()
    acc = make(broker, linger_ms=50)
    loop = asyncio.get_running_loop()
    start = loop.time()
    first = acc.append("b1", "a", 1)
    await asyncio.sleep(0.01)
    second = acc.append("b1", "b", 1)
    await asyncio.wait_for(asyncio.gather(first, second), 1.0)
    assert broker.batches() == [["a", "b"]]
    assert loop.time() - start >= 0.045
    await acc.close(1.0)


async def test_linger_does_not_hold_a_full_request() -> None:
    broker = FakeBroker()
    acc = make(broker, linger_ms=10_000, batch_max_messages=3)
    futs = [acc.append("b1", f"m{i}", 1) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*futs), 1.0)
    assert broker.batches() == [["m0", "m1", "m2"]]
    await acc.close(1.0)


async def test_coalesce_holds_a_few_sends_for_the_answer_in_flight() -> None:
    """With a request in flight and slots free, a few more sends wait for its answer (not a
    slot of their own), then leave together at once."""
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=4, coalesce_ms=10_000)
    first = acc.append("b1", "a", 1)
    await broker.wait_requests(1)  # a lone send to an idle broker goes at once
    rest = [acc.append("b1", f"c{i}", 1) for i in range(3)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert broker.batches() == [["a"]]  # three slots free, yet they wait
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *rest), 2.0)
    assert broker.batches() == [["a"], ["c0", "c1", "c2"]]
    await acc.close(1.0)


async def test_coalesce_lets_a_held_send_go_after_coalesce_ms() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=4, coalesce_ms=30)
    first = acc.append("b1", "a", 1)
    await broker.wait_requests(1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    second = acc.append("b1", "b", 1)
    await broker.wait_requests(2)  # the first is still unanswered
    assert loop.time() - start >= 0.025
    assert broker.batches() == [["a"], ["b"]]
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 2.0)
    await acc.close(1.0)


async def test_coalesce_does_not_hold_a_backlog() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=4, coalesce_ms=10_000)
    first = acc.append("b1", "a", 1)
    await broker.wait_requests(1)
    backlog = [acc.append("b1", f"m{i}", 1) for i in range(SPLIT_MIN)]
    await broker.wait_requests(2)  # as many as SPLIT_MIN leave without waiting
    broker.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *backlog), 2.0)
    assert sum(len(b) for b in broker.batches()[1:]) == SPLIT_MIN
    await acc.close(1.0)


async def test_close_flushes_what_is_queued() -> None:
    broker = FakeBroker(gated=True)
    acc = make(broker, max_in_flight=1, linger_ms=10_000)
    futs = [acc.append("b1", f"m{i}", 1) for i in range(10)]
    closing = asyncio.ensure_future(acc.close(2.0))
    await broker.wait_requests(1)  # close sent them at once, linger notwithstanding
    with pytest.raises(UnavailableError, match="closed before the message was sent"):
        acc.append("b1", "late", 1)
    broker.gate.set()
    await asyncio.wait_for(closing, 2.0)
    assert [f.result() for f in futs] == [f"ok:m{i}" for i in range(10)]
    assert broker.batches() == [[f"m{i}" for i in range(10)]]


async def test_close_is_bounded_and_fails_what_is_left() -> None:
    broker = FakeBroker(gated=True)  # never released: the broker hangs
    acc = make(broker, max_in_flight=1)
    in_flight = acc.append("b1", "a", 1)
    await broker.wait_requests(1)
    queued = acc.append("b1", "b", 1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await acc.close(0.2)
    assert loop.time() - start < 1.5
    for fut in (in_flight, queued):
        assert isinstance(fut.exception(), UnavailableError)
    assert acc.pending_count() == 0


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_in_flight", 0, "max_in_flight: must be an integer of at least 1, got 0"),
        (
            "batch_max_messages",
            1.5,
            "batch_max_messages: must be an integer of at least 1, got 1.5",
        ),
        ("linger_ms", -1, "linger_ms: must be a number of at least 0, got -1"),
        ("coalesce_ms", float("nan"), "coalesce_ms: must be a number of at least 0, got nan"),
    ],
)
def test_bad_batching_options(option: str, value: float, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        BatchingConfig(**{option: value})  # type: ignore[arg-type]
    assert str(info.value) == message
