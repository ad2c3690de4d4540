"""The broker's logic by capability, free of any protocol.

Nothing under ``core`` imports gRPC or the generated protocol types: calls take and return
plain values and dataclasses, and refuse with the error kinds of :mod:`apogee.common.errors`.
The servicers (:mod:`apogee_broker.servicers`) turn requests into these calls and results back
into responses, and map errors to statuses in one place (:mod:`apogee.rpc.errors`). A second
protocol is a second set of thin servicers over the same calls. (The caller's rights are
checked with :mod:`apogee.service.access`, which reads the caller its server interceptor set;
that module lives beside the interceptor and so brings the gRPC package in with it.)

================  ===========================================================================
package           what it does
================  ===========================================================================
:mod:`.send`      a send's messages checked (the check ladder) and stored, each answered
:mod:`.consume`   pulls, push delivery streams, committed offsets, queue locks, send-back
                  (retries and dead letters), group administration
:mod:`.txn`       transactions: half messages, their end, the checker's checks and reads
:mod:`.schedule`  the broker's side of delayed and timer messages
:mod:`.storage`   glue to the store: the writer every write goes through (durability wait,
                  outcomes), full-disk episodes, store spans, lookups
:mod:`.clients`   who is connected: consumer groups and their sessions, producer sessions
(modules)         shared: :mod:`.topics` (the topic table), :mod:`.checks` (the request checks
                  every consumer call shares), :mod:`.holds` (long-poll deadlines),
                  :mod:`.registration` (with the nameservers)
================  ===========================================================================

Dependencies run downwards: ``txn`` -> ``send`` -> ``storage``; ``consume`` and ``schedule`` ->
``storage``; everything -> ``clients``, ``topics``, ``checks``; nothing in ``core`` imports
the servicers, the app or the metrics collector (the core counts on a
:class:`~apogee_broker.metrics.BrokerMetrics` handed to it).

Which servicer (of the internal protocol's services) calls what:

=========================================  ================================================
servicer                                   core
=========================================  ================================================
``BrokerServicer`` (Broker)                SendMessages, SendStream:
                                           :class:`.send.service.SendService`,
                                           :class:`.send.record_intake.RecordIntake`;
                                           GetMessage, QueryMessages:
                                           :class:`.storage.lookup.MessageLookup`
``BrokerAdminServicer`` (BrokerAdmin)      :class:`.topics.TopicManager`, DescribeTopic's
                                           queues from :class:`.storage.lookup.MessageLookup`
``ConsumerServicer`` (Consumer)            PullStream: :class:`.consume.pulling.PullService`;
                                           Deliver: :class:`.consume.push.DeliveryHub`;
                                           Session: :class:`.clients.sessions.SessionHub`;
                                           GetMembers: :class:`.clients.groups.ConsumerGroups`;
                                           CommitOffsets, QueryOffsets:
                                           :class:`.consume.offsets.ConsumerOffsets`;
                                           GetQueueOffsets: :func:`.consume.queues.queue_offsets`;
                                           LockQueues, UnlockQueues:
                                           :class:`.consume.locks.QueueLocks`;
                                           SendBack: :class:`.consume.send_back.SendBackService`
``ConsumerAdminServicer`` (ConsumerAdmin)  :class:`.consume.group_admin.GroupAdmin`
``ScheduleServicer`` (Schedule)            :class:`.schedule.service.ScheduleService`
``TransactionServicer`` (Transaction)      SendHalf(s): :class:`.txn.halves.HalfIntake`;
                                           EndTransaction(s): :class:`.txn.ends.TransactionEnds`;
                                           ProducerSession:
                                           :class:`.clients.producers.ProducerRegistry`
``TransactionCheckServicer``               CheckHalf: :class:`.txn.checks.HalfChecks`;
(TransactionCheck)                         CommitTransactionProgress:
                                           :class:`.txn.ledger.TransactionLedger`; the rest:
                                           :class:`.txn.scans.TransactionScans`
=========================================  ================================================

The app (:mod:`apogee_broker.app`) builds these objects and hands the metrics collector what it
reads (:class:`~apogee_broker.metrics.BrokerSources`): the group administration,
:meth:`.schedule.service.ScheduleService.waiting` and
:meth:`.txn.scans.TransactionScans.count_pending`.
"""
