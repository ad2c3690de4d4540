"""The broker, wired: store, topics, sending, lookups, consumption (pulls, groups, sessions,
offsets, locks), the schedule topic's service and send-back, transactions (half messages, their
end and checks, producer sessions), gRPC server with health, registration.

Start: bind the port (the advertised address needs it), open the store (recovery runs here),
load ``topics.json``, ``consumerOffset.json`` and ``transactionProgress.json``, rebuild the
decided transactions from the op queue, start the background loops (consumer and producer
expiry, offset persistence), start serving, register with every nameserver. Stop, bounded
throughout: held pulls are answered and session, producer session and delivery streams end (so
nothing waits out a long poll), health NOT_SERVING and no new calls, calls in flight get
``shutdown_grace_s``, heartbeats stop and the broker unregisters from every nameserver, the
consumer and producer loops stop and the offsets are written, then the store closes (flush,
checkpoint, clean-stop marker).

Metrics (:mod:`apogee_broker.metrics`): the broker's own registry, served on ``metrics_listen``
from right after the gRPC port is bound (a port in use fails the start, naming the address)
until the gRPC server has stopped.

Tracing (docs/tracing.md): when the process set it up (``python -m apogee_broker`` does, from
the OTEL_* environment), every stored message that carries a trace context gets a store span.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Protocol

import grpc.aio
from opentelemetry.trace import Tracer
from prometheus_client.registry import Collector

from apogee.common import tracing
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import StoreConfigError
from apogee.rocketmq.v2 import service_pb2 as v2_service_pb2
from apogee.rocketmq.v2 import service_pb2_grpc as v2_service_pb2_grpc
from apogee.rpc.mux import MuxServer
from apogee.rpc.security import ClientSecurity, service_security
from apogee.rpc.server import GrpcServer
from apogee.rpc.tls import server_tls_from
from apogee.service.access import interceptors_from
from apogee.service.metrics import MetricsServer, auth_refusals, new_registry, start_metrics
from apogee.store import MessageStore
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    consumer_pb2,
    consumer_pb2_grpc,
    schedule_pb2,
    schedule_pb2_grpc,
    transaction_pb2,
    transaction_pb2_grpc,
)
from apogee_broker.core.clients.groups import ConsumeMode, ConsumerGroups, Heartbeat, Member
from apogee_broker.core.clients.official import OfficialClients
from apogee_broker.core.clients.producers import ProducerRegistry
from apogee_broker.core.clients.sessions import SessionHub
from apogee_broker.core.consume.group_admin import GroupAdmin
from apogee_broker.core.consume.locks import QueueLocks
from apogee_broker.core.consume.offsets import ConsumerOffsets
from apogee_broker.core.consume.pulling import PullService
from apogee_broker.core.consume.push import DeliveryHub
from apogee_broker.core.consume.send_back import SendBackService
from apogee_broker.core.pop.renewals import Renewals
from apogee_broker.core.pop.service import PopService
from apogee_broker.core.pop.table import PopTable
from apogee_broker.core.registration import RegistrationLoop
from apogee_broker.core.schedule.layout import check_layout_file, schedule_tag_code
from apogee_broker.core.schedule.service import ScheduleService
from apogee_broker.core.send.dedup import DedupWindow
from apogee_broker.core.send.dedup_log import rebuild as rebuild_dedup
from apogee_broker.core.send.service import SendService
from apogee_broker.core.storage.lookup import MessageLookup
from apogee_broker.core.topics import TopicManager
from apogee_broker.core.txn.checks import HalfChecks
from apogee_broker.core.txn.ends import TransactionEnds
from apogee_broker.core.txn.halves import HalfIntake
from apogee_broker.core.txn.ledger import TransactionLedger
from apogee_broker.core.txn.scans import TransactionScans
from apogee_broker.metrics import BrokerCollector, BrokerMetrics, BrokerSources
from apogee_broker.nameserver_link import BrokerIdentity, GrpcNameServerLink, RouteLookup
from apogee_broker.replication.leader import ReplicationLeader
from apogee_broker.replication.state import (
    SCHEDULE,
    TRANSACTIONS,
    StateApplier,
    StateLog,
)
from apogee_broker.servicers.admin import BrokerAdminServicer
from apogee_broker.servicers.broker import BrokerServicer
from apogee_broker.servicers.consumer import ConsumerAdminServicer, ConsumerServicer
from apogee_broker.servicers.schedule import ScheduleServicer
from apogee_broker.servicers.transaction import TransactionCheckServicer, TransactionServicer
from apogee_broker.servicers.v2.messaging import MessagingServicer, V2Config
from apogee_broker.settings import BrokerSettings, store_host_of

log = logging.getLogger(__name__)

#: Most queues a user topic may have.
MAX_TOPIC_QUEUES = 1024

SERVICE_NAMES = [
    broker_pb2.DESCRIPTOR.services_by_name["Broker"].full_name,
    broker_pb2.DESCRIPTOR.services_by_name["BrokerAdmin"].full_name,
    consumer_pb2.DESCRIPTOR.services_by_name["Consumer"].full_name,
    consumer_pb2.DESCRIPTOR.services_by_name["ConsumerAdmin"].full_name,
    schedule_pb2.DESCRIPTOR.services_by_name["Schedule"].full_name,
    transaction_pb2.DESCRIPTOR.services_by_name["Transaction"].full_name,
    transaction_pb2.DESCRIPTOR.services_by_name["TransactionCheck"].full_name,
    v2_service_pb2.DESCRIPTOR.services_by_name["MessagingService"].full_name,
]


async def open_store(settings: BrokerSettings, address: str, clock: Clock) -> MessageStore:
    """Open (and recover) the broker's store, its records stamped with ``address``'s host."""
    store_host = await asyncio.to_thread(store_host_of, address)
    return await asyncio.to_thread(
        MessageStore.open,
        settings.data_dir,
        settings.store_config(),
        clock=clock,
        store_host=store_host,
        tag_code=schedule_tag_code,
    )


class ReplicaServices(Protocol):
    """What a replica group's node serves beside the broker while it leads: its Replication
    service and its metrics (:mod:`apogee_broker.replication.node`)."""

    @property
    def collector(self) -> Collector: ...

    def add_to(self, server: grpc.aio.Server) -> str:
        """Add the Replication service to ``server``; returns its name (for health)."""
        ...


class BrokerApp:
    """One broker, runnable in-process: ``port = await app.start()``, ``await app.stop()``."""

    def __init__(
        self,
        settings: BrokerSettings,
        clock: Clock = SYSTEM_CLOCK,
        tracer: Tracer | None = None,
        *,
        store: MessageStore | None = None,
        replication: ReplicationLeader | None = None,
        replica_services: ReplicaServices | None = None,
    ) -> None:
        """``tracer``: the broker's spans' (None: the process's, when tracing is set up).
        A replica group's leader (:mod:`apogee_broker.replication.node`) passes its open
        ``store`` (then neither opened nor closed here), the ``replication`` of its term (every
        write waits for it) and its ``replica_services`` (served here too)."""
        self.settings = settings
        self._given_store = store
        self.replication = replication
        self.replica_services = replica_services
        #: a replica group leader's state records (topics, offsets)
        self.state: StateLog | None = None
        self.clock = clock
        self.tracer = tracer if tracer is not None else tracing.service_tracer("apogee.broker")
        self.grpc: GrpcServer | None = None
        self.store: MessageStore | None = None
        self.topics: TopicManager | None = None
        self.sending: SendService | None = None
        self.registration: RegistrationLoop | None = None
        self.offsets: ConsumerOffsets | None = None
        self.groups: ConsumerGroups | None = None
        self.locks: QueueLocks | None = None
        self.sessions: SessionHub | None = None
        self.pulling: PullService | None = None
        self.delivery: DeliveryHub | None = None
        self.send_back: SendBackService | None = None
        self.schedule: ScheduleService | None = None
        self.producers: ProducerRegistry | None = None
        #: what the transaction steps share (decisions, closed copies, locks, progress)
        self.transactions: TransactionLedger | None = None
        self.halves: HalfIntake | None = None
        self.ends: TransactionEnds | None = None
        #: POP consumption (the official RocketMQ 5 clients') and its durable state
        self.pop_table: PopTable | None = None
        self.pop: PopService | None = None
        self.v2: MessagingServicer | None = None
        self.routes: RouteLookup | None = None
        self.renewals: Renewals | None = None
        self.group_admin: GroupAdmin | None = None
        self.address = ""
        self.port = 0
        #: this broker's metrics (a registry of its own: brokers in one process do not mix)
        self.registry = new_registry()
        self.metrics = BrokerMetrics(
            self.registry,
            max_topics=settings.metrics_max_topics,
            max_groups=settings.metrics_max_groups,
        )
        self.metrics_server: MetricsServer | None = None
        self._stopped = False
        #: the SendStream and PullStream streams, ended (after answering what they read) at stop
        self.streams = MuxServer(f"broker {settings.broker_name}")

    async def start(self) -> int:
        """Open everything and serve; returns the bound gRPC port. On failure what was opened
        is closed again before the error propagates."""
        s = self.settings
        try:
            self.grpc = GrpcServer(
                s.listen,
                f"broker {s.broker_name}",
                tls=server_tls_from(s),
                interceptors=interceptors_from(s, auth_refusals(self.registry)),
            )
            self.port = self.grpc.bind()
            sources = BrokerSources(asyncio.get_running_loop(), self.clock)
            self.registry.register(BrokerCollector(sources, self.metrics))
            if self.replica_services is not None:
                self.registry.register(self.replica_services.collector)
            self.metrics_server = start_metrics(
                s.metrics_listen,
                self.registry,
                f"broker {s.broker_name}",
                cert_file=s.tls_cert_file,
                key_file=s.tls_key_file,
                ca_file=s.tls_ca_file,
                client_auth=s.tls_client_auth,
            )
            self.address = s.advertised(self.port)
            layout = s.schedule_layout()
            if self._given_store is not None:
                self.store = self._given_store
            else:
                self.store = await open_store(s, self.address, self.clock)
            recovered_at_ms = self.clock.time_ms()
            self.store.commitlog.flush_observer = self.metrics.flush_latency.observe
            sources.store = self.store
            await asyncio.to_thread(check_layout_file, s.data_dir, layout)
            self.topics = TopicManager(
                s.data_dir,
                default_topic_queues=s.default_topic_queues,
                max_queues=MAX_TOPIC_QUEUES,
                auto_create=s.auto_create_topics,
                max_topic_length=self.store.cfg.max_topic_length,
                broker_name=s.broker_name,
                schedule_queues=layout.queue_count,
            )
            if self.replication is not None:  # the files as the log's state records say
                await asyncio.to_thread(StateApplier(self.store, s.data_dir).catch_up)
            self.topics.load()
            identity = BrokerIdentity(
                cluster=s.cluster,
                broker_name=s.broker_name,
                address=self.address,
                heartbeat_interval_s=s.heartbeat_interval_s,
                auto_create_topics=s.auto_create_topics,
                epoch=self.replication.epoch if self.replication is not None else 0,
            )
            dedup = None
            if s.dedup_window_s > 0:  # remembered across restarts: read back from the log
                dedup = DedupWindow(s.dedup_window_s, s.dedup_max_ids)
                await asyncio.to_thread(rebuild_dedup, dedup, self.store, self.clock.time_ms())
            self.sending = SendService(
                self.store,
                self.topics,
                broker_name=s.broker_name,
                max_message_size=s.max_message_size,
                max_messages_per_request=s.max_messages_per_request,
                clock=self.clock,
                layout=layout,
                timer_max_delay_ms=int(s.timer_max_delay_s * 1000),
                metrics=self.metrics,
                tracer=self.tracer,
                dedup=dedup,
            )
            self.sending.writer.replication = self.replication
            if self.replication is not None:
                self.state = StateLog(self.sending.writer)
                self.state.topics_snapshot = self.topics.snapshot
                self.topics.on_change = self.state.topic_changed
            self.send_back = SendBackService(
                self.store,
                self.topics,
                self.sending.writer,
                layout,
                max_reconsume_times=s.max_reconsume_times,
                first_delay_level=s.first_retry_delay_level,
                clock=self.clock,
            )
            self.schedule = ScheduleService(
                self.store, self.topics, self.sending.writer, layout, s.data_dir, clock=self.clock
            )
            self.schedule.load()
            sources.schedule_waiting = self.schedule.waiting
            stranded = self.schedule.stranded_levels()
            if stranded:
                raise StoreConfigError(
                    field="delay_levels",
                    rule=f"has {layout.levels} levels, but delay level(s) "
                    + ", ".join(f"{lv} ({n} messages)" for lv, n in sorted(stranded.items()))
                    + " still hold undelivered messages: keep those levels until they are "
                    "delivered",
                )
            schedule_pb2_grpc.add_ScheduleServicer_to_server(
                ScheduleServicer(self.schedule, s.broker_name), self.grpc.server
            )
            sources.pending_transactions = (await self._wire_transactions()).count_pending
            lookup = MessageLookup(
                self.store, self.topics, broker_name=s.broker_name, clock=self.clock
            )
            sources.groups = self._wire_consumption()
            broker_pb2_grpc.add_BrokerServicer_to_server(
                BrokerServicer(self.sending, lookup, s.broker_name, self.streams),
                self.grpc.server,
            )
            broker_pb2_grpc.add_BrokerAdminServicer_to_server(
                BrokerAdminServicer(self.topics, lookup, self.store, identity, recovered_at_ms),
                self.grpc.server,
            )
            security = service_security(s)
            self._wire_v2(security)
            services = SERVICE_NAMES
            if self.replica_services is not None:
                services = [*SERVICE_NAMES, self.replica_services.add_to(self.grpc.server)]
            await self.grpc.start(services)
            topics = self.topics
            self.registration = RegistrationLoop(
                [GrpcNameServerLink(addr, identity, security) for addr in s.nameservers],
                topics.list_topics,
                interval_s=s.heartbeat_interval_s,
                timeout_s=s.register_timeout_s,
                version=lambda: topics.digest,
            )
            self.topics.add_listener(self.registration.topics_changed)
            await self.registration.start()
            log.info(
                "broker %s of cluster %s serving at %s (port %d), data in %s, flush %s",
                s.broker_name,
                s.cluster,
                self.address,
                self.port,
                s.data_dir,
                s.flush_mode.value,
            )
        except BaseException:
            await self.stop()
            raise
        return self.port

    async def _wire_transactions(self) -> TransactionScans:
        """Producers' sessions and transactions (decisions rebuilt from the op queue), the
        expiry loop started and their services added to the server; returns the reads of
        the transactions (for the metrics)."""
        s = self.settings
        assert self.store is not None
        assert self.topics is not None
        assert self.sending is not None
        assert self.grpc is not None
        self.producers = ProducerRegistry(
            expiry_s=s.producer_expiry_s, broker_name=s.broker_name, clock=self.clock
        )
        ledger = self.transactions = TransactionLedger(
            self.store, self.sending.writer, s.data_dir, broker_name=s.broker_name, clock=self.clock
        )
        await ledger.load()
        checks = self.sending.checks
        self.halves = HalfIntake(ledger, checks)
        self.ends = TransactionEnds(ledger, self.topics, checks)
        transaction_pb2_grpc.add_TransactionServicer_to_server(
            TransactionServicer(
                self.halves,
                self.ends,
                self.producers,
                self.metrics,
                s.broker_name,
            ),
            self.grpc.server,
        )
        scans = TransactionScans(ledger, self.producers)
        transaction_pb2_grpc.add_TransactionCheckServicer_to_server(
            TransactionCheckServicer(
                ledger, HalfChecks(ledger, self.producers), scans, self.metrics
            ),
            self.grpc.server,
        )
        self.producers.start()
        return scans

    def _wire_v2(self, security: ClientSecurity) -> None:
        """POP consumption (its state read back from its journal) and the v2 service."""
        s = self.settings
        assert self.store is not None
        assert self.topics is not None
        assert self.sending is not None
        assert self.send_back is not None
        assert self.offsets is not None
        assert self.halves is not None
        assert self.ends is not None
        assert self.producers is not None
        assert self.schedule is not None
        assert self.grpc is not None
        self.pop_table = PopTable(s.data_dir / "pop")
        replayed = self.pop_table.load()
        log.info(
            "POP state read back: %d journal records (%d bytes cut from a torn tail), %d groups",
            replayed.records,
            replayed.truncated_bytes,
            len(self.pop_table.groups()),
        )
        if self.state is not None:  # a replica group's leader: its followers keep the journal
            self.state.attach_pop(self.pop_table)
        self.pop = PopService(
            self.store,
            self.topics,
            self.pop_table,
            self.send_back,
            self.offsets,
            broker_name=s.broker_name,
            max_attempts=s.max_reconsume_times + 1,
            clock=self.clock,
        )
        metrics = self.metrics
        self.pop.on_expired = lambda group, _topic, n: metrics.pop(group, "expired", n)
        self.pop.on_dead_lettered = lambda group, _topic, n: metrics.pop(group, "dead_lettered", n)
        self.routes = RouteLookup(s.nameservers, security)
        clients = OfficialClients(self.clock)
        assert self.group_admin is not None
        self.group_admin.pop = self.pop_table
        self.group_admin.official = clients
        self.renewals = Renewals(self.pop, clients.alive, self.clock)
        self.renewals.start()
        self.v2 = MessagingServicer(
            V2Config(
                broker_name=s.broker_name,
                address=self.address,
                max_body_size=s.max_message_size,
                max_attempts=s.max_reconsume_times + 1,
            ),
            self.topics,
            self.sending,
            self.pop,
            self.halves,
            self.ends,
            self.producers,
            self.routes.route,
            clients,
            self.renewals,
            self.schedule,
            security,
            self.group_admin.check_pop_receive,
            self.metrics,
        )
        v2_service_pb2_grpc.add_MessagingServiceServicer_to_server(self.v2, self.grpc.server)

    def _wire_consumption(self) -> GroupAdmin:
        """Pulls, groups, sessions, offsets and locks, their loops started and their services
        added to the server; returns the group administration (for the metrics)."""
        s = self.settings
        assert self.store is not None
        assert self.topics is not None
        assert self.grpc is not None
        self.offsets = ConsumerOffsets(
            s.data_dir, self.store, self.topics, persist_interval_s=s.offset_persist_interval_s
        )
        self.offsets.load()
        if self.state is not None:
            self.offsets.replicate = self.state.write_offsets
            self.offsets.on_commit = self.state.commit_offsets
            assert self.schedule is not None
            assert self.transactions is not None
            self.schedule.replicate = partial(self.state.write, SCHEDULE)
            self.transactions.replicate = partial(self.state.write, TRANSACTIONS)
            self.schedule.replicate_recall = self.state.recall
        self.groups = ConsumerGroups(expiry_ms=s.consumer_expiry_ms, clock=self.clock)
        self.groups.add_listener(self.metrics.members_changed)
        self.locks = QueueLocks(self.topics, expiry_ms=s.lock_expiry_ms, clock=self.clock)
        locks = self.locks

        def release_locks(member: Member, reason: str) -> None:
            locks.drop_client(member.group, member.client_id)

        self.groups.add_removal_listener(release_locks)
        send_back = self.send_back
        assert send_back is not None

        def joined(hb: Heartbeat) -> None:
            if self.group_admin is not None:
                self.group_admin.check_offsets_join(hb.group)
            if hb.mode is not ConsumeMode.BROADCASTING:
                send_back.ensure_retry_topic(hb.group)

        self.sessions = SessionHub(
            self.groups,
            broker_name=s.broker_name,
            first_heartbeat_timeout_s=s.consumer_expiry_ms / 1000,
            on_join=joined,
        )
        self.pulling = PullService(
            self.store,
            self.topics,
            self.offsets,
            pull_max_messages=s.pull_max_messages,
            pull_max_bytes=s.pull_max_bytes,
            long_poll_max_ms=s.long_poll_max_ms,
            clock=self.clock,
            metrics=self.metrics,
        )
        self.delivery = DeliveryHub(
            self.store,
            self.topics,
            self.offsets,
            pull_max_messages=s.pull_max_messages,
            pull_max_bytes=s.pull_max_bytes,
            coalesce_s=s.delivery_coalesce_ms / 1000,
            metrics=self.metrics,
        )
        admin = self.group_admin = GroupAdmin(
            self.store,
            self.topics,
            self.groups,
            self.offsets,
            self.locks,
            self.sessions,
            self.clock,
        )
        consumer_pb2_grpc.add_ConsumerServicer_to_server(
            ConsumerServicer(
                self.pulling,
                self.sessions,
                self.groups,
                self.offsets,
                self.locks,
                s.broker_name,
                self.send_back,
                self.streams,
                self.delivery,
            ),
            self.grpc.server,
        )
        consumer_pb2_grpc.add_ConsumerAdminServicer_to_server(
            ConsumerAdminServicer(admin, s.broker_name), self.grpc.server
        )
        self.groups.start()
        self.offsets.start()
        return admin

    async def stop(self) -> None:
        """Stop gracefully (see the module docstring); safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        s = self.settings
        # Held pulls and session streams would keep the server's grace period busy: end them.
        if self.pulling is not None:
            self.pulling.stop()
        if self.delivery is not None:
            self.delivery.stop()
        self.streams.stop()
        if self.sessions is not None:
            self.sessions.stop()
        if self.producers is not None:
            self.producers.end_sessions()
        if self.schedule is not None:
            self.schedule.stop()
        if self.v2 is not None:
            self.v2.stop()
        if self.grpc is not None:
            try:
                await self.grpc.stop(s.shutdown_grace_s)
            except Exception:
                log.exception("stopping the gRPC server failed")
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.registration is not None:
            try:
                await self.registration.stop(unregister=True)
            except Exception:
                log.exception("stopping the registration loop failed")
        if self.groups is not None:
            try:
                await self.groups.stop()
            except Exception:
                log.exception("stopping the consumer expiry loop failed")
        if self.producers is not None:
            try:
                await self.producers.stop()
            except Exception:
                log.exception("stopping the producer expiry loop failed")
        if self.renewals is not None:
            await self.renewals.stop()
        if self.v2 is not None:
            await self.v2.close()
        if self.routes is not None:
            await self.routes.close()
        if self.pop_table is not None:
            try:
                self.pop_table.close()
            except OSError:
                log.exception("closing the POP journal failed; the next start reads it back")
        if self.offsets is not None:
            await self.offsets.stop()  # writes the offsets; never raises
        if self.state is not None:
            await self.state.close()
        if self.store is not None and self._given_store is None:
            try:
                await asyncio.to_thread(self.store.close)
            except Exception:
                log.exception("closing the store failed; the next start will recover it")
        log.info("broker %s stopped", s.broker_name)
