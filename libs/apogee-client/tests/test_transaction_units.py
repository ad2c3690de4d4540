"""The transactional producer's parts without a broker: the rules a transactional message
follows (code and sentence, before anything is sent), decisions, the executor wrapper, result
shaping, the half a check listener sees, options, and the rate-limited warning."""

from __future__ import annotations

import asyncio
import logging
import zlib
from typing import Any

import pytest

from apogee.client import (
    EndOutcome,
    Message,
    StoredMessage,
    SyncTransactionProducer,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
    TransactionResult,
)
from apogee.client.producer.transaction import (
    TransactionConfig,
    executor_message,
    validate_transactional,
)
from apogee.client.producer.txn_checks import RateLimitedLog
from apogee.client.producer.txn_model import (
    HalfSent,
    checked_message,
    decision_of,
    end_request,
    half_request,
    run_executor,
    transaction_result,
)
from apogee.client.producer.validation import MessageValidator
from apogee.codec import SYSFLAG_COMPRESSED
from apogee.common.clock import ManualClock
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    InvalidPropertyError,
    InvalidTopicError,
    UnavailableError,
)
from apogee.v1 import common_pb2, transaction_pb2

pytestmark = pytest.mark.unit

LOGGER = "apogee.client.producer.transaction"


def msg(**kw: Any) -> Message:
    fields: dict[str, Any] = {"topic": "Orders", "body": b"x"}
    fields.update(kw)
    return Message(**fields)


def commit(m: TransactionMessage, arg: object) -> TransactionDecision:
    return TransactionDecision.COMMIT


# -- the rules -----------------------------------------------------------------------------------

REFUSED: list[tuple[object, type[ApogeeError], str]] = [
    (
        [msg(), msg()],
        InvalidArgumentError,
        "message: send_in_transaction takes one message, got a list of 2 (a batch cannot be "
        "sent in a transaction)",
    ),
    (
        (msg(),),
        InvalidArgumentError,
        "message: send_in_transaction takes one message, got a tuple of 1 (a batch cannot be "
        "sent in a transaction)",
    ),
    (
        msg(delay_level=3),
        InvalidArgumentError,
        "delay_level: a transactional message cannot be delayed; got level 3, must be 0",
    ),
    (
        msg(deliver_at=1_800_000_000.0),
        InvalidArgumentError,
        "deliver_at: a transactional message cannot be delayed; must be None, got 1800000000.0",
    ),
    (
        msg(properties={"REAL_TOPIC": "Elsewhere"}),
        InvalidPropertyError,
        "property 'REAL_TOPIC': is set by brokers only; use Message.delay_level or "
        "Message.deliver_at for a delayed message",
    ),
    (
        msg(properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "soon"}),
        InvalidPropertyError,
        "property 'CHECK_IMMUNITY_TIME_IN_SECONDS': must be a whole number of seconds from 1 to "
        "86400 (how long after it is stored a half is first checked), got 'soon'",
    ),
    (
        msg(properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "0"}),
        InvalidPropertyError,
        "property 'CHECK_IMMUNITY_TIME_IN_SECONDS': must be a whole number of seconds from 1 to "
        "86400 (how long after it is stored a half is first checked), got '0'",
    ),
    (msg(topic="a b"), InvalidTopicError, "topic 'a b': has a character outside [%|a-zA-Z0-9_-]"),
    (msg(body=b""), InvalidArgumentError, "body: must not be empty"),
    (
        "text",
        InvalidArgumentError,
        "message: must be an apogee.client.Message, got str",
    ),
]


@pytest.mark.parametrize(("message", "kind", "sentence"), REFUSED)
def test_a_message_that_cannot_be_sent_in_a_transaction_is_refused_with_its_rule(
    message: object, kind: type[ApogeeError], sentence: str
) -> None:
    with pytest.raises(kind) as caught:
        validate_transactional(message, MessageValidator())
    assert str(caught.value) == sentence
    assert caught.value.code == "INVALID_ARGUMENT"
    assert not caught.value.retriable


def test_a_good_message_passes_and_keeps_its_check_immunity() -> None:
    m = msg(
        tags="t", keys=("k1", "k2"), properties={"a": "1", "CHECK_IMMUNITY_TIME_IN_SECONDS": "30"}
    )
    assert validate_transactional(m, MessageValidator()) is m


async def test_the_producer_refuses_before_sending_or_connecting() -> None:
    """Nothing listens at the nameserver's address: a refused message never gets that far."""
    async with TransactionProducer("127.0.0.1:9", "txn-group") as producer:
        for message, kind, sentence in REFUSED:
            with pytest.raises(kind) as caught:
                await producer.send_in_transaction(message, commit)  # type: ignore[arg-type]
            assert str(caught.value) == sentence
        with pytest.raises(TypeError, match="executor must be callable, got int"):
            await producer.send_in_transaction(msg(), 5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="closed"):
        await producer.send_in_transaction(msg(), lambda m, a: TransactionDecision.COMMIT)


def test_the_sync_producer_refuses_the_same() -> None:
    with SyncTransactionProducer("127.0.0.1:9", "txn-group") as producer:
        for message, kind, sentence in REFUSED:
            with pytest.raises(kind) as caught:
                producer.send_in_transaction(message, commit)  # type: ignore[arg-type]
            assert str(caught.value) == sentence
    with pytest.raises(RuntimeError, match="closed"):
        producer.send_in_transaction(msg(), lambda m, a: TransactionDecision.COMMIT)


# -- the executor --------------------------------------------------------------------------------


def txn_msg() -> TransactionMessage:
    return executor_message(msg(keys="k"), "TXN1")


def test_the_executor_gets_a_copy_with_the_transaction_id() -> None:
    original = msg(tags="t", keys=("a", "b"), properties={"p": "v"})
    copy = executor_message(original, "ABC")
    assert isinstance(copy, Message)
    assert copy.transaction_id == "ABC"
    assert (copy.topic, copy.body, copy.tags, copy.keys, dict(copy.properties)) == (
        "Orders",
        b"x",
        "t",
        ("a", "b"),
        {"p": "v"},
    )


async def test_a_plain_executor_decides() -> None:
    seen: list[tuple[TransactionMessage, object]] = []

    def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        seen.append((m, arg))
        return TransactionDecision.ROLLBACK

    m = txn_msg()
    assert await run_executor(executor, m, {"order": 1}, 1.0) == (TransactionDecision.ROLLBACK, "")
    assert seen == [(m, {"order": 1})]


async def test_an_async_executor_decides() -> None:
    async def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        await asyncio.sleep(0)
        return TransactionDecision.COMMIT

    assert await run_executor(executor, txn_msg(), None, 1.0) == (TransactionDecision.COMMIT, "")


@pytest.mark.parametrize("is_async", [False, True])
async def test_an_executor_that_raises_counts_as_unknown_and_is_logged(
    is_async: bool, caplog: pytest.LogCaptureFixture
) -> None:
    def plain(m: TransactionMessage, arg: object) -> TransactionDecision:
        raise ValueError("the database is down")

    async def coro(m: TransactionMessage, arg: object) -> TransactionDecision:
        raise ValueError("the database is down")

    caplog.set_level(logging.WARNING, logger=LOGGER)
    decision, why = await run_executor(coro if is_async else plain, txn_msg(), None, 1.0)
    assert decision is TransactionDecision.UNKNOWN
    assert why == "the executor raised ValueError: the database is down"
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "the executor raised ValueError for transaction TXN1; it counts as UNKNOWN (the "
        "broker's checks will ask)"
    )
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)


async def test_an_executor_past_its_timeout_is_cancelled_and_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cancelled = asyncio.Event()

    async def slow(m: TransactionMessage, arg: object) -> TransactionDecision:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return TransactionDecision.COMMIT

    caplog.set_level(logging.WARNING, logger=LOGGER)
    decision, why = await run_executor(slow, txn_msg(), None, 0.05)
    assert (decision, why) == (
        TransactionDecision.UNKNOWN,
        "the executor ran past its timeout of 0.05 s",
    )
    assert cancelled.is_set()
    assert "ran past its 0 s for transaction TXN1" in caplog.text


async def test_an_executors_own_timeout_error_is_a_failure_not_ours() -> None:
    async def raises(m: TransactionMessage, arg: object) -> TransactionDecision:
        raise TimeoutError("the lock wait timed out")

    decision, why = await run_executor(raises, txn_msg(), None, 5.0)
    assert decision is TransactionDecision.UNKNOWN
    assert why == "the executor raised TimeoutError: the lock wait timed out"


@pytest.mark.parametrize("value", [None, "COMMIT", True, 1, transaction_pb2.COMMIT])
async def test_anything_but_a_decision_counts_as_unknown(
    value: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    decision, why = await run_executor(lambda m, a: value, txn_msg(), None, 1.0)  # type: ignore[arg-type,return-value]
    assert decision is TransactionDecision.UNKNOWN
    assert why == f"the executor returned {value!r}, not a TransactionDecision"
    assert why in caplog.text


def test_decision_of_passes_decisions_through() -> None:
    for d in TransactionDecision:
        assert decision_of(d, "x", "id") == (d, "")
    assert [d.as_pb() for d in TransactionDecision] == [
        transaction_pb2.COMMIT,
        transaction_pb2.ROLLBACK,
        transaction_pb2.UNKNOWN,
    ]


# -- the protocol --------------------------------------------------------------------------------


def test_the_half_request_carries_the_message_and_the_chosen_queue() -> None:
    m = msg(body=b"b" * 10_000, tags="t", keys=("k1", "k2"), properties={"a": "1"})
    req = half_request(m, "UID1", "txn-group", 3, 1234, 4096)
    assert req.producer_group == "txn-group"
    pb = req.message
    assert (pb.topic, pb.tags, list(pb.keys), dict(pb.properties)) == (
        "Orders",
        "t",
        ["k1", "k2"],
        {"a": "1"},
    )
    assert (pb.unique_id, pb.queue_id, pb.born_timestamp_ms) == ("UID1", 3, 1234)
    assert (pb.delay_level, pb.deliver_at_ms) == (0, 0)
    assert pb.sys_flag == SYSFLAG_COMPRESSED
    assert zlib.decompress(pb.body) == b"b" * 10_000
    plain = half_request(msg(), "UID2", "g", 0, 1, 4096).message
    assert (plain.body, plain.sys_flag) == (b"x", 0)


def test_the_end_request_names_the_copy_the_source_and_the_client() -> None:
    req = end_request("g", "UID", 17, TransactionDecision.ROLLBACK, transaction_pb2.CHECK, "c@1")
    assert (req.producer_group, req.unique_id, req.half_offset, req.client_id) == (
        "g",
        "UID",
        17,
        "c@1",
    )
    assert (req.decision, req.source) == (transaction_pb2.ROLLBACK, transaction_pb2.CHECK)


HALF = HalfSent(
    executor_message(msg(), "UID"), "UID", "broker-a", "127.0.0.1:1", "Orders", 2, 40, 99
)


def result(
    decision: TransactionDecision,
    end: transaction_pb2.EndTransactionResponse | BaseException | None,
    why: str = "",
) -> TransactionResult:
    return transaction_result(HALF, decision, why, end)


def test_a_committed_result_says_where_the_message_is() -> None:
    r = result(
        TransactionDecision.COMMIT,
        transaction_pb2.EndTransactionResponse(
            outcome=transaction_pb2.COMMITTED, topic="Orders", queue_id=2, queue_offset=7
        ),
    )
    assert r == TransactionResult(
        message_id="UID",
        decision=TransactionDecision.COMMIT,
        end_outcome=EndOutcome.COMMITTED,
        topic="Orders",
        queue_id=2,
        broker_name="broker-a",
        half_offset=40,
        store_timestamp_ms=99,
        queue_offset=7,
    )
    assert r.transaction_id == r.unique_id == "UID"
    assert r.committed
    assert not r.pending


def test_rolled_back_already_done_unknown_and_failed_results() -> None:
    rolled = result(
        TransactionDecision.ROLLBACK,
        transaction_pb2.EndTransactionResponse(outcome=transaction_pb2.ROLLED_BACK),
    )
    assert (rolled.end_outcome, rolled.queue_offset, rolled.committed, rolled.pending) == (
        EndOutcome.ROLLED_BACK,
        -1,
        False,
        False,
    )
    again = result(
        TransactionDecision.COMMIT,
        transaction_pb2.EndTransactionResponse(
            outcome=transaction_pb2.ALREADY_DONE, topic="Orders", queue_id=2, queue_offset=3
        ),
    )
    assert (again.end_outcome, again.queue_offset, again.committed) == (
        EndOutcome.ALREADY_DONE,
        3,
        True,
    )
    unknown = result(TransactionDecision.UNKNOWN, None, "the executor raised ValueError: x")
    assert (unknown.end_outcome, unknown.pending, unknown.committed) == (
        EndOutcome.NOT_ENDED,
        True,
        False,
    )
    assert unknown.executor_error == "the executor raised ValueError: x"
    failed = result(
        TransactionDecision.COMMIT,
        UnavailableError(what="broker broker-a at 127.0.0.1:1", detail="connection refused"),
    )
    assert (failed.end_outcome, failed.pending, failed.committed) == (
        EndOutcome.FAILED,
        True,
        False,
    )
    assert failed.end_error == "broker broker-a at 127.0.0.1:1 is unavailable: connection refused"
    odd = result(TransactionDecision.COMMIT, transaction_pb2.EndTransactionResponse())
    assert odd.end_outcome is EndOutcome.FAILED
    assert odd.end_error == "the broker answered outcome 0, which this client does not know"


def test_the_half_sent_looks_like_a_delayed_send_to_hooks() -> None:
    sent = HALF.send_result()
    assert (sent.message_id, sent.topic, sent.queue_id, sent.queue_offset, sent.broker_name) == (
        "UID",
        "Orders",
        2,
        -1,
        "broker-a",
    )


def test_a_check_shows_the_half_under_its_real_topic_with_the_users_properties_only() -> None:
    body = b"payload " * 1000
    half = common_pb2.StoredMessage(
        topic="RMQ_SYS_TRANS_HALF_TOPIC",
        queue_id=0,
        queue_offset=57,
        body=zlib.compress(body),
        sys_flag=SYSFLAG_COMPRESSED,
        tags="created",
        keys=["o-1"],
        unique_id="TXNID",
        properties={
            "REAL_TOPIC": "Orders",
            "REAL_QID": "3",
            "PGROUP": "txn-group",
            "TRAN_MSG": "true",
            "TRANSACTION_CHECK_TIMES": "2",
            "TRAN_FIRST_STORED": "1700000000000",
            "UNIQ_KEY": "TXNID",
            "TAGS": "created",
            "a": "1",
            "CHECK_IMMUNITY_TIME_IN_SECONDS": "5",
        },
        born_timestamp_ms=5,
        store_timestamp_ms=6,
    )
    check = transaction_pb2.TransactionCheckRequest(
        half=half, unique_id="TXNID", half_offset=57, check_times=2, topic="Orders"
    )
    m = checked_message(check, "broker-a")
    assert isinstance(m, TransactionCheckMessage)
    assert isinstance(m, StoredMessage)
    assert (m.transaction_id, m.check_times) == ("TXNID", 2)
    assert (m.topic, m.queue_id, m.queue_offset, m.unique_id, m.broker_name) == (
        "Orders",
        3,
        -1,
        "TXNID",
        "broker-a",
    )
    assert (m.body, m.tags, m.keys) == (body, "created", ("o-1",))
    assert m.properties == {"a": "1"}
    # without the check's topic, REAL_TOPIC says it
    bare = transaction_pb2.TransactionCheckRequest(half=half, unique_id="TXNID", half_offset=57)
    assert checked_message(bare, "broker-a").topic == "Orders"


# -- options -------------------------------------------------------------------------------------


def test_transaction_options_are_split_from_the_producers() -> None:
    txn, rest = TransactionConfig.split(
        {"check_timeout": 2.0, "topics": "Orders", "retries": 1, "client_id": "me@1"}
    )
    assert (txn.check_timeout, txn.topics, txn.client_id) == (2.0, ("Orders",), "me@1")
    assert rest == {"retries": 1}
    default = TransactionConfig()
    assert (default.max_concurrent_checks, default.heartbeat_interval) == (16, 30.0)
    assert "@" in default.client_id


@pytest.mark.parametrize(
    ("options", "sentence"),
    [
        ({"check_timeout": 0}, "check_timeout: must be a number above 0, got 0"),
        (
            {"max_concurrent_checks": 0},
            "max_concurrent_checks: must be an integer of at least 1, got 0",
        ),
        ({"heartbeat_interval": -1}, "heartbeat_interval: must be a number above 0, got -1"),
        (
            {"client_id": "a b"},
            "client_id: 'a b' must be 1 to 255 characters from [a-zA-Z0-9_.@:%|-]",
        ),
        ({"topics": 5}, "topics: must be a sequence of topic names, got 5"),
    ],
)
def test_bad_transaction_options_are_refused(options: dict[str, Any], sentence: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        TransactionProducer("127.0.0.1:9", "g", **options)
    assert str(caught.value) == sentence


def test_unknown_options_and_listeners_that_are_not_callable_are_refused() -> None:
    with pytest.raises(TypeError, match="unknown producer option"):
        TransactionProducer("127.0.0.1:9", "g", no_such_option=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="check_listener must be callable or None, got str"):
        TransactionProducer("127.0.0.1:9", "g", "listener")  # type: ignore[arg-type]


# -- rate-limited warnings -----------------------------------------------------------------------


def test_a_rate_limited_warning_says_how_many_it_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    clock = ManualClock()
    limited = RateLimitedLog(clock, every=60.0)
    assert limited.warning("no listener for %s", "a")
    assert not limited.warning("no listener for %s", "b")
    assert not limited.warning("no listener for %s", "c")
    clock.advance(61)
    assert limited.warning("no listener for %s", "d")
    assert [r.getMessage() for r in caplog.records] == [
        "no listener for a",
        "no listener for d (2 more like it in the last 60 s)",
    ]
