"""Apogee's Python SDK.

Asyncio first, with synchronous twins for scripts::

    from apogee.client import Message, Producer

    async with Producer("127.0.0.1:9876", group="orders") as producer:
        result = await producer.send(Message("Orders", b"{...}", tags="created", keys="o-17"))

Concurrent and asynchronous sends are gathered into one request per broker (see
:mod:`apogee.client.producer.accumulator`); a lone send goes out at once. Transactional messages
go through :class:`TransactionProducer` (see :mod:`apogee.client.producer.transaction`).
"""

from apogee.client.admin import (
    AdminClient,
    BrokerInfo,
    BrokerTopicStatus,
    MessageType,
    MessageWindow,
    Perm,
    QueueStatus,
    TopicConfig,
    TopicListing,
    TopicStatus,
    TopicUpdate,
)
from apogee.client.consumer.allocate import AllocateStrategy
from apogee.client.consumer.config import ConsumeFrom, ConsumeMode, ConsumerConfig, ConsumerOptions
from apogee.client.consumer.pull import PullConsumer
from apogee.client.consumer.push import ConsumeResult, PushConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.retry import SendBackOutcome
from apogee.client.consumer.sync import SyncPullConsumer, SyncPushConsumer
from apogee.client.dlq import DeadLetter, RedriveItem, RedriveResult
from apogee.client.groups import GroupDescription, GroupSummary, OfficialClientInfo, QueueLag
from apogee.client.message import Message, SendResult, SendStatus, StoredMessage
from apogee.client.producer.config import ProducerConfig, ProducerOptions, SendHook
from apogee.client.producer.delivery import SendCallback
from apogee.client.producer.producer import Producer, ProducerStats
from apogee.client.producer.routes import MessageQueue
from apogee.client.producer.transaction import TransactionProducer
from apogee.client.producer.txn_model import (
    EndOutcome,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionResult,
)
from apogee.client.reader import QueueBounds, QueueReader, ReadBatch
from apogee.client.sync import SyncAdminClient, SyncProducer, SyncTransactionProducer

__all__ = [
    "AdminClient",
    "AllocateStrategy",
    "BrokerInfo",
    "BrokerTopicStatus",
    "ConsumeFrom",
    "ConsumeMode",
    "ConsumeResult",
    "ConsumerConfig",
    "ConsumerOptions",
    "DeadLetter",
    "EndOutcome",
    "GroupDescription",
    "GroupSummary",
    "Message",
    "MessageQueue",
    "MessageType",
    "MessageWindow",
    "OfficialClientInfo",
    "Perm",
    "Producer",
    "ProducerConfig",
    "ProducerOptions",
    "ProducerStats",
    "PullConsumer",
    "PushConsumer",
    "QueueBounds",
    "QueueLag",
    "QueueReader",
    "QueueStatus",
    "ReadBatch",
    "ReceivedMessage",
    "RedriveItem",
    "RedriveResult",
    "SendBackOutcome",
    "SendCallback",
    "SendHook",
    "SendResult",
    "SendStatus",
    "StoredMessage",
    "SyncAdminClient",
    "SyncProducer",
    "SyncPullConsumer",
    "SyncPushConsumer",
    "SyncTransactionProducer",
    "TopicConfig",
    "TopicListing",
    "TopicStatus",
    "TopicUpdate",
    "TransactionCheckMessage",
    "TransactionDecision",
    "TransactionMessage",
    "TransactionProducer",
    "TransactionResult",
]
