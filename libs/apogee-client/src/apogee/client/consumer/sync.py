"""Synchronous twins of the consumers: the asyncio consumer runs on its own loop thread.

``SyncPushConsumer`` calls a plain-function listener on its thread pool; ``SyncPullConsumer``'s
``poll`` blocks the calling thread. Both are context managers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Self, TypeVar, Unpack

from apogee.client._loop import LoopThread
from apogee.client.consumer.config import ConsumerOptions
from apogee.client.consumer.pull import PullConsumer
from apogee.client.consumer.push import ConsumeResult, PushConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.retry import SendBackOutcome
from apogee.client.producer.routes import MessageQueue

_GRACE = 5.0
C = TypeVar("C", PushConsumer, PullConsumer)


class _SyncConsumer(Generic[C]):
    """What both twins do: hand each call to the asyncio consumer on the loop thread."""

    def __init__(self, core: C, thread_name: str) -> None:
        self._core: C = core
        self.config = core.config
        self._thread = LoopThread(thread_name)

    @property
    def client_id(self) -> str:
        return self._core.client_id

    def subscribe(self, topic: str, tag_expression: str = "*", *, sql: str = "") -> None:
        self._thread.run(
            _call(functools.partial(self._core.subscribe, sql=sql), topic, tag_expression), _GRACE
        )

    def start(self) -> None:
        self._thread.run(
            self._core.start(), self.config.request_timeout * 3 + _GRACE, "starting the consumer"
        )

    def assignment(self) -> list[MessageQueue]:
        return self._thread.run(_value(self._core.assignment), _GRACE)

    def close(self) -> None:
        if self._thread.running():
            try:
                self._thread.run(
                    self._core.close(), self.config.close_timeout * 2 + _GRACE, "closing"
                )
            finally:
                self._thread.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncPushConsumer(_SyncConsumer[PushConsumer]):
    """``with SyncPushConsumer(namesrv, group, listener) as c: c.subscribe(...); c.start()``."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        listener: Callable[[list[ReceivedMessage]], ConsumeResult | None],
        **options: Unpack[ConsumerOptions],
    ) -> None:
        super().__init__(PushConsumer(namesrv, group, listener, **options), "apogee-push-consumer")


class SyncPullConsumer(_SyncConsumer[PullConsumer]):
    """``with SyncPullConsumer(namesrv, group) as c: c.subscribe(...); c.start(); c.poll()``."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        *,
        auto_commit: bool = True,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        super().__init__(
            PullConsumer(namesrv, group, auto_commit=auto_commit, **options),
            "apogee-pull-consumer",
        )

    def poll(self, timeout: float = 1.0, max_messages: int = 1024) -> list[ReceivedMessage]:
        return self._thread.run(self._core.poll(timeout, max_messages), timeout + _GRACE, "poll")

    def commit(self) -> None:
        self._thread.run(self._core.commit(), self.config.request_timeout + _GRACE, "commit")

    def send_back(self, message: ReceivedMessage, reason: str = "") -> SendBackOutcome:
        """See :meth:`PullConsumer.send_back`."""
        return self._thread.run(
            self._core.send_back(message, reason),
            self.config.request_timeout + _GRACE,
            "send_back",
        )

    def __iter__(self) -> Iterator[ReceivedMessage]:
        while self._thread.running():
            yield from self.poll(timeout=1.0)


async def _call(fn: Callable[..., None], *args: str) -> None:
    fn(*args)


async def _value(fn: Callable[[], list[MessageQueue]]) -> list[MessageQueue]:
    return fn()
