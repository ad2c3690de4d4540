"""Helpers for tests that drive a :class:`MessageStore`: Apogee's own, and users'."""

from __future__ import annotations

from collections.abc import Callable

from apogee.store.store import MessageStore

#: A fixture's opener: ``open_store(config=None, *, root=None, **open_kwargs) -> MessageStore``.
OpenStore = Callable[..., MessageStore]


def dispatched(store: MessageStore, timeout: float = 10.0) -> None:
    """Wait until everything appended is readable through its queue; fail the test if not."""
    if not store.wait_dispatched(timeout):
        raise AssertionError(f"the dispatcher did not catch up within {timeout}s")
