"""Apogee broker service: stores messages and serves producers and consumers.

- :mod:`apogee_broker.settings` - :class:`BrokerSettings` and how they are loaded
- :mod:`apogee_broker.app` - :class:`BrokerApp`, the wiring; run it in-process or with
  ``python -m apogee_broker``
- :mod:`apogee_broker.core` - topics, sending, lookups, registration; pulls with long polling,
  consumer groups and sessions, consumer offsets, queue locks (no gRPC)
- :mod:`apogee_broker.servicers` - the ``apogee.v1.Broker``, ``BrokerAdmin``, ``Consumer`` and
  ``ConsumerAdmin`` RPCs
- :mod:`apogee_broker.testing` - helpers to run a broker in tests
"""
