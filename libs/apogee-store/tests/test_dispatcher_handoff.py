"""The dispatcher's hand-offs between the appending threads and its own thread: a full backlog
holds appends back until the thread takes work, a stop waits for a batch being applied inline,
and small and large batches stay in log order whichever thread indexes them.

The dispatcher's ``apply`` is wrapped so that a test can hold a batch in the middle of being
applied (a gate) and see which thread applied each batch."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import pytest

from apogee.store import Message, MessageStore, StoreConfig
from apogee.store.commitlog import AppendResult
from apogee.testkit.store import OpenStore

pytestmark = pytest.mark.unit

WAIT = 10.0


class Gated:
    """Wraps a store dispatcher's ``apply``: batches wait at the gate while it is closed, and
    the name of the thread that applied each batch is kept, in order."""

    def __init__(self, store: MessageStore) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        self._apply: Callable[[list[AppendResult]], None] = store.dispatcher.apply
        store.dispatcher.apply = self.apply  # type: ignore[method-assign]

    def apply(self, batch: list[AppendResult]) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT), "the test never opened the gate"
        self.threads.append(threading.current_thread().name)
        self._apply(batch)


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def batch(n: int, body: bytes = b"x") -> list[Message]:
    return [Message(topic="Handoff", body=body) for _ in range(n)]


def test_a_full_backlog_holds_appends_until_the_thread_takes_work(
    open_store: OpenStore, config: StoreConfig
) -> None:
    store = open_store(dataclasses.replace(config, dispatch_backlog_max=1, dispatch_inline_max=0))
    gated = Gated(store)
    store.append(batch(3))  # taken by the thread, which waits at the gate
    assert gated.entered.wait(WAIT)
    store.append(batch(3))  # the one batch the backlog holds
    third, third_done = in_thread(lambda: store.append(batch(3)))
    assert not third_done.wait(0.3), "an append went past a full backlog"

    gated.gate.set()
    assert third_done.wait(WAIT), "the held append was not let through when room came"
    third.join(WAIT)
    assert store.wait_dispatched(WAIT)
    got = store.get("Handoff", 0, 0, 100)
    assert [m.queue_offset for m in got.messages] == list(range(9))
    assert set(gated.threads) == {"apogee-store-dispatch"}


def test_stop_waits_for_a_batch_applied_inline_then_the_thread_ends(
    open_store: OpenStore, config: StoreConfig
) -> None:
    store = open_store(dataclasses.replace(config, dispatch_inline_max=4))
    gated = Gated(store)
    appender, appended = in_thread(lambda: store.append(batch(2)))
    assert gated.entered.wait(WAIT)  # applied inline by the appending thread, held at the gate
    thread = store.dispatcher._thread
    assert thread is not None
    assert thread.is_alive()

    stopper, stopped = in_thread(lambda: store.dispatcher.stop(timeout=WAIT))
    assert not stopped.wait(0.3), "stop did not wait for the batch being applied"
    gated.gate.set()
    assert appended.wait(WAIT)
    assert stopped.wait(WAIT), "the dispatcher thread did not end after the inline batch"
    appender.join(WAIT)
    stopper.join(WAIT)
    assert not thread.is_alive()
    assert gated.threads == [appender.name]
    assert store.dispatcher.dispatched == store.commitlog.max_offset


def test_inline_and_threaded_batches_keep_log_order_and_wake_waiters(
    open_store: OpenStore, config: StoreConfig
) -> None:
    store = open_store(dataclasses.replace(config, dispatch_inline_max=2))
    gated = Gated(store)
    gated.gate.set()
    sizes = [1, 5, 2, 1, 8, 1]
    for n in sizes:
        store.append(batch(n))
        # every batch, whichever thread applies it, wakes a waiter for it
        assert store.wait_dispatched(WAIT)
    got = store.get("Handoff", 0, 0, 100)
    assert [m.queue_offset for m in got.messages] == list(range(sum(sizes)))
    main = threading.current_thread().name
    assert gated.threads == [main if n <= 2 else "apogee-store-dispatch" for n in sizes], (
        "small batches on the appending thread, larger ones on the dispatcher's"
    )
