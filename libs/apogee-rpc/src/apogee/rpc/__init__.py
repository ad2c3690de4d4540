"""Apogee's gRPC runtime, for its services and its clients (the SDK, the tools):

- :mod:`~apogee.rpc.errors`: the one mapping between Apogee's errors and gRPC statuses, both
  ways (:func:`~apogee.rpc.errors.call` makes a client's call raise an Apogee error);
- :mod:`~apogee.rpc.server`: a grpc.aio server started and stopped the same way everywhere,
  with its health service, and a process run until SIGTERM or SIGINT;
- :mod:`~apogee.rpc.security` and :mod:`~apogee.rpc.tls`: how a client reaches a service (TLS,
  signed calls) and how a server serves TLS, its certificates reloaded while it runs;
- :mod:`~apogee.rpc.mux`: unary calls multiplexed on one long-lived stream;
- :mod:`~apogee.rpc.protowire`: protobuf's wire format, where message bytes are handled by hand;
- :mod:`~apogee.rpc.handlers` and :mod:`~apogee.rpc.malformed`: what server interceptors build
  on, and the one that refuses requests whose bytes do not parse;
- :mod:`~apogee.rpc.probe`: ``python -m apogee.rpc.probe``, the health check of container images.

The stubs are :mod:`apogee.v1` (apogee-proto); what the services stand on besides (their
process, leadership, per-broker workers, the metrics server, the auth interceptor) is
:mod:`apogee.service`.
"""
