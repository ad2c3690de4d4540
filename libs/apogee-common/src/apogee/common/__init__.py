"""Pieces shared by every Apogee library and service: the error registry, ids and the clock."""
