"""Operating-system names for a process's Python threads.

Python 3.11 names its threads for itself only: ``top -H``, ``ps -L``, ``perf`` and
``/proc/<pid>/task/<tid>/comm`` show every one of them as ``python``, beside gRPC's own
``event_engine`` threads. :func:`name_os_threads` gives each live Python thread the name it has
in Python (at most 15 bytes, the kernel's limit), so that an operator can tell which thread of a
service is busy or wakes often: ``store-dispatch``, ``store-flush``, ``grpc-poller`` (gRPC's
completion-queue poller, which wakes the event loop), ``uvloop_0`` (a loop's worker threads) and
so on. The event loop's thread is the process's main thread (its thread id is the process id)
and keeps the process's name. Linux only; elsewhere, or where ``/proc`` cannot be written, it
does nothing.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Final

#: The kernel keeps at most this many bytes of a thread's name.
NAME_MAX: Final = 15

_POLLER: Final = re.compile(r"^Thread-\d+ \(_poll_wrapper\)$")
_STARTED_BY: Final = re.compile(r"^Thread-\d+ \((\w+)\)$")


def os_name(python_name: str) -> str:
    """The operating-system name for a thread called ``python_name`` in Python."""
    if _POLLER.match(python_name):
        return "grpc-poller"
    started = _STARTED_BY.match(python_name)
    name = started.group(1).lstrip("_") if started else python_name
    name = name.removeprefix("apogee-")
    return name.encode()[:NAME_MAX].decode(errors="ignore").strip() or "python"


def name_os_threads() -> int:
    """Name every live Python thread but the main one after its Python name (see the module
    docstring); returns how many were named."""
    main = threading.main_thread()
    named = 0
    for thread in threading.enumerate():
        tid = thread.native_id
        if thread is main or tid is None or tid == os.getpid():
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm", "w", encoding="utf-8") as f:
                f.write(os_name(thread.name))
        except OSError:  # not Linux, the thread just ended, or /proc is read-only
            continue
        named += 1
    return named
