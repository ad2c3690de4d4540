"""What every Apogee service stands on: its process, its replicas' leadership, its work on every
broker, its metrics endpoint and who may call it. Services only; the SDK never imports it.

A service's process:

- :mod:`~apogee.service.process`: ``__main__`` the same way everywhere: argv, settings,
  logging, tracing, then the app until SIGTERM or SIGINT (:func:`~.process.run_service`), with
  one set of exit statuses.

Leader-elected services (schedule, the transaction checker, the operator), one replica active:

- :mod:`~apogee.service.leadership`: the seam (:class:`~.leadership.Leadership`) and the file
  lock; :mod:`~apogee.service.lease`: a Kubernetes Lease behind the same seam, over
  :mod:`~apogee.service.kube` (the API server, from asyncio; the ``kubernetes`` extra);
- :mod:`~apogee.service.leader_settings`: the settings they share (descriptions, checks) and the
  leadership they choose;
- :mod:`~apogee.service.leader_app`: one replica's life (health server, leadership, the work
  while it leads, the ``<service>_leader`` gauge) and its command line.

Services that work on every broker (schedule, the transaction checker):

- :mod:`~apogee.service.directory`: the live brokers, from the nameservers, and one worker per
  broker kept in line with them;
- :mod:`~apogee.service.workers`: a worker keeps one session with its broker running, started
  again with backoff after a failure; the sessions' shared base;
- :mod:`~apogee.service.broker_client`: the channel a session calls its broker on;
- :mod:`~apogee.service.loops`: a background loop, as one task started and stopped.

Serving:

- :mod:`~apogee.service.longpoll`: calls that find nothing held until something arrives;
- :mod:`~apogee.service.metrics`: each app's registry and its ``/metrics`` endpoint (HTTP or
  HTTPS), and the metrics services share;
- :mod:`~apogee.service.access`: the auth interceptor: every call authenticated, the right each
  method needs checked.

The gRPC runtime below all this is :mod:`apogee.rpc`; what the SDK shares too,
:mod:`apogee.common`.
"""
