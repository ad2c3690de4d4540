"""Network namespaces for partition tests: one namespace per process, each joined to a bridge of
the root namespace by a veth pair, and a link cut and healed on demand.

:class:`Network` makes, on a ``/24`` of ``10.77.0.0/16`` that no address or route of the host
uses, a bridge at ``10.77.<n>.1`` (:attr:`Network.gateway`) and namespaces at ``10.77.<n>.11``,
``.12``, ... Processes of the root namespace reach every namespace through the bridge, and each
namespace reaches the others and the bridge's address (where the test's own servers listen).
:meth:`Network.cut` sets the root side of a namespace's veth down: the namespace loses everyone
at once, its packets are dropped (no reset: calls hang until their deadline, as across a real
partition), while its own address keeps answering inside it. :meth:`Network.heal` sets it up::

    with Network(3) as net:          # removed at the end of the block, whatever happened in it
        proc = NamespacedProcess(net.namespace(0), "apogee_broker", [...], log, env)
        net.cut(0)
        net.heal(0)

Names carry a random tag of six hex digits (the bridge ``apb<tag>``, veths ``apv<tag><i>``,
namespaces ``apogee-<tag>-<i>``), so runs side by side do not meet; a name taken already fails
the creation, and only what this object made is removed. A run killed before it could clean up
leaves its own behind (``ip netns list``, ``ip link show type bridge``). Everything here needs
root and ``ip`` (iproute2): :func:`unavailable` says why it cannot run.

``python -m e2e.netns send ADDRESS TOPIC COUNT INTERVAL`` is a raw producer meant to run inside
a namespace (``ip netns exec``): it connects to the broker at ``ADDRESS``, prints ``ready``,
waits for a line on its input, then calls ``Broker.SendMessages`` with one message every
``INTERVAL`` seconds (``COUNT`` in all, each with its own deadline) and prints one JSON line per
send: its body, when it began (``time.monotonic()``, the same clock as the test's on Linux), and
its outcome (``ok``, or the error kind, or ``DEADLINE_EXCEEDED``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from apogee.testkit.processes import ServiceProcess, service_env

__all__ = ["NamespacedProcess", "Network", "unavailable"]

#: the /16 the test networks are cut from (10.77.<n>.0/24)
PREFIX = "10.77"
#: the last byte of the first namespace's address (then +1 for each)
FIRST_HOST = 11


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no ``ip netns``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add, veth pairs, a bridge)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"ip netns is not available: {probe.stderr.decode(errors='replace').strip()}"
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip <args>``; raises :class:`AssertionError` with its error output when it fails (and
    ``check``)."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _free_subnet() -> int:
    """A third byte ``n`` such that no address or route of the host is in 10.77.<n>.0/24."""
    nets: list[ipaddress.IPv4Network] = []
    for entry in json.loads(ip("-j", "-4", "addr", "show").stdout or "[]"):
        for a in entry.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = str(route.get("dst", ""))
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
    # a route as broad as 10.0.0.0/8 (a VPN's, say) loses to the bridge's /24 and is no clash
    nets = [net for net in nets if net.prefixlen > 8]
    free = [
        n
        for n in range(1, 255)
        if not any(ipaddress.IPv4Network(f"{PREFIX}.{n}.0/24").overlaps(net) for net in nets)
    ]
    if not free:
        raise AssertionError(f"no /24 of {PREFIX}.0.0/16 is free on this host")
    return random.choice(free)


class Network:
    """A bridge and ``size`` namespaces (see the module docstring); made by ``with`` or
    :meth:`create`, removed by :meth:`close` or the end of the ``with`` block."""

    def __init__(self, size: int) -> None:
        if not 1 <= size <= 15:
            raise ValueError(f"size: must be 1 to 15 namespaces, got {size}")
        self.size = size
        self.tag = secrets.token_hex(3)
        self.bridge = f"apb{self.tag}"
        self.subnet = 0
        self.gateway = ""
        self._namespaces: list[str] = []
        self._veths: list[str] = []
        self._made_bridge = False

    def namespace(self, i: int) -> str:
        """The name of namespace ``i`` (for ``ip netns exec``)."""
        return f"apogee-{self.tag}-{i}"

    def veth(self, i: int) -> str:
        """The root side of namespace ``i``'s veth pair (on the bridge)."""
        return f"apv{self.tag}{i:x}"

    def host(self, i: int) -> str:
        """The address of namespace ``i``."""
        return f"{PREFIX}.{self.subnet}.{FIRST_HOST + i}"

    def create(self) -> None:
        """Make the bridge and the namespaces; on a failure, remove what was made and raise."""
        try:
            self.subnet = _free_subnet()
            self.gateway = f"{PREFIX}.{self.subnet}.1"
            ip("link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for i in range(self.size):
                ns, veth = self.namespace(i), self.veth(i)
                ip("netns", "add", ns)
                self._namespaces.append(ns)
                ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._veths.append(veth)
                ip("link", "set", veth, "master", self.bridge)
                ip("link", "set", veth, "up")
                ip("-n", ns, "addr", "add", f"{self.host(i)}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def cut(self, i: int) -> float:
        """Cut namespace ``i`` off from everyone; the ``time.monotonic()`` of the cut."""
        ip("link", "set", self.veth(i), "down")
        return time.monotonic()

    def heal(self, i: int) -> float:
        """Join namespace ``i`` again; the ``time.monotonic()`` of the heal."""
        ip("link", "set", self.veth(i), "up")
        return time.monotonic()

    def exec_prefix(self, i: int) -> list[str]:
        """What runs a command in namespace ``i``: ``ip netns exec <name>``."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def close(self) -> None:
        """Remove the veth pairs, the namespaces and the bridge; what is gone already is
        skipped. Processes still running in a namespace are not stopped (stop them first): the
        namespace lives on, without a name and a link, until they end."""
        errors = []
        for veth in reversed(self._veths):  # either end removes the pair
            ip("link", "del", veth, check=False)
        self._veths.clear()
        for ns in reversed(self._namespaces):
            done = ip("netns", "del", ns, check=False)
            if done.returncode != 0 and ns in ip("netns", "list").stdout.split():
                errors.append(f"ip netns del {ns}: {done.stderr.strip()}")
        self._namespaces.clear()
        if self._made_bridge:
            done = ip("link", "del", self.bridge, check=False)
            if (
                done.returncode != 0
                and ip("link", "show", self.bridge, check=False).returncode == 0
            ):
                errors.append(f"ip link del {self.bridge}: {done.stderr.strip()}")
            self._made_bridge = False
        if errors:
            raise AssertionError("the test network could not be removed: " + "; ".join(errors))

    def __enter__(self) -> Network:
        self.create()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NamespacedProcess(ServiceProcess):
    """:class:`~apogee.testkit.processes.ServiceProcess` run in the network namespace
    ``netns`` (``ip netns exec`` replaces itself with the service: signals reach it directly)."""

    def __init__(
        self,
        netns: str,
        module: str,
        args: Sequence[str],
        log: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, sys.executable, "-m", module, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=service_env(env),
            )


# -- the raw producer run inside a namespace ----------------------------------------------------


async def _send_loop(address: str, topic: str, count: int, interval: float) -> None:
    import grpc  # noqa: PLC0415 - only the child process needs it
    import grpc.aio  # noqa: PLC0415

    from apogee.rpc.errors import KIND_KEY  # noqa: PLC0415
    from apogee.rpc.server import CLIENT_OPTIONS  # noqa: PLC0415
    from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2  # noqa: PLC0415

    async with grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        stub = broker_pb2_grpc.BrokerStub(channel)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)

        async def one(k: int) -> None:
            await asyncio.sleep(k * interval)  # a schedule of sends, not a wait for anything
            body = f"inside-{k}"
            began = time.monotonic()
            request = broker_pb2.SendMessagesRequest(
                messages=[common_pb2.Message(topic=topic, body=body.encode())]
            )
            outcome, detail = "ok", ""
            try:
                reply = await stub.SendMessages(request, timeout=8.0)
            except grpc.aio.AioRpcError as err:
                kinds = [v for key, v in err.trailing_metadata() or () if key == KIND_KEY]
                outcome = str(kinds[0]) if kinds else err.code().name
                detail = err.details() or ""
            else:
                bad = [r.status for r in reply.results if r.status.code != 0]
                if bad or not reply.results:
                    outcome = bad[0].reason if bad else "NO_RESULT"
                    detail = bad[0].message if bad else ""
            line = {"body": body, "began": began, "ended": time.monotonic()}
            print(json.dumps({**line, "outcome": outcome, "detail": detail}), flush=True)

        await asyncio.gather(*(one(k) for k in range(count)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.netns")
    sub = parser.add_subparsers(dest="command", required=True)
    send = sub.add_parser("send", help="raw sends to one broker address (see the docstring)")
    send.add_argument("address")
    send.add_argument("topic")
    send.add_argument("count", type=int)
    send.add_argument("interval", type=float)
    args = parser.parse_args(argv)
    asyncio.run(_send_loop(args.address, args.topic, args.count, args.interval))


if __name__ == "__main__":
    main()
