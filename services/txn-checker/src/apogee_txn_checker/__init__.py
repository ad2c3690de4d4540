"""Apogee transaction checker: asks producers about transactions left undecided."""
