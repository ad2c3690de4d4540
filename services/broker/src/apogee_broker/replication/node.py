"""One replica of a broker's replica group, and the roles it moves between.

A replica opens its store once (recovery runs here) and keeps it for its whole life. It has an
identity kept in ``<data_dir>/replica.id`` (made at first start, never derived from its
address), so a replica whose disk was wiped comes back as a new member that has to catch up.
Then it loops over the group's record in the coordination engine:

- **Leader.** When nobody holds the leader's claim and this replica may lead (the group is new,
  or it is in the record's in-sync set and not behind after a crash; or ``unclean_election``),
  it campaigns: a compare-and-set that writes ``epoch + 1``, itself as leader and itself alone
  in the in-sync set. Having won, it starts the new epoch in its epoch checkpoint at its log
  end and serves as a whole broker (:class:`~apogee_broker.app.BrokerApp`, on the same open
  store and port) with a :class:`~.leader.ReplicationLeader`, registering with the nameservers
  under the epoch. Its term ends when it loses its claim, meets a higher epoch, or stops; the
  broker is then stopped (the store stays open) and the replica looks at the record again.
- **Follower.** While another replica leads, it serves only health, Replication and a
  ``NOT_LEADER`` answer to everything else (naming the leader), and copies the leader's log
  (:class:`~.follower.Follower`).

Between the two it is a candidate; a replica that cannot reach the engine neither campaigns
nor stops following, so an unreachable engine causes no election.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc.aio
from grpc_health.v1 import health_pb2

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import ApogeeError, NotLeaderError, UnavailableError
from apogee.rpc.security import service_security
from apogee.rpc.server import GrpcServer
from apogee.rpc.tls import server_tls_from
from apogee.service.access import interceptors_from
from apogee.service.metrics import MetricsServer, auth_refusals, new_registry, start_metrics
from apogee.service.replica_group import (
    FileCoordination,
    GroupRecord,
    ReplicaCoordination,
    Versioned,
)
from apogee.store import MessageStore
from apogee.store.epochs import EpochFile
from apogee.v1 import replication_pb2 as pb
from apogee.v1 import replication_pb2_grpc
from apogee_broker.app import BrokerApp, open_store
from apogee_broker.replication.follower import Follower, FollowerConfig
from apogee_broker.replication.leader import LeaderConfig, ReplicationLeader
from apogee_broker.replication.metrics import ReplicationCollector
from apogee_broker.replication.servicer import (
    SERVICE_NAME,
    NotLeaderHandler,
    ReplicationServicer,
    not_leader,
)
from apogee_broker.replication.state import StateApplier
from apogee_broker.servicers.v2.access import AccessPoint, AccessPointHandler
from apogee_broker.settings import BrokerSettings

log = logging.getLogger(__name__)

ID_FILE = "replica.id"
#: how often a follower or candidate reads the group's record
POLL_S = 0.1
#: how long a handoff may take: the successor catching up, then taking over
HANDOFF_S = 5.0


def replica_id_of(data_dir: Path) -> str:
    """This replica's identity, made once and kept in its data directory."""
    path = data_dir / ID_FILE
    try:
        rid = path.read_text().strip()
    except FileNotFoundError:
        rid = ""
    if rid:
        return rid
    data_dir.mkdir(parents=True, exist_ok=True)
    rid = uuid.uuid4().hex[:12]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(rid + "\n")
    tmp.replace(path)
    return rid


def coordination_of(
    settings: BrokerSettings, replica_id: str
) -> tuple[ReplicaCoordination, Callable[[], Awaitable[None]] | None]:
    """The coordination ``settings`` name, and what closes the client it opened (if any)."""
    if settings.replication == "file":
        return FileCoordination(settings.replica_group_dir), None
    if settings.replication == "lease":
        return _lease_coordination(settings, replica_id)
    from apogee.service.etcd import EtcdClient  # noqa: PLC0415 - etcd only
    from apogee.service.etcd_group import EtcdCoordination  # noqa: PLC0415 - etcd only

    client = EtcdClient(
        settings.etcd_endpoints_list, timeout_s=max(0.3, settings.replica_lease_s / 4)
    )
    coordination = EtcdCoordination(
        client,
        cluster=settings.cluster,
        broker_name=settings.broker_name,
        replica_id=replica_id,
        lease_s=settings.replica_lease_s,
    )
    return coordination, client.close


def _lease_coordination(
    settings: BrokerSettings, replica_id: str
) -> tuple[ReplicaCoordination, Callable[[], Awaitable[None]]]:
    """The Kubernetes Lease ``<lease_prefix>-<broker_name>``, through the pod's service
    account (outside a pod: ``$KUBECONFIG``)."""
    from apogee.service.kube import new_api_client, pod_namespace  # noqa: PLC0415 - lease only
    from apogee.service.lease_group import (  # noqa: PLC0415 - lease only
        KubeLeaseCoordination,
        group_lease_name,
    )

    api = new_api_client()
    namespace = settings.lease_namespace or os.environ.get("POD_NAMESPACE") or pod_namespace()
    coordination = KubeLeaseCoordination(
        api,
        namespace,
        group_lease_name(settings.lease_prefix, settings.broker_name),
        replica_id,
        lease_s=settings.replica_lease_s,
        timeout_s=max(0.3, settings.replica_lease_s / 4),
    )

    async def close() -> None:
        await asyncio.to_thread(api.close)

    return coordination, close


class ReplicaNode:
    """``port = await node.start()``, ``await node.stop()``; see the module docstring."""

    def __init__(
        self,
        settings: BrokerSettings,
        clock: Clock = SYSTEM_CLOCK,
        coordination: ReplicaCoordination | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._given = coordination
        self.coordination: ReplicaCoordination = coordination or FileCoordination(Path("."))
        self._close_client: Callable[[], Awaitable[None]] | None = None
        self.store: MessageStore | None = None
        self.epochs: EpochFile | None = None
        self.replica_id = ""
        self.address = ""
        self.port = 0
        self.role = "CANDIDATE"
        self.unclean = False
        self.leader: ReplicationLeader | None = None
        self.follower: Follower | None = None
        self.app: BrokerApp | None = None
        self.record = GroupRecord()
        self.state_applier: StateApplier | None = None
        #: the highest high watermark heard of from a leader (a new term starts from it)
        self.known_hw = 0
        self._server: GrpcServer | None = None
        self._access: AccessPoint | None = None
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        #: when this replica first saw a successor named that is not itself
        self._successor_since: float | None = None
        #: how many terms this replica led (for tests and describe)
        self.terms = 0
        #: the follower's metrics (refusals of its access checks); a leader serves the broker's
        self.registry = new_registry()
        self._refusals = auth_refusals(self.registry)
        #: the group's metrics, in this registry and in the registry of each term's broker
        self.collector = ReplicationCollector(self)
        self.registry.register(self.collector)
        self._metrics: MetricsServer | None = None

    # -- life -----------------------------------------------------------------------------------

    async def start(self) -> int:
        s = self.settings
        try:
            server = self._follower_server()
            self.port = server.bind()
            host = s.listen.rsplit(":", 1)[0]
            self.settings = s = replace(s, listen=f"{host}:{self.port}")
            self.address = s.advertised(self.port)
            self.replica_id = await asyncio.to_thread(replica_id_of, s.data_dir)
            if self._given is None:
                self.coordination, self._close_client = coordination_of(s, self.replica_id)
            self.store = await open_store(s, self.address, self.clock)
            self.unclean = not self.store.recovery.clean_shutdown
            self.state_applier = StateApplier(self.store, s.data_dir)
            self.epochs = EpochFile(s.data_dir / "epochs")
            await asyncio.to_thread(self.epochs.load)
            await server.start([SERVICE_NAME])
            self._server = server
            await self._ready(False)
            await self._serve_metrics()
            log.info(
                "broker %s replica %s at %s: log ends at %d, last epoch %s%s",
                s.broker_name,
                self.replica_id,
                self.address,
                self.store.commitlog.max_offset,
                self.epochs.last,
                " (after a crash: it catches up before it may lead)" if self.unclean else "",
            )
            self._task = asyncio.create_task(self._run(), name=f"replica {s.broker_name}")
        except BaseException:
            await self.stop()
            raise
        return self.port

    async def _serve_metrics(self) -> None:
        """The replica's own metrics while it does not lead (a leader's broker serves them)."""
        s = self.settings
        self._metrics = start_metrics(
            s.metrics_listen,
            self.registry,
            f"broker {s.broker_name} (replica)",
            cert_file=s.tls_cert_file,
            key_file=s.tls_key_file,
            ca_file=s.tls_ca_file,
            client_auth=s.tls_client_auth,
        )

    async def _stop_metrics(self) -> None:
        metrics, self._metrics = self._metrics, None
        if metrics is not None:
            await metrics.stop()

    def add_to(self, server: grpc.aio.Server) -> str:
        """Serve the Replication service on ``server`` (a term's broker); returns its name."""
        replication_pb2_grpc.add_ReplicationServicer_to_server(ReplicationServicer(self), server)
        return SERVICE_NAME

    def _follower_server(self) -> GrpcServer:
        s = self.settings
        server = GrpcServer(
            s.listen,
            f"broker {s.broker_name} (replica)",
            tls=server_tls_from(s),
            interceptors=interceptors_from(s, self._refusals),
        )
        self.add_to(server.server)
        if self._access is None:
            self._access = AccessPoint(s.nameservers, service_security(s))
        # an official client's first calls (QueryRoute, RecallMessage) answered as a leader
        # does, every other call NOT_LEADER
        server.server.add_generic_rpc_handlers(
            (AccessPointHandler(self._access), NotLeaderHandler(self))
        )
        return server

    async def stop(self) -> None:
        """Stop; a leader first hands leadership to an in-sync follower (SIGTERM in a rolling
        restart), so that no send fails."""
        leader = self.leader
        if leader is not None and not leader.ended and leader.handing_off is None:
            try:
                record = await self.hand_off("")
                log.info("handed leadership to %s (epoch %d)", record.leader, record.epoch)
            except ApogeeError as exc:
                log.warning("no handoff before stopping: %s", exc)
        self._stopping.set()  # no new role from here
        self._wake.set()
        follower = self.follower
        if follower is not None:
            await follower.leave()  # acknowledgements stop waiting for this replica now
        if self.follower is not None:
            self.follower.stop()
        if self.leader is not None:
            self.leader.step_down("the broker stops")
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        await self._stop_metrics()
        if self._access is not None:
            await self._access.close()
            self._access = None
        with contextlib.suppress(Exception):
            await self.coordination.close()
        if self._close_client is not None:
            with contextlib.suppress(Exception):
                await self._close_client()
            self._close_client = None
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
            self.store = None

    # -- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._step()
            except Exception:  # a replica keeps trying: it never stops on its own
                log.exception("broker %s replica %s", self.settings.broker_name, self.replica_id)
                await self._pause(1.0)

    async def _step(self) -> None:
        """One look at the record, and the role it calls for (led or followed to its end)."""
        try:
            view = await self.coordination.read()
        except UnavailableError as exc:
            log.warning("the coordination engine cannot be reached: %s", exc)
            await self._pause(1.0)
            return
        except ApogeeError as exc:
            log.error("the group's record cannot be read: %s", exc)
            await self._pause(1.0)
            return
        self.record = rec = view.record
        if not view.leader_alive or not rec.leader:
            if rec.successor and rec.successor != self.replica_id:
                # a handoff names another: give it time to take over before campaigning
                if self._successor_since is None:
                    self._successor_since = time.monotonic()
                if time.monotonic() - self._successor_since < HANDOFF_S:
                    await self._pause(POLL_S)
                    return
            self._successor_since = None
            if self._may_lead(rec):
                await self._pause(self._campaign_delay(rec))
                if self._stopping.is_set():
                    return
                won = await self._campaign(view)
                if won is not None:
                    await self._lead(won)
                    return
            await self._pause(POLL_S)
            return
        if rec.leader == self.replica_id:
            await self._pause(POLL_S)  # an older claim of this replica: let it lapse
            return
        await self._follow(rec)

    async def _pause(self, seconds: float) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _may_lead(self, rec: GroupRecord) -> bool:
        if self.settings.unclean_election:
            return True
        if rec.epoch == 0:
            return True  # a new group: everybody is empty
        return self.replica_id in rec.in_sync and not self.unclean

    def _campaign_delay(self, rec: GroupRecord) -> float:
        """The former leader's first follower campaigns first; others a little later (the
        compare-and-set decides anyway: this only saves lost rounds). A successor named by a
        handoff campaigns at once."""
        if rec.successor == self.replica_id:
            return 0.0
        rank = rec.in_sync.index(self.replica_id) if self.replica_id in rec.in_sync else 3
        return 0.05 * rank + random.uniform(0, 0.05)

    async def _campaign(self, view: Versioned) -> Versioned | None:
        rec = view.record
        members = rec.members if self.replica_id in rec.members else (*rec.members, self.replica_id)
        # Everyone in the set has every acknowledged message, so the set carries over, less
        # the old leader: gone after a failure, stopping after most handoffs (it rejoins once it
        # copies again when it stays), and counting it would hold every acknowledgement
        # until then.
        kept = tuple(r for r in rec.in_sync if r not in (self.replica_id, rec.leader))
        new = GroupRecord(
            epoch=rec.epoch + 1,
            leader=self.replica_id,
            leader_address=self.address,
            in_sync=(self.replica_id, *kept),
            members=members,
        )
        try:
            won = await self.coordination.campaign(new, view.version)
        except UnavailableError as exc:
            log.warning("campaign failed: %s", exc)
            return None
        if won is not None:
            log.info(
                "broker %s replica %s leads at epoch %d",
                self.settings.broker_name,
                self.replica_id,
                new.epoch,
            )
        return won

    async def _lead(self, won: Versioned) -> None:
        s = self.settings
        store, epochs = self.store, self.epochs
        assert store is not None
        assert epochs is not None
        self.record = won.record
        await asyncio.to_thread(epochs.begin, won.record.epoch, store.commitlog.max_offset)
        leader = ReplicationLeader(
            LeaderConfig(
                broker_name=s.broker_name,
                replica_id=self.replica_id,
                address=self.address,
                acks=s.acks,
                min_insync=s.min_insync_replicas,
                lag_max_s=s.replica_lag_max_s,
                timeout_s=s.replication_timeout_s,
            ),
            store,
            epochs,
            self.coordination,
            won,
            known_hw=self.known_hw,
        )
        self.leader = leader
        self.role = "LEADER"
        self.terms += 1
        leader.install()
        leader.start()
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        await self._stop_metrics()
        app = BrokerApp(s, self.clock, store=store, replication=leader, replica_services=self)
        self.app = app
        try:
            await app.start()
            await leader.announce(self.address)
            if app.state is not None and app.topics is not None:
                # the term's first record: the table as this leader starts with it (a broker
                # that ran alone before its group formed hands its topics over this way)
                app.state.topics_whole()
        except Exception:
            log.exception("broker %s cannot serve as leader", s.broker_name)
            leader.step_down("the broker could not start")
        with contextlib.suppress(asyncio.CancelledError):
            stop: asyncio.Future[Any] = asyncio.ensure_future(self._stopping.wait())
            lost: asyncio.Future[Any] = leader.lost
            await asyncio.wait({lost, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
        leader.step_down("the broker stops")
        await app.stop()
        self.app = None
        await leader.close()
        leader.uninstall()
        self.leader = None
        self.role = "CANDIDATE"
        with contextlib.suppress(Exception):
            await self.coordination.resign()
        if not self._stopping.is_set():
            server = self._follower_server()
            server.bind()
            await server.start([SERVICE_NAME])
            self._server = server
            await self._ready(False)
            await self._serve_metrics()

    async def _ready(self, in_sync: bool) -> None:
        """The server's overall health (what a readiness probe asks) while this replica does
        not lead: SERVING only while it is in the group's in-sync set, so that a rolling update
        waits for a restarted replica to catch up before it stops the next one. The
        Replication service's own health stays SERVING (liveness)."""
        if self._server is not None:
            await self._server.health.set(
                "",
                health_pb2.HealthCheckResponse.SERVING
                if in_sync
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )

    async def _follow(self, rec: GroupRecord) -> None:
        if self._stopping.is_set():
            return
        s = self.settings
        store, epochs = self.store, self.epochs
        assert store is not None
        assert epochs is not None
        follower = Follower(
            FollowerConfig(
                broker_name=s.broker_name,
                replica_id=self.replica_id,
                address=self.address,
                lost_after_s=max(3.0, self.coordination.lease_s),
            ),
            store,
            epochs,
            service_security(s),
            rec.leader,
            rec.leader_address,
            rec.epoch,
            self.unclean,
        )
        assert self.state_applier is not None
        follower.after_append = self.state_applier.catch_up
        follower.behind = self.state_applier.behind
        self.follower = follower
        self.role = "FOLLOWER"
        run = asyncio.create_task(follower.run())
        successor = False
        try:
            while not run.done() and not self._stopping.is_set():
                await asyncio.wait({run}, timeout=POLL_S)
                if run.done():
                    break
                try:
                    view = await self.coordination.read()
                except ApogeeError:
                    continue  # no engine: keep following
                now = view.record
                if now.epoch != rec.epoch or now.leader != rec.leader or not view.leader_alive:
                    # named successor in a handoff: the leader waited until this replica had
                    # its whole log, so no answer in flight holds anything for it
                    successor = now.successor == self.replica_id
                    break
                self.record = now  # the in-sync set and the leader's client address move
                await self._ready(self.replica_id in now.in_sync)
            follower.stop()
            # its stream is cancelled at once (a cut network would hold a read): do not wait long
            done, _ = await asyncio.wait({run}, timeout=0 if successor else 0.2)
            if not done:
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run
                why = "stopped (its stream from the old leader cut short)"
            else:
                why = run.result()
            await self._ready(False)
            log.info(
                "broker %s replica %s stops following: %s", s.broker_name, self.replica_id, why
            )
            if why.startswith("replication failed"):
                await self._pause(1.0)  # not something the next attempt mends at once
        finally:
            follower.stop()
            if not run.done():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run
            self.unclean = follower.unclean
            self.known_hw = max(self.known_hw, follower.high_watermark)
            self.follower = None
            self.role = "CANDIDATE"

    # -- what the servicer asks -----------------------------------------------------------------

    def leading(self, broker_name: str) -> ReplicationLeader:
        leader = self.leader
        if broker_name and broker_name != self.settings.broker_name:
            raise NotLeaderError(
                broker=broker_name,
                replica=self.replica_id,
                detail=f"this replica belongs to broker {self.settings.broker_name!r}",
            )
        if leader is None or leader.ended:
            raise self.not_leader()
        return leader

    def not_leader(self) -> NotLeaderError:
        rec = self.record
        return not_leader(
            self.settings.broker_name,
            self.replica_id,
            rec.leader if rec.leader != self.replica_id else "",
            rec.client_address or rec.leader_address,
            rec.epoch,
        )

    async def hand_off(self, target: str) -> GroupRecord:
        """Hand leadership to ``target`` (an in-sync follower; "": the most caught-up one)
        and end this term once it serves; returns the group's record with the new leader.
        Writes that arrive meanwhile are held, then answered NOT_LEADER (the client retries
        at the successor): a controlled switch fails no send."""
        leader = self.leading("")
        leader.successor_for(target)  # none: refused before anything is held or drained
        log.info(
            "broker %s replica %s hands leadership over (epoch %d)%s",
            self.settings.broker_name,
            self.replica_id,
            leader.epoch,
            f" to {target}" if target else "",
        )
        app = self.app
        if app is not None and app.offsets is not None and app.state is not None:
            # the successor starts from the group's offsets as they are now
            await app.offsets.persist()
            await app.state.drain(HANDOFF_S)
        record = await leader.hand_off(target, HANDOFF_S)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANDOFF_S
        now = record
        successor = leader.followers.get(record.successor)

        def quiet() -> bool:
            """True while the successor may still be taking over: it was heard from lately (it
            stops copying once it campaigns, and campaigns within moments)."""
            last = successor.last_heard if successor is not None else 0.0
            return time.monotonic() - last < 1.0

        try:
            while loop.time() < deadline:
                try:
                    view = await self.coordination.read()
                except ApogeeError:
                    view = None
                if (
                    view is not None
                    and view.record.epoch > leader.epoch
                    and view.leader_alive
                    and view.record.client_address  # it serves and is registered
                ):
                    now = view.record
                    break
                if view is not None and view.record.epoch == leader.epoch and not quiet():
                    break  # the successor neither copies nor campaigns: it is gone too
                await asyncio.sleep(0.02)  # a poll with a deadline: the successor's campaign
        finally:
            leader.successor_serves()
            leader.step_down(f"it handed leadership to {record.successor}")
        if now.epoch <= leader.epoch:
            raise NotLeaderError(
                broker=self.settings.broker_name,
                replica=self.replica_id,
                detail=f"it gave up leadership, but {record.successor} did not take over "
                f"within {HANDOFF_S}s; the group elects a leader as after a failure",
            )
        return now

    def describe(self) -> pb.DescribeReplicaResponse:
        s = self.settings
        store = self.store
        end = store.commitlog.max_offset if store is not None else 0
        leader = self.leader
        out = pb.DescribeReplicaResponse(
            broker_name=s.broker_name,
            replica_id=self.replica_id,
            role=self.role,
            epoch=leader.epoch if leader is not None else self.record.epoch,
            leader_id=self.record.leader,
            leader_address=self.record.client_address or self.record.leader_address,
            log_end=end,
            acks=s.acks,
            min_insync_replicas=s.min_insync_replicas,
            eligible=self._may_lead(self.record),
        )
        if leader is not None:
            out.high_watermark = leader.hw
            out.in_sync.extend(sorted(leader.in_sync))
            now = time.monotonic()
            for f in leader.followers.values():
                out.followers.append(
                    pb.FollowerInfo(
                        replica_id=f.replica_id,
                        address=f.address,
                        in_sync=f.replica_id in leader.in_sync,
                        offset=f.offset,
                        lag_bytes=max(0, leader.written_end - f.offset),
                        lag_seconds=max(0.0, now - f.caught_up_at)
                        if f.offset < leader.written_end
                        else 0.0,
                    )
                )
        elif self.follower is not None:
            out.high_watermark = self.follower.high_watermark
            out.in_sync.extend(self.record.in_sync)
        return out
