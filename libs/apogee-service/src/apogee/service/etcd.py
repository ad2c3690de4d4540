"""An asyncio client of etcd's v3 API, the little of it that Apogee calls.

The brokers keep a replica group's record in etcd (:mod:`apogee.service.etcd_group`); this is
how they talk to it, over gRPC with the stubs generated from etcd's own API definitions
(:mod:`apogee.etcd`, trimmed from etcd v3.4's ``rpc.proto`` and ``kv.proto``; the method paths
are etcd's, ``/etcdserverpb.KV/Range`` and so on). It does:

- keys: :meth:`EtcdClient.get` (a key's value, ``mod_revision`` and ``create_revision``),
  :meth:`~EtcdClient.get_prefix` (every key under a prefix, in one consistent read),
  :meth:`~EtcdClient.put`, :meth:`~EtcdClient.delete`;
- compare-and-set: :meth:`~EtcdClient.txn` puts several keys (some attached to a lease) if
  every :class:`Guard` holds: a key's ``mod_revision`` is the one read
  (:meth:`Guard.mod_revision`), or the key is absent (:meth:`Guard.absent`: its
  ``create_revision`` is 0);
- leases: :meth:`~EtcdClient.grant`, :meth:`~EtcdClient.keep_alive` (one renewal on etcd's
  ``LeaseKeepAlive`` stream, opened for the call and closed after its answer: the remaining
  TTL, 0 when the lease is gone), :meth:`~EtcdClient.revoke`.

Keys and values are ``bytes``, or ``str`` sent as UTF-8. No TLS, no authentication, no watch.

Every call is bounded by ``timeout_s`` in all. With several endpoints (members of one cluster) a
call goes to the one that answered last; when it fails there with ``UNAVAILABLE`` or its
deadline, the call is tried on the next, each try with an equal share of the time left. When
none answers the call raises :class:`~apogee.common.errors.UnavailableError` naming the
endpoints and what each try met. Other failures are etcd's answers and become the Apogee error
of their status (:func:`apogee.rpc.errors.from_rpc_error`).

A write tried again on another member after a deadline may have been done by the first try. A
compare-and-set cannot be done twice (its guard then fails), but it may answer "the guard
failed" for a write it made itself: the caller reads again, and the record tells who wrote it.
A lease granted twice that way is never renewed and lapses after its TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar

import grpc
import grpc.aio

from apogee.common.errors import InternalError, InvalidArgumentError, UnavailableError
from apogee.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc
from apogee.rpc.errors import from_rpc_error

__all__ = ["Entry", "EtcdClient", "Guard", "Put", "TxnResult"]

T = TypeVar("T")
Bytes = str | bytes

#: statuses after which the call is tried on the next endpoint
_TRY_NEXT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class _NoAnswer(Exception):
    """An endpoint ended a call without answering it: the call is tried on the next one."""


def _bytes(value: Bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range every key starting with ``prefix`` (etcd's rule:
    the prefix with its last byte below 0xff plus one)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


class Entry(NamedTuple):
    """A key's value and revisions, as etcd keeps them."""

    value: bytes
    mod_revision: int
    create_revision: int


def _entry(kv: kv_pb2.KeyValue) -> Entry:
    return Entry(kv.value, kv.mod_revision, kv.create_revision)


@dataclass(frozen=True, slots=True)
class Guard:
    """One condition of a :meth:`EtcdClient.txn`: the key's ``target`` revision equals
    ``revision``."""

    key: bytes
    target: Literal["mod_revision", "create_revision"]
    revision: int

    @classmethod
    def mod_revision(cls, key: Bytes, revision: int) -> Guard:
        """The key was last written at ``revision`` (0: it is absent)."""
        return cls(_bytes(key), "mod_revision", revision)

    @classmethod
    def absent(cls, key: Bytes) -> Guard:
        """The key does not exist (its ``create_revision`` is 0)."""
        return cls(_bytes(key), "create_revision", 0)

    def to_proto(self) -> rpc_pb2.Compare:
        if self.target == "mod_revision":
            return rpc_pb2.Compare(
                result=rpc_pb2.Compare.EQUAL,
                target=rpc_pb2.Compare.MOD,
                key=self.key,
                mod_revision=self.revision,
            )
        return rpc_pb2.Compare(
            result=rpc_pb2.Compare.EQUAL,
            target=rpc_pb2.Compare.CREATE,
            key=self.key,
            create_revision=self.revision,
        )


@dataclass(frozen=True, slots=True)
class Put:
    """One write of a :meth:`EtcdClient.txn`: ``value`` at ``key``, attached to the lease
    ``lease`` (0: none, the key stays until deleted)."""

    key: Bytes
    value: Bytes
    lease: int = 0

    def to_proto(self) -> rpc_pb2.RequestOp:
        put = rpc_pb2.PutRequest(key=_bytes(self.key), value=_bytes(self.value), lease=self.lease)
        return rpc_pb2.RequestOp(request_put=put)


@dataclass(frozen=True, slots=True)
class TxnResult:
    """What a :meth:`EtcdClient.txn` did: whether every guard held (and so the writes were
    made), the store's revision after it (the ``mod_revision`` of the keys it wrote, when it
    wrote), and the keys it was asked to read that exist (read after its writes, when the
    guards held; nothing is read when they did not)."""

    succeeded: bool
    revision: int
    found: dict[bytes, Entry]


class EtcdClient:
    """etcd at ``endpoints`` (``host:port`` of its members, or ``http://host:port``); every
    call within ``timeout_s`` seconds."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0) -> None:
        if not endpoints:
            raise InvalidArgumentError(field="endpoints", rule="must name at least one endpoint")
        if timeout_s <= 0:
            raise InvalidArgumentError(
                field="timeout_s", rule=f"must be a positive number of seconds, got {timeout_s}"
            )
        self.endpoints = [_address(e) for e in endpoints]
        self.timeout_s = timeout_s
        #: names etcd in errors
        self.what = f"etcd at {', '.join(self.endpoints)}"
        self._channels: dict[str, grpc.aio.Channel] = {}
        #: the endpoint tried first: the one that answered last
        self._current = 0

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = grpc.aio.insecure_channel(
                endpoint, options=[("grpc.max_reconnect_backoff_ms", 1000)]
            )
            self._channels[endpoint] = channel
        return channel

    async def _call(
        self, action: str, attempt: Callable[[grpc.aio.Channel, float], Awaitable[T]]
    ) -> T:
        """``attempt(channel, timeout)`` on one endpoint after the other, from the current one,
        until one answers; :class:`UnavailableError` when none does within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        count = len(self.endpoints)
        tried: list[str] = []
        for step in range(count):
            index = (self._current + step) % count
            endpoint = self.endpoints[index]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            share = left / (count - step)
            try:
                async with asyncio.timeout(share + 0.5):  # gRPC's deadline first, this if not
                    result = await attempt(self._channel(endpoint), share)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _TRY_NEXT:
                    raise from_rpc_error(exc, f"{self.what} ({action})") from None
                tried.append(f"{endpoint}: {exc.code().name} ({exc.details()})")
                continue
            except TimeoutError:
                tried.append(f"{endpoint}: no answer within {share:.3g}s")
                continue
            except _NoAnswer as exc:
                tried.append(f"{endpoint}: {exc}")
                continue
            self._current = index
            return result
        self._current = (self._current + 1) % count  # the next call starts elsewhere
        if len(tried) < count:
            tried.append(f"no time left for the others (timeout_s {self.timeout_s:g})")
        raise UnavailableError(
            what=self.what, detail=f"{action} failed on every endpoint: {'; '.join(tried)}"
        )

    # keys

    async def get(self, key: Bytes) -> Entry | None:
        """The key's value, ``mod_revision`` and ``create_revision``; None when it is absent."""
        request = rpc_pb2.RangeRequest(key=_bytes(key))

        async def attempt(channel: grpc.aio.Channel, timeout: float) -> rpc_pb2.RangeResponse:
            return await rpc_pb2_grpc.KVStub(channel).Range(request, timeout=timeout)

        answer = await self._call(f"get {_bytes(key)!r}", attempt)
        return _entry(answer.kvs[0]) if answer.kvs else None

    async def get_prefix(self, prefix: Bytes) -> dict[bytes, Entry]:
        """Every key that starts with ``prefix``, read at one revision."""
        start = _bytes(prefix)
        request = rpc_pb2.RangeRequest(key=start, range_end=prefix_end(start))

        async def attempt(channel: grpc.aio.Channel, timeout: float) -> rpc_pb2.RangeResponse:
            return await rpc_pb2_grpc.KVStub(channel).Range(request, timeout=timeout)

        answer = await self._call(f"get the prefix {start!r}", attempt)
        return {kv.key: _entry(kv) for kv in answer.kvs}

    async def put(self, key: Bytes, value: Bytes, lease: int = 0) -> int:
        """Write ``value`` at ``key`` (attached to ``lease`` unless 0); its new
        ``mod_revision``."""
        request = rpc_pb2.PutRequest(key=_bytes(key), value=_bytes(value), lease=lease)

        async def attempt(channel: grpc.aio.Channel, timeout: float) -> rpc_pb2.PutResponse:
            return await rpc_pb2_grpc.KVStub(channel).Put(request, timeout=timeout)

        answer = await self._call(f"put {_bytes(key)!r}", attempt)
        return answer.header.revision

    async def delete(self, key: Bytes) -> int:
        """Delete ``key``; how many keys went (0 or 1)."""
        request = rpc_pb2.DeleteRangeRequest(key=_bytes(key))

        async def attempt(channel: grpc.aio.Channel, timeout: float) -> rpc_pb2.DeleteRangeResponse:
            return await rpc_pb2_grpc.KVStub(channel).DeleteRange(request, timeout=timeout)

        answer = await self._call(f"delete {_bytes(key)!r}", attempt)
        return answer.deleted

    async def txn(
        self, guards: Sequence[Guard], puts: Sequence[Put] = (), reads: Sequence[Bytes] = ()
    ) -> TxnResult:
        """In one step: if every guard holds, make the ``puts`` and then read the keys
        ``reads``; else nothing."""
        success = [p.to_proto() for p in puts]
        success += [
            rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=_bytes(k))) for k in reads
        ]
        request = rpc_pb2.TxnRequest(compare=[g.to_proto() for g in guards], success=success)

        async def attempt(channel: grpc.aio.Channel, timeout: float) -> rpc_pb2.TxnResponse:
            return await rpc_pb2_grpc.KVStub(channel).Txn(request, timeout=timeout)

        answer = await self._call("txn", attempt)
        found: dict[bytes, Entry] = {}
        for op in answer.responses:
            if op.WhichOneof("response") == "response_range":
                found.update((kv.key, _entry(kv)) for kv in op.response_range.kvs)
        return TxnResult(answer.succeeded, answer.header.revision, found)

    # leases

    async def grant(self, ttl_s: int) -> int:
        """A new lease that lapses ``ttl_s`` seconds after its last renewal (etcd may grant
        more, never less: its floor is 1.5 election timeouts); its id."""
        if ttl_s < 1:
            raise InvalidArgumentError(field="ttl_s", rule=f"must be at least 1, got {ttl_s}")
        request = rpc_pb2.LeaseGrantRequest(TTL=ttl_s)

        async def attempt(channel: grpc.aio.Channel, timeout: float) -> rpc_pb2.LeaseGrantResponse:
            return await rpc_pb2_grpc.LeaseStub(channel).LeaseGrant(request, timeout=timeout)

        answer = await self._call(f"grant a lease of {ttl_s}s", attempt)
        if answer.error:
            raise InternalError(detail=f"{self.what} refused a lease of {ttl_s}s: {answer.error}")
        return answer.ID

    async def keep_alive(self, lease: int) -> int:
        """Renew the lease once; its TTL from now (seconds), 0 when it is gone (lapsed or
        revoked)."""
        request = rpc_pb2.LeaseKeepAliveRequest(ID=lease)

        async def attempt(channel: grpc.aio.Channel, timeout: float) -> int:
            call = rpc_pb2_grpc.LeaseStub(channel).LeaseKeepAlive(timeout=timeout)
            try:
                await call.write(request)
                await call.done_writing()  # etcd answers, then ends the stream cleanly
                answer = await call.read()
                if not isinstance(answer, rpc_pb2.LeaseKeepAliveResponse):  # grpc.aio.EOF
                    raise _NoAnswer("the keep-alive stream ended without an answer")
                return max(answer.TTL, 0)
            finally:
                if not call.done():
                    call.cancel()

        return await self._call(f"renew lease {lease:x}", attempt)

    async def revoke(self, lease: int) -> None:
        """Revoke the lease: the keys attached to it are deleted. A lease that is gone already
        is no error."""
        request = rpc_pb2.LeaseRevokeRequest(ID=lease)

        async def attempt(channel: grpc.aio.Channel, timeout: float) -> None:
            try:
                await rpc_pb2_grpc.LeaseStub(channel).LeaseRevoke(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # etcd: "requested lease not found"
                    raise

        await self._call(f"revoke lease {lease:x}", attempt)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close(grace=None)

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _address(endpoint: str) -> str:
    """``host:port`` of an endpoint given as that or as ``http://host:port``."""
    text = endpoint.strip()
    if text.startswith("https://"):
        raise InvalidArgumentError(
            field="endpoints", rule=f"{endpoint!r}: TLS to etcd is not supported yet"
        )
    text = text.removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgumentError(
            field="endpoints", rule=f"{endpoint!r} must be host:port or http://host:port"
        )
    return text
