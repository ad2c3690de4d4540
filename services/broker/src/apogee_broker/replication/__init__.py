"""Replica groups: a broker name served by a leader and its followers (docs/replication.md)."""
