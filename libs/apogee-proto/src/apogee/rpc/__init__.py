"""gRPC plumbing shared by Apogee's services and clients: error mapping, server lifecycle, and
the nameserver directory through which services find the live brokers."""
