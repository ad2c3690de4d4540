"""The clients connected to this broker: who they are and the streams the broker talks to them on.

- :mod:`.groups` - :class:`ConsumerGroups`: each consumer group's members and their
  subscriptions, from their heartbeats; expiry.
- :mod:`.sessions` - :class:`SessionHub`: one consumer session per stream, tying a member to its
  connection; what the broker tells it (member changes, offset resets).
- :mod:`.producers` - :class:`ProducerRegistry`: transactional producers' sessions, and the
  transaction checks sent to them.
"""
