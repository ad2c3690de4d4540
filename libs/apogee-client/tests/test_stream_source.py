"""StreamSource over a stand-in delivery stream: a queue subscribed at its first fetch, pushed
answers handed out in order, credit kept at two batches (topped up once per batch), commits
riding on the next write, a fetch from another offset subscribing again, a queue's error raised
once, and a quiet queue answered NO_NEW_MESSAGE after the wait."""

from __future__ import annotations

from typing import Any

import pytest

from apogee.client._rpc import ChannelPool, PullAnswer
from apogee.client.consumer.config import ConsumerConfig
from apogee.client.consumer.delivery import Subscription
from apogee.client.consumer.fetcher import FetchRequest
from apogee.client.consumer.stream_source import StreamSource
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import UnknownTopicError
from apogee.v1 import consumer_pb2

pytestmark = pytest.mark.unit

MQ = MessageQueue("T", "b1", 0)


class FakeStream:
    """Records what the source asks of its stream."""

    def __init__(self) -> None:
        self.subs: list[Subscription] = []
        self.unsubscribed: list[Subscription] = []
        self.grants: list[int] = []
        self.commits: list[tuple[str, int, int, bool]] = []

    def subscribe(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        tag_expression: str,
        credit_messages: int,
        credit_bytes: int,
        on_batch: Any,
        on_error: Any,
        sql_expression: str = "",
        exclusive: bool = False,
    ) -> Subscription:
        s = Subscription(
            len(self.subs) + 1,
            topic,
            queue_id,
            offset,
            tag_expression,
            credit_messages,
            credit_bytes,
            on_batch,
            on_error,
            sql_expression,
            exclusive,
        )
        self.subs.append(s)
        return s

    def unsubscribe(self, s: Subscription, keep_commit: bool = False) -> None:
        self.unsubscribed.append(s)

    def grant(self, s: Subscription, messages: int, nbytes: int = 0) -> None:
        s.credit_messages += messages
        self.grants.append(messages)

    def commit(self, topic: str, queue_id: int, offset: int, now: bool = True) -> None:
        self.commits.append((topic, queue_id, offset, now))

    def push(self, s: Subscription, count: int, next_offset: int) -> None:
        s.credit_messages -= count
        s.offset = next_offset
        answer = PullAnswer.of(
            consumer_pb2.PullResponse(
                status=consumer_pb2.PULL_FOUND, count=count, next_offset=next_offset
            )
        )
        s.on_batch(s, answer)


@pytest.fixture
def fake() -> FakeStream:
    return FakeStream()


@pytest.fixture
def source(fake: FakeStream) -> StreamSource:
    cfg = ConsumerConfig.create("127.0.0.1:9876", "g", {"long_poll_timeout": 0.05})
    src = StreamSource(cfg, ChannelPool())
    src.stream = lambda address: fake  # type: ignore[assignment,method-assign,return-value]
    return src


def request(offset: int, commit: int | None = None, max_messages: int = 10) -> FetchRequest:
    return FetchRequest(MQ, "a:1", offset, max_messages, "*", commit)


async def test_first_fetch_subscribes_and_pushed_answers_come_in_order(
    source: StreamSource, fake: FakeStream
) -> None:
    quiet = await source.fetch(request(5))
    assert (quiet.response.status, quiet.response.next_offset) == (
        consumer_pb2.PULL_NO_NEW_MESSAGE,
        5,
    )
    [sub] = fake.subs
    assert (sub.offset, sub.credit_messages) == (5, 20)  # two batches
    assert sub.exclusive  # clustering: one member of the group at a time
    assert sub.as_pb().exclusive
    fake.push(sub, 2, 7)
    fake.push(sub, 1, 8)
    first = await source.fetch(request(5))
    second = await source.fetch(request(7))
    assert [first.response.next_offset, second.response.next_offset] == [7, 8]
    assert len(fake.subs) == 1  # one subscription throughout


async def test_credit_is_topped_up_once_it_falls_to_half(
    source: StreamSource, fake: FakeStream
) -> None:
    await source.fetch(request(0))
    [sub] = fake.subs
    fake.push(sub, 9, 9)
    await source.fetch(request(0))
    assert fake.grants == []  # 11 of 20 left: more than a batch
    fake.push(sub, 1, 10)
    await source.fetch(request(9))
    assert fake.grants == [10]  # one batch left: back to two
    assert sub.credit_messages == 20


async def test_commits_ride_on_the_next_write_once_each(
    source: StreamSource, fake: FakeStream
) -> None:
    await source.fetch(request(0, commit=0))
    await source.fetch(request(0, commit=0))
    await source.fetch(request(0, commit=3))
    assert fake.commits == [("T", 0, 0, False), ("T", 0, 3, False)]


async def test_a_fetch_from_another_offset_subscribes_again(
    source: StreamSource, fake: FakeStream
) -> None:
    await source.fetch(request(0))
    first = fake.subs[0]
    fake.push(first, 3, 3)
    got = await source.fetch(request(0))
    assert got.response.next_offset == 3
    await source.fetch(request(0))  # the records from 0 again (they failed their check)
    assert fake.unsubscribed == [first]
    assert fake.subs[1].offset == 0


async def test_a_queue_error_is_raised_and_the_next_fetch_starts_over(
    source: StreamSource, fake: FakeStream
) -> None:
    await source.fetch(request(0))
    sub = fake.subs[0]
    sub.on_error(sub, UnknownTopicError(topic="T", detail="was deleted"))
    with pytest.raises(UnknownTopicError):
        await source.fetch(request(0))
    await source.fetch(request(0))
    assert len(fake.subs) == 2
