"""FileLockLeadership beyond what every backend promises (test_leadership_contract.py: one
holder at a time, the lock freed on release or at its holder's death): a lock file that cannot
be created fails the attempt at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee.service.leadership import FileLockLeadership

pytestmark = pytest.mark.unit


async def test_a_lock_file_that_cannot_be_created_fails_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    leader = FileLockLeadership(blocker / "schedule.lock")
    with pytest.raises(FileExistsError):
        await leader.try_acquire()
    await leader.release()
