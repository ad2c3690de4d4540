"""``python -m apogee_console.passwd NAME [--role read|admin]``: print a ``[[users]]`` entry of
the console's users file for a password read from standard input (the first line; never from
the command line, which other users of the machine can read). On a terminal it is asked for
without echo, twice. The password is kept as scrypt with a random salt,
``password = "scrypt$n=16384,r=8,p=1$<salt>$<key>"``; an entry of the older form (``salt`` and
``password_sha256``) is replaced by what this prints for the same name."""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Sequence

from apogee_console.core.access import users_entry


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m apogee_console.passwd", description=__doc__)
    p.add_argument("name", help="the user's name")
    p.add_argument("--role", choices=["read", "admin"], default="read")
    args = p.parse_args(argv)
    if sys.stdin.isatty():
        password = getpass.getpass("password: ")
        if getpass.getpass("again: ") != password:
            print("passwd: the passwords differ", file=sys.stderr)
            return 1
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        print("passwd: the password is empty", file=sys.stderr)
        return 1
    sys.stdout.write(users_entry(args.name, password, args.role))
    return 0


if __name__ == "__main__":
    sys.exit(main())
