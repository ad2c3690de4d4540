"""SendHalf: a transaction's message stored as a half, until its end.

:meth:`HalfIntake.send_half` checks a message as a send does (:mod:`apogee_broker.core.send.
checks`: topic known, writable and not a system topic; body, size, flags, compression,
properties, unique id; a half is a TRANSACTION message, which only TRANSACTION and MIXED topics
accept), refuses what would delay it, and stores it under
``RMQ_SYS_TRANS_HALF_TOPIC`` queue 0 with its real topic and queue (the broker's turn over the
topic's write queues when the producer gave -1; the half copy is drawn in :mod:`.records`). The
send is acknowledged once stored as any send is (after fsync with ``flush_mode = sync``).
:meth:`HalfIntake.send_halves` does the same for several, stored as one append.

Refusals (each names the field and the rule):

==========================  ===================  ==============================================
check                       error kind           example sentence
==========================  ===================  ==============================================
producer group              INVALID_ARGUMENT     producer_group: must not be empty
no delay                    INVALID_ARGUMENT     message.delay_level: is 3; a transactional ...
no delay by property        INVALID_PROPERTY     property 'DELAY': is set by brokers only; a ...
immunity                    INVALID_PROPERTY     property 'CHECK_IMMUNITY_TIME_IN_SECONDS': ...
what a send checks          (as a send)          topic 'RMQ_SYS_TRANS_HALF_TOPIC': is a system...
==========================  ===================  ==============================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from apogee.codec import (
    PROP_CHECK_IMMUNITY,
    PROP_DELAY,
    PROP_DELIVER_AT,
    SYSFLAG_COMPRESSED,
    Message,
    check_immunity_rule,
)
from apogee.common.errors import ApogeeError, InvalidArgumentError, InvalidPropertyError
from apogee.common.topics import MessageType
from apogee_broker.core.checks import validate_group
from apogee_broker.core.send.checks import (
    HALF_WHY,
    SendChecks,
    check_client_properties,
    check_unique_id,
)
from apogee_broker.core.send.service import Outgoing
from apogee_broker.core.storage.writer import NOT_STORED, SendOutcome
from apogee_broker.core.topics import TopicConfig
from apogee_broker.core.txn.ledger import TransactionLedger
from apogee_broker.core.txn.records import stored_copy, to_half

_DELAYED: Final = (
    "a transactional message cannot be delayed: it is delivered when committed (send it "
    "without delay_level, deliver_at_ms or the DELAY / DELIVER_AT_MS properties)"
)


@dataclass(frozen=True, slots=True)
class HalfSent:
    unique_id: str
    half_offset: int
    store_timestamp: int
    #: the real topic's queue the message goes to when committed
    queue_id: int


class HalfIntake:
    """SendHalf and SendHalves at one broker; methods run on the loop."""

    def __init__(self, ledger: TransactionLedger, checks: SendChecks) -> None:
        self.ledger = ledger
        self.writer = ledger.writer
        self.checks = checks
        self._turns: dict[str, int] = {}

    async def send_half(
        self,
        producer_group: str,
        msg: Message,
        delay_level: int = 0,
        deliver_at_ms: int = 0,
        host: str = "",
    ) -> HalfSent:
        """Check ``msg`` (``queue_id`` -1: the broker picks) and store it as a half."""
        validate_group(producer_group, "producer_group")
        queue_id = self._prepare_half("message", producer_group, msg, delay_level, deliver_at_ms)
        self.writer.fill_defaults([msg], host)
        results, err = await self.writer.append_all([msg])
        if err is not None:
            raise err
        r = results[0]
        self.ledger.recent.add(stored_copy(msg, r))
        return HalfSent(r.unique_id, r.queue_offset, r.store_timestamp, queue_id)

    async def send_halves(
        self, producer_group: str, items: Sequence[Outgoing], host: str = ""
    ) -> list[HalfSent | ApogeeError]:
        """:meth:`send_half` of each of ``items`` (SendHalves): one outcome per item, in order;
        those that pass their checks are stored as one append. Raises only for what is wrong
        with the request as a whole (its group, its size)."""
        validate_group(producer_group, "producer_group")
        count = len(items)
        self.checks.check_request_size(count, "messages", "half messages")
        out: list[HalfSent | ApogeeError | None] = [None] * count
        good: list[int] = []
        batch: list[Message] = []
        queues: dict[int, int] = {}
        for i, (msg, delay, at) in enumerate(items):
            try:
                queues[i] = self._prepare_half(i, producer_group, msg, delay, at)
            except ApogeeError as err:
                out[i] = err
                continue
            good.append(i)
            batch.append(msg)
        if batch:
            self.writer.fill_defaults(batch, host)
            stored: list[SendOutcome | None] = [None] * count
            await self.writer.store_batch(good, batch, stored)
            for i in good:
                o = stored[i]
                if o is None or o.result is None:
                    out[i] = o.error if o is not None and o.error is not None else NOT_STORED
                elif o.error is not None:
                    out[i] = o.error  # stored, durability not confirmed: as send_half raises
                else:
                    r = o.result
                    self.ledger.recent.add(stored_copy(items[i].message, r))
                    out[i] = HalfSent(r.unique_id, r.queue_offset, r.store_timestamp, queues[i])
        return [o if o is not None else NOT_STORED for o in out]

    def _prepare_half(
        self, i: int | str, producer_group: str, msg: Message, delay_level: int, deliver_at_ms: int
    ) -> int:
        """Every check of half ``i`` (``"message"``, or its index in ``messages``); then make
        ``msg`` the half: its real topic and queue in properties (the broker's turn over the
        topic's queues when it asked for -1). Returns that real queue."""
        where = i if isinstance(i, str) else f"messages[{i}]"
        if delay_level:
            raise InvalidArgumentError(
                field=f"{where}.delay_level", rule=f"is {delay_level}; {_DELAYED}"
            )
        if deliver_at_ms:
            raise InvalidArgumentError(
                field=f"{where}.deliver_at_ms", rule=f"is {deliver_at_ms}; {_DELAYED}"
            )
        props = msg.properties or {}
        for name in (PROP_DELAY, PROP_DELIVER_AT):
            if name in props:
                raise InvalidPropertyError(field=name, rule=f"is set by brokers only; {_DELAYED}")
        asked = msg.queue_id
        topic = self.checks.check(
            i, msg.topic, len(msg.body), msg.sys_flag, 0 if asked == -1 else asked
        )
        self.checks.check_type(i, topic, MessageType.TRANSACTION, HALF_WHY)
        if msg.sys_flag & SYSFLAG_COMPRESSED:
            self.checks.check_compressed(i, msg.body)
        check_client_properties(props)
        immunity = props.get(PROP_CHECK_IMMUNITY)
        if immunity is not None:
            rule = check_immunity_rule(immunity)
            if rule is not None:
                raise InvalidPropertyError(field=PROP_CHECK_IMMUNITY, rule=rule)
        if msg.unique_id:
            check_unique_id(msg.unique_id)
        queue_id = self._next_queue(topic) if asked == -1 else asked
        to_half(msg, producer_group, queue_id)
        return queue_id

    def _next_queue(self, topic: TopicConfig) -> int:
        turn = self._turns.get(topic.name, -1) + 1
        self._turns[topic.name] = turn
        return turn % topic.write_queues
