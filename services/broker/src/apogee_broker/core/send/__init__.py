"""Sending: a send's messages checked and stored, each answered on its own.

- :mod:`.checks` - the check ladder every message a client sends goes through (:class:`SendChecks`),
  in one order with one error each; shared with half messages.
- :mod:`.service` - :class:`SendService`: a request of whole messages (SendMessages).
- :mod:`.record_intake` - :class:`RecordIntake`: a request of send records, checked in place and
  appended as one block (the SDK's SendStream).
- :mod:`.dedup` - the dedup window: a message sent again with the same dedup id is not stored
  twice; :mod:`.dedup_log` rebuilds it from the CommitLog at start-up.

What is stored goes through :mod:`apogee_broker.core.storage.writer`.
"""
