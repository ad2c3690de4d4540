"""Operators' view of transactions: what is pending on every broker, and ending one by hand.

:func:`list_pending` asks every live broker (``apogee.v1.TransactionCheck/ListPending``) for
the transactions it holds undecided: half messages still being checked, and those that ran out
of checks and wait in ``TRANS_CHECK_MAX_TIME_TOPIC``. :func:`resolve` finds a transaction by its
id among them and ends it there (``apogee.v1.Transaction/EndTransaction``, source OPERATOR):
a commit stores the real message once, a rollback drops it. What ``apogee txn`` runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from apogee.client._rpc import ChannelPool, rpc
from apogee.client.message import check_text
from apogee.common.errors import InvalidArgumentError, NotFoundError
from apogee.common.topics import validate_topic
from apogee.v1 import transaction_pb2, transaction_pb2_grpc

__all__ = ["MAX_PENDING", "PendingTransaction", "Resolved", "list_pending", "resolve"]

#: Most pending transactions one broker lists.
MAX_PENDING = 10_000


@dataclass(frozen=True, slots=True)
class PendingTransaction:
    """A transaction no one has decided yet, on one broker."""

    transaction_id: str
    broker_name: str
    producer_group: str
    topic: str
    #: when its half message was first stored (ms since the epoch, the broker's clock)
    first_stored_ms: int
    check_times: int
    #: False: it ran out of checks and waits in TRANS_CHECK_MAX_TIME_TOPIC for an operator
    checking: bool
    keys: str


@dataclass(frozen=True, slots=True)
class Resolved:
    """What ending a transaction by hand did."""

    transaction_id: str
    broker_name: str
    #: "committed", "rolled back", or "already committed" / "already rolled back"
    outcome: str
    #: a commit: where the real message is
    topic: str = ""
    queue_id: int = -1
    queue_offset: int = -1


#: (broker name, address) of a live broker
Broker = tuple[str, str]


async def list_pending(
    pool: ChannelPool,
    brokers: Sequence[Broker],
    timeout: float,
    group: str = "",
    topic: str = "",
    max_entries: int = 100,
) -> list[PendingTransaction]:
    """Every broker's pending transactions of ``group`` and ``topic`` (empty: all), oldest
    first, at most ``max_entries`` in all."""
    if not isinstance(max_entries, int) or not 1 <= max_entries <= MAX_PENDING:
        raise InvalidArgumentError(
            field="max_entries",
            rule=f"must be an integer from 1 to {MAX_PENDING}, got {max_entries!r}",
        )
    if topic:
        validate_topic(topic)
    check_text("group", group)
    request = transaction_pb2.ListPendingRequest(
        producer_group=group, topic=topic, max_entries=max_entries
    )

    async def ask(b: Broker) -> list[PendingTransaction]:
        name, address = b
        stub = transaction_pb2_grpc.TransactionCheckStub(pool.channel(address))
        resp = await rpc(f"broker {name} at {address}", stub.ListPending(request, timeout=timeout))
        return [
            PendingTransaction(
                p.unique_id,
                resp.broker_name or name,
                p.producer_group,
                p.topic,
                p.first_stored_ms,
                p.check_times,
                p.checking,
                p.keys,
            )
            for p in resp.pending
        ]

    found = [p for answer in await asyncio.gather(*(ask(b) for b in brokers)) for p in answer]
    found.sort(key=lambda p: (p.first_stored_ms, p.broker_name, p.transaction_id))
    return found[:max_entries]


async def resolve(
    pool: ChannelPool,
    brokers: Sequence[Broker],
    timeout: float,
    transaction_id: str,
    commit: bool,
    operator: str,
) -> Resolved:
    """End the pending transaction ``transaction_id``: commit it (``commit``) or roll it back.
    :class:`NotFoundError` when no broker holds it pending."""
    if not isinstance(transaction_id, str) or not transaction_id.strip():
        raise InvalidArgumentError(field="transaction_id", rule="must be a non-empty string")
    check_text("operator", operator)
    pending = await list_pending(pool, brokers, timeout, max_entries=MAX_PENDING)
    matches = [p for p in pending if p.transaction_id == transaction_id]
    if not matches:
        raise NotFoundError(
            what=f"transaction {transaction_id}",
            detail="no live broker holds it pending (it may be decided already, or unknown)",
        )
    target = matches[0]
    address = dict(brokers)[target.broker_name]
    stub = transaction_pb2_grpc.TransactionStub(pool.channel(address))
    resp = await rpc(
        f"broker {target.broker_name} at {address}",
        stub.EndTransaction(
            transaction_pb2.EndTransactionRequest(
                producer_group=target.producer_group,
                unique_id=transaction_id,
                half_offset=-1,
                decision=transaction_pb2.COMMIT if commit else transaction_pb2.ROLLBACK,
                source=transaction_pb2.OPERATOR,
                client_id=operator,
            ),
            timeout=timeout,
        ),
    )
    outcome = {
        transaction_pb2.COMMITTED: "committed",
        transaction_pb2.ROLLED_BACK: "rolled back",
    }.get(resp.outcome, "already committed" if commit else "already rolled back")
    return Resolved(
        transaction_id,
        target.broker_name,
        outcome,
        resp.topic,
        resp.queue_id if resp.topic else -1,
        resp.queue_offset if resp.topic else -1,
    )
