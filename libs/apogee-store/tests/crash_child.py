"""The victim of ``test_crash_kill9.py``: appends to a store forever until it is killed with -9.

Run as ``python crash_child.py '<json>'``; the JSON object holds ``path`` (the store directory),
``config`` (keyword arguments of :class:`StoreConfig`, without ``flush_mode``), ``flush_mode``,
``seed``, ``threads``, ``max_batch``, ``roll_hook`` and ``lifetime_s``.

It opens the store, prints ``READY``, then every writer thread appends a random mix of single
messages and batches and, once ``append`` has returned (acknowledged), prints one line per message
on stdout, flushed at once (one line, shown on two)::

    A <topic> <queue id> <queue offset> <phys offset> <unique id>
      <body size> <body sha256> <key> <tag>

``<tag>`` is ``-`` for no tag. Lines of one append are written with one ``write`` under a lock,
so lines of different threads never mix.

``roll_hook`` (test-only, installed here and never in the library) wraps
``store.commitlog.files.create``: ``before`` prints ``ROLL`` and pauses a few milliseconds before
the next CommitLog file is created, ``after`` creates it first, then prints ``ROLL`` and pauses,
so that a kill lands between file creation and the first write into the new file. Both print
``ROLLED <start>`` once the pause is over, which tells the parent whether its kill was inside the
window. ``none`` installs nothing.

Any failure prints a traceback to stderr and exits with status 3; after ``lifetime_s`` the child
exits with status 4 on its own (the parent always kills it long before).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from apogee.store import FlushMode, Message, MessageStore, StoreConfig
from apogee.store.mapped_file import MappedFile

TOPICS = ("CrashA", "CrashB", "CrashC")
QUEUES = 4
MAX_BODY = 6 * 1024
TAGS = (None, "red", "green")
#: How long the roll-over hook holds the append lock around the new file's creation.
ROLL_PAUSE_S = 0.005


class Out:
    """Whole lines to fd 1, one ``write`` per call, serialised between threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        data = text.encode()
        with self._lock:
            while data:
                n = os.write(1, data)
                data = data[n:]


def install_roll_hook(store: MessageStore, mode: str, out: Out) -> None:
    files = store.commitlog.files
    create: Callable[[int], MappedFile] = files.create

    def hooked(start: int) -> MappedFile:
        if mode == "before":
            out.write(f"ROLL {start}\n")
            time.sleep(ROLL_PAUSE_S)  # the window the parent's kill aims at
            mf = create(start)
        else:
            mf = create(start)
            out.write(f"ROLL {start}\n")
            time.sleep(ROLL_PAUSE_S)
        out.write(f"ROLLED {start}\n")
        return mf

    files.create = hooked  # type: ignore[method-assign]


def writer(
    store: MessageStore, seed: int, max_batch: int, out: Out, failed: threading.Event
) -> None:
    rng = random.Random(seed)
    try:
        while True:
            n = 1 if rng.random() < 0.5 else rng.randint(2, max_batch)
            msgs: list[Message] = []
            meta: list[tuple[str, str, str]] = []
            for _ in range(n):
                body = rng.randbytes(rng.randint(1, MAX_BODY))
                key = f"k{rng.randrange(1 << 30):x}"
                tag = rng.choice(TAGS)
                msgs.append(
                    Message(
                        rng.choice(TOPICS),
                        body,
                        queue_id=rng.randrange(QUEUES),
                        tags=tag,
                        keys=[key],
                    )
                )
                meta.append((hashlib.sha256(body).hexdigest(), key, tag or "-"))
            results = store.append(msgs[0] if n == 1 else msgs)
            out.write(
                "".join(
                    f"A {r.topic} {r.queue_id} {r.queue_offset} {r.phys_offset} {r.unique_id} "
                    f"{len(m.body)} {digest} {key} {tag}\n"
                    for r, m, (digest, key, tag) in zip(results, msgs, meta, strict=True)
                )
            )
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        failed.set()


def main(argv: list[str]) -> int:
    args: dict[str, Any] = json.loads(argv[1])
    cfg = StoreConfig(**args["config"], flush_mode=FlushMode(args["flush_mode"]))
    store = MessageStore.open(args["path"], cfg, disk_usage=lambda: 0.0)
    out = Out()
    if args["roll_hook"] != "none":
        install_roll_hook(store, args["roll_hook"], out)
    out.write(f"READY {store.commitlog.max_offset}\n")
    failed = threading.Event()
    master = random.Random(args["seed"])
    for i in range(args["threads"]):
        threading.Thread(
            target=writer,
            args=(store, master.getrandbits(64), args["max_batch"], out, failed),
            name=f"crash-writer-{i}",
            daemon=True,
        ).start()
    if failed.wait(args["lifetime_s"]):
        os._exit(3)
    sys.stderr.write("crash_child: lifetime over without being killed\n")
    sys.stderr.flush()
    os._exit(4)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
