"""Send records checked in place: every bad record gets the sentence the same message gets on
the message path, the good ones are appended as one block, and the answer is per request."""

from __future__ import annotations

import importlib.util
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from apogee.codec import SYSFLAG_COMPRESSED
from apogee.codec.send import encode_properties, encode_send_record
from apogee.common.errors import ApogeeError, InvalidArgumentError
from apogee.common.topics import SCHEDULE_TOPIC
from apogee.store import FlushMode, Message
from apogee.testkit.store import dispatched
from apogee_broker.core.send.record_intake import RecordIntake, RecordsOutcome
from apogee_broker.core.send.service import Outgoing


def _sibling(name: str) -> ModuleType:
    """A module of this folder (tests are imported by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(
        f"_{name}", Path(__file__).with_name(f"{name}.py")
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


#: The message path's tests: their broker and their bad cases, which records must match.
_sending = _sibling("test_broker_sending")
#: test_broker_sending.Broker: its store, topics, sending service, lookup and clock
Broker = Any
make_broker: Callable[..., Broker] = _sending.make_broker
BAD: list[tuple[Outgoing, str, str]] = _sending.BAD

pytestmark = pytest.mark.unit


@pytest.fixture(params=[FlushMode.ASYNC, FlushMode.SYNC], ids=["async", "sync"])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    b = make_broker(tmp_path, request.param)
    try:
        yield b
    finally:
        b.store.close()


def rec(item: Outgoing | None = None, uid: str = "", raw_props: bytes | None = None) -> bytes:
    """``item``'s message as a producer encodes it."""
    m = (item or Outgoing(_msg())).message
    props = (
        raw_props
        if raw_props is not None
        else encode_properties(m.tags, m.keys, uid or m.unique_id or "", m.properties)
    )
    return bytes(
        encode_send_record(
            m.topic.encode(),
            m.body,
            props,
            queue_id=m.queue_id,
            flag=m.flag,
            sys_flag=m.sys_flag,
            born_timestamp=m.born_timestamp,
            delay_level=item.delay_level if item else 0,
            deliver_at_ms=item.deliver_at_ms if item else 0,
        )
    )


def _msg(body: bytes = b"hello", queue_id: int = 0, **kwargs: Any) -> Message:
    return Message("Orders", body, queue_id, **kwargs)


def good(body: bytes, queue_id: int = 1, uid: str = "") -> bytes:
    return rec(Outgoing(_msg(body, queue_id, tags="t")), uid=uid or f"U-{body.decode()}")


async def send(broker: Broker, *records: bytes, host: str = "10.0.0.9:5555") -> RecordsOutcome:
    return await RecordIntake(broker.sending).send(b"".join(records), host)


async def test_plain_records_are_stored_and_answered_per_request(broker: Broker) -> None:
    out = await send(broker, good(b"a"), good(b"b"), good(b"c", queue_id=2))
    assert list(out.queue_offsets) == [0, 1, 0]
    assert out.others == []
    assert out.store_timestamp == broker.clock.time_ms()
    assert len(out.packed_offsets()) == 24
    dispatched(broker.store)
    [a, _] = broker.store.get("Orders", 1, 0).messages
    assert (a.body, a.tags, a.unique_id, a.born_host) == (b"a", "t", "U-a", "10.0.0.9:5555")
    assert a.store_host == "127.0.0.1:10911"
    found = await broker.lookup.by_unique_id("U-b")
    assert found.body == b"b"


#: The message path's bad cases a record can carry (a record cannot hold a key with a space).
RECORD_BAD = [b for b in BAD if not b[2].startswith("property 'keys'")]


@pytest.mark.parametrize(
    ("bad", "reason", "message"),
    RECORD_BAD,
    ids=[f"{i}-{b[1]}" for i, b in enumerate(RECORD_BAD)],
)
async def test_a_bad_record_gets_the_message_paths_sentence(
    broker: Broker, bad: Outgoing, reason: str, message: str
) -> None:
    out = await send(
        broker, good(b"first"), rec(bad, uid=bad.message.unique_id or "U-bad"), good(b"third")
    )
    assert list(out.queue_offsets) == [0, -1, 1]
    [(index, outcome)] = out.others
    assert index == 1
    err = outcome.error
    assert isinstance(err, ApogeeError)
    assert (err.kind.name, str(err)) == (reason, message)
    assert outcome.result is None
    dispatched(broker.store)
    assert [m.body for m in broker.store.get("Orders", 1, 0).messages] == [b"first", b"third"]
    assert sum(broker.store.queue_max_offsets().values()) == 2


async def test_a_delayed_record_waits_in_the_schedule_topic(broker: Broker) -> None:
    delayed = rec(Outgoing(_msg(b"later", 3, tags="t"), 2), uid="U-later")
    out = await send(broker, good(b"now"), delayed)
    assert list(out.queue_offsets) == [0, -1]
    [(index, outcome)] = out.others
    assert index == 1
    assert outcome.ok
    assert (outcome.topic, outcome.queue_id, outcome.unique_id) == ("Orders", 3, "U-later")
    assert outcome.scheduled_for == broker.clock.time_ms() + 5_000
    dispatched(broker.store)
    [parked] = broker.store.get(SCHEDULE_TOPIC, 1, 0).messages
    assert parked.body == b"later"
    assert parked.properties["REAL_TOPIC"] == "Orders"
    assert parked.born_host == "10.0.0.9:5555"


async def test_records_a_producer_did_not_write_take_the_ordinary_path(broker: Broker) -> None:
    no_id = rec(Outgoing(_msg(b"no id")), raw_props=b"")
    user_first = rec(
        Outgoing(_msg(zlib.compress(b"user first"), sys_flag=SYSFLAG_COMPRESSED)),
        raw_props=b"x\x01y\x02TAGS\x01late\x02UNIQ_KEY\x01U-uf\x02",
    )
    out = await send(broker, no_id, user_first)
    assert all(o.ok for _, o in out.others)
    ids = {i: o.unique_id for i, o in out.others}
    assert len(ids[0]) == 32  # assigned by the broker
    assert ids[1] == "U-uf"
    dispatched(broker.store)
    first, second = broker.store.get("Orders", 0, 0).messages
    assert (first.body, first.unique_id) == (b"no id", ids[0])
    assert (second.tags, second.properties["x"], second.sys_flag) == ("late", "y", 1)


@pytest.mark.parametrize("name", ["UNIQ_KEY", "TAGS", "KEYS"])
async def test_a_record_naming_one_of_its_own_fields_twice_is_refused(
    broker: Broker, name: str
) -> None:
    twice = rec(
        Outgoing(_msg(b"twice", 1, tags="t", keys=("k",))),
        uid="U-real",
        raw_props=f"TAGS\x01t\x02KEYS\x01k\x02UNIQ_KEY\x01U-real\x02{name}\x01forged\x02".encode(),
    )
    out = await send(broker, good(b"first"), twice)
    assert list(out.queue_offsets) == [0, -1]
    [(index, outcome)] = out.others
    assert index == 1
    assert isinstance(outcome.error, ApogeeError)
    assert (outcome.error.kind.name, str(outcome.error)) == (
        "INVALID_PROPERTY",
        f"property {name!r}: appears more than once; a message has one",
    )
    dispatched(broker.store)
    assert sum(broker.store.queue_max_offsets().values()) == 1


@pytest.mark.parametrize(
    ("props", "says"),
    [
        (
            b"UNIQ_KEY\x01U-p\x02\x01nameless\x02",
            "property '': a property name must be non-empty, without \\x01 or \\x02",
        ),
        (
            b"UNIQ_KEY\x01U-p\x02a\x01b\x01c\x02",
            "property 'a': a value must not contain \\x01 or \\x02",
        ),
        (
            b"UNIQ_KEY\x01U-p\x02junk\x02",
            "property 'properties': entry 'junk' has no \\x01 between a name and a value",
        ),
        (
            b"UNIQ_KEY\x01U-p\x02a\x01b",
            "property 'properties': must end each entry with \\x02; 'a\\x01b' does not",
        ),
        (
            b"UNIQ_KEY\x01U-p\x02a\tb\x01v\x02",
            "property 'a\\tb': a property name must not contain control characters, got '\\t'",
        ),
    ],
)
async def test_properties_a_message_could_not_be_written_again_with_are_refused(
    broker: Broker, props: bytes, says: str
) -> None:
    # stored, such a record would be refused by the store at its first retry, dead letter or
    # delayed delivery (each writes the message again through the store's checks)
    bad = rec(Outgoing(_msg(b"odd", 1)), raw_props=props)
    out = await send(broker, good(b"first"), bad, good(b"third"))
    assert list(out.queue_offsets) == [0, -1, 1]
    [(index, outcome)] = out.others
    assert index == 1
    assert isinstance(outcome.error, ApogeeError)
    assert (outcome.error.kind.name, str(outcome.error)) == ("INVALID_PROPERTY", says)
    dispatched(broker.store)
    assert sum(broker.store.queue_max_offsets().values()) == 2


async def test_a_negative_born_timestamp_is_refused_as_on_the_message_path(
    broker: Broker,
) -> None:
    message = Outgoing(_msg(b"born", 1, born_timestamp=-5))
    [on_path] = await broker.sending.send([message])
    out = await send(broker, rec(message, uid="U-born"))
    assert list(out.queue_offsets) == [-1]
    [(_, outcome)] = out.others
    assert isinstance(outcome.error, ApogeeError)
    assert isinstance(on_path.error, ApogeeError)
    assert (outcome.error.kind.name, str(outcome.error)) == (
        "INVALID_ARGUMENT",
        "born_timestamp: must be an integer from 0 to 9223372036854775807, got -5",
    )
    assert str(outcome.error) == str(on_path.error)
    assert broker.store.commitlog.max_offset == 0


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "messages: must not be empty"),
        (b"\x00" * 20, "records[0] (at byte 0): 20 bytes is shorter than a record's header"),
        (b"junk" * 40, "records[0] (at byte 0): its magic or sizes do not make a record"),
    ],
)
async def test_a_broken_frame_fails_the_request(broker: Broker, data: bytes, says: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        await send(broker, data)
    assert str(caught.value) == says
    with pytest.raises(InvalidArgumentError) as caught:
        await send(broker, good(b"ok"), good(b"cut")[:-3])
    assert str(caught.value).startswith("records[1] (at byte ")
    assert broker.store.commitlog.max_offset == 0


async def test_too_many_records_fail_the_request(broker: Broker) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        await send(broker, *(good(f"m{i}".encode()) for i in range(6)))
    assert str(caught.value) == (
        "messages: 6 messages in one request; at most 4 are allowed (max_messages_per_request)"
    )
    assert broker.store.commitlog.max_offset == 0


async def test_a_closed_store_answers_every_record_with_a_retriable_error(broker: Broker) -> None:
    broker.store.close()
    out = await send(broker, good(b"a"), good(b"b"))
    assert list(out.queue_offsets) == [-1, -1]
    assert [(i, o.error.kind.name if o.error else "") for i, o in out.others] == [
        (0, "STORE_CLOSED"),
        (1, "STORE_CLOSED"),
    ]
    assert all(o.error is not None and o.error.retriable for _, o in out.others)
