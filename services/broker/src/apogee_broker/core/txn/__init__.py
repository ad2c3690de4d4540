"""Transactional messages at the broker: half messages, their end, and their checks.

- :mod:`.halves` - :class:`HalfIntake`: SendHalf and SendHalves, a message stored as a half.
- :mod:`.ends` - :class:`TransactionEnds`: EndTransaction and EndTransactions, a decision
  applied.
- :mod:`.checks` - :class:`HalfChecks`: CheckHalf, the txn-checker's step on one half copy.
- :mod:`.scans` - :class:`TransactionScans`: what the txn-checker and operators read (state,
  scans of the half and op queues, pending transactions).
- :mod:`.ledger` - :class:`TransactionLedger`: what those steps share: decisions, closed copies
  and recent halves (:mod:`.state`), each transaction's lock (:mod:`.locks`), the checker's
  progress, and the writes and reads they make (:mod:`.lookups`).
- :mod:`.records` - half copies and op records, drawn once.

Producers' sessions, which checks are sent on, are in :mod:`apogee_broker.core.clients.producers`.
"""
