"""``python -m apogee.rpc.probe HOST:PORT [SERVICE]``: one grpc.health.v1 Check, for the health
checks of container images (a Dockerfile's ``HEALTHCHECK``, compose's ``healthcheck``), where no
``grpc_health_probe`` binary is installed.

Exit status 0 when the server answers ``SERVING`` within ``--timeout`` seconds (default 3), 1
otherwise (another status, no answer, refused), with one line on standard output saying which;
2 for bad arguments. ``SERVICE`` is a health service name (``apogee.schedule.Process`` answers
while the process runs, standby or active); empty or absent: the server's overall status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING


def probe(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """Ask ``address`` for ``service``'s health: (whether it is SERVING, a line saying what
    was answered)."""
    what = f"{address} {service or '(overall)'}"
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            code = getattr(err, "code", None)  # a failed call is also a grpc.Call
            name = code().name if callable(code) else type(err).__name__
            return False, f"{what}: {name}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == SERVING, f"{what}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m apogee.rpc.probe", description="Check a gRPC server's health."
    )
    p.add_argument("address", help="host:port of the gRPC server")
    p.add_argument("service", nargs="?", default="", help="health service name (default: overall)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = p.parse_args(argv)
    ok, line = probe(args.address, args.service, args.timeout)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
