"""Thin gRPC servicers over the core."""
