"""SendService and MessageLookup on a real store: every bad input gets its exact sentence, and the
good messages of a mixed request are stored while the bad ones are not."""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import ApogeeError, DiskFullError, InvalidArgumentError, NotFoundError
from apogee.common.topics import Perm
from apogee.store import FlushMode, Message, MessageStore, StoreConfig
from apogee.testkit.store import dispatched
from apogee_broker.core.send.service import Outgoing, SendService
from apogee_broker.core.storage.lookup import MessageLookup
from apogee_broker.core.storage.writer import SendOutcome
from apogee_broker.core.topics import TopicConfig, TopicManager

pytestmark = pytest.mark.unit

KiB = 1024
CONFIG = StoreConfig(
    commitlog_file_size=256 * KiB,
    max_message_size=16 * KiB,
    consume_queue_entries_per_file=64,
    index_slots=97,
    index_entries_per_file=400,
)


@dataclass
class Broker:
    store: MessageStore
    topics: TopicManager
    sending: SendService
    lookup: MessageLookup
    clock: ManualClock


def make_broker(
    root: Path, flush_mode: FlushMode = FlushMode.ASYNC, auto_create: bool = False
) -> Broker:
    clock = ManualClock()
    cfg = dataclasses.replace(CONFIG, flush_mode=flush_mode)
    store = MessageStore.open(
        root / "store", cfg, clock=clock, store_host="127.0.0.1:10911", start_retention=False
    )
    topics = TopicManager(root, default_topic_queues=4, auto_create=auto_create, broker_name="b1")
    topics.load()
    topics.put(TopicConfig("Orders", 8, 8))
    topics.put(TopicConfig("ReadOnly", 2, 2, Perm.READ))
    sending = SendService(
        store,
        topics,
        broker_name="b1",
        max_message_size=1024,
        max_messages_per_request=4,
        clock=clock,
    )
    lookup = MessageLookup(store, topics, broker_name="b1", clock=clock)
    return Broker(store, topics, sending, lookup, clock)


@pytest.fixture(params=[FlushMode.ASYNC, FlushMode.SYNC], ids=["async", "sync"])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    b = make_broker(tmp_path, request.param)
    try:
        yield b
    finally:
        b.store.close()


def msg(topic: str = "Orders", body: bytes = b"hello", **kwargs: object) -> Message:
    return Message(topic, body, **kwargs)  # type: ignore[arg-type]


def error_of(outcome: SendOutcome) -> ApogeeError:
    assert outcome.error is not None, f"expected an error, got {outcome}"
    return outcome.error


async def test_one_message_is_stored_and_readable(broker: Broker) -> None:
    [out] = await broker.sending.send([Outgoing(msg(queue_id=3, tags="t", keys=["k1"]))])
    assert out.ok
    assert out.result is not None
    assert (out.topic, out.queue_id, out.result.queue_offset) == ("Orders", 3, 0)
    assert len(out.unique_id) == 32
    dispatched(broker.store)
    got = broker.store.get("Orders", 3, 0)
    [stored] = got.messages
    assert stored.body == b"hello"
    assert stored.tags == "t"
    assert stored.keys == ["k1"]
    assert stored.unique_id == out.unique_id
    assert stored.born_timestamp == broker.clock.time_ms()
    assert stored.store_host == "127.0.0.1:10911"


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([], "messages: must not be empty"),
        (
            [Outgoing(msg())] * 5,
            "messages: 5 messages in one request; at most 4 are allowed (max_messages_per_request)",
        ),
    ],
)
async def test_request_level_problems_fail_the_call(
    broker: Broker, items: list[Outgoing], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        await broker.sending.send(items)
    assert str(caught.value) == message
    assert broker.store.commitlog.max_offset == 0


BAD = [
    (
        Outgoing(msg(topic="a b")),
        "INVALID_TOPIC",
        "topic 'a b': has a character outside [%|a-zA-Z0-9_-]",
    ),
    (
        Outgoing(msg(topic="x" * 128)),
        "INVALID_TOPIC",
        f"topic {'x' * 128!r}: is 128 characters; at most 127 are allowed",
    ),
    (Outgoing(msg(body=b"")), "INVALID_ARGUMENT", "messages[1].body: must not be empty"),
    (
        Outgoing(msg(body=b"x" * 1025)),
        "MESSAGE_TOO_LARGE",
        "messages[1].body is 1025 bytes: the maximum is 1024 bytes (max_message_size)",
    ),
    (
        Outgoing(msg(sys_flag=0x4)),
        "INVALID_ARGUMENT",
        "messages[1].sys_flag: only bit 0x1 (body compressed with zlib) may be set, got 0x4",
    ),
    (
        Outgoing(msg(), 19),
        "INVALID_ARGUMENT",
        "messages[1].delay_level 19: must be between 1 and 18, the levels of this broker's "
        "delay table (0: no delay)",
    ),
    (
        Outgoing(msg(), -1),
        "INVALID_ARGUMENT",
        "messages[1].delay_level -1: must be between 1 and 18, the levels of this broker's "
        "delay table (0: no delay)",
    ),
    (
        Outgoing(msg(topic="Nope")),
        "UNKNOWN_TOPIC",
        "topic 'Nope' does not exist on broker b1 and auto_create_topics is off: "
        "create it first (PutTopic)",
    ),
    (
        Outgoing(msg(topic="TBW102")),
        "PERMISSION_DENIED",
        "topic 'TBW102': is a system topic; clients cannot send to it",
    ),
    (
        Outgoing(msg(topic="SCHEDULE_TOPIC_XXXX")),
        "PERMISSION_DENIED",
        "topic 'SCHEDULE_TOPIC_XXXX': is a system topic; clients cannot send to it",
    ),
    (
        Outgoing(msg(topic="ReadOnly")),
        "PERMISSION_DENIED",
        "topic 'ReadOnly': is not writable on broker b1 (perm R--)",
    ),
    (
        Outgoing(msg(queue_id=8)),
        "INVALID_QUEUE_ID",
        "queue_id 8: must be between 0 and 7: topic 'Orders' has 8 write queues on broker b1",
    ),
    (
        Outgoing(msg(queue_id=-1)),
        "INVALID_QUEUE_ID",
        "queue_id -1: must be between 0 and 7: topic 'Orders' has 8 write queues on broker b1",
    ),
    (
        Outgoing(msg(), 3, 2**40),
        "INVALID_ARGUMENT",
        "messages[1]: delay_level and deliver_at_ms are both set; give one or the other",
    ),
    (
        Outgoing(msg(), 0, -5),
        "INVALID_ARGUMENT",
        "messages[1].deliver_at_ms: must be a time in ms since the epoch (0: none), got -5",
    ),
    (
        Outgoing(msg(keys=["a b"])),
        "INVALID_PROPERTY",
        "property 'keys': key 'a b' must be non-empty, without spaces, \\x01 or \\x02",
    ),
    # a body flagged compressed must inflate, within max_message_size (a body that did not
    # once stopped every reader of its queue at its offset)
    (
        Outgoing(msg(body=b"not zlib", sys_flag=1)),
        "INVALID_ARGUMENT",
        "messages[1].body: is flagged compressed (sys_flag 0x1) but does not inflate with zlib "
        "(Error -3 while decompressing data: incorrect header check)",
    ),
    (
        Outgoing(msg(body=zlib.compress(b"x" * 1025), sys_flag=1)),
        "INVALID_ARGUMENT",
        "messages[1].body: is flagged compressed (sys_flag 0x1) but inflates to more than 1024 "
        "bytes (max_message_size)",
    ),
    (
        Outgoing(msg(body=zlib.compress(b"hello")[:-2], sys_flag=1)),
        "INVALID_ARGUMENT",
        "messages[1].body: is flagged compressed (sys_flag 0x1) but ends before its zlib "
        "stream does",
    ),
    # an empty body is refused, compressed or not
    (
        Outgoing(msg(body=zlib.compress(b""), sys_flag=1)),
        "INVALID_ARGUMENT",
        "messages[1].body: is flagged compressed (sys_flag 0x1) but inflates to 0 bytes; a "
        "body must not be empty",
    ),
    # ids and property names that lookups, lists and logs could not show
    (
        Outgoing(msg(unique_id="u" * 129)),
        "INVALID_ARGUMENT",
        "unique_id: is 129 characters; at most 128 are allowed",
    ),
    (
        Outgoing(msg(unique_id="two words")),
        "INVALID_ARGUMENT",
        "unique_id: must not contain spaces or control characters",
    ),
    (
        Outgoing(msg(properties={"a\nb": "v"})),
        "INVALID_PROPERTY",
        "property 'a\\nb': a property name must not contain control characters, got '\\n'",
    ),
    (
        Outgoing(msg(properties={"nul\x00": "v"})),
        "INVALID_PROPERTY",
        "property 'nul\\x00': a property name must not contain control characters, got '\\x00'",
    ),
    # what only brokers set: a delayed message's destination, a retry's origin, ... (a client
    # that set REAL_TOPIC once had its delayed message delivered to another topic)
    (
        Outgoing(msg(properties={"REAL_TOPIC": "Victim"}), 1),
        "INVALID_PROPERTY",
        "property 'REAL_TOPIC': is set by brokers only; use the message's delay_level or "
        "deliver_at_ms for a delayed message",
    ),
    (
        Outgoing(msg(properties={"ok": "1", "DELAY": "3"})),
        "INVALID_PROPERTY",
        "property 'DELAY': is set by brokers only; use the message's delay_level or "
        "deliver_at_ms for a delayed message",
    ),
    (
        Outgoing(msg(properties={"RETRY_TOPIC": "Victim"})),
        "INVALID_PROPERTY",
        "property 'RETRY_TOPIC': is set by brokers only; use the message's delay_level or "
        "deliver_at_ms for a delayed message",
    ),
    (
        Outgoing(msg(properties={"DLQ_ANYTHING": "x"})),
        "INVALID_PROPERTY",
        "property 'DLQ_ANYTHING': is set by brokers only; use the message's delay_level or "
        "deliver_at_ms for a delayed message",
    ),
    (
        Outgoing(msg(unique_id="UID-1", properties={"big": "v" * 33_000})),
        "PROPERTIES_TOO_LARGE",
        f"properties are {len('UNIQ_KEY=UID-1;big=;') + 33_000} bytes: the maximum is 32767 "
        "bytes (max_properties_size), tags, keys and unique id included",
    ),
]


@pytest.mark.parametrize(
    ("bad", "reason", "message"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)]
)
async def test_a_bad_message_gets_its_sentence_and_the_good_ones_are_stored(
    broker: Broker, bad: Outgoing, reason: str, message: str
) -> None:
    good = [msg(body=b"first", queue_id=1), msg(body=b"third", queue_id=1)]
    outcomes = await broker.sending.send([Outgoing(good[0]), bad, Outgoing(good[1])])
    assert [o.ok for o in outcomes] == [True, False, True]
    err = error_of(outcomes[1])
    assert (err.kind.name, str(err)) == (reason, message)
    assert not err.retriable
    assert outcomes[1].result is None
    dispatched(broker.store)
    stored = broker.store.get("Orders", 1, 0).messages
    assert [m.body for m in stored] == [b"first", b"third"]
    assert [m.unique_id for m in stored] == [outcomes[0].unique_id, outcomes[2].unique_id]
    # nothing of the bad message reached any queue
    assert sum(broker.store.queue_max_offsets().values()) == 2


#: What only a message (not a send record) can carry: a separator inside a unique id or a
#: property name. The broker answers them as any other control character, before the store.
SEPARATORS = [
    (
        Outgoing(msg(unique_id="sep\x01arated")),
        "INVALID_ARGUMENT",
        "unique_id: must not contain spaces or control characters",
    ),
    (
        Outgoing(msg(unique_id="sep\x02arated")),
        "INVALID_ARGUMENT",
        "unique_id: must not contain spaces or control characters",
    ),
    (
        Outgoing(msg(properties={"a\x01b": "v"})),
        "INVALID_PROPERTY",
        "property 'a\\x01b': a property name must not contain control characters, got '\\x01'",
    ),
    (
        Outgoing(msg(properties={"a\x02b": "v"})),
        "INVALID_PROPERTY",
        "property 'a\\x02b': a property name must not contain control characters, got '\\x02'",
    ),
]


@pytest.mark.parametrize(
    ("bad", "reason", "message"),
    SEPARATORS,
    ids=[f"{i}-{b[1]}" for i, b in enumerate(SEPARATORS)],
)
async def test_a_separator_in_an_id_or_a_name_gets_the_control_character_sentence(
    broker: Broker, bad: Outgoing, reason: str, message: str
) -> None:
    outcomes = await broker.sending.send([Outgoing(msg(body=b"first", queue_id=1)), bad])
    assert outcomes[0].ok
    err = error_of(outcomes[1])
    assert (err.kind.name, str(err)) == (reason, message)
    dispatched(broker.store)
    assert sum(broker.store.queue_max_offsets().values()) == 1


@pytest.mark.parametrize("name", ["UNIQ_KEY", "TAGS", "KEYS"])
async def test_a_message_cannot_carry_its_own_fields_as_properties(
    broker: Broker, name: str
) -> None:
    [outcome] = await broker.sending.send([Outgoing(msg(properties={name: "forged"}))])
    err = error_of(outcome)
    assert (err.kind.name, str(err)) == (
        "INVALID_PROPERTY",
        f"property {name!r}: is reserved; use the message's tags, keys or unique id",
    )
    assert sum(broker.store.queue_max_offsets().values()) == 0


async def test_a_request_of_only_bad_messages_stores_nothing(broker: Broker) -> None:
    outcomes = await broker.sending.send(
        [Outgoing(msg(topic="Nope")), Outgoing(msg(keys=["a b"])), Outgoing(msg(body=b""))]
    )
    assert [error_of(o).kind.name for o in outcomes] == [
        "UNKNOWN_TOPIC",
        "INVALID_PROPERTY",
        "INVALID_ARGUMENT",
    ]
    assert broker.store.commitlog.max_offset == 0


async def test_retry_and_dead_letter_topics_can_be_written(broker: Broker) -> None:
    broker.topics.put(TopicConfig("%RETRY%g", 1, 1))
    broker.topics.put(TopicConfig("%DLQ%g", 1, 1))
    outcomes = await broker.sending.send(
        [Outgoing(msg(topic="%RETRY%g")), Outgoing(msg(topic="%DLQ%g"))]
    )
    assert all(o.ok for o in outcomes), outcomes


async def test_a_batch_keeps_request_order_and_queue_offsets(broker: Broker) -> None:
    items = [Outgoing(msg(body=f"m{i}".encode(), queue_id=i % 2)) for i in range(4)]
    outcomes = await broker.sending.send(items)
    assert [(o.queue_id, o.result.queue_offset if o.result else None) for o in outcomes] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
    ]
    phys = [o.result.phys_offset for o in outcomes if o.result]
    assert phys == sorted(phys)
    assert len({o.unique_id for o in outcomes}) == 4


async def test_given_ids_hosts_and_flags_are_kept(broker: Broker) -> None:
    [out] = await broker.sending.send(
        [
            Outgoing(
                msg(
                    unique_id="MY-ID",
                    born_host="10.1.2.3:4567",
                    born_timestamp=1_600_000_000_000,
                    body=zlib.compress(b"hello"),
                    flag=7,
                    sys_flag=1,
                    properties={"trace": "abc"},
                )
            )
        ],
        default_born_host="127.0.0.1:1",
    )
    assert out.unique_id == "MY-ID"
    found = await broker.lookup.by_unique_id("MY-ID")
    assert (found.born_host, found.born_timestamp, found.flag, found.sys_flag) == (
        "10.1.2.3:4567",
        1_600_000_000_000,
        7,
        1,
    )
    assert found.properties["trace"] == "abc"


async def test_the_callers_address_is_the_default_born_host(broker: Broker) -> None:
    [out] = await broker.sending.send([Outgoing(msg())], default_born_host="10.9.8.7:1234")
    found = await broker.lookup.by_unique_id(out.unique_id)
    assert found.born_host == "10.9.8.7:1234"


async def test_concurrent_sends_all_succeed(broker: Broker) -> None:
    async def one(i: int) -> list[SendOutcome]:
        return await broker.sending.send([Outgoing(msg(body=f"c{i}".encode(), queue_id=i % 8))])

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), 30)
    assert all(o.ok for r in results for o in r)
    dispatched(broker.store)
    assert sum(broker.store.queue_max_offsets().values()) == 64


async def test_a_closed_store_answers_every_message_with_a_retriable_error(
    broker: Broker,
) -> None:
    broker.store.close()
    outcomes = await broker.sending.send([Outgoing(msg()), Outgoing(msg(topic="Nope"))])
    first = error_of(outcomes[0])
    assert first.kind.name == "STORE_CLOSED"
    assert first.retriable
    assert error_of(outcomes[1]).kind.name == "UNKNOWN_TOPIC"


async def test_auto_create_makes_the_topic_from_tbw102(tmp_path: Path) -> None:
    b = make_broker(tmp_path, auto_create=True)
    try:
        [out] = await b.sending.send([Outgoing(msg(topic="Fresh", queue_id=3))])
        assert out.ok
        assert b.topics.get("Fresh") == TopicConfig("Fresh", 4, 4)
        [bad] = await b.sending.send([Outgoing(msg(topic="Fresh2", queue_id=4))])
        assert error_of(bad).kind.name == "INVALID_QUEUE_ID"
        assert b.topics.get("Fresh2") == TopicConfig("Fresh2", 4, 4)
        # a message that is bad on its own does not create its topic
        [empty] = await b.sending.send([Outgoing(msg(topic="Fresh3", body=b""))])
        assert error_of(empty).kind.name == "INVALID_ARGUMENT"
        assert b.topics.get("Fresh3") is None
    finally:
        b.store.close()


async def test_lookup_by_unique_id_that_is_not_there(broker: Broker) -> None:
    with pytest.raises(NotFoundError) as caught:
        await broker.lookup.by_unique_id("NOPE")
    assert str(caught.value) == (
        "message 'NOPE' not found: broker b1 stores no message with this unique id (it may be on "
        "another broker, or removed by retention)"
    )
    with pytest.raises(InvalidArgumentError, match="unique_id: must not be empty"):
        await broker.lookup.by_unique_id("")


async def by_key(broker: Broker, *args: object) -> list[bytes]:
    found, more = await broker.lookup.query(*args)  # type: ignore[arg-type]
    assert not more  # only lookups without key say "more"
    return sorted(m.body for m in found)


async def test_lookup_by_key_and_time_range(broker: Broker) -> None:
    t0 = broker.clock.time_ms()
    await broker.sending.send([Outgoing(msg(body=b"a", keys=["order-1"]))])
    broker.clock.advance(10)
    await broker.sending.send(
        [Outgoing(msg(body=b"b", keys=["order-1", "x"])), Outgoing(msg(body=b"c", keys=["y"]))]
    )
    dispatched(broker.store)
    assert await by_key(broker, "Orders", "order-1", 0, 0, 0) == [b"a", b"b"]
    assert await by_key(broker, "Orders", "order-1", t0 + 5_000, 0, 0) == [b"b"]
    assert await by_key(broker, "Orders", "order-1", 0, t0 + 5_000, 10) != []
    assert await by_key(broker, "Orders", "none", 0, 0, 0) == []


async def test_lookup_by_time_alone_lists_the_window_newest_first(broker: Broker) -> None:
    """``apogee message query --topic T --begin ... --end ...`` without a key."""
    t0 = broker.clock.time_ms()
    for i in range(12):  # 12 messages over 4 queues, 1 s apart
        await broker.sending.send([Outgoing(msg(body=b"m%d" % i, queue_id=i % 4))])
        broker.clock.advance(1)
    dispatched(broker.store)
    found, more = await broker.lookup.query("Orders", "", t0 + 3_000, t0 + 7_000, 0)
    assert [m.body for m in found] == [b"m7", b"m6", b"m5", b"m4", b"m3"]
    assert not more
    found, more = await broker.lookup.query("Orders", "", t0 + 3_000, t0 + 7_000, 2)
    assert [m.body for m in found] == [b"m7", b"m6"]
    assert more, "the window holds 5: the answer must say it left some out"
    found, more = await broker.lookup.query("Orders", "", 0, 0, 0)  # the whole topic to now
    assert len(found) == 12
    assert not more
    found, more = await broker.lookup.query("Orders", "", t0 + 100, t0 + 900, 0)
    assert found == []  # between two messages
    assert not more


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("Orders", "a b", 0, 0, 0), "key: 'a b': a key has no spaces"),
        (("Orders", "k", 5, 4, 0), "begin_ms: 5 is after end_ms 4"),
        (("Orders", "k", -1, 0, 0), "begin_ms: must not be negative, got -1"),
        (("Orders", "", 0, -3, 0), "end_ms: must not be negative, got -3"),
        (("Orders", "k", 0, 0, 5000), "max_messages: at most 1024, got 5000"),
        (("Nope", "k", 0, 0, 0), "topic 'Nope' does not exist on broker b1"),
    ],
)
async def test_bad_queries_are_refused(
    broker: Broker, args: tuple[str, str, int, int, int], message: str
) -> None:
    with pytest.raises(ApogeeError) as caught:
        await broker.lookup.query(*args)
    assert str(caught.value) == message


async def test_a_full_disk_is_logged_once_when_it_starts_and_once_when_it_ends(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Producers saw every refusal; the broker said nothing. Now each episode is two lines."""
    full = [True]

    def refusing(real: Callable[..., object]) -> Callable[..., object]:
        def append(*args: object, **kwargs: object) -> object:
            if full[0]:
                raise DiskFullError(path=str(broker.store.root), detail="No space left on device")
            return real(*args, **kwargs)

        return append

    for name in ("append", "append_async"):  # async and sync flush
        monkeypatch.setattr(broker.store, name, refusing(getattr(broker.store, name)))
    for _ in range(3):
        [out] = await broker.sending.send([Outgoing(msg(body=b"x" * 100))])
        assert error_of(out).kind.name == "DISK_FULL"
        assert error_of(out).retriable
    full[0] = False
    [out] = await broker.sending.send([Outgoing(msg())])
    assert out.ok
    lines = [r for r in caplog.records if r.name == "apogee_broker.core.storage.disk_episodes"]
    assert [r.levelname for r in lines] == ["WARNING", "WARNING"]
    start, end = (r.getMessage() for r in lines)
    assert start.startswith("disk full: sends are refused until space is freed (")
    assert "bytes free; the refused append needed 100): no space left for" in start
    assert end.startswith("disk no longer full: sends are stored again after 3 refused (")
