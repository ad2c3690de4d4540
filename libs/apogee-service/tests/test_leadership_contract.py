"""What every leadership backend (:class:`apogee.service.leadership.Leadership`) promises, one
suite run against each: the file lock and the Kubernetes Lease (against the API server
stand-in :mod:`apogee.testkit.apiserver`, with the real ``kubernetes`` client).

- Of candidates trying at once, one leads; it stays the leader when it tries again, the others
  stay standbys, and a standby's :meth:`~Leadership.holder` names the leader.
- A leader keeps leading while it lives, however long the others try.
- A released leader hands over promptly, to one standby at a time.
- A leader that dies (``kill -9``, nothing released) is taken over by one standby, within the
  backend's bound and, for a lease, not before the lease ran out.
- Release is bounded and safe to repeat, and does nothing for a candidate that does not lead;
  a standby's :meth:`~Leadership.acquire` can be cancelled at once; a released leader can lead
  again.

A backend added later (etcd, say) gets a :class:`Backend` in :func:`backend` and passes all of
this before anything else of it is trusted. Backend-specific behaviour (what a Lease records,
renewals that fail, leadership taken away) is tested beside it (``test_lease.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pytest

from apogee.service.leadership import FileLockLeadership
from apogee.service.lease import lease_leadership
from apogee.testkit.apiserver import FakeApiServer
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

#: how many candidates the tests run at once
CANDIDATES = 4
#: a release, a cancelled acquire: at most this long
PROMPT_S = 2.0

# the Lease's timings (seconds): short, and in the order the Lease demands
NS = "apogee"
LEASE = "apogee-contract"
DURATION = 2
DEADLINE = 1.0
RETRY = 0.2


class Candidate(Protocol):
    """A :class:`~apogee.service.leadership.Leadership`, with ``held``: whether it leads now."""

    poll_s: float

    @property
    def held(self) -> bool: ...

    async def try_acquire(self) -> bool: ...

    async def acquire(self) -> None: ...

    async def release(self) -> None: ...

    def holder(self) -> str: ...


@dataclass
class Backend:
    """How the suite drives one backend."""

    name: str
    #: a new candidate of the same election, named ``identity``
    new: Callable[[str], Candidate]
    #: the candidate a process makes (a Python expression), and that process's environment
    holder_code: str
    holder_env: dict[str, str]
    #: what a standby's holder() shows of a leader named ``identity`` in process ``pid``
    shows: Callable[[str, int], str]
    #: after the leader dies: a standby leads not before, and at most, this many seconds later
    takeover_s: tuple[float, float]
    #: after the leader releases: a standby leads within this many seconds
    handover_s: float
    made: list[Candidate] = field(default_factory=list)

    def candidate(self, identity: str) -> Candidate:
        c = self.new(identity)
        self.made.append(c)
        return c


def lock_backend(folder: Path) -> Backend:
    lock = folder / "run" / "leader.lock"
    return Backend(
        name="lock",
        new=lambda identity: FileLockLeadership(lock, poll_s=0.02),
        holder_code=f"FileLockLeadership(Path({str(lock)!r}), poll_s=0.02)",
        holder_env=dict(os.environ),
        shows=lambda identity, pid: f"pid {pid} on ",
        # the kernel drops a dead holder's lock: the next try of a standby wins
        takeover_s=(0.0, 1.0),
        handover_s=1.0,
    )


def lease_backend(api: FakeApiServer, folder: Path) -> Backend:
    env = {**os.environ, "KUBECONFIG": str(api.kubeconfig(folder / "kubeconfig"))}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    timings = f"{DURATION}, {DEADLINE}, {RETRY}"
    return Backend(
        name="lease",
        new=lambda identity: lease_leadership(
            NS, LEASE, identity, DURATION, DEADLINE, RETRY, api_client_factory=api.api_client
        ),
        holder_code=f"lease_leadership({NS!r}, {LEASE!r}, 'pod-held', {timings})",
        holder_env=env,
        shows=lambda identity, pid: f"({identity})",
        # a dead holder renews nothing: taken once the Lease went its duration unrenewed (its
        # last renewal at most a retry period before the death), at a standby's next try
        takeover_s=(DURATION - RETRY - 0.1, DURATION + 2 * RETRY + 1.0),
        # a release clears the holder: taken at a standby's next try
        handover_s=DURATION / 2,
    )


@pytest.fixture(params=["lock", "lease"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    """Each backend in turn; every candidate a test made is released at its end."""
    with contextlib.ExitStack() as stack:
        if request.param == "lease":
            b = lease_backend(stack.enter_context(FakeApiServer()), tmp_path)
        else:
            b = lock_backend(tmp_path)
        try:
            yield b
        finally:
            for c in b.made:
                await c.release()


def leaders(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.held]


async def cancelled(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


HOLDER = """
import asyncio, sys
from pathlib import Path
from apogee.service.leadership import FileLockLeadership
from apogee.service.lease import lease_leadership

async def main() -> None:
    lead = {code}
    await lead.acquire()
    print("leading", flush=True)
    await asyncio.to_thread(sys.stdin.read)

asyncio.run(main())
"""


@pytest.fixture
def holder_process(backend: Backend) -> Iterator[subprocess.Popen[bytes]]:
    """A process that leads (it has said so) until it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(code=backend.holder_code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=backend.holder_env,
    )
    with proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"leading\n"  # b"" if it died
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)


# -- the contract ---------------------------------------------------------------------------------


async def test_of_candidates_trying_at_once_one_leads_and_the_others_name_it(
    backend: Backend,
) -> None:
    candidates = [backend.candidate(f"pod-{i}") for i in range(CANDIDATES)]
    won = await asyncio.gather(*(c.try_acquire() for c in candidates))
    assert sum(won) == 1, won
    leader = candidates[won.index(True)]
    assert leaders(candidates) == [leader]
    assert await leader.try_acquire()  # already leading: still True
    for c in candidates:
        if c is not leader:
            assert not await c.try_acquire()
            assert backend.shows(f"pod-{won.index(True)}", os.getpid()) in c.holder()
    assert leaders(candidates) == [leader]


async def test_a_leader_keeps_leading_while_it_lives(backend: Backend) -> None:
    leader, standby = backend.candidate("pod-a"), backend.candidate("pod-b")
    assert await leader.try_acquire()
    # a standby tries for longer than a dead leader would be taken over in, and once more
    # after that: a live leader is never taken over
    bound = backend.takeover_s[1]
    start = time.monotonic()
    tries = 0
    while True:
        past = time.monotonic() - start > bound
        assert not await standby.try_acquire(), f"taken over after {time.monotonic() - start}s"
        tries += 1
        if past:
            break
        await asyncio.sleep(standby.poll_s)  # a standby's pace
    assert tries >= 2
    assert leader.held
    assert not standby.held


async def test_a_released_leader_hands_over_promptly_to_one_standby_at_a_time(
    backend: Backend,
) -> None:
    candidates = [backend.candidate(f"pod-{i}") for i in range(CANDIDATES)]
    leader, standbys = candidates[0], candidates[1:]
    assert await leader.try_acquire()
    waiting = {asyncio.create_task(s.acquire()): s for s in standbys}
    try:
        await eventually(
            lambda: all(backend.shows("pod-0", os.getpid()) in s.holder() for s in standbys),
            5,
            "every standby has seen the leader",
        )
        assert not any(t.done() for t in waiting)
        for _ in range(len(standbys)):  # each leader releases in turn
            released = time.monotonic()
            await leader.release()
            done, _pending = await asyncio.wait(
                waiting, timeout=backend.handover_s + 1.0, return_when=asyncio.FIRST_COMPLETED
            )
            took = time.monotonic() - released
            assert len(done) == 1, f"{len(done)} took over after {took:.2f}s"
            [task] = done
            task.result()
            leader = waiting.pop(task)
            assert took < backend.handover_s, took
            assert leaders(candidates) == [leader]
    finally:
        await cancelled(list(waiting))


async def test_a_leader_that_dies_is_taken_over_by_one_standby_within_the_bound(
    backend: Backend, holder_process: subprocess.Popen[bytes]
) -> None:
    standbys = [backend.candidate(f"pod-{i}") for i in range(CANDIDATES - 1)]
    for s in standbys:
        assert not await s.try_acquire()
        assert backend.shows("pod-held", holder_process.pid) in s.holder()
    waiting = {asyncio.create_task(s.acquire()): s for s in standbys}
    try:
        holder_process.kill()  # kill -9: nothing is released
        holder_process.wait(5)
        killed = time.monotonic()
        low, high = backend.takeover_s
        done, _pending = await asyncio.wait(
            waiting, timeout=high + 1.0, return_when=asyncio.FIRST_COMPLETED
        )
        took = time.monotonic() - killed
        assert len(done) == 1, f"{len(done)} took over after {took:.2f}s"
        [task] = done
        task.result()
        assert low <= took <= high, took
        assert leaders(standbys) == [waiting[task]]
    finally:
        await cancelled(list(waiting))


async def test_release_is_bounded_safe_to_repeat_and_nothing_for_a_standby(
    backend: Backend,
) -> None:
    leader, standby, other = (backend.candidate(f"pod-{i}") for i in range(3))
    await standby.release()  # never led: nothing happens
    assert await leader.try_acquire()
    assert not await standby.try_acquire()
    await asyncio.wait_for(standby.release(), PROMPT_S)  # a standby's release takes nothing
    assert leaders([leader, standby, other]) == [leader]
    assert not await other.try_acquire()

    trying = asyncio.create_task(standby.acquire())
    await asyncio.sleep(0)  # under way
    trying.cancel()  # a standby's acquire stops at once when cancelled
    await asyncio.wait_for(asyncio.gather(trying, return_exceptions=True), PROMPT_S)
    assert not standby.held

    await asyncio.wait_for(leader.release(), PROMPT_S)
    await asyncio.wait_for(leader.release(), PROMPT_S)  # again: nothing happens
    # nobody leads: the standby stopped trying, so it did not take over
    assert leaders([leader, standby, other]) == []

    # free again: the released leader may lead again
    await eventually(leader.try_acquire, backend.handover_s + 1.0, "the leader leading again")
    assert leaders([leader, standby, other]) == [leader]
