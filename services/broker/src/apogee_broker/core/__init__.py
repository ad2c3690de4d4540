"""The broker's logic, free of gRPC: topics, sending, lookups, registration."""
