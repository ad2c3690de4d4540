"""A replica group's leader cut off by a network partition acknowledges nothing, a new leader
serves within seconds, and the old one cuts its divergent tail and rejoins once the network
heals (docs/replication.md, "An isolated old leader acknowledges nothing").

Each replica runs in a network namespace of its own (:mod:`e2e.netns`), joined by a veth pair
to a bridge of the root namespace where etcd and the nameserver listen; the producer runs in
the root namespace. The cut sets the leader's veth down: it loses its followers, etcd and the
nameserver at once, and every packet to or from it is dropped. A raw producer inside its
namespace keeps sending to it directly throughout, so that it stores messages nobody else has
(the tail it must cut later). Sends and reads are checked Jepsen-style
(:class:`e2e.replication_support.History`), and the replicas' CommitLogs are compared byte for
byte at the end.

Needs root and ``ip netns``; skipped, saying so, without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apogee.client import Producer
from apogee.store import MessageStore
from apogee.store.epochs import EpochFile
from apogee.testkit.etcd import EtcdServer
from apogee.testkit.waiting import eventually
from apogee.v1 import replication_pb2
from apogee_broker.settings import load_settings as broker_settings
from e2e import netns
from e2e.netns import Network
from e2e.replication_support import Load, Replica, ReplicaGroup, read_messages

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "PartitionedOrders"
#: the bound of the design: a new leader acknowledges sends within this long of the cut
NEW_LEADER_S = 5.0
#: the producer's deadline per send (see the test)
SEND_TIMEOUT_S = 1.0
#: the raw sends from inside the cut namespace: one every INSIDE_EVERY_S for INSIDE_SENDS
INSIDE_SENDS = 16
INSIDE_EVERY_S = 0.25
#: how a send to the cut-off leader may end: refused, not confirmed, never answered, or (plain
#: UNAVAILABLE, from gRPC itself) a connection refused while the replica switches roles: having
#: stepped down it closes the broker's server, and opens the follower's on the same port once
#: the broker has stopped (its unregistration from the unreachable nameserver waits out its
#: deadline first); or (CANCELLED, from gRPC itself) a call that came in as the stepping-down
#: broker's server was stopping, ended by the server
NOT_ACKNOWLEDGED = {
    "NOT_REPLICATED",
    "NOT_ENOUGH_REPLICAS",
    "NOT_LEADER",
    "DEADLINE_EXCEEDED",
    "UNAVAILABLE",
    "CANCELLED",
}
#: outcomes that may have stored the message (the rest stored nothing)
MAYBE_STORED = {"NOT_REPLICATED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED"}
#: what follower.py logs when it cuts its log back to the consistent point
CUT = re.compile(
    r"cut (\d+) bytes past offset (\d+), which the leader (\w+) \(epoch (\d+)\) does not have"
)


@pytest.fixture
def network() -> Iterator[Network]:
    """A bridge and a namespace per replica, removed after the test whatever happened."""
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"the partition test needs network namespaces: {why}")
    with Network(3) as net:
        yield net


@dataclass(frozen=True)
class InsideSend:
    body: str
    began: float
    ended: float
    outcome: str
    detail: str


class InsideSender:
    """``python -m e2e.netns send`` run in namespace ``i``, sending to ``address`` once told to
    go (:meth:`go`); its outcomes read by :meth:`outcomes`."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc = proc
        self.log = log

    @classmethod
    async def start(cls, net: Network, i: int, address: str, log: Path) -> InsideSender:
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *net.exec_prefix(i),
                *(sys.executable, "-m", "e2e.netns", "send", address, TOPIC),
                *(str(INSIDE_SENDS), str(INSIDE_EVERY_S)),
                cwd=ROOT,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        sender = cls(proc, log)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line.strip() == b"ready", f"the inside sender: {line!r}\n{sender.errors()}"
        except BaseException:
            sender.kill()
            raise
        return sender

    async def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()

    async def outcomes(self, timeout: float) -> list[InsideSend]:
        """Every send's outcome, once the sender has ended (at most ``timeout`` seconds)."""
        assert self.proc.stdout is not None
        out, _ = await asyncio.wait_for(self.proc.communicate(), timeout)
        assert self.proc.returncode == 0, f"the inside sender exited {self.proc.returncode}"
        got = [InsideSend(**json.loads(line)) for line in out.decode().splitlines()]
        assert len(got) == INSIDE_SENDS, (got, self.errors())
        return got

    def errors(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


def read_log(replica: Replica) -> tuple[int, bytes]:
    """A stopped replica's CommitLog: where it starts, and its bytes from there to its end."""
    cfg = broker_settings(env=replica.env).store_config()
    size = cfg.commitlog_file_size
    parts = []
    with MessageStore.open(replica.data_dir, cfg, start_retention=False) as store:
        log = store.commitlog
        start, end = log.min_offset, log.max_offset
        at = start
        while at < end:
            n = min(end, (at // size + 1) * size) - at  # a read stays within one file
            parts.append(log.read(at, n))
            at += n
    return start, b"".join(parts)


def epoch_start(replica: Replica, epoch: int) -> int:
    """Where ``epoch`` begins in a stopped replica's CommitLog (its epoch checkpoint)."""
    epochs = EpochFile(replica.data_dir / "epochs")
    epochs.load()
    starts = {e.epoch: e.start_offset for e in epochs.entries}
    assert epoch in starts, f"replica {replica.index} has no epoch {epoch}: {epochs.entries}"
    return starts[epoch]


#: the log lines that tell who led when
_ROLES = re.compile(r"leads at epoch|steps down|stops following|follows|cut \d+ bytes|registered")


def timeline(group: ReplicaGroup) -> str:
    """Every replica's log lines about roles, in time order (each line starts with its time)."""
    lines = [
        line.replace(" ", f" replica {r.index}: ", 1)
        for r in group.replicas
        for p in r.logs()
        for line in p.read_text(errors="replace").splitlines()
        if _ROLES.search(line)
    ]
    return "\n".join(sorted(lines))


def logged_cuts(replica: Replica) -> list[re.Match[str]]:
    return [m for p in replica.logs() for m in CUT.finditer(p.read_text(errors="replace"))]


async def caught_up(group: ReplicaGroup) -> tuple[int, int]:
    """Wait until the leader has three replicas in sync and no follower lags; its high
    watermark and log end then."""
    found: list[tuple[int, int]] = []

    async def level() -> bool:
        got = await group.leader()
        if got is None:
            return False
        d = got[1]
        if len(d.in_sync) < 3 or any(f.lag_bytes for f in d.followers):
            return False
        found.append((d.high_watermark, d.log_end))
        return True

    await eventually(level, 30, "every follower caught up", every=0.05, detail=group.logs)
    return found[-1]


async def new_leader(
    group: ReplicaGroup, old: Replica
) -> tuple[Replica, replication_pb2.DescribeReplicaResponse]:
    """The replica other than ``old`` that leads, once one does (the cut-off ``old`` is not
    asked: it would cost a timeout per poll)."""
    found: list[tuple[Replica, replication_pb2.DescribeReplicaResponse]] = []

    async def leads() -> bool:
        for r in group.replicas:
            d = None if r is old else await group.describe(r)
            if d is not None and d.role == "LEADER":
                found.append((r, d))
                return True
        return False

    await eventually(leads, 15, "a new leader", every=0.02, detail=group.logs)
    return found[-1]


async def test_a_partitioned_leader_acknowledges_nothing_and_rejoins(
    tmp_path: Path, network: Network
) -> None:
    net = network
    places = [(net.namespace(i), net.host(i)) for i in range(3)]
    with EtcdServer(tmp_path / "etcd", host=net.gateway) as etcd:
        async with ReplicaGroup(
            tmp_path / "group",
            coordination="etcd",
            etcd_endpoint=etcd.endpoint,
            host=net.gateway,
            namespaces=places,
        ) as group:
            # Sends to the cut-off leader hang until their deadline (no reset crosses the
            # partition), and a send starts on the route the producer has: with the default 3 s
            # a round of sends begun just before the route changes waits 3 s more. A shorter
            # deadline measures the group rather than the producer's timeout.
            async with Producer(
                group.namesrv, route_refresh_interval=0.5, send_timeout=SEND_TIMEOUT_S
            ) as producer:
                load = Load(producer, TOPIC)
                h = load.history
                sending = asyncio.create_task(load.run())
                inside: InsideSender | None = None
                try:
                    await load.until_acked(200, 30)
                    got = await group.leader()
                    assert got is not None
                    old, before = got[0], got[1]
                    k = group.replicas.index(old)
                    inside = await InsideSender.start(net, k, old.address, tmp_path / "inside.log")
                    cut_at = net.cut(k)
                    await inside.go()
                    new, elected = await new_leader(group, old)
                    elected_after = time.monotonic() - cut_at
                    await load.until_acked(100, 30)  # the new leader serves the producer
                    sent_inside = await inside.outcomes(30)
                    healed_at = net.heal(k)
                    await group.wait_in_sync(3, timeout=30)
                    rejoined_after = time.monotonic() - healed_at
                    await load.until_acked(100, 30)
                finally:
                    load.stop.set()
                    await asyncio.wait_for(sending, 30)
                    if inside is not None:
                        inside.kill()
            hw, end = await caught_up(group)
            leader = await group.wait_leader()
            for r in group.replicas:
                assert r.proc is not None
                assert await r.proc.terminate(20) == 0, r.proc.output()[-3000:]

    # 1. the cut-off leader acknowledged nothing: the sends from inside its namespace all failed
    wrong = [s for s in sent_inside if s.outcome not in NOT_ACKNOWLEDGED]
    assert not wrong, wrong
    # ... and every acknowledgement of a send begun after the cut is in the new leader's epoch
    messages = read_messages(leader, TOPIC)
    offset_of = dict(messages)
    new_epoch = elected.epoch
    assert new_epoch > before.epoch
    epoch_of_new = epoch_start(leader, new_epoch)
    acked_after_cut = {b for b, (began, _) in h.ack_times.items() if began > cut_at}
    old_epoch_acks = sorted(
        b for b in acked_after_cut if b in offset_of and offset_of[b] < epoch_of_new
    )
    assert not old_epoch_acks, f"acknowledged after the cut, in the old epoch: {old_epoch_acks}"

    # 2. a new leader acknowledged the producer's sends within NEW_LEADER_S of the cut
    first_ack = min((e for b, e in h.ack_times.values() if b > cut_at), default=cut_at + 99)
    first_ack -= cut_at
    assert first_ack < NEW_LEADER_S, (
        f"the first acknowledgement after the cut: {first_ack:.2f}s (a new leader elected "
        f"{elected_after:.2f}s after it)\n" + timeline(group)
    )
    during = [b for b in acked_after_cut if h.ack_times[b][1] < healed_at]

    # 3. the old leader cut what only it had, and rejoined (wait_in_sync above)
    cuts = logged_cuts(old)
    assert cuts, "the old leader's log shows no cut:\n" + group.logs()
    assert any(int(m[1]) > 0 and m[3] == elected.replica_id for m in cuts), [m[0] for m in cuts]
    inside_bodies = {s.body for s in sent_inside}
    assert not inside_bodies & set(offset_of), "the old leader's cut tail came back"

    # 4. nothing acknowledged lost, nothing duplicated, unexpected or stored although refused
    for s in sent_inside:
        (h.unknown if s.outcome in MAYBE_STORED else h.failed).add(s.body)
    h.read.update(b for b, _ in messages)
    verdict = h.check()
    assert verdict == {kind: [] for kind in verdict}, {k: v[:10] for k, v in verdict.items()}

    # 5. the replicas' logs are equal as far as the shortest goes, the high watermark at least
    logs = [read_log(r) for r in group.replicas]
    start = max(s for s, _ in logs)
    upto = min(s + len(b) for s, b in logs)
    assert upto >= hw, f"a replica's log ends at {upto}, below the high watermark {hw}"
    firsts = [b[start - s : upto - s] for s, b in logs]
    differ = [r.index for r, b in zip(group.replicas, firsts, strict=True) if b != firsts[0]]
    assert not differ, f"replicas {differ} differ from replica 0 below offset {upto}"

    outcomes = ", ".join(
        f"{s.outcome} at {s.began - cut_at:.2f}s"
        for s in sorted(sent_inside, key=lambda s: s.began)
    )
    print(
        f"partition of leader {old.index}: replica {new.index} elected {elected_after:.2f}s "
        f"after the cut, first acknowledgement {first_ack:.2f}s after it; {len(during)} "
        f"acknowledged during "
        f"the partition (epoch {before.epoch} -> {new_epoch}); inside the cut: "
        f"{len(sent_inside)} sends, none acknowledged ({outcomes}); the old leader "
        f"cut {sum(int(m[1]) for m in cuts)} bytes and rejoined {rejoined_after:.2f}s after "
        f"the heal; {len(h.acked)} acknowledged, {len(h.failed)} refused, {len(h.unknown)} "
        f"unknown; logs equal up to {upto} (high watermark {hw}, leader's end {end})"
    )
