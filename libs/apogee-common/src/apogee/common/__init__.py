"""Pieces shared by every Apogee library and service: the error registry, ids, the clock, topics,
and the scaffolding of services (leadership, per-broker workers, long-poll holds)."""
