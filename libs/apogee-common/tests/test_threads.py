"""Python threads get their names at the operating system's level."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from apogee.common.threads import name_os_threads, os_name

pytestmark = pytest.mark.unit


def test_os_names_are_short_and_say_what_the_thread_does() -> None:
    assert os_name("Thread-3 (_poll_wrapper)") == "grpc-poller"
    assert os_name("apogee-store-dispatch") == "store-dispatch"
    assert os_name("Thread-7 (serve_forever)") == "serve_forever"
    assert os_name("metrics broker broker-a") == "metrics broker"  # the kernel's 15 bytes
    assert len(os_name("x" * 40).encode()) == 15
    assert os_name("") == "python"


def test_a_running_thread_is_named_in_proc() -> None:
    started = threading.Event()
    release = threading.Event()

    def run() -> None:
        started.set()
        release.wait(10)

    thread = threading.Thread(target=run, name="apogee-store-flush", daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        assert name_os_threads() >= 1
        comm = Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()
        assert comm == "store-flush"
        main = Path(f"/proc/self/task/{threading.main_thread().native_id}/comm").read_text()
        assert main.strip() != "store-flush"  # the main thread keeps the process's name
    finally:
        release.set()
        thread.join(10)
