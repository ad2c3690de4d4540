"""A dispatcher that fails (a full disk under the queue files, say) stops appends with a clear
error, and what was appended is dispatched by recovery at the next open."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from apogee.common.errors import StoreFailedError
from apogee.store import Message, MessageStore
from apogee.store.consumequeue import ConsumeQueue

pytestmark = pytest.mark.unit


def test_dispatch_failure_stops_appends_and_recovery_catches_up(
    open_store: Callable[..., MessageStore],
) -> None:
    store = open_store()
    store.append(Message("Ok", b"before"))
    assert store.wait_dispatched(10)

    real_get_or_create = store.cqs.get_or_create

    def failing(topic: str, queue_id: int) -> ConsumeQueue:
        if topic == "Doomed":
            raise OSError(28, "No space left on device")
        return real_get_or_create(topic, queue_id)

    store.cqs.get_or_create = failing  # type: ignore[method-assign]
    [doomed] = store.append(Message("Doomed", b"in the log, not yet in its queue"))
    assert not store.wait_dispatched(2)
    assert store.dispatcher.failure is not None
    with pytest.raises(StoreFailedError) as caught:
        store.append(Message("Ok", b"after"))
    assert str(caught.value) == (
        f"the store at {store.root} stopped accepting writes: dispatch failed: "
        "OSError(28, 'No space left on device'); reopen it to recover"
    )
    assert store.get("Ok", 0, 0).messages[0].body == b"before"  # reads keep working
    store.close()

    reopened = open_store()
    assert not reopened.recovery.clean_shutdown  # a failed dispatcher is not a clean stop
    got = reopened.get("Doomed", 0, 0)
    assert [m.body for m in got.messages] == [b"in the log, not yet in its queue"]
    assert got.messages[0].phys_offset == doomed.phys_offset
    reopened.append(Message("Ok", b"after reopen"))
    assert reopened.wait_dispatched(10)
    # the refused append wrote nothing: only what was acknowledged is there
    assert [m.body for m in reopened.get("Ok", 0, 0, 10).messages] == [b"before", b"after reopen"]
