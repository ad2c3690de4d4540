"""``apache.rocketmq.v2.MessagingService``: the official RocketMQ 5 clients' protocol, turned
into calls on the broker's core (sending, POP consumption, transactions) and answers in the
protocol's own terms. Every answer carries a ``Status`` with v2's ``Code`` and a sentence
(:mod:`.status`); a request that fails is answered, never aborted, so the clients act on the
code. What Apogee does not serve (lite topics, pull by offset) is refused with ``UNSUPPORTED``
or ``NOT_IMPLEMENTED`` and a sentence.

Clients are known by their ``x-mq-client-id`` header
(:mod:`apogee_broker.core.clients.official`). The Telemetry stream
of each stays open for its life: the broker answers every Settings the client writes with the
client's own Settings merged with the broker's values (max body size, back-off, long polling,
whether a group is FIFO), and writes commands on it (a transaction check) whenever it has one.

The service is made of parts, one per RPC group: :mod:`.clients_rpc` (routes, heartbeats,
Telemetry), :mod:`.producing` (sends, transactions, recalls) and :mod:`.consuming` (POP), over
what :mod:`.base` shares.
"""

from __future__ import annotations

from apogee_broker.servicers.v2.base import V2Config
from apogee_broker.servicers.v2.clients_rpc import ClientsPart
from apogee_broker.servicers.v2.consuming import ConsumingPart
from apogee_broker.servicers.v2.producing import ProducingPart

__all__ = ["MessagingServicer", "V2Config"]


class MessagingServicer(ClientsPart, ProducingPart, ConsumingPart):
    """The v2 service of one broker."""
