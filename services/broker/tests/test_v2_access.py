"""apache.rocketmq.v2 with authentication on: the official clients sign with the same access
keys as Apogee's SDK, and a refusal is answered in v2's own Status (UNAUTHORIZED for a bad
signature, FORBIDDEN naming the user, the resource and the right), never as a gRPC error, while
the broker goes on serving."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration

from apogee.common.auth.signature import signed_metadata
from apogee.common.topics import TopicConfig
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.testkit.broker import running_broker, small_settings
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

USERS = """
[[users]]
access_key = "orders-app"
secret_key = "orders-secret-0123456789"
[users.topics]
"Orders" = "PUB|SUB"
[users.groups]
"billing" = "SUB"

[[users]]
access_key = "reader"
secret_key = "reader-secret-0123456789"
[users.topics]
"Orders" = "SUB"
[users.groups]
"billing" = "SUB"

[[users]]
access_key = "apogee-service"
secret_key = "service-secret-0123456789"
service = true
"""


def md(ak: str, sk: str) -> tuple[tuple[str, str], ...]:
    return (("x-mq-client-id", f"{ak}@1@1@x"), *signed_metadata(ak, sk))


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    users = tmp_path / "users.toml"
    users.write_text(USERS)
    credentials = tmp_path / "credentials.toml"
    credentials.write_text(
        'access_key = "apogee-service"\nsecret_key = "service-secret-0123456789"\n'
    )
    settings = small_settings(
        tmp_path / "b",
        auth_enabled=True,
        auth_users_file=str(users),
        auth_credentials_file=str(credentials),
    )
    async with running_broker(settings) as app:
        assert app.topics is not None
        app.topics.put(TopicConfig("Orders", 2, 2))
        app.topics.put(TopicConfig("Payroll", 2, 2))
        yield app


def order(topic: str = "Orders") -> s.SendMessageRequest:
    return s.SendMessageRequest(
        messages=[
            d.Message(
                topic=d.Resource(name=topic),
                body=b"x",
                system_properties=d.SystemProperties(message_id="A1", body_encoding=d.IDENTITY),
            )
        ]
    )


async def test_signed_calls_pass_and_refusals_name_the_user_the_resource_and_the_right(
    broker: BrokerApp,
) -> None:
    async with grpc.aio.insecure_channel(broker.address) as ch:
        stub = sg.MessagingServiceStub(ch)
        owner = md("orders-app", "orders-secret-0123456789")
        sent = await stub.SendMessage(order(), metadata=owner, timeout=5)
        assert sent.status.code == d.OK, sent.status

        bad = md("orders-app", "not-the-secret-at-all")
        refused = await stub.SendMessage(order(), metadata=bad, timeout=5)
        assert refused.status.code == d.UNAUTHORIZED, refused.status
        assert "orders-app" in refused.status.message
        unsigned = await stub.QueryRoute(
            s.QueryRouteRequest(topic=d.Resource(name="Orders")),
            metadata=(("x-mq-client-id", "x@1@1@x"),),
            timeout=5,
        )
        assert unsigned.status.code == d.UNAUTHORIZED, unsigned.status

        reader = md("reader", "reader-secret-0123456789")
        forbidden = await stub.SendMessage(order(), metadata=reader, timeout=5)
        assert forbidden.status.code == d.FORBIDDEN, forbidden.status
        assert "reader" in forbidden.status.message
        assert "Orders" in forbidden.status.message
        assert "PUB" in forbidden.status.message
        other = await stub.SendMessage(order("Payroll"), metadata=owner, timeout=5)
        assert other.status.code == d.FORBIDDEN
        assert "Payroll" in other.status.message

        req = s.ReceiveMessageRequest(
            group=d.Resource(name="audit"),
            message_queue=d.MessageQueue(topic=d.Resource(name="Orders"), id=-1),
            filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
            invisible_duration=Duration(seconds=10),
            long_polling_timeout=Duration(seconds=0),
        )
        answers = [r async for r in stub.ReceiveMessage(req, metadata=reader, timeout=5)]
        assert answers[0].status.code == d.FORBIDDEN
        assert "audit" in answers[0].status.message
        req.group.name = "billing"
        got = [r async for r in stub.ReceiveMessage(req, metadata=reader, timeout=5)]
        assert [r.message.body for r in got if r.HasField("message")] == [b"x"]
