"""What the end-to-end tests of the official RocketMQ 5 clients share
(:mod:`e2e.test_rocketmq_clients`, :mod:`e2e.test_rocketmq_examples`).

The official Python client (``rocketmq-python-client``) never runs in the test process: each
client is a process of its own (:mod:`e2e.rocketmq_proc`, or one of the upstream examples), with
a ``HOME`` of its own under the test's temporary folder (the client writes its log to
``$HOME/logs/rocketmq_python/`` from the moment it is imported). A test can so kill a client
with SIGKILL, and a client that hangs cannot hang the test: every wait has a deadline, and every
process started here is stopped - gracefully within a bound, else killed - when its test ends.

- :class:`LineProcess`: a process whose stdout lines are collected (with the time each came) as
  it writes them; what it wrote, its stderr and its client log make the failure messages.
- :class:`ClientProcess`: an :mod:`e2e.rocketmq_proc` process; :meth:`ClientProcess.call` sends
  it a command and waits for the answer; its events (messages consumed, transactions checked)
  are collected. :class:`OfficialClients` starts them (a producer, a simple or a push
  consumer) and stops them all at teardown; each plain text and unsigned, unless given an
  :class:`Access` (credentials, TLS and the CA it trusts).
- :func:`receive_until`: a simple consumer's receives until what the test waits for came.
- :func:`make_topic`: a topic of a message type (when Apogee's admin API takes types), routed by
  every nameserver; :func:`require_v2`: fails the test at once, saying so, when the brokers do
  not serve ``apache.rocketmq.v2.MessagingService``.
- :func:`substitute` and :class:`ExampleProcess`: an upstream example with its constants set.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import grpc
import pytest

from apogee.client import AdminClient
from apogee.common import topics as topic_defs
from e2e.harness import Cluster, in_thread, wait_for_route, wait_until

ROOT = Path(__file__).resolve().parent.parent
#: Where the official client writes its log, under its ``HOME``.
CLIENT_LOG = Path("logs", "rocketmq_python", "rocketmq_client.log")
#: Seconds a client may take to start (a push consumer alone waits up to 10 s for its
#: settings), and to shut down before it is killed.
START_TIMEOUT = 40.0
STOP_TIMEOUT = 20.0
#: The simple consumers' long poll (seconds), and what a receive call may take beyond it.
AWAIT_S = 5
CALL_SLACK_S = 20.0
#: The route QueryRoute of the public protocol: a broker that does not serve it answers
#: UNIMPLEMENTED.
QUERY_ROUTE = "/apache.rocketmq.v2.MessagingService/QueryRoute"

JSON = dict[str, Any]


def unique(prefix: str) -> str:
    """``prefix`` with a random suffix: a topic or group no other test (or run) uses."""
    return f"{prefix}-{secrets.token_hex(4)}"


def endpoints(cluster: Cluster, brokers: Sequence[str] | None = None) -> str:
    """The official client's access point: the brokers' gRPC addresses (``brokers``, by default
    every broker of ``cluster``), joined by ``;``."""
    members = [b for b in cluster.brokers if brokers is None or b.name in brokers]
    return ";".join(b.address for b in members)


def client_env(home: Path) -> dict[str, str]:
    """This process's environment, with ``HOME`` set to ``home`` and output unbuffered."""
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read {path.name}: {exc})"
    return "\n".join(text[-lines:]) or "(empty)"


# -- the cluster side ------------------------------------------------------------------------------


def topic_types_supported() -> bool:
    """Whether Apogee's admin API creates topics of a message type (``message_type``)."""
    return "message_type" in inspect.signature(AdminClient.create_or_update_topic).parameters


def make_topic(
    cluster: Cluster,
    topic: str,
    message_type: str,
    *,
    queues: int = 2,
    brokers: Sequence[str] | None = None,
) -> None:
    """``topic`` with ``queues`` queues on ``brokers`` (by default every broker), of
    ``message_type`` (NORMAL, FIFO, DELAY, TRANSACTION, MIXED) when the admin API takes types
    (else untyped, which Apogee treats as MIXED); returns once every nameserver routes it."""
    extra: dict[str, Any] = {}
    if topic_types_supported():
        kind = getattr(topic_defs, "MessageType", None)  # Apogee's type, when it has one
        extra["message_type"] = kind(message_type) if kind is not None else message_type
    names = list(brokers) if brokers is not None else [b.name for b in cluster.brokers]

    async def create() -> None:
        async with AdminClient(cluster.namesrv) as admin:
            await admin.create_or_update_topic(topic, queues=queues, brokers=names, **extra)
        await wait_for_route(cluster.nameservers, topic, set(names))

    in_thread(lambda: asyncio.run(create()))


def v2_problem(address: str, timeout: float = 5.0) -> str | None:
    """None when the broker at ``address`` serves ``apache.rocketmq.v2.MessagingService`` (an
    empty QueryRoute gets any answer but UNIMPLEMENTED or UNAVAILABLE), else why not."""
    with grpc.insecure_channel(address) as channel:
        call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(QUERY_ROUTE)
        try:
            call(b"", timeout=timeout)
        except grpc.RpcError as exc:
            # a failed call is also a grpc.Call, whose code() and details() say why
            code: Any = getattr(exc, "code", lambda: None)()
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                details: Any = getattr(exc, "details", lambda: "")()
                return f"QueryRoute to {address} answered {code.name}: {details}"
    return None


#: Retries of a failed message before the dead-letter topic, on the shared cluster's brokers.
MAX_RECONSUME_TIMES = 2
#: The shared cluster's brokers (:func:`start_rocketmq_cluster`): no topic created on first send.
BROKER_ENV = {
    "APOGEE_BROKER_AUTO_CREATE_TOPICS": "false",
    "APOGEE_BROKER_MAX_RECONSUME_TIMES": str(MAX_RECONSUME_TIMES),
}
#: The transaction checker: a round every second, a first check 1 s after a half is stored.
CHECKER_ENV = {
    "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1",
    "APOGEE_TXN_CHECKER_IMMUNITY_S": "1",
    "APOGEE_TXN_CHECKER_BROKER_REFRESH_S": "1",
}


def start_rocketmq_cluster(data_dir: Path) -> Cluster:
    """The cluster the official-client tests and the examples share (the ``rocketmq_cluster``
    fixture): every test uses topics and groups of its own."""
    return Cluster.start(data_dir, broker_env=BROKER_ENV, txn_checker_env=CHECKER_ENV)


def one_broker(cluster: Cluster) -> list[str]:
    """For a topic whose messages must be received when they become visible: on one broker, a
    SimpleConsumer (each receive asks one broker of the topic, picked at random, and an empty
    one waits its whole long poll) never waits on the other one meanwhile."""
    return [cluster.brokers[0].name]


def require_v2(cluster: Cluster) -> None:
    """Fail the test at once, saying why, unless every broker serves the public protocol."""
    problems = [p for b in cluster.brokers if (p := v2_problem(b.address)) is not None]
    if problems:
        pytest.fail(
            "the brokers do not serve apache.rocketmq.v2.MessagingService on their gRPC port, "
            "which the official RocketMQ 5 clients speak: " + "; ".join(problems),
            pytrace=False,
        )


# -- processes -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Line:
    """One line a process wrote on stdout, and when it was read (``time.time()``)."""

    text: str
    at: float


class LineProcess:
    """A process whose stdout is read, line by line, by a thread of its own; stderr goes to
    ``<workdir>/stderr.log``. :meth:`close` always leaves it stopped."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        *,
        cwd: Path = ROOT,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.workdir = workdir
        self.home = workdir / "home"
        workdir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = workdir / "stderr.log"
        self._lines: list[Line] = []
        self._lock = threading.Lock()
        with self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=cwd,
                env={**client_env(self.home), **(env or {})},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = Line(raw.decode("utf-8", "replace").rstrip("\n"), time.time())
            with self._lock:
                self._lines.append(line)
            self.on_line(line)

    def on_line(self, line: Line) -> None:
        """Called on the reader thread for every line."""

    def lines(self) -> list[Line]:
        with self._lock:
            return list(self._lines)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def write(self, text: str) -> None:
        """``text`` on the process's stdin (an error when it is gone)."""
        stdin: IO[bytes] | None = self.proc.stdin
        if stdin is None or stdin.closed:
            raise AssertionError(f"{self.name}: its stdin is closed\n{self.detail()}")
        try:
            stdin.write(text.encode())
            stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise AssertionError(
                f"{self.name}: cannot write to it ({exc})\n{self.detail()}"
            ) from None

    def wait_line(self, pattern: str, timeout: float, what: str, count: int = 1) -> list[Line]:
        """Wait until ``count`` lines match ``pattern`` (a regular expression, searched);
        returns them. Fails at once when the process exited without writing them."""
        rx = re.compile(pattern)

        def matching() -> list[Line]:
            return [ln for ln in self.lines() if rx.search(ln.text)]

        def enough() -> bool:
            if len(matching()) >= count:
                return True
            if self.returncode is not None:
                self._reader.join(2.0)
                if len(matching()) >= count:
                    return True
                raise AssertionError(f"{self.name} exited before {what}\n{self.detail()}")
            return False

        wait_until(enough, timeout, f"{self.name}: {what}", every=0.05, detail=self.detail)
        return matching()

    def wait_matches(self, pattern: str, timeout: float, what: str, count: int) -> list[str]:
        """Wait until ``pattern`` matched ``count`` times in all of stdout (threads that print at
        once may share a line); returns the matches."""
        rx = re.compile(pattern)

        def matches() -> list[str]:
            return [m[0] for m in rx.finditer("\n".join(ln.text for ln in self.lines()))]

        def enough() -> bool:
            if len(matches()) >= count:
                return True
            if self.returncode is not None:
                self._reader.join(2.0)
                if len(matches()) >= count:
                    return True
                raise AssertionError(f"{self.name} exited before {what}\n{self.detail()}")
            return False

        wait_until(enough, timeout, f"{self.name}: {what}", every=0.05, detail=self.detail)
        return matches()

    def wait_exit(self, timeout: float) -> int:
        """The exit code, once it exited within ``timeout`` (else an error saying so)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout:g}s\n{self.detail()}"
            ) from None
        self._reader.join(5.0)
        return code

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10.0)

    def close(self) -> None:
        """Kill it unless it exited; release its pipes."""
        try:
            self.kill()
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            self._reader.join(5.0)

    def detail(self) -> str:
        """What to show when a wait on it fails: exit code, stdout, stderr, client log."""
        out = "\n".join(ln.text for ln in self.lines()[-20:]) or "(nothing)"
        return (
            f"--- {self.name}: {' '.join(self.argv[1:])} (exit code {self.returncode})\n"
            f"--- its last stdout lines:\n{out}\n"
            f"--- its stderr:\n{tail(self.stderr_path)}\n"
            f"--- its client log:\n{tail(self.home / CLIENT_LOG)}"
        )


@dataclass(frozen=True, slots=True)
class Access:
    """How an official client reaches the brokers: the access key and secret key it signs its
    requests with (none: unsigned), and whether it speaks TLS (the client's ``tls_enable``),
    trusting ``ca_file`` (given to gRPC as ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``, which replaces
    the default roots a TLS channel of the client trusts; None: the default roots)."""

    access_key: str = ""
    secret_key: str = ""
    tls: bool = False
    ca_file: Path | None = None

    def args(self) -> list[str]:
        """The options of :mod:`e2e.rocketmq_proc` that say so."""
        out = []
        if self.access_key or self.secret_key:
            out += ["--access-key", self.access_key, "--secret-key", self.secret_key]
        return [*out, "--tls"] if self.tls else out

    def env(self) -> dict[str, str]:
        """What the client process's environment needs besides."""
        if self.ca_file is None:
            return {}
        return {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(self.ca_file)}


#: Plain text and unsigned, as the clients of a cluster without security.
PLAIN = Access()


class ClientCallError(AssertionError):
    """A command that the client process answered with an error (``error``: its text)."""

    def __init__(self, text: str, error: str) -> None:
        super().__init__(text)
        self.error = error


class ClientProcess(LineProcess):
    """An official client in an :mod:`e2e.rocketmq_proc` process."""

    def __init__(
        self,
        name: str,
        role: str,
        args: Sequence[str],
        workdir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.role = role
        self._ids = itertools.count(1)
        self._replies: dict[int, JSON] = {}
        self._events: list[JSON] = []
        argv = [sys.executable, "-m", "e2e.rocketmq_proc", role, *args]
        super().__init__(name, argv, workdir, env=env)

    def on_line(self, line: Line) -> None:
        try:
            obj = json.loads(line.text)
        except ValueError:
            return  # not ours: shown by detail()
        with self._lock:
            if "event" in obj:
                self._events.append(obj)
            elif isinstance(obj.get("id"), int):
                self._replies[obj["id"]] = obj

    def events(self, kind: str | None = None) -> list[JSON]:
        with self._lock:
            return [e for e in self._events if kind is None or e["event"] == kind]

    def start(self, timeout: float = START_TIMEOUT) -> ClientProcess:
        """Wait until the client's ``startup()`` returned."""

        def started() -> bool:
            if self.events("start_failed"):
                err = self.events("start_failed")[0]["error"]
                raise AssertionError(f"{self.name} failed to start: {err}\n{self.detail()}")
            if self.events("ready"):
                return True
            if self.returncode is not None:
                raise AssertionError(f"{self.name} exited while starting\n{self.detail()}")
            return False

        wait_until(started, timeout, f"{self.name} started", every=0.05, detail=self.detail)
        return self

    @property
    def client_id(self) -> str:
        ready = self.events("ready")
        return str(ready[0]["client_id"]) if ready else ""

    def call(self, op: str, timeout: float = CALL_SLACK_S, **fields: Any) -> Any:
        """Send command ``op`` and wait for its answer: the result, or
        :class:`ClientCallError` when the client raised."""
        n = next(self._ids)
        self.write(json.dumps({"id": n, "op": op, **fields}) + "\n")

        def answered() -> bool:
            with self._lock:
                if n in self._replies:
                    return True
            if self.returncode is not None:
                raise AssertionError(f"{self.name} exited during {op}\n{self.detail()}")
            return False

        what = f"{self.name}: an answer to {op}"
        wait_until(answered, timeout, what, every=0.01, detail=self.detail)
        with self._lock:
            reply = self._replies.pop(n)
        if not reply["ok"]:
            text = f"{self.name}: {op} {json.dumps(fields)[:300]} failed: {reply['error']}"
            raise ClientCallError(f"{text}\n{self.detail()}", reply["error"])
        return reply["result"]

    def wait_events(
        self, check: Callable[[list[JSON]], bool], timeout: float, what: str, kind: str
    ) -> list[JSON]:
        """Wait until ``check(events of kind)`` holds; returns those events."""

        def holds() -> bool:
            if check(self.events(kind)):
                return True
            if self.returncode is not None:
                raise AssertionError(f"{self.name} exited before {what}\n{self.detail()}")
            return False

        wait_until(holds, timeout, f"{self.name}: {what}", every=0.05, detail=self.detail)
        return self.events(kind)

    def shutdown(self) -> None:
        """Ask for ``shutdown()`` (the process exits after it); :meth:`close` waits."""
        if self.returncode is None:
            with contextlib.suppress(AssertionError):
                self.write(json.dumps({"op": "shutdown"}) + "\n")


class OfficialClients:
    """Starts official clients in processes of their own under ``root``; :meth:`close` stops
    them all (each is asked to shut down, and killed if it has not within
    :data:`STOP_TIMEOUT`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.processes: list[ClientProcess] = []

    def _start(self, role: str, args: list[str], access: Access) -> ClientProcess:
        n = len(self.processes) + 1
        name = f"{role}#{n}"
        workdir = self.root / f"{n:02d}-{role}"
        proc = ClientProcess(name, role, [*args, *access.args()], workdir, access.env())
        self.processes.append(proc)
        return proc.start()

    def producer(
        self,
        access_point: str,
        topics: Iterable[str],
        *,
        checker: str | None = None,
        access: Access = PLAIN,
    ) -> ClientProcess:
        """A started Producer of ``topics``; with a TransactionChecker answering ``checker``
        (COMMIT, ROLLBACK or UNKNOWN) when given."""
        args = ["--endpoints", access_point]
        for t in topics:
            args += ["--topic", t]
        if checker is not None:
            args += ["--checker", checker]
        return self._start("producer", args, access)

    def simple(
        self,
        access_point: str,
        group: str,
        topic: str,
        *,
        expression: str = "*",
        sql: bool = False,
        await_s: int = AWAIT_S,
        access: Access = PLAIN,
    ) -> ClientProcess:
        """A started SimpleConsumer of ``group`` subscribed to ``topic`` with a tag (or SQL92)
        filter ``expression``, long-polling ``await_s`` seconds."""
        args = ["--endpoints", access_point, "--group", group, "--topic", topic]
        args += ["--filter", expression, "--await-s", str(await_s)]
        return self._start("simple", [*args, "--sql"] if sql else args, access)

    def push(
        self,
        access_point: str,
        group: str,
        topic: str,
        *,
        expression: str = "*",
        fail_keys: Iterable[str] = (),
        access: Access = PLAIN,
    ) -> ClientProcess:
        """A started PushConsumer of ``group`` on ``topic`` whose listener answers FAILURE for
        messages with one of ``fail_keys``, SUCCESS for the others."""
        args = ["--endpoints", access_point, "--group", group, "--topic", topic]
        args += ["--filter", expression]
        for k in fail_keys:
            args += ["--fail-key", k]
        return self._start("push", args, access)

    def close(self) -> None:
        for p in self.processes:
            p.shutdown()
        deadline = time.monotonic() + STOP_TIMEOUT
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            p.close()


# -- receiving -------------------------------------------------------------------------------------


def receive_until(
    consumer: ClientProcess,
    done: Callable[[list[JSON]], bool],
    *,
    invisible_s: int,
    timeout: float,
    what: str,
    ack: bool = False,
    max_messages: int = 32,
    tolerate_errors: bool = False,
) -> list[JSON]:
    """Receive (``max_messages`` at a time, invisible for ``invisible_s``) until
    ``done(everything received)``; returns everything received, acked first when ``ack``. A
    receive that fails fails the wait, unless ``tolerate_errors`` (a broker restarting)."""
    got: list[JSON] = []
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while not done(got):
        if time.monotonic() > deadline:
            seen = [(m["body"], m["delivery_attempt"]) for m in got]
            raise AssertionError(
                f"not within {timeout:g}s: {what}\nreceived (body, attempt): {seen}\n"
                f"failed receives: {errors[-5:]}\n{consumer.detail()}"
            )
        try:
            batch = consumer.call(
                "receive", AWAIT_S + CALL_SLACK_S, max=max_messages, invisible_s=invisible_s
            )
        except ClientCallError as exc:
            if not tolerate_errors:
                raise
            errors.append(exc.error)
            time.sleep(0.2)  # pacing the retries of a failed receive, not a synchronisation
            continue
        if ack:
            for m in batch:
                consumer.call("ack", ref=m["ref"])
        got += batch
    return got


def by_body(messages: Iterable[JSON]) -> dict[str, list[JSON]]:
    """Deliveries grouped by body (every test sends distinct bodies)."""
    out: dict[str, list[JSON]] = {}
    for m in messages:
        out.setdefault(m["body"], []).append(m)
    return out


# -- the upstream examples -------------------------------------------------------------------------


def substitute(source: str, values: Mapping[str, str]) -> str:
    """``source`` with the string constant of each name in ``values`` set: every line
    ``<indent><name> = "<anything>"`` becomes ``<indent><name> = "<value>"``. Each name must
    have exactly one such line (so a changed example fails here, saying what it lacks)."""
    out = source
    for name, value in values.items():
        rx = re.compile(rf'^(?P<indent>[ \t]*){re.escape(name)} = "[^"\n]*"[ \t]*$', re.M)
        found = rx.findall(out)
        if len(found) != 1:
            raise AssertionError(
                f'the example has {len(found)} lines `{name} = "..."`, expected exactly one'
            )
        line = f"{name} = {json.dumps(value)}"

        def put(m: re.Match[str], line: str = line) -> str:
            return m["indent"] + line

        out = rx.sub(put, out)
    return out


class ExampleProcess(LineProcess):
    """An upstream example run with its constants substituted (:func:`substitute`): the
    edited copy is written to ``<workdir>/<its name>`` and run there with ``HOME`` in
    ``workdir``."""

    def __init__(self, example: Path, values: Mapping[str, str], workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        script = workdir / example.name
        script.write_text(substitute(example.read_text(), values))
        super().__init__(example.stem, [sys.executable, str(script)], workdir, cwd=workdir)

    def wait_started(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the client's log says it started (``... start success.``): a consumer
        has then made its group known to the brokers."""
        log = self.home / CLIENT_LOG

        def started() -> bool:
            if self.returncode is not None:
                raise AssertionError(f"{self.name} exited while starting\n{self.detail()}")
            try:
                return "start success." in log.read_text(errors="replace")
            except FileNotFoundError:
                return False

        wait_until(started, timeout, f"{self.name} started", every=0.05, detail=self.detail)

    def press_enter(self) -> None:
        """What ``input()`` waits for."""
        self.write("\n")

    def failures(self) -> list[str]:
        """The lines in which the example reports an exception it caught."""
        return [ln.text for ln in self.lines() if "exception" in ln.text]
