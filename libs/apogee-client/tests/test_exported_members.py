"""The public surface of apogee.client, pinned: adding or removing a name is a decision."""

from __future__ import annotations

import pytest

import apogee.client

pytestmark = pytest.mark.unit

EXPECTED = [
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


def test_all_is_pinned() -> None:
    assert apogee.client.__all__ == EXPECTED


#: Exported classes defined once for the SDK, the brokers and the nameservers, in the small
#: library they all install.
SHARED = {
    "MessageType": "apogee.common.topics",
    "Perm": "apogee.common.topics",
    "TopicConfig": "apogee.common.topics",
}


def test_every_exported_class_belongs_to_the_sdk() -> None:
    for name in apogee.client.__all__:
        member = getattr(apogee.client, name)  # raises if the name is missing
        if isinstance(member, type):
            home = SHARED.get(name, "apogee.client.")
            assert member.__module__.startswith(home), (name, member.__module__)
