"""The nameserver's logic, free of gRPC: the route registry and its expiry loop."""
