"""The bad transactional sends of :mod:`e2e.test_transactions`, each with the error it gets: its
kind, its status code and its sentence (the start of it where the rest names a value of the
run). Through the SDK (:data:`SDK_CASES`), which refuses them before anything is sent, and as
raw ``apogee.v1.Transaction/SendHalf`` requests (:data:`RAW_CASES`), which the broker refuses
itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import grpc

from apogee.client import Message
from apogee.v1 import common_pb2, transaction_pb2

#: The topic of the bad sends (created by the test); the one below is never created.
TOPIC: Final = "TxnBadInputs"
NO_SUCH_TOPIC: Final = "TxnNoSuchTopic"
IMMUNITY: Final = "CHECK_IMMUNITY_TIME_IN_SECONDS"
_BROKERS_ONLY_SDK: Final = (
    "is set by brokers only; use Message.delay_level or Message.deliver_at for a delayed message"
)
_BROKERS_ONLY_RAW: Final = (
    "is set by brokers only; use the message's delay_level or deliver_at_ms for a delayed message"
)
_NOT_DELAYED: Final = (
    "a transactional message cannot be delayed: it is delivered when committed (send it "
    "without delay_level, deliver_at_ms or the DELAY / DELIVER_AT_MS properties)"
)
_SYSTEM: Final = "is a system topic; clients cannot send to it"


def immunity_rule(value: str) -> str:
    return (
        f"property {IMMUNITY!r}: must be a whole number of seconds from 1 to 86400 (how long "
        f"after it is stored a half is first checked), got {value!r}"
    )


@dataclass(frozen=True)
class SdkCase:
    name: str
    #: what is handed to ``send_in_transaction``: a message, or a batch
    message: object
    kind: str
    code: str
    says: str


@dataclass(frozen=True)
class RawCase:
    name: str
    request: transaction_pb2.SendHalfRequest
    kind: str
    code: grpc.StatusCode
    says: str


SDK_CASES: Final = [
    SdkCase(
        "a batch",
        [Message(TOPIC, b"a"), Message(TOPIC, b"b")],
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "message: send_in_transaction takes one message, got a list of 2 (a batch cannot be "
        "sent in a transaction)",
    ),
    SdkCase(
        "a delay level",
        Message(TOPIC, b"x", delay_level=3),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "delay_level: a transactional message cannot be delayed; got level 3, must be 0",
    ),
    SdkCase(
        "a delivery time",
        Message(TOPIC, b"x", deliver_at=4_000_000_000.0),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "deliver_at: a transactional message cannot be delayed; must be None, got 4000000000.0",
    ),
    *[
        SdkCase(
            f"the broker's property {name}",
            Message(TOPIC, b"x", properties={name: value}),
            "INVALID_PROPERTY",
            "INVALID_ARGUMENT",
            f"property {name!r}: {_BROKERS_ONLY_SDK}",
        )
        for name, value in (
            ("TRAN_MSG", "true"),
            ("PGROUP", "someone-else"),
            ("REAL_TOPIC", "Elsewhere"),
            ("TRANSACTION_CHECK_TIMES", "99"),
            ("TRAN_FIRST_STORED", "0"),
        )
    ],
    *[
        SdkCase(
            f"{IMMUNITY}={value!r}",
            Message(TOPIC, b"x", properties={IMMUNITY: value}),
            "INVALID_PROPERTY",
            "INVALID_ARGUMENT",
            immunity_rule(value),
        )
        for value in ("0", "86401", "1.5", "-3", "soon", "")
    ],
    SdkCase(
        "an unknown topic",
        Message(NO_SUCH_TOPIC, b"x"),
        "UNKNOWN_TOPIC",
        "NOT_FOUND",
        f"topic {NO_SUCH_TOPIC!r} has no route: no live broker has it and none creates topics "
        "automatically",
    ),
    *[
        SdkCase(
            f"the system topic {topic}",
            Message(topic, b"x"),
            "PERMISSION_DENIED",
            "PERMISSION_DENIED",
            f"topic {topic!r}: {_SYSTEM}",
        )
        for topic in ("RMQ_SYS_TRANS_HALF_TOPIC", "TRANS_CHECK_MAX_TIME_TOPIC")
    ],
]


def raw_half(group: str = "txn-e2e-raw", **fields: Any) -> transaction_pb2.SendHalfRequest:
    """A SendHalf request of a message of :data:`TOPIC`, with ``fields`` changed."""
    message = {"topic": TOPIC, "body": b"raw", "queue_id": -1, **fields}
    return transaction_pb2.SendHalfRequest(
        producer_group=group, message=common_pb2.Message(**message)
    )


INVALID = grpc.StatusCode.INVALID_ARGUMENT
RAW_CASES: Final = [
    RawCase(
        "a delay level",
        raw_half(delay_level=3),
        "INVALID_ARGUMENT",
        INVALID,
        f"message.delay_level: is 3; {_NOT_DELAYED}",
    ),
    RawCase(
        "a delivery time",
        raw_half(deliver_at_ms=4_000_000_000_000),
        "INVALID_ARGUMENT",
        INVALID,
        f"message.deliver_at_ms: is 4000000000000; {_NOT_DELAYED}",
    ),
    RawCase(
        "DELAY among the properties",
        raw_half(properties={"DELAY": "3"}),
        "INVALID_PROPERTY",
        INVALID,
        f"property 'DELAY': is set by brokers only; {_NOT_DELAYED}",
    ),
    *[
        RawCase(
            f"the broker's property {name}",
            raw_half(properties={name: "x"}),
            "INVALID_PROPERTY",
            INVALID,
            f"property {name!r}: {_BROKERS_ONLY_RAW}",
        )
        for name in ("TRAN_MSG", "PGROUP", "TRANSACTION_CHECK_TIMES")
    ],
    RawCase(
        f"{IMMUNITY}='0'",
        raw_half(properties={IMMUNITY: "0"}),
        "INVALID_PROPERTY",
        INVALID,
        immunity_rule("0"),
    ),
    RawCase(
        "an unknown topic",
        raw_half(topic=NO_SUCH_TOPIC),
        "UNKNOWN_TOPIC",
        grpc.StatusCode.NOT_FOUND,
        f"topic {NO_SUCH_TOPIC!r} does not exist on broker ",
    ),
    RawCase(
        "the half topic",
        raw_half(topic="RMQ_SYS_TRANS_HALF_TOPIC"),
        "PERMISSION_DENIED",
        grpc.StatusCode.PERMISSION_DENIED,
        f"topic 'RMQ_SYS_TRANS_HALF_TOPIC': {_SYSTEM}",
    ),
    RawCase(
        "no producer group",
        raw_half(group=""),
        "INVALID_ARGUMENT",
        INVALID,
        "producer_group: must not be empty",
    ),
    RawCase(
        "a producer group that is no name",
        raw_half(group="no spaces"),
        "INVALID_ARGUMENT",
        INVALID,
        "producer_group: ",
    ),
]
