"""Apogee broker service: stores messages and serves producers (and, later, consumers).

- :mod:`apogee_broker.settings` - :class:`BrokerSettings` and how they are loaded
- :mod:`apogee_broker.app` - :class:`BrokerApp`, the wiring; run it in-process or with
  ``python -m apogee_broker``
- :mod:`apogee_broker.core` - topics, sending, lookups, registration (no gRPC)
- :mod:`apogee_broker.servicers` - the ``apogee.v1.Broker`` and ``apogee.v1.BrokerAdmin`` RPCs
- :mod:`apogee_broker.testing` - helpers to run a broker in tests
"""
