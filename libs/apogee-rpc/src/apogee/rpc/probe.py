"""``python -m apogee.rpc.probe HOST:PORT [SERVICE]``: one grpc.health.v1 Check, for the health
checks of container images (a Dockerfile's ``HEALTHCHECK``, compose's ``healthcheck``), where no
``grpc_health_probe`` binary is installed.

Exit status 0 when the server answers ``SERVING`` within ``--timeout`` seconds (default 3), 1
otherwise (another status, no answer, refused, a TLS handshake that failed), with one line on
standard output saying which; 2 for bad arguments (or TLS files that cannot be used).
``SERVICE`` is a health service name (``apogee.schedule.Process`` answers while the process
runs, standby or active); empty or absent: the server's overall status.

A port that serves TLS (a service with ``tls_cert_file`` set) is probed over TLS when any of
these is given, as a flag or in the environment (the flag wins), so that an image's
``HEALTHCHECK`` line stays the same and the container's environment turns TLS on:

- ``--tls`` / ``APOGEE_PROBE_TLS=true``: TLS, verifying the server with the system's roots
  unless a CA is given;
- ``--tls-ca FILE`` / ``APOGEE_PROBE_TLS_CA``: the CA the server's certificate chains to;
- ``--tls-cert FILE`` and ``--tls-key FILE`` / ``APOGEE_PROBE_TLS_CERT`` and
  ``APOGEE_PROBE_TLS_KEY``: a client certificate, for a server with ``tls_client_auth =
  require`` (the service's own certificate and key do);
- ``--tls-server-name NAME`` / ``APOGEE_PROBE_TLS_SERVER_NAME``: the name expected in the
  server's certificate, when it does not hold the probed host (``127.0.0.1``), e.g. the
  Service's DNS name in Kubernetes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2

from apogee.common.errors import InvalidArgumentError
from apogee.rpc.tls import ClientTls

SERVING = health_pb2.HealthCheckResponse.SERVING

#: flag destination -> environment variable
TLS_ENV = {
    "tls_ca": "APOGEE_PROBE_TLS_CA",
    "tls_cert": "APOGEE_PROBE_TLS_CERT",
    "tls_key": "APOGEE_PROBE_TLS_KEY",
    "tls_server_name": "APOGEE_PROBE_TLS_SERVER_NAME",
}
_TRUE = {"1", "true", "yes", "on"}


def probe(
    address: str, service: str = "", timeout: float = 3.0, tls: ClientTls | None = None
) -> tuple[bool, str]:
    """Ask ``address`` for ``service``'s health (over TLS when ``tls`` is given): (whether it
    is SERVING, a line saying what was answered)."""
    what = f"{address} {service or '(overall)'}"
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, tls.credentials(), options=tls.channel_options())
    with channel:
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


def tls_of(args: argparse.Namespace, env: Mapping[str, str]) -> ClientTls | None:
    """The TLS the flags (else the environment) ask for; None for plaintext."""
    values = {dest: getattr(args, dest) or env.get(var, "") for dest, var in TLS_ENV.items()}
    wanted = args.tls or env.get("APOGEE_PROBE_TLS", "").strip().lower() in _TRUE
    if not wanted and not any(values.values()):
        return None
    return ClientTls(
        ca_file=values["tls_ca"],
        cert_file=values["tls_cert"],
        key_file=values["tls_key"],
        server_name=values["tls_server_name"],
    )


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m apogee.rpc.probe", description="Check a gRPC server's health."
    )
    p.add_argument("address", help="host:port of the gRPC server")
    p.add_argument("service", nargs="?", default="", help="health service name (default: overall)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--tls", action="store_true", help="use TLS ($APOGEE_PROBE_TLS)")
    p.add_argument("--tls-ca", metavar="FILE", help="CA of the server ($APOGEE_PROBE_TLS_CA)")
    p.add_argument("--tls-cert", metavar="FILE", help="client certificate ($APOGEE_PROBE_TLS_CERT)")
    p.add_argument("--tls-key", metavar="FILE", help="client key ($APOGEE_PROBE_TLS_KEY)")
    p.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name expected in the server's certificate ($APOGEE_PROBE_TLS_SERVER_NAME)",
    )
    args = p.parse_args(argv)
    try:
        tls = tls_of(args, os.environ if env is None else env)
        ok, line = probe(args.address, args.service, args.timeout, tls)
    except InvalidArgumentError as err:
        print(f"{p.prog}: {err}", file=sys.stderr)
        return 2
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
