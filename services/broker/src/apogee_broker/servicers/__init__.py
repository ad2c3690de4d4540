"""Thin gRPC servicers: requests become core calls, results become responses."""
