"""apogee.cli: the ``apogee`` command (:mod:`apogee.cli.main`), its admin commands over the SDK
alone (topics, sends, lookups, consumers, groups, dead letters, transactions, ``top``).

This distribution (``apogee-cli``) needs only ``apogee-client`` and the small libraries under it:
no storage engine, no service. It finds a local cluster by its record
(:mod:`apogee.cli.local_state`), but starts none: ``apogee cluster up | status | down`` comes
with ``apogee-local`` (:mod:`apogee.local`), which adds it through the ``apogee.cli`` entry
point group. The in-process cluster for tests is :mod:`apogee.testkit.cluster`.
"""
