"""Axis ``timers`` of the scale benchmark: how the schedule service and the broker fare with many
timer messages pending, against a real cluster (``apogee.local.cluster``: one nameserver, one
broker and the schedule service as processes, async flush, free ports; a fresh data directory
at each step). Steps: 10,000, 1,000,000, 5,000,000 pending timer messages by default.

At each step:

- ``send_s``, ``sends_per_s``, ``send_errors``: sending the ``n`` timer messages (64-byte
  bodies) through a ``Producer``, at most ``--send-window`` unsettled, their delivery times spread
  over 1 to 2 hours from now (:data:`FAR_FROM_S`, :data:`FAR_SPAN_S`), so that they all stay
  pending while the step runs;
- ``schedule_idle_rss_mb``: the schedule service's resident memory before the sends;
  ``schedule_rss_mb``, ``schedule_fds``, ``schedule_maps``: with the ``n`` pending (after the
  probes, below); ``per_pending_timer_b``: the growth per pending message, in bytes;
- ``broker_rss_mb``, ``broker_fds``, ``broker_maps``: the broker's, with the ``n`` pending;
  ``broker_data_mb``: the size of its data directory (the files' lengths; preallocated files
  count whole) and ``broker_data_disk_mb``: the blocks they occupy;
- ``probes_sent``, ``probes_received``, ``probes_duplicates``, ``probes_early``: with the ``n``
  pending, ``--probes`` timer messages on a topic of their own, due spread over the
  :data:`PROBE_SPAN_S` seconds that start :data:`PROBE_AHEAD_S` seconds after the sending
  began, consumed by a ``PushConsumer``; every one must arrive, none twice, none before its
  time;
- ``late_p50_ms``, ``late_p99_ms``, ``late_max_ms``: the probes' lateness, the time the
  listener got a probe (this machine's clock) minus the time it was due (what it carries in
  its body): the schedule service's reaction, the broker's append and the consumer's pull;
- ``schedule_restart_s``: after ``kill -9`` of the schedule service, until it is started again
  and serving (overall health SERVING: it holds the leadership and delivers);
  ``schedule_restart_rss_mb``: its resident memory then; ``restart_probes_*`` and
  ``restart_late_*``: a tenth as many probes again, the same way, and
  ``schedule_settled_rss_mb``: its memory once they came; ``restart_probes_redelivered``:
  copies of the first probes delivered again meanwhile (what was resolved since the service's
  last progress commit is resolved again: at-least-once); ``--no-restart`` skips it.

The schedule service reads only the timer wheel's active slots (see
``apogee_schedule.core.layout``): messages due further ahead than a few slot widths stay in the
broker's schedule queues, so they should cost it nothing; ``per_pending_timer_b`` checks that.

    python bench/scale_bench.py --axis timers --steps 10000,100000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import struct
import time
from pathlib import Path
from typing import Any, Final

from figures import percentile
from load import create_topics, windowed_sends
from scale_common import Step, proc_facts, run

from apogee.client import ConsumeFrom, Message, Producer, PushConsumer, ReceivedMessage
from apogee.local import cluster as local_cluster
from apogee.testkit.waiting import eventually

DEFAULT_STEPS: Final = [10_000, 1_000_000, 5_000_000]
PENDING_TOPIC: Final = "ScaleTimers"
PROBE_TOPIC: Final = "ScaleTimerProbes"
PROBE_GROUP: Final = "scale-timer-probes"
QUEUES: Final = 8
BODY_BYTES: Final = 64
PENDING_BODY: Final = b"p" * BODY_BYTES
#: the pending messages are due from this many seconds after their sending began ...
FAR_FROM_S: Final = 3600.0
#: ... over this many seconds, in groups of equal delivery time: at most FAR_GROUPS, each of
#: at least four send windows (a group's sends settle before the next one starts)
FAR_SPAN_S: Final = 3600.0
FAR_GROUPS: Final = 120
#: a probe carries its index and its delivery time (ms since the epoch) in its body
PROBE: Final = struct.Struct(">qq")
PROBE_PAD: Final = b"q" * (BODY_BYTES - PROBE.size)
#: the probes are due from this many seconds after their sending began, over PROBE_SPAN_S
PROBE_AHEAD_S: Final = 5.0
PROBE_SPAN_S: Final = 25.0
#: how long the probes may come after the last one is due
PROBE_GRACE_S: Final = 60.0
MiB: Final = 1 << 20


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def schedule_pid(step: Step) -> int:
    """The schedule service's process, from the cluster's state."""
    return step.state.schedule[0].pid


def data_size(root: Path) -> tuple[float, float]:
    """The files under ``root``: their lengths and the blocks they occupy, in MiB."""
    length = blocks = 0
    for p in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            if p.is_file():
                length += st.st_size
                blocks += st.st_blocks * 512
    return round(length / MiB, 1), round(blocks / MiB, 1)


async def send_pending(namesrv: str, n: int, window: int) -> dict[str, Any]:
    """``n`` timer messages due from :data:`FAR_FROM_S` on, spread over :data:`FAR_SPAN_S`."""
    groups = max(1, min(n // (4 * window), FAR_GROUPS))
    start = time.time() + FAR_FROM_S
    sent = errors = 0
    t0 = time.perf_counter()
    async with Producer(namesrv, send_timeout=60) as producer:
        for g in range(groups):
            count = n * (g + 1) // groups - sent
            due = start + g * FAR_SPAN_S / groups
            msg = Message(PENDING_TOPIC, PENDING_BODY, deliver_at=due)
            got = await windowed_sends(producer, msg, count, window, settle_timeout_s=600)
            errors += got.errors
            sent += count
    took = time.perf_counter() - t0
    return {
        "send_s": round(took, 2),
        "sends_per_s": round(n / took) if took else 0,
        "send_errors": errors,
    }


async def probe(namesrv: str, count: int, first_index: int = 0) -> dict[str, Any]:
    """``count`` timer messages (indexes from ``first_index`` on) due over the next
    :data:`PROBE_SPAN_S` seconds, consumed; their lateness at the listener. Copies of earlier
    probes (below ``first_index``) that come meanwhile are counted as ``probes_redelivered``."""
    first: dict[int, float] = {}  # probe index -> lateness (ms) of its first copy
    dups = early = redelivered = 0

    async def listen(msgs: list[ReceivedMessage]) -> None:
        nonlocal dups, early, redelivered
        got = time.time() * 1000
        for m in msgs:
            if len(m.body) < PROBE.size or m.body[PROBE.size :] != PROBE_PAD:
                continue  # the readiness message
            index, due = PROBE.unpack_from(m.body)
            if index < first_index:
                redelivered += 1
                continue
            if index in first:
                dups += 1
                continue
            first[index] = got - due
            if got < due:
                early += 1

    ready = Message(PROBE_TOPIC, b"ready")
    readiness: list[int] = []

    async def listen_ready(msgs: list[ReceivedMessage]) -> None:
        readiness.extend(1 for m in msgs if m.body == b"ready")
        await listen(msgs)

    consumer = PushConsumer(namesrv, PROBE_GROUP, listen_ready, consume_from=ConsumeFrom.EARLIEST)
    consumer.subscribe(PROBE_TOPIC)
    async with consumer, Producer(namesrv) as producer:
        await consumer.start()
        # the consumer holds the topic's queues once a plain message reaches it
        await producer.send(ready)
        await eventually(lambda: bool(readiness), 30, "the probe consumer got a message")
        base = now_ms() + int(PROBE_AHEAD_S * 1000)
        span = int(PROBE_SPAN_S * 1000)
        sends = []
        for i in range(count):
            due = base + i * span // count
            body = PROBE.pack(first_index + i, due) + PROBE_PAD
            msg = Message(PROBE_TOPIC, body, deliver_at=due / 1000)
            sends.append(producer.send(msg))
        results = await asyncio.gather(*sends, return_exceptions=True)
        failed = sum(isinstance(r, BaseException) for r in results)
        wait_s = (base + span - now_ms()) / 1000 + PROBE_GRACE_S
        with contextlib.suppress(AssertionError):  # what is missing is reported
            await eventually(
                lambda: len(first) >= count - failed, wait_s, "every probe received", every=0.1
            )
    late = sorted(first.values())
    return {
        "probes_sent": count - failed,
        "probes_received": len(first),
        "probes_duplicates": dups,
        "probes_early": early,
        "probes_redelivered": redelivered,
        "late_p50_ms": round(percentile(late, 0.50), 1),
        "late_p99_ms": round(percentile(late, 0.99), 1),
        "late_max_ms": round(late[-1], 1) if late else 0.0,
    }


def restart_schedule(step: Step, probes: int, first_index: int) -> dict[str, Any]:
    """``kill -9`` the schedule service, start it again; seconds until it is serving, its
    memory then, and once it delivers again (``probes`` more probes, their lateness; the
    copies of earlier probes that it delivers again, at least once, come meanwhile)."""
    pid = schedule_pid(step)
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    t0 = time.perf_counter()
    member = local_cluster.restart(step.state, "schedule", timeout=120)
    took = time.perf_counter() - t0
    row: dict[str, Any] = {
        "schedule_restart_s": round(took, 2),
        "schedule_restart_rss_mb": proc_facts(member.pid)["rss_mb"],
    }
    again = run(probe(step.namesrv, probes, first_index))
    row |= {f"restart_{k}": v for k, v in again.items() if k.startswith(("probes_", "late_"))}
    row["schedule_settled_rss_mb"] = proc_facts(member.pid)["rss_mb"]
    return row


def axis_timers(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"axis": "timers", "step": n}
    window = getattr(args, "send_window", 2_000)
    probes = getattr(args, "probes", 2_000)
    with Step(base, f"timers-{n}", schedule=True) as step:
        run(create_topics(step.namesrv, [PENDING_TOPIC, PROBE_TOPIC], queues=QUEUES))
        idle = proc_facts(schedule_pid(step))
        row["schedule_idle_rss_mb"] = idle["rss_mb"]
        row |= run(send_pending(step.namesrv, n, window))
        row |= run(probe(step.namesrv, probes))
        pending = proc_facts(schedule_pid(step))
        row |= {f"schedule_{k}": v for k, v in pending.items()}
        row["per_pending_timer_b"] = round((pending["rss_mb"] - idle["rss_mb"]) * MiB / n, 1)
        row |= {f"broker_{k}": v for k, v in proc_facts(step.pid).items()}
        data = Path(step.broker.data_dir)
        row["broker_data_mb"], row["broker_data_disk_mb"] = data_size(data)
        if not getattr(args, "no_restart", False):
            try:
                row |= restart_schedule(step, max(1, probes // 10), probes)
            except Exception as exc:  # a wall: the service does not come back
                row["schedule_restart_failed"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
    return row
