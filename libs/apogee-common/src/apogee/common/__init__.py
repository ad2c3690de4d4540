"""Pieces shared by every Apogee library and service: the error registry, ids, the clock,
asyncio helpers, settings and their reference, topics, tags and SQL92 selectors, logs,
authentication signatures, certificate files, the metrics pieces the SDK shares, and tracing.
The gRPC runtime is :mod:`apogee.rpc`; what the services stand on besides (leadership,
per-broker workers, long-poll holds, the metrics server) is :mod:`apogee.service`."""
