"""The checker: knows nothing of gRPC beyond the client seam in :mod:`.client`."""
