"""POP consumption (RocketMQ 5's): per group and topic, the broker hands out messages from any
of its readable queues and keeps each one invisible until it is acked or its time runs out.

- :mod:`.handles`: the receipt handle a consumer acks or re-arms a delivery with.
- :mod:`.journal`: the append-only file that makes the invisible state durable.
- :mod:`.table`: the state itself (per queue: a cursor and the messages in flight), kept by the
  journal.
- :mod:`.service`: receive (with long polling), ack, change the invisible time, dead-lettering.
"""
