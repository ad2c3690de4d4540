"""A transactional producer in a process of its own, for the end-to-end tests that kill it in the
middle of a transaction.

    python -m e2e.txn_producer_proc --namesrv A --group G --topic T --body B [--key K]

It sends one message in a transaction whose executor prints ``TXN <transaction id>`` on stdout
(one line, flushed) and then waits forever: the half is stored, the transaction is never ended.
The process is meant to be killed (SIGKILL); the check of its transaction is then answered by
another producer of the group. The producer has no check listener: a check that reaches it
before it dies is answered UNKNOWN.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from apogee.client import Message, TransactionDecision, TransactionMessage, TransactionProducer


async def run(args: argparse.Namespace) -> None:
    async def executor(message: TransactionMessage, arg: object) -> TransactionDecision:
        print(f"TXN {message.transaction_id}", flush=True)
        await asyncio.Event().wait()  # the local transaction never ends: killed meanwhile
        return TransactionDecision.COMMIT

    keys = [args.key] if args.key else []
    async with TransactionProducer(args.namesrv, args.group, executor_timeout=3600.0) as producer:
        await producer.send_in_transaction(
            Message(args.topic, args.body.encode(), keys=keys), executor
        )
    print("the transaction ended: this process was not killed in time", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--namesrv", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--body", required=True)
    p.add_argument("--key", default="")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
