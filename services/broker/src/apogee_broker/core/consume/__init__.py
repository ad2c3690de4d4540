"""Consuming: what consumers read, commit, lock and send back.

- :mod:`.pulling` - :class:`PullService`: a pull of one queue, held (long polling) when nothing
  is new.
- :mod:`.push` - push delivery streams (:class:`DeliveryHub`, one :class:`DeliverySession` per
  ``Consumer.Deliver`` stream): subscriptions fed as records arrive, within the consumer's
  credits.
- :mod:`.reads` - the queue reads both share (hot records on the event loop, cold ones on a
  worker thread).
- :mod:`.offsets` - :class:`ConsumerOffsets`: committed offsets, kept in
  ``consumerOffset.json``; resets.
- :mod:`.queues` - a queue's offsets by time (GetQueueOffsets).
- :mod:`.locks` - :class:`QueueLocks`: queue locks of orderly consumption.
- :mod:`.send_back` - :class:`SendBackService`: failed messages stored again for a retry
  (``%RETRY%<group>``) or as dead letters (``%DLQ%<group>``).
- :mod:`.group_admin` - :class:`GroupAdmin`: the groups known here, their lag, offset resets.

Who is in a group, and the session streams that carry it, are in
:mod:`apogee_broker.core.clients`.
"""
