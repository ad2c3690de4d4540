"""The ``apogee`` command.

    apogee cluster up [--data DIR] [--brokers N] [--nameservers N] [--flush sync|async]
                      [--no-console] [--monitoring [--scrape-interval S] [--prometheus-port PORT]]
    apogee cluster status | down [--data DIR]
    apogee top [--metrics HOST:PORT]... [--interval S] [--once]
    apogee broker describe [NAME] | elect NAME [--to REPLICA_ID]
    apogee topic create|update NAME [--queues N] [--perm rw|r|w] [--broker NAME]...
                [--type NORMAL|FIFO|DELAY|TRANSACTION|MIXED]
    apogee topic delete NAME | list | describe NAME
    apogee send TOPIC [--tag T] [--key K]... [--property k=v]...
                [--delay-level N | --deliver-in S | --deliver-at TIME] [BODY | --body-file PATH]
    apogee message get ID
    apogee message query --topic T [--key K] [--begin TIME] [--end TIME] [--max N]
    apogee consume TOPIC --group G [--tag EXPR] [--count N] [--timeout S] [--from earliest|latest]
    apogee group list | describe GROUP
    apogee group reset-offset GROUP --topic T (--to earliest|latest|TIME | --timestamp MS)
    apogee dlq list --group G [--filter key=K] [--since TIME|SECONDS] [--limit N]
    apogee dlq redrive --group G [--filter key=K] [--since TIME|SECONDS] [--rate N/s] [--dry-run]
    apogee txn list [--group G] [--topic T] [--max N]
    apogee txn resolve ID (--commit | --rollback)

``apogee cluster`` comes with ``apogee-local`` (:mod:`apogee.local.commands`), which adds it
through the ``apogee.cli`` entry point group (:func:`add_plugins`); without it, ``apogee cluster
...`` exits 1 saying what to install. The other commands need the SDK alone.

Nameservers come from ``--namesrv`` or ``APOGEE_NAMESRV`` (``host:port;host:port``), else from the
local cluster's state (``--data``, default ``$APOGEE_HOME/local``). Errors print one line naming
what went wrong and exit with status 1 (2 for a usage error); never a traceback, unless
``APOGEE_DEBUG`` is set and the error is not one the command expected.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Final, TextIO

from apogee.cli import (
    brokers,
    commands,
    consume,
    dlq,
    groups,
    top,
    txn,
)
from apogee.cli.common import CommandError, UsageError
from apogee.common.errors import ApogeeError

#: The entry point group through which other distributions add commands: each entry point is
#: named after its command and is a function that adds it to the subcommands it is given.
PLUGIN_GROUP: Final = "apogee.cli"
#: The commands other distributions add, first in the help, in this order: what each does and the
#: distribution it comes with (which a missing one's error names).
PLUGINS: Final = {"cluster": ("run a local cluster", "apogee-local")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse cannot take `send TOPIC --tag T BODY` (a positional after options) by itself
    if args.command == "send" and args.body is None and len(extra) == 1 and extra[0][:1] != "-":
        args.body, extra = extra[0], []
    if extra and args.run is not _not_installed:  # whatever follows, say what to install
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        result: int = args.run(args, sys.stdout)
        return result
    except BrokenPipeError:  # `apogee ... | head`: the reader has gone, which is fine
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return 0
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"apogee: error: {exc}", file=sys.stderr)
        return 2
    except (ApogeeError, CommandError) as exc:
        print(f"apogee: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: still one line, the traceback only when asked for
        if os.environ.get("APOGEE_DEBUG"):
            traceback.print_exc()
        print(
            f"apogee: unexpected error ({type(exc).__name__}: {exc}); "
            "set APOGEE_DEBUG=1 for the traceback",
            file=sys.stderr,
        )
        return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="apogee", description="Apogee message queue command line")
    p.add_argument("--namesrv", help="nameservers, host:port;host:port (or APOGEE_NAMESRV)")
    p.add_argument(
        "--data",
        type=Path,
        default=None,
        help="the local cluster's folder (default $APOGEE_HOME/local, ~/.apogee/local)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_plugins(sub)
    brokers.add_commands(sub)
    commands.add_commands(sub)
    consume.add_consume_command(sub)
    groups.add_commands(sub)
    dlq.add_commands(sub)
    txn.add_commands(sub)
    top.add_command(sub)
    return p


def add_plugins(sub: Any) -> None:
    """The commands of :data:`PLUGINS`, each added by the distribution that installs it (its
    entry point in :data:`PLUGIN_GROUP`); one that is not installed, or does not load, still
    parses and fails with one line saying what to install."""
    found = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    for name, (text, distribution) in PLUGINS.items():
        ep = found.get(name)
        if ep is None:
            missing = f"`apogee {name}` needs {distribution}, which is not installed here"
        else:
            try:
                ep.load()(sub)
                continue
            except ImportError as exc:
                missing = f"`apogee {name}` does not load from {distribution} ({exc})"
        stand_in = sub.add_parser(
            name, help=f"{text} (needs {distribution})", description=f"{missing}."
        )
        stand_in.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        stand_in.set_defaults(run=_not_installed, missing=missing, distribution=distribution)


def _not_installed(args: argparse.Namespace, out: TextIO) -> int:
    raise CommandError(f"{args.missing}; install it with `pip install {args.distribution}`")


if __name__ == "__main__":
    raise SystemExit(main())
