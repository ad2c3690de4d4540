"""``apogee.v1.BrokerAdmin``: topics and what the broker is."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import grpc.aio

from apogee.common.errors import InvalidArgumentError
from apogee.rpc.errors import rpc_errors
from apogee.store import MessageStore
from apogee.v1 import broker_pb2, broker_pb2_grpc
from apogee_broker.core.storage.lookup import MessageLookup
from apogee_broker.core.topics import TopicConfig, TopicManager
from apogee_broker.nameserver_link import BrokerIdentity, topic_to_pb

Context = grpc.aio.ServicerContext[Any, Any]


class BrokerAdminServicer(broker_pb2_grpc.BrokerAdminServicer):
    def __init__(
        self,
        topics: TopicManager,
        lookup: MessageLookup,
        store: MessageStore,
        identity: BrokerIdentity,
        recovered_at_ms: int = 0,
    ) -> None:
        self.topics = topics
        self.lookup = lookup
        self.store = store
        self.identity = identity
        #: when the store finished opening (its recovery), ms since the epoch
        self.recovered_at_ms = recovered_at_ms

    @rpc_errors
    async def PutTopic(
        self, request: broker_pb2.PutTopicRequest, context: Context
    ) -> broker_pb2.PutTopicResponse:
        if not request.HasField("topic"):
            raise InvalidArgumentError(field="topic", rule="is required")
        t = request.topic
        config = TopicConfig.from_pb(t)
        old = self.topics.get(t.name)
        if not t.message_type and old is not None:  # an update that does not name a type
            config = replace(config, message_type=old.message_type)
        stored, created = self.topics.put(config)
        return broker_pb2.PutTopicResponse(topic=topic_to_pb(stored), created=created)

    @rpc_errors
    async def DeleteTopic(
        self, request: broker_pb2.DeleteTopicRequest, context: Context
    ) -> broker_pb2.DeleteTopicResponse:
        self.topics.delete(request.topic)
        return broker_pb2.DeleteTopicResponse()

    @rpc_errors
    async def ListTopics(
        self, request: broker_pb2.BrokerListTopicsRequest, context: Context
    ) -> broker_pb2.BrokerListTopicsResponse:
        return broker_pb2.BrokerListTopicsResponse(
            topics=[topic_to_pb(t) for t in self.topics.list_topics(request.include_system)]
        )

    @rpc_errors
    async def DescribeTopic(
        self, request: broker_pb2.DescribeTopicRequest, context: Context
    ) -> broker_pb2.DescribeTopicResponse:
        topic = self.topics.require(request.topic)
        queues = await self.lookup.queues(topic)
        return broker_pb2.DescribeTopicResponse(
            topic=topic_to_pb(topic),
            queues=[
                broker_pb2.QueueStatus(
                    queue_id=q.queue_id,
                    min_offset=q.min_offset,
                    max_offset=q.max_offset,
                    last_store_timestamp_ms=q.last_store_timestamp_ms,
                )
                for q in queues
            ],
            broker_name=self.identity.broker_name,
        )

    @rpc_errors
    async def GetBrokerInfo(
        self, request: broker_pb2.GetBrokerInfoRequest, context: Context
    ) -> broker_pb2.GetBrokerInfoResponse:
        me = self.identity
        return broker_pb2.GetBrokerInfoResponse(
            cluster=me.cluster,
            broker_name=me.broker_name,
            address=me.address,
            flush_mode=self.store.cfg.flush_mode.value,
            auto_create_topics=me.auto_create_topics,
            commitlog_min_offset=self.store.commitlog.min_offset,
            commitlog_max_offset=self.store.commitlog.max_offset,
            topic_count=len(self.topics),
            last_recovery=self._recovery(),
        )

    def _recovery(self) -> broker_pb2.RecoveryReport:
        r = self.store.recovery
        return broker_pb2.RecoveryReport(
            finished_ms=self.recovered_at_ms,
            clean=r.clean_shutdown,
            files_checked=r.files_checked,
            records_checked=r.records_checked,
            bytes_truncated=r.bytes_truncated,
            files_quarantined=list(r.files_quarantined),
            entries_redispatched=r.entries_redispatched,
            seconds=r.seconds,
            summary=r.summary(),
        )
