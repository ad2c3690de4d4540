"""gRPC plumbing shared by Apogee's services and clients: error mapping, server lifecycle, a
service's process (:mod:`~apogee.rpc.process`), a leader-elected service's replica
(:mod:`~apogee.rpc.leader_app`), and the nameserver directory through which services find the
live brokers."""
