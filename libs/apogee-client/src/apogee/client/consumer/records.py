"""Messages as consumers receive them, decoded from the records a pull returns.

A pull (``apogee.v1.Consumer.Pull``) answers with whole CommitLog records back to back, in
queue order. :func:`decode_records` checks every record and wraps each in a
:class:`ReceivedMessage`, in place and lazily: the decoding is :mod:`apogee.codec.view`'s, the
layout :mod:`apogee.codec.layout`'s.
"""

from __future__ import annotations

from functools import partial

from apogee.codec import SYSFLAG_COMPRESSED, RecordView
from apogee.codec import decode_records as _decode_records

__all__ = ["SYSFLAG_COMPRESSED", "ReceivedMessage", "decode_records"]


class ReceivedMessage(RecordView):
    """One message handed to a consumer.

    The attributes that a :class:`~apogee.client.StoredMessage` has carry the same names and
    meaning; ``properties`` holds the user's properties only (tags, keys and the unique id are
    attributes of their own). ``size`` is the record's size in bytes (what flow control counts).
    The body is decompressed, and properties parsed, on first use. Instances come from
    :func:`decode_records`.
    """

    #: ``_trace``: the message's spans, set only when the consumer traces
    #: (:mod:`apogee.client.consumer.spans`)
    __slots__ = ("_trace",)

    @property
    def message_id(self) -> str:
        """The same as :attr:`unique_id`."""
        return self.unique_id

    def __repr__(self) -> str:
        return (
            f"ReceivedMessage(topic={self.topic!r}, broker_name={self.broker_name!r}, "
            f"queue_id={self.queue_id}, queue_offset={self.queue_offset}, "
            f"unique_id={self.unique_id!r}, size={self.size})"
        )


#: ``decode_records(buf, broker_name, topic, queue_id, first_offset, verify_crc=True, *,
#: start=0, end=None)``: the messages of one pull, decoded where they arrived and every record
#: checked (:func:`apogee.codec.decode_records`, as :class:`ReceivedMessage` objects).
decode_records = partial(_decode_records, cls=ReceivedMessage)
