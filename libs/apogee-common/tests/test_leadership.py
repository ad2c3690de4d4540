"""FileLockLeadership: one holder at a time, the lock freed on release (or process death)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apogee.common.leadership import FileLockLeadership

pytestmark = pytest.mark.unit


async def test_one_holder_at_a_time_and_a_waiter_takes_over_on_release(tmp_path: Path) -> None:
    lock = tmp_path / "run" / "schedule.lock"
    first = FileLockLeadership(lock, poll_s=0.02)
    second = FileLockLeadership(lock, poll_s=0.02)
    try:
        assert await first.try_acquire()
        assert await first.try_acquire()  # already held: still True
        assert first.held
        assert not await second.try_acquire()
        assert f"pid {os.getpid()}" in second.holder()
        waiting = asyncio.create_task(second.acquire())
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await first.release()
        await asyncio.wait_for(waiting, 5)
        assert second.held
        assert not first.held
    finally:
        await first.release()
        await second.release()


async def test_a_lock_is_freed_when_its_holder_dies(tmp_path: Path) -> None:
    lock = tmp_path / "schedule.lock"
    holder = subprocess.Popen(  # noqa: ASYNC220 - a helper process that only holds a lock
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    leader = FileLockLeadership(lock, poll_s=0.02)
    with holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == b"locked\n"  # EOF (b"") if it died
            assert not await leader.try_acquire()
            holder.kill()  # kill -9: the kernel drops its lock
            holder.wait(5)
            await asyncio.wait_for(leader.acquire(), 5)
            assert leader.held
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(5)
            await leader.release()


async def test_a_lock_file_that_cannot_be_created_fails_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    leader = FileLockLeadership(blocker / "schedule.lock")
    with pytest.raises(FileExistsError):
        await leader.try_acquire()
    await leader.release()
