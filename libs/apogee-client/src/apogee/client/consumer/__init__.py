"""Apogee's consumers: pull with long polling, rebalance across the group, commit offsets."""
