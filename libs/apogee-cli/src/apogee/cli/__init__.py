"""apogee.cli: the ``apogee`` command (:mod:`apogee.cli.main`), the local cluster it starts and
stops (:mod:`apogee.cli.local_cluster`), and an in-process cluster for tests
(:mod:`apogee.cli.testing`).

This distribution (``apogee-cli``) declares the services it starts: ``apogee-nameserver``,
``apogee-broker``, ``apogee-schedule`` and ``apogee-txn-checker``. The SDK alone is
``apogee-client``.
"""
