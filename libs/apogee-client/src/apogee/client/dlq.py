"""Dead letters: list a consumer group's dead-letter topic and redrive its messages.

A clustering consumer group's messages that failed ``max_reconsume_times`` retries (or that an
orderly consumer gave up on) land in ``%DLQ%<group>``, one queue on each broker that had them,
with their original topic (property ``DLQ_ORIGIN_TOPIC``), the consumer's last failure
(``DLQ_REASON``) and their attempt count (``ATTEMPTS``, else the record's reconsume times + 1).

:func:`list_dead_letters` reads that topic on every broker the nameservers route it to, with
``Consumer.PullStream`` from the earliest message kept up to the end seen when the read began,
under the reader group :data:`READER_GROUP` and without committing anything (the group's own
offsets are untouched, and reading twice shows the same). :func:`redrive` sends the matching
messages again to their original topics with a :class:`~apogee.client.Producer`: body, tags,
keys and user properties kept, the brokers' own properties (``REAL_*``, ``RETRY_TOPIC``,
``DLQ_*``, ``ATTEMPTS``, ``DELAY``, ``ORIGIN_MSG_ID``) left behind, and the dead letter's unique
id in ``ORIGIN_MSG_ID`` (so consumers can tell a redriven message from the original). Sends are
paced to a rate. Redrive does not remove anything from the dead-letter topic: running it twice
sends the messages twice.

Both are reached through :meth:`AdminClient.list_dead_letters` and
:meth:`AdminClient.redrive_dead_letters`, and the ``apogee dlq`` command.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from apogee.client._rpc import ChannelPool, NameServerClient
from apogee.client.consumer.rebalance import ReadRoute
from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.client.consumer.retry import (
    PROP_ATTEMPTS,
    PROP_DLQ_ORIGIN_TOPIC,
    PROP_DLQ_REASON,
    PROP_ORIGIN_MSG_ID,
    PROP_RETRY_TOPIC,
    is_internal_property,
)
from apogee.client.groups import check_group_name
from apogee.client.message import Message
from apogee.client.producer.producer import Producer
from apogee.common.clock import SYSTEM_CLOCK, Clock, check_epoch_ms
from apogee.common.errors import ApogeeError, InvalidArgumentError
from apogee.common.topics import dlq_topic
from apogee.v1 import consumer_pb2

log = logging.getLogger(__name__)

__all__ = [
    "READER_GROUP",
    "DeadLetter",
    "DeadLetterFilter",
    "RedriveItem",
    "RedriveResult",
    "list_dead_letters",
    "redrive",
]

#: The group name dead-letter reads are made under (nothing is ever committed for it).
READER_GROUP: Final = "apogee-dlq-reader"
#: The producer group of redriven messages.
REDRIVE_GROUP: Final = "apogee-dlq-redrive"
#: Most dead letters one listing returns.
MAX_LIST: Final = 100_000
#: Messages one pull of the dead-letter topic asks for.
_PULL_BATCH: Final = 256
PREVIEW_CHARS: Final = 60
#: What a broker answers for a queue of the route that it does not have.
_NOT_THERE: Final = frozenset({"UNKNOWN_TOPIC", "INVALID_QUEUE_ID"})


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One message of a group's dead-letter topic."""

    #: the dead letter's unique id (the message id it was consumed under)
    unique_id: str
    #: the topic it was consumed from (``DLQ_ORIGIN_TOPIC``)
    origin_topic: str
    #: how often a consumer of the group tried it
    attempts: int
    #: the consumer's last failure, as it sent the message back
    reason: str
    store_timestamp_ms: int
    keys: tuple[str, ...]
    tags: str
    body: bytes
    #: every property but tags, keys and the unique id, the brokers' own included
    properties: Mapping[str, str]
    broker_name: str
    queue_id: int
    queue_offset: int
    reconsume_times: int
    born_timestamp_ms: int = 0

    @property
    def body_preview(self) -> str:
        """The start of the body as one line of text (undecodable bytes shown as ``\\xNN``)."""
        head = self.body[: PREVIEW_CHARS * 4].replace(b"\\", b"\\\\")
        text = head.decode("utf-8", "backslashreplace")
        text = text.replace("\n", "\\n").replace("\t", "\\t")
        text = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
        return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."

    @property
    def user_properties(self) -> dict[str, str]:
        """The properties a redrive keeps (the brokers' own left out)."""
        return {k: v for k, v in self.properties.items() if not is_internal_property(k)}

    @classmethod
    def from_message(cls, m: ReceivedMessage) -> DeadLetter:
        props = dict(m.properties)
        attempts_text = props.get(PROP_ATTEMPTS, "")
        attempts = int(attempts_text) if attempts_text.isdigit() else m.reconsume_times + 1
        return cls(
            unique_id=m.unique_id,
            origin_topic=props.get(PROP_DLQ_ORIGIN_TOPIC) or props.get(PROP_RETRY_TOPIC, ""),
            attempts=attempts,
            reason=props.get(PROP_DLQ_REASON, ""),
            store_timestamp_ms=m.store_timestamp_ms,
            keys=m.keys,
            tags=m.tags,
            body=m.body,
            properties=props,
            broker_name=m.broker_name,
            queue_id=m.queue_id,
            queue_offset=m.queue_offset,
            reconsume_times=m.reconsume_times,
            born_timestamp_ms=m.born_timestamp_ms,
        )


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    """Which dead letters to take: all of ``key``, ``tag``, ``topic`` (the original topic) and
    ``since_ms`` (stored at or after, epoch ms) that are set must match."""

    key: str | None = None
    tag: str | None = None
    topic: str | None = None
    since_ms: int = 0

    def __post_init__(self) -> None:
        for name in ("key", "tag", "topic"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(
                    field=name, rule=f"must be a non-empty string when given, got {value!r}"
                )
        check_epoch_ms("since_ms", self.since_ms)

    def matches(self, letter: DeadLetter) -> bool:
        return (
            letter.store_timestamp_ms >= self.since_ms
            and (self.key is None or self.key in letter.keys)
            and (self.tag is None or self.tag == letter.tags)
            and (self.topic is None or self.topic == letter.origin_topic)
        )


@dataclass(frozen=True, slots=True)
class RedriveItem:
    """What became of one matching dead letter."""

    old_id: str
    origin_topic: str
    #: the id of the message sent; "" in a dry run or when it failed
    new_id: str = ""
    #: why it was not sent; "" when it was (or in a dry run)
    error: str = ""


@dataclass(frozen=True, slots=True)
class RedriveResult:
    matched: int
    sent: int
    failed: int
    dry_run: bool
    items: tuple[RedriveItem, ...] = field(default=())

    @property
    def redriven(self) -> list[tuple[str, str]]:
        """(old id, new id) of every message sent."""
        return [(i.old_id, i.new_id) for i in self.items if i.new_id]


async def scan(
    pool: ChannelPool,
    namesrv: NameServerClient,
    group: str,
    timeout: float,
    verify_crc: bool = True,
) -> AsyncIterator[DeadLetter]:
    """Every dead letter of ``group``, broker by broker (by name), queue by queue, oldest
    first in each; nothing when the group has no dead-letter topic."""
    topic = dlq_topic(group)
    try:
        route = ReadRoute.from_pb(topic, await namesrv.get_route(topic))
    except ApogeeError as err:
        if err.kind.name == "UNKNOWN_TOPIC":
            return
        raise
    client_id = f"{READER_GROUP}@{os.getpid()}"
    for mq in route.queues:
        address = route.addresses[mq.broker_name]
        what = f"broker {mq.broker_name} ({address})"
        offset = 0
        end: int | None = None
        while end is None or offset < end:
            try:
                answer = await pool.pull(
                    address,
                    consumer_pb2.PullRequest(
                        group=READER_GROUP,
                        topic=topic,
                        queue_id=mq.queue_id,
                        offset=offset,
                        max_messages=_PULL_BATCH,
                        client_id=client_id,
                    ),
                    timeout,
                    what,
                )
            except ApogeeError as err:
                # for a topic no broker has (or had a moment ago), nameservers answer with the
                # route of the brokers that create topics automatically: no such topic or queue
                # there, so no dead letters
                if err.kind.name in _NOT_THERE:
                    break
                raise
            resp = answer.response
            if end is None:
                end = resp.max_offset  # what was there when the read began
            status = resp.status
            if status == consumer_pb2.PULL_FOUND:
                msgs = decode_records(
                    answer.records,
                    resp.broker_name or mq.broker_name,
                    topic,
                    mq.queue_id,
                    offset,
                    verify_crc,
                    start=answer.start,
                    end=answer.end,
                )
                for m in msgs:
                    if m.queue_offset < end:
                        yield DeadLetter.from_message(m)
            elif status in (consumer_pb2.PULL_NO_NEW_MESSAGE, consumer_pb2.PULL_OFFSET_OVERFLOW):
                break
            if resp.next_offset <= offset:
                break  # no progress: never loop on one offset
            offset = resp.next_offset


async def list_dead_letters(
    pool: ChannelPool,
    namesrv: NameServerClient,
    group: str,
    flt: DeadLetterFilter | None = None,
    limit: int = 100,
    timeout: float = 3.0,
) -> list[DeadLetter]:
    """Up to ``limit`` dead letters of ``group`` that match ``flt``, oldest first."""
    check_group_name(group)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIST:
        raise InvalidArgumentError(
            field="limit", rule=f"must be an integer from 1 to {MAX_LIST}, got {limit!r}"
        )
    flt = flt or DeadLetterFilter()
    found: list[DeadLetter] = []
    per_broker: dict[str, int] = {}
    async for letter in scan(pool, namesrv, group, timeout):
        # each broker's queue is in store order: its first `limit` matches are all it can add
        if per_broker.get(letter.broker_name, 0) >= limit or not flt.matches(letter):
            continue
        per_broker[letter.broker_name] = per_broker.get(letter.broker_name, 0) + 1
        found.append(letter)
    found.sort(key=lambda d: (d.store_timestamp_ms, d.broker_name, d.queue_offset))
    return found[:limit]


async def redrive(
    pool: ChannelPool,
    namesrv: NameServerClient,
    group: str,
    flt: DeadLetterFilter | None = None,
    rate: float = 100.0,
    dry_run: bool = False,
    timeout: float = 3.0,
    clock: Clock = SYSTEM_CLOCK,
) -> RedriveResult:
    """Send ``group``'s dead letters that match ``flt`` to their original topics again, at
    most ``rate`` per second; with ``dry_run`` only count and list them."""
    check_group_name(group)
    if (
        not isinstance(rate, int | float)
        or isinstance(rate, bool)
        or not math.isfinite(rate)
        or rate <= 0
    ):
        raise InvalidArgumentError(
            field="rate", rule=f"must be a number of messages per second above 0, got {rate!r}"
        )
    flt = flt or DeadLetterFilter()
    items: list[RedriveItem] = []
    producer: Producer | None = None
    start = clock.monotonic()
    try:
        async for letter in scan(pool, namesrv, group, timeout):
            if not flt.matches(letter):
                continue
            if dry_run:
                items.append(RedriveItem(letter.unique_id, letter.origin_topic))
                continue
            if not letter.origin_topic:
                items.append(
                    RedriveItem(
                        letter.unique_id,
                        "",
                        error=f"has no {PROP_DLQ_ORIGIN_TOPIC} property: its topic is unknown",
                    )
                )
                continue
            wait = start + len(items) / rate - clock.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if producer is None:
                producer = Producer(
                    namesrv.addresses, REDRIVE_GROUP, send_timeout=timeout, security=pool.security
                )
            items.append(await _send_one(producer, letter))
    finally:
        if producer is not None:
            await producer.close()
    failed = sum(1 for i in items if i.error)
    sent = sum(1 for i in items if i.new_id)
    return RedriveResult(len(items), sent, failed, dry_run, tuple(items))


def redriven_message(letter: DeadLetter) -> Message:
    """The message a redrive sends for ``letter``."""
    props = letter.user_properties
    props[PROP_ORIGIN_MSG_ID] = letter.properties.get(PROP_ORIGIN_MSG_ID) or letter.unique_id
    return Message(
        letter.origin_topic, letter.body, tags=letter.tags, keys=letter.keys, properties=props
    )


async def _send_one(producer: Producer, letter: DeadLetter) -> RedriveItem:
    try:
        result = await producer.send(redriven_message(letter))
    except ApogeeError as err:
        log.warning("redriving %s to %s failed: %s", letter.unique_id, letter.origin_topic, err)
        return RedriveItem(letter.unique_id, letter.origin_topic, error=str(err))
    return RedriveItem(letter.unique_id, letter.origin_topic, new_id=result.message_id)


def parse_filters(specs: Sequence[str], since_ms: int = 0) -> DeadLetterFilter:
    """``["key=K", "tag=T", "topic=T"]`` (each at most once) as a filter."""
    found: dict[str, str] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        name = name.strip()
        if not sep or name not in ("key", "tag", "topic") or not value:
            raise InvalidArgumentError(
                field="filter",
                rule=f"{spec!r} must be key=K, tag=T or topic=T (the original topic)",
            )
        if name in found:
            raise InvalidArgumentError(field="filter", rule=f"{name}= is given twice")
        found[name] = value
    return DeadLetterFilter(
        key=found.get("key"), tag=found.get("tag"), topic=found.get("topic"), since_ms=since_ms
    )
