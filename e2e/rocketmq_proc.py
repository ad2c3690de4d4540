"""The official RocketMQ 5 Python client (``rocketmq-python-client``) in a process of its own,
driven over its pipes by the end-to-end tests (:class:`e2e.rocketmq_support.ClientProcess`)::

    python -m e2e.rocketmq_proc producer --endpoints E [--topic T]... [--checker RESOLUTION]
    python -m e2e.rocketmq_proc simple --endpoints E --group G --topic T [--filter X [--sql]]
                                       [--await-s S]
    python -m e2e.rocketmq_proc push --endpoints E --group G --topic T [--filter X [--sql]]
                                     [--fail-key K]...

Only the client's public API is used (``from rocketmq import ...``). ``E`` is the access point,
one ``host:port`` or several joined by ``;``. Run it with a ``HOME`` of its own: the client writes
its log to ``$HOME/logs/rocketmq_python/rocketmq_client.log`` from the moment it is imported.

Every role also takes ``--access-key AK --secret-key SK`` (the client signs its requests with
them; without, it sends none) and ``--tls`` (the client's ``tls_enable``: a TLS channel with
gRPC's default roots, which ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH`` in the environment replaces).

On stdout, one JSON object a line:

- events: ``{"event": "ready", "client_id": ...}`` once ``startup()`` returned (or
  ``{"event": "start_failed", "error": ...}`` and exit code 1); ``{"event": "consumed",
  "result": "SUCCESS"|"FAILURE", "message": {...}}`` for every message a push consumer's listener
  is given; ``{"event": "checked", "resolution": ..., "message": {...}}`` for every transaction
  check the producer's checker answers;
- replies to the commands read from stdin, one JSON object a line ``{"id": N, "op": ..., ...}``:
  ``{"id": N, "ok": true, "result": ...}`` or ``{"id": N, "ok": false, "error": "Type: text"}``.

Commands: every role takes ``shutdown`` (``client.shutdown()``, then the process exits; so does
the end of stdin). A producer: ``send`` (``topic``, ``body``, and any of ``tag``, ``keys``,
``properties``, ``message_group``, ``delivery_timestamp`` in whole seconds, ``transaction``:
``commit``, ``rollback`` or ``open`` - sent in a transaction that is then committed, rolled back,
or left for the server's check), answered with the receipt; ``recall`` (``topic``, ``handle``),
answered with the recalled message id. A simple consumer: ``receive`` (``max``, ``invisible_s``),
answered with the messages, each with a ``ref`` naming it in later commands; ``ack`` (``ref``);
``change_invisible`` (``ref``, ``invisible_s``).

A message is shown as ``{"topic", "message_id", "body", "tag", "keys", "properties",
"message_group", "delivery_timestamp_ms", "born_timestamp_ms", "delivery_attempt",
"message_type", "corrupted", "at"}``; ``at`` is this process's clock (``time.time()``) when the
message was handed over, and a reply that changes something (``send``, ``ack``, ...) carries
the ``at`` of its return too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from rocketmq import (  # type: ignore[import-untyped]
    ClientConfiguration,
    ConsumeResult,
    Credentials,
    FilterExpression,
    Message,
    MessageListener,
    Producer,
    PushConsumer,
    SimpleConsumer,
    TransactionChecker,
    TransactionResolution,
)
from rocketmq.grpc_protocol import FilterType  # type: ignore[import-untyped]

_out_lock = threading.Lock()

RESOLUTIONS = {
    "COMMIT": TransactionResolution.COMMIT,
    "ROLLBACK": TransactionResolution.ROLLBACK,
    "UNKNOWN": TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED,
}


def emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout (whole, even when threads write at once)."""
    line = json.dumps(obj, sort_keys=True)
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def describe(message: Any) -> dict[str, Any]:
    """A received message as JSON-friendly data, through the client's public properties."""
    body = message.body
    return {
        "topic": message.topic,
        "message_id": message.message_id,
        "body": body.decode("utf-8", "backslashreplace") if body is not None else None,
        "tag": message.tag,
        "keys": sorted(message.keys or ()),
        "properties": dict(message.properties or {}),
        "message_group": message.message_group,
        "delivery_timestamp_ms": message.delivery_timestamp,
        "born_timestamp_ms": message.born_timestamp,
        "delivery_attempt": message.delivery_attempt,
        "message_type": message.message_type,
        "corrupted": bool(message.corrupted),
        "at": time.time(),
    }


def config(args: argparse.Namespace) -> Any:
    """The client configuration, 10 s per request: signed with ``--access-key`` and
    ``--secret-key`` when given, else without credentials."""
    credentials = Credentials(args.access_key, args.secret_key)
    return ClientConfiguration(args.endpoints, credentials, request_timeout=10)


def subscription(args: argparse.Namespace) -> dict[str, Any]:
    kind = FilterType.SQL if args.sql else FilterType.TAG
    return {args.topic: FilterExpression(args.filter, kind)}


# -- the roles -------------------------------------------------------------------------------------


class Checker(TransactionChecker):  # type: ignore[misc]
    """Answers every check with one resolution, noting each on stdout first."""

    def __init__(self, resolution: str) -> None:
        self.name = resolution
        self.resolution = RESOLUTIONS[resolution]

    def check(self, message: Any) -> Any:
        emit({"event": "checked", "resolution": self.name, "message": describe(message)})
        return self.resolution


class Listener(MessageListener):  # type: ignore[misc]
    """SUCCESS, but FAILURE for a message with one of ``fail_keys``; notes each on stdout."""

    def __init__(self, fail_keys: set[str]) -> None:
        self.fail_keys = fail_keys

    def consume(self, message: Any) -> Any:
        failed = bool(self.fail_keys & set(message.keys or ()))
        result = "FAILURE" if failed else "SUCCESS"
        emit({"event": "consumed", "result": result, "message": describe(message)})
        return ConsumeResult.FAILURE if failed else ConsumeResult.SUCCESS


class ProducerRole:
    def __init__(self, args: argparse.Namespace) -> None:
        checker = Checker(args.checker) if args.checker else None
        self.client = Producer(
            config(args), tuple(args.topic), checker=checker, tls_enable=args.tls
        )
        #: transactions left open, kept so that nothing ends them
        self.open: list[Any] = []

    def send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        msg = Message()
        msg.topic = cmd["topic"]
        msg.body = cmd["body"].encode()
        if cmd.get("tag"):
            msg.tag = cmd["tag"]
        for key in cmd.get("keys", ()):
            msg.keys = key  # the client's setter adds one key per assignment
        for name, value in cmd.get("properties", {}).items():
            msg.add_property(name, value)
        if cmd.get("message_group"):
            msg.message_group = cmd["message_group"]
        if cmd.get("delivery_timestamp") is not None:
            msg.delivery_timestamp = int(cmd["delivery_timestamp"])
        how = cmd.get("transaction")
        if how is None:
            receipt = self.client.send(msg)
        else:
            tx = self.client.begin_transaction()
            receipt = self.client.send(msg, tx)
            if how == "commit":
                tx.commit()
            elif how == "rollback":
                tx.rollback()
            else:
                self.open.append(tx)
        return {
            "message_id": receipt.message_id,
            "transaction_id": receipt.transaction_id,
            "offset": receipt.offset,
            "recall_handle": receipt.recall_handle,
            "at": time.time(),
        }

    def recall(self, cmd: dict[str, Any]) -> Any:
        return self.client.recall_message(cmd["topic"], cmd["handle"])

    def ops(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        return {"send": self.send, "recall": self.recall}


class SimpleRole:
    def __init__(self, args: argparse.Namespace) -> None:
        self.client = SimpleConsumer(
            config(args),
            args.group,
            subscription(args),
            await_duration=args.await_s,
            tls_enable=args.tls,
        )
        self.refs: dict[str, Any] = {}
        self._next = 0

    def receive(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        got = self.client.receive(int(cmd["max"]), int(cmd["invisible_s"])) or []
        out = []
        for m in got:
            self._next += 1
            ref = f"m{self._next}"
            self.refs[ref] = m
            out.append({**describe(m), "ref": ref})
        return out

    def ack(self, cmd: dict[str, Any]) -> float:
        self.client.ack(self.refs[cmd["ref"]])
        return time.time()

    def change_invisible(self, cmd: dict[str, Any]) -> float:
        self.client.change_invisible_duration(self.refs[cmd["ref"]], int(cmd["invisible_s"]))
        return time.time()

    def ops(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        return {"receive": self.receive, "ack": self.ack, "change_invisible": self.change_invisible}


class PushRole:
    def __init__(self, args: argparse.Namespace) -> None:
        self.client = PushConsumer(
            config(args),
            args.group,
            Listener(set(args.fail_key)),
            subscription(args),
            tls_enable=args.tls,
        )

    def ops(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        return {}


ROLES: dict[str, Callable[[argparse.Namespace], ProducerRole | SimpleRole | PushRole]] = {
    "producer": ProducerRole,
    "simple": SimpleRole,
    "push": PushRole,
}


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def serve(role: ProducerRole | SimpleRole | PushRole) -> None:
    """Answer commands from stdin until ``shutdown`` or its end; then shut the client down."""
    ops = role.ops()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "shutdown":
            break
        if op not in ops:
            emit({"id": cmd.get("id"), "ok": False, "error": f"op: unknown command {op!r}"})
            continue
        try:
            result = ops[op](cmd)
        except Exception as exc:
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            emit({"id": cmd.get("id"), "ok": False, "error": error_text(exc)})
        else:
            emit({"id": cmd.get("id"), "ok": True, "result": result})
    role.client.shutdown()
    emit({"event": "shut_down"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--endpoints", required=True)
    p.add_argument("--topic", action="append", default=[])
    p.add_argument("--group", default="")
    p.add_argument("--filter", default="*")
    p.add_argument("--sql", action="store_true")
    p.add_argument("--await-s", type=int, default=5)
    p.add_argument("--checker", choices=sorted(RESOLUTIONS), default="")
    p.add_argument("--fail-key", action="append", default=[])
    p.add_argument("--access-key", default="")
    p.add_argument("--secret-key", default="")
    p.add_argument("--tls", action="store_true")
    args = p.parse_args()
    if args.role != "producer":
        if len(args.topic) != 1 or not args.group:
            p.error("a consumer takes one --topic and a --group")
        args.topic = args.topic[0]
    try:
        role = ROLES[args.role](args)
        role.client.startup()
    except Exception as exc:
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        emit({"event": "start_failed", "error": error_text(exc)})
        os._exit(1)  # the client's threads would keep the process alive
    emit({"event": "ready", "client_id": role.client.client_id})
    serve(role)
    os._exit(0)  # whatever threads the client left behind


if __name__ == "__main__":
    main()
