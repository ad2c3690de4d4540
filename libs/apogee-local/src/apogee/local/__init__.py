"""apogee.local: a local Apogee cluster of processes on this machine.

- :mod:`apogee.local.cluster`: start (``up``), check (``status``), restart and stop (``down``)
  nameservers, brokers, the schedule service, the transaction checker, the web console and,
  when asked, Prometheus; recorded in ``<data>/cluster.json`` (:mod:`apogee.cli.local_state`).
- :mod:`apogee.local.commands`: ``apogee cluster up | status | down``, added to the ``apogee``
  command through the ``apogee.cli`` entry point group.
- :mod:`apogee.local.processes`, :mod:`apogee.local.prometheus`, :mod:`apogee.local.webconsole`:
  spawning and stopping members (and who holds a port), the Prometheus server, the console as a
  member.
- :mod:`apogee.local.health`: the members' health checks and the waits until they pass.
- :mod:`apogee.local.ports`: the ports each member keeps from one start to the next
  (``<data>/ports.json``).

This distribution (``apogee-local``) declares the services it starts (``apogee-nameserver``,
``apogee-broker``, ``apogee-schedule``, ``apogee-txn-checker``) and runs each as its own process
by its module (``python -m apogee_broker``); it imports none of them. The console
(``apogee-console``) is started when it is installed.
"""
