"""Apogee nameserver service."""
