"""Apogee broker service: stores messages and serves producers and consumers.

- :mod:`apogee_broker.settings` - :class:`BrokerSettings` and how they are loaded
- :mod:`apogee_broker.app` - :class:`BrokerApp`, the wiring; run it in-process or with
  ``python -m apogee_broker``
- :mod:`apogee_broker.core` - the logic by capability, free of any protocol: ``send``,
  ``consume``, ``txn``, ``schedule``, ``storage``, ``clients``, and the topics, checks and
  registration they share (its docstring maps which servicer calls what)
- :mod:`apogee_broker.servicers` - thin handlers of the ``apogee.v1`` services (``Broker``,
  ``BrokerAdmin``, ``Consumer``, ``ConsumerAdmin``, ``Schedule``, ``Transaction``,
  ``TransactionCheck``) over the core
- :mod:`apogee_broker.metrics` - the broker's metrics, declared once
- :mod:`apogee.testkit.broker` - helpers to run a broker in tests
"""
