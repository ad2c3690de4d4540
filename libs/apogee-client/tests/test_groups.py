"""Group administration without a cluster: merging what several brokers say, argument checks,
and how the CLI prints a group (unknown lag is "unknown", never a number)."""

from __future__ import annotations

import io
from typing import Any

import pytest

from apogee.cli.groups import print_description
from apogee.cli.main import main
from apogee.client.admin import AdminClient, GroupDescription, OfficialClientInfo, QueueLag
from apogee.client.groups import merge_descriptions, merge_group_lists
from apogee.common.errors import InvalidArgumentError, InvalidTopicError
from apogee.v1 import consumer_pb2 as pb

pytestmark = pytest.mark.unit


def member(client_id: str, beat: int, *subs: tuple[str, str]) -> pb.GroupMember:
    return pb.GroupMember(
        client_id=client_id,
        host="10.0.0.9:5000",
        mode=pb.CLUSTERING,
        subscriptions=[pb.Subscription(topic=t, tag_expression=e) for t, e in subs],
        last_heartbeat_ms=beat,
    )


def test_group_lists_merge_over_brokers() -> None:
    a = pb.ListGroupsResponse(
        groups=[
            pb.GroupSummary(group="orders", members=2, mode=pb.CLUSTERING, topics=["Orders"]),
            pb.GroupSummary(group="audit", members=0, topics=["Audit"]),
        ]
    )
    b = pb.ListGroupsResponse(
        groups=[pb.GroupSummary(group="orders", members=3, topics=["Refunds", "Orders"])]
    )
    got = merge_group_lists([("broker-a", a), ("broker-b", b)])
    assert [(g.group, g.members, g.mode, g.topics, g.brokers) for g in got] == [
        ("audit", 0, "unknown", ("Audit",), ("broker-a",)),
        ("orders", 3, "clustering", ("Orders", "Refunds"), ("broker-a", "broker-b")),
    ]


def test_descriptions_merge_members_and_keep_unknown_as_none() -> None:
    a = pb.DescribeGroupResponse(
        group="orders",
        broker_name="broker-a",
        members=[member("c1", 100, ("Orders", "*")), member("c2", 50, ("Orders", "*"))],
        queues=[
            pb.QueueLag(
                topic="Orders",
                queue_id=1,
                broker_offset=10,
                consumer_offset=4,
                lag_messages=6,
                lag_ms=2500,
                locked_by="c1",
            ),
            pb.QueueLag(
                topic="Orders",
                queue_id=0,
                broker_offset=3,
                consumer_offset=-1,
                lag_messages=-1,
                lag_ms=-1,
            ),
        ],
        warnings=["members declare different subscriptions"],
    )
    b = pb.DescribeGroupResponse(
        group="orders",
        broker_name="broker-b",
        members=[member("c1", 120, ("Orders", "TagA"))],
        queues=[
            pb.QueueLag(
                topic="Orders",
                queue_id=0,
                broker_offset=7,
                consumer_offset=7,
                lag_messages=0,
                lag_ms=0,
            )
        ],
        warnings=["members declare different subscriptions"],
    )
    d = merge_descriptions("orders", [a, b], ["broker broker-c did not answer: down"])
    assert [(m.client_id, m.last_heartbeat_ms, m.brokers) for m in d.members] == [
        ("c1", 120, ("broker-a", "broker-b")),
        ("c2", 50, ("broker-a",)),
    ]
    assert [(s.topic, s.tag_expression) for s in d.members[0].subscriptions] == [
        ("Orders", "*"),
        ("Orders", "TagA"),
    ]
    assert [(q.broker_name, q.queue_id) for q in d.queues] == [
        ("broker-a", 0),
        ("broker-a", 1),
        ("broker-b", 0),
    ]
    unknown, known, caught_up = d.queues
    assert (unknown.consumer_offset, unknown.lag_messages, unknown.lag_seconds) == (
        None,
        None,
        None,
    )
    assert (known.lag_messages, known.lag_seconds, known.locked_by) == (6, 2.5, "c1")
    assert (caught_up.lag_messages, caught_up.lag_seconds, caught_up.locked_by) == (0, 0.0, None)
    assert d.lag_messages is None  # one queue is unknown: no made-up total
    assert d.lag_seconds is None
    assert d.warnings == (
        "broker-a, broker-b: members declare different subscriptions",
        "member c1 declares different subscriptions to different brokers",
        "broker broker-c did not answer: down",
    )


def test_describe_prints_unknown_lag_as_unknown() -> None:
    d = GroupDescription(
        group="orders",
        members=(),
        queues=(
            QueueLag("broker-a", "Orders", 0, 3, None, None, None, None),
            QueueLag("broker-a", "Orders", 1, 10, 4, 6, 2.5, "c1"),
        ),
        warnings=("broker broker-b did not answer: unavailable",),
    )
    out = io.StringIO()
    print_description(d, out)
    text = out.getvalue()
    lines = text.splitlines()
    assert (
        lines[0]
        == "group orders: 0 members, 2 queues, lag at least 6 messages (1 of the queues unknown)"
    )
    assert "no member online" in lines
    header = next(line for line in lines if line.startswith("TOPIC"))
    assert header.split() == [
        "TOPIC",
        "BROKER",
        "QUEUE",
        "BROKER",
        "OFFSET",
        "CONSUMER",
        "OFFSET",
        "LAG",
        "LAG",
        "(S)",
        "LOCKED",
        "BY",
    ]
    rows = [line.split() for line in lines if line.startswith("Orders")]
    assert rows == [
        ["Orders", "broker-a", "0", "3", "none", "unknown", "unknown", "-"],
        ["Orders", "broker-a", "1", "10", "4", "6", "2.5", "c1"],
    ]
    assert lines[-1] == "warning: broker broker-b did not answer: unavailable"
    assert "-1" not in text


def official(client_id: str, language: str = "JAVA") -> pb.OfficialClient:
    return pb.OfficialClient(
        client_id=client_id,
        language=language,
        version="5.0.7",
        client_type="PUSH_CONSUMER",
        host="10.0.0.7",
    )


def test_descriptions_merge_pop_consumption_clients_and_in_flight() -> None:
    a = pb.DescribeGroupResponse(
        group="pay",
        broker_name="broker-a",
        consumption="POP",
        clients=[official("c2", "GOLANG"), official("c1")],
        queues=[
            pb.QueueLag(
                topic="Pay",
                queue_id=0,
                broker_offset=9,
                consumer_offset=4,
                lag_messages=5,
                lag_ms=1000,
                in_flight=3,
                invisible=2,
            )
        ],
    )
    b = pb.DescribeGroupResponse(
        group="pay",
        broker_name="broker-b",
        consumption="OFFSETS",
        clients=[official("c1")],
        queues=[
            pb.QueueLag(topic="Pay", queue_id=0, broker_offset=2, consumer_offset=2, lag_messages=0)
        ],
    )
    d = merge_descriptions("pay", [b, a], [])
    assert d.consumption == "POP"  # any broker saying POP
    assert d.clients == (
        OfficialClientInfo("c1", "JAVA", "5.0.7", "PUSH_CONSUMER", "10.0.0.7", "broker-a"),
        OfficialClientInfo("c1", "JAVA", "5.0.7", "PUSH_CONSUMER", "10.0.0.7", "broker-b"),
        OfficialClientInfo("c2", "GOLANG", "5.0.7", "PUSH_CONSUMER", "10.0.0.7", "broker-a"),
    )
    assert [(q.broker_name, q.in_flight, q.invisible) for q in d.queues] == [
        ("broker-a", 3, 2),
        ("broker-b", 0, 0),
    ]
    assert (d.in_flight, d.invisible) == (3, 2)
    assert d.members == ()
    assert d.warnings == ()


def test_consumption_is_pop_then_offsets_then_unknown() -> None:
    def merged(*kinds: str) -> str:
        answers = [
            pb.DescribeGroupResponse(group="g", broker_name=f"b{i}", consumption=k)
            for i, k in enumerate(kinds)
        ]
        return merge_descriptions("g", answers, []).consumption

    assert merged("", "OFFSETS", "POP") == "POP"
    assert merged("OFFSETS", "") == "OFFSETS"
    assert merged("", "") == ""


def pop_description(**fields: Any) -> GroupDescription:
    values: dict[str, Any] = {
        "group": "pay",
        "members": (),
        "queues": (
            QueueLag("broker-a", "Pay", 0, 9, 4, 5, 1.0, None, in_flight=3, invisible=2),
            QueueLag("broker-b", "Pay", 0, 2, 2, 0, 0.0, None),
        ),
        "warnings": (),
        "consumption": "POP",
        "clients": (
            OfficialClientInfo("c1@1", "JAVA", "5.0.7", "PUSH_CONSUMER", "10.0.0.7", "broker-a"),
            OfficialClientInfo("c1@1", "JAVA", "5.0.7", "PUSH_CONSUMER", "10.0.0.7", "broker-b"),
            OfficialClientInfo("c2@1", "GOLANG", "", "SIMPLE_CONSUMER", "", "broker-a"),
        ),
    }
    return GroupDescription(**{**values, **fields})


def test_describe_prints_a_pop_group_as_the_rocketmq_dashboard_does() -> None:
    out = io.StringIO()
    print_description(pop_description(), out)
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "group pay: 2 official clients, 2 queues, lag 5 messages, 3 in flight (2 invisible)"
    )
    assert lines[1] == "consumption: POP"
    assert "no member online" not in lines
    start = lines.index("official clients:")
    assert lines[start + 1].split() == [
        "CLIENT", "ID", "LANGUAGE", "VERSION", "TYPE", "HOST", "BROKER",
    ]  # fmt: skip
    assert [line.split() for line in lines[start + 2 : start + 5]] == [
        ["c1@1", "JAVA", "5.0.7", "PUSH_CONSUMER", "10.0.0.7", "broker-a"],
        ["c1@1", "JAVA", "5.0.7", "PUSH_CONSUMER", "10.0.0.7", "broker-b"],
        ["c2@1", "GOLANG", "-", "SIMPLE_CONSUMER", "-", "broker-a"],
    ]
    header = next(line for line in lines if line.startswith("TOPIC"))
    assert "IN FLIGHT" in header
    assert header.index("INVISIBLE") < header.index("LOCKED BY")
    rows = [line.split() for line in lines if line.startswith("Pay")]
    assert rows == [
        ["Pay", "broker-a", "0", "9", "4", "5", "1.0", "3", "2", "-"],
        ["Pay", "broker-b", "0", "2", "2", "0", "0.0", "0", "0", "-"],
    ]


def test_describe_of_a_pop_group_without_clients_or_queues_says_so() -> None:
    out = io.StringIO()
    print_description(pop_description(clients=(), queues=()), out)
    lines = out.getvalue().splitlines()
    assert lines[:2] == [
        "group pay: 0 official clients, 0 queues, lag 0 messages, 0 in flight (0 invisible)",
        "consumption: POP",
    ]
    assert "no official client connected" in lines
    assert "no queue has a message received by this group" in lines


def test_describe_of_an_offsets_group_keeps_its_columns() -> None:
    d = GroupDescription(
        group="orders",
        members=(),
        queues=(QueueLag("broker-a", "Orders", 0, 10, 4, 6, 2.5, "c1"),),
        warnings=(),
        consumption="OFFSETS",
    )
    out = io.StringIO()
    print_description(d, out)
    lines = out.getvalue().splitlines()
    assert lines[:2] == [
        "group orders: 0 members, 1 queues, lag 6 messages",
        "consumption: OFFSETS",
    ]
    assert "official clients:" not in lines
    header = next(line for line in lines if line.startswith("TOPIC"))
    assert header.split() == [
        "TOPIC", "BROKER", "QUEUE", "BROKER", "OFFSET", "CONSUMER", "OFFSET", "LAG", "LAG",
        "(S)", "LOCKED", "BY",
    ]  # fmt: skip


async def test_reset_offsets_needs_exactly_one_target() -> None:
    async with AdminClient("127.0.0.1:1") as admin:  # refused before any call is made
        targets: list[dict[str, Any]] = [
            {},
            {"earliest": True, "latest": True},
            {"latest": True, "timestamp_ms": 5},
        ]
        for kwargs in targets:
            with pytest.raises(InvalidArgumentError) as info:
                await admin.reset_offsets("g", "T", **kwargs)
            assert str(info.value) == (
                "to: give exactly one of earliest=True, latest=True or timestamp_ms=<epoch ms>"
            )
        for bad in (-1, 10**29):
            with pytest.raises(InvalidArgumentError, match="timestamp_ms: must be a time from"):
                await admin.reset_offsets("g", "T", timestamp_ms=bad)
        with pytest.raises(InvalidArgumentError, match=r"group: 'bad group' must be 1 to 255"):
            await admin.reset_offsets("bad group", "T", earliest=True)
        with pytest.raises(InvalidTopicError):
            await admin.reset_offsets("g", "bad topic", earliest=True)
        with pytest.raises(InvalidArgumentError, match="group: '' must be"):
            await admin.describe_group("")


def test_reset_offset_command_needs_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--namesrv", "127.0.0.1:1", "group", "reset-offset", "g", "--topic", "T"])
    assert info.value.code == 2
    assert "one of the arguments --to --timestamp is required" in capsys.readouterr().err
    code = main(
        ["--namesrv", "127.0.0.1:1", "group", "reset-offset", "g", "--topic", "T", "--to", "soon"]
    )
    assert code == 2
    assert "--to 'soon': use ISO 8601" in capsys.readouterr().err
