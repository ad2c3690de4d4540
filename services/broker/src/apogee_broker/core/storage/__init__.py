"""The broker's glue to its store (:mod:`apogee.store`).

- :mod:`.writer` - :class:`StoreWriter`: every write of the broker (sends, halves, decisions,
  retries, the schedule topic's deliveries), its defaults, outcomes and durability wait.
- :mod:`.disk_episodes` - a full disk, logged once when sends start and stop being refused.
- :mod:`.store_spans` - the store spans of traced messages.
- :mod:`.lookup` - :class:`MessageLookup`: messages by unique id, key or time; a topic's queues.
"""
