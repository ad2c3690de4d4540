"""Strings UTF-8 cannot encode (a lone surrogate, as text decoded with
``errors="surrogateescape"`` holds for each byte that was not UTF-8): every string the SDK
sends is refused with the registry's error naming the field and the rule, never a bare
``UnicodeEncodeError``, and before anything is sent."""

from __future__ import annotations

import re

import pytest

from apogee.client import AdminClient, Message, Producer, PullConsumer, QueueReader
from apogee.client._rpc import ChannelPool
from apogee.client.producer.routes import MessageQueue
from apogee.client.producer.validation import MessageValidator, validate_batch, validate_message
from apogee.client.txn_admin import list_pending, resolve
from apogee.common.errors import InvalidArgumentError, InvalidPropertyError

pytestmark = pytest.mark.unit

#: "a", the byte 0xff as surrogateescape decodes it, "b"
BAD = "a\udcffb"
USE_BODY = "; binary data belongs in the body"
CLOSED = "127.0.0.1:1"  # nothing is asked of it: every case is refused before


def rule(position: int = 1) -> str:
    return (
        f"must be valid Unicode text: lone surrogate U+DCFF at position {position} cannot be "
        "encoded as UTF-8"
    )


def exactly(text: str) -> str:
    return f"^{re.escape(text)}$"


RULE = rule()


def msg(**kw: object) -> Message:
    fields: dict[str, object] = {"topic": "Orders", "body": b"x"}
    fields.update(kw)
    return Message(**fields)  # type: ignore[arg-type]


MESSAGES = [
    (msg(tags=BAD), f"property 'tags': {RULE}{USE_BODY}"),
    (msg(keys=["ok", BAD]), f"property 'keys': key {BAD!r} {RULE}{USE_BODY}"),
    (msg(properties={BAD: "v"}), f"property {BAD!r}: a property name {RULE}{USE_BODY}"),
    (msg(properties={"n": BAD}), f"property 'n': a value {RULE}{USE_BODY}"),
    (msg(properties={"n": "\udcff"}), f"property 'n': a value {rule(0)}{USE_BODY}"),
]


@pytest.mark.parametrize(("message", "text"), MESSAGES)
def test_a_message_field_that_is_not_text_is_named(message: Message, text: str) -> None:
    for check in (validate_message, MessageValidator(), lambda m: validate_batch([msg(), m])):
        with pytest.raises(InvalidPropertyError) as info:
            check(message)
        assert str(info.value) == text
        assert not info.value.retriable


async def test_the_producer_refuses_them_before_sending() -> None:
    async with Producer(CLOSED) as producer:
        with pytest.raises(InvalidPropertyError, match=exactly(MESSAGES[1][1])):
            await producer.send(msg(keys=["ok", BAD]))
        with pytest.raises(InvalidArgumentError) as info:
            await producer.send_ordered(msg(), BAD)
        assert str(info.value) == f"sharding_key: {RULE}; pass bytes for a binary key"
        assert producer.stats().requests == 0


def test_a_subscription_that_is_not_text_is_named() -> None:
    consumer = PullConsumer(CLOSED, "g")
    with pytest.raises(InvalidArgumentError) as info:
        consumer.subscribe("T", BAD)
    assert str(info.value) == f"tag_expression: {RULE}"
    with pytest.raises(InvalidArgumentError) as info:
        consumer.subscribe("T", sql=f"a = '{BAD}'")
    assert str(info.value) == f"sql_expression: {rule(6)}"


async def test_reader_and_admin_arguments_that_are_not_text_are_named() -> None:
    queue = MessageQueue("T", "broker-a", 0)
    async with QueueReader(CLOSED) as reader:
        with pytest.raises(InvalidArgumentError, match=exactly(f"tag_expression: {RULE}")):
            await reader.read_batch(queue, 0, tag_expression=BAD)
        with pytest.raises(InvalidArgumentError, match=exactly(f"sql: {RULE}")):
            await reader.read_batch(queue, 0, sql=BAD)
    async with AdminClient(CLOSED) as admin:
        with pytest.raises(InvalidArgumentError, match=exactly(f"unique_id: {RULE}")):
            await admin.get_messages(BAD)
        with pytest.raises(InvalidArgumentError, match=exactly(f"key: {RULE}")):
            await admin.query_messages("T", BAD)
    pool = ChannelPool()
    with pytest.raises(InvalidArgumentError, match=exactly(f"group: {RULE}")):
        await list_pending(pool, [], 1.0, group=BAD)
    with pytest.raises(InvalidArgumentError, match=exactly(f"operator: {RULE}")):
        await resolve(pool, [], 1.0, "T1", True, BAD)
