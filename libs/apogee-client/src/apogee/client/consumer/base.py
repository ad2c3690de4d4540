"""What the push and the pull consumer share: subscriptions made before ``start()`` (checked at
once, handed to the runtime when it starts), the runtime itself once started, and the queries
on it (assignment, rebalance)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from apogee.client.consumer.config import ConsumerConfig
from apogee.client.consumer.queue_state import Sink
from apogee.client.consumer.runtime import ConsumerRuntime, check_subscription
from apogee.client.producer.routes import MessageQueue
from apogee.common import tracing

if TYPE_CHECKING:
    from apogee.client.metrics import ConsumerMetrics


class ConsumerBase:
    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        #: None unless this consumer traces (see apogee.client.consumer.spans)
        self._tracer = tracing.client_tracer(config.tracer_provider, "apogee.client.consumer")
        #: None unless this consumer counts metrics (see apogee.client.metrics)
        self._metrics = _metrics_of(config)
        self._pending: dict[str, tuple[str, str]] = {}
        self._runtime: ConsumerRuntime | None = None
        self._closed = False

    @property
    def client_id(self) -> str:
        return self.config.client_id

    def subscribe(self, topic: str, tag_expression: str = "*", *, sql: str = "") -> None:
        """Consume ``topic``: the messages whose tag matches ``tag_expression`` (``*`` for
        all, or ``"A || B"``) and, when ``sql`` is given, whose properties meet that SQL92
        condition (``"color = 'red' AND size > 3"``; RocketMQ's ``MessageSelector.bySql``),
        filtered at the broker. Subscribing again to a topic replaces its filter. Allowed
        before and after start; a condition that does not parse raises
        :class:`~apogee.common.errors.InvalidArgumentError` naming its position."""
        check_subscription(topic, tag_expression, sql)
        if self._runtime is not None:
            self._runtime.subscribe(topic, tag_expression, sql)
        else:
            self._pending.pop(topic, None)
            self._pending[topic] = (tag_expression, sql)

    def unsubscribe(self, topic: str) -> None:
        self._pending.pop(topic, None)
        if self._runtime is not None:
            self._runtime.unsubscribe(topic)

    def _startable(self) -> bool:
        """False when already started; raises when closed."""
        if self._closed:
            raise RuntimeError("the consumer is closed")
        return self._runtime is None

    async def _start_runtime(self, sink: Sink) -> None:
        """Start the runtime with the subscriptions made so far; on failure it is gone again
        (and has cleaned up after itself)."""
        runtime = ConsumerRuntime(self.config, sink, tracer=self._tracer, metrics=self._metrics)
        for topic, (expr, sql) in self._pending.items():
            runtime.subscribe(topic, expr, sql)
        self._runtime = runtime
        try:
            await runtime.start()
        except BaseException:
            self._runtime = None
            raise

    def assignment(self) -> list[MessageQueue]:
        """The queues of the subscribed topics this consumer reads now (in clustering mode it
        also reads a share of the group's retry topic, ``%RETRY%<group>``, not listed here)."""
        runtime = self._runtime
        if runtime is None:
            return []
        return [mq for mq in runtime.owned() if mq.topic != runtime.retry_topic]

    async def rebalance(self) -> None:
        """Recompute the share of queues now (it also happens on its own)."""
        if self._runtime is not None:
            await self._runtime.rebalance()


def _metrics_of(config: ConsumerConfig) -> ConsumerMetrics | None:
    """The consumer's metrics when it was given a registry (importing prometheus_client only
    then: the SDK does not depend on it)."""
    if config.metrics_registry is None:
        return None
    from apogee.client.metrics import ConsumerMetrics  # noqa: PLC0415 - only when asked for

    return ConsumerMetrics(config.metrics_registry, config.group)
