"""Every command fed bad arguments: one line naming the argument and the rule, a non-zero exit,
never a traceback. No cluster runs: the nameserver given is a closed port, and every case here
is refused before anything is asked of it."""

from __future__ import annotations

import pytest

from apogee.cli.main import main

pytestmark = pytest.mark.unit

TIME_RULE = (
    "must be a time from 1970-01-01 to 9999-12-31 UTC (0 to 253402300799999 ms since the epoch)"
)

#: (arguments, exit status, what the last line of stderr says)
CASES: list[tuple[list[str], int, str]] = [
    (
        ["group", "reset-offset", "g", "--topic", "T", "--timestamp", "99999999999999999999"],
        2,
        f"--timestamp 99999999999999999999: {TIME_RULE}",
    ),
    (
        ["group", "reset-offset", "g", "--topic", "T", "--timestamp", "9223372036854775807"],
        2,
        f"--timestamp 9223372036854775807: {TIME_RULE}",
    ),
    (["group", "reset-offset", "g", "--topic", "T", "--timestamp", "-5"], 2, f"-5: {TIME_RULE}"),
    (
        ["group", "reset-offset", "g", "--topic", "T", "--to", "99999999999999999999"],
        2,
        f"--to '99999999999999999999': {TIME_RULE}",
    ),
    (
        ["group", "reset-offset", "g", "--topic", "T", "--to", "yesterday"],
        2,
        "--to 'yesterday': use ISO 8601 (2026-11-21T10:00:00) or ms",
    ),
    (
        ["group", "reset-offset", "bad group", "--topic", "T", "--to", "latest"],
        1,
        "group: 'bad group' must be 1 to 255 characters from [%|a-zA-Z0-9_-]",
    ),
    (
        ["group", "describe", "bad group"],
        1,
        "group: 'bad group' must be 1 to 255 characters from [%|a-zA-Z0-9_-]",
    ),
    (
        ["message", "query", "--topic", "T", "--key", "k", "--begin", "10000-01-01"],
        2,
        "--begin '10000-01-01': use ISO 8601 (2026-11-21T10:00:00) or ms",
    ),
    (
        ["message", "query", "--topic", "T", "--key", "k", "--end", "99999999999999999999"],
        2,
        f"--end '99999999999999999999': {TIME_RULE}",
    ),
    (
        ["message", "query", "--topic", "T", "--key", "k", "--max", "-3"],
        1,
        "max_messages: must be an integer from 1 to 1024, got -3",
    ),
    (
        ["message", "query", "--topic", "T", "--max", "1025"],
        1,
        "max_messages: must be an integer from 1 to 1024, got 1025",
    ),
    (
        ["message", "query", "--topic", "bad topic"],
        1,
        "topic 'bad topic'",
    ),
    (["message", "get", ""], 1, "unique_id: must be a non-empty string"),
    (
        ["message", "read", "T", "--since", "99999999999999999999"],
        2,
        f"--since '99999999999999999999': {TIME_RULE}",
    ),
    (["message", "read", "T", "--from", "-1"], 2, "--from must not be negative"),
    (
        ["consume", "T", "--group", "g", "--from", "99999999999999999999"],
        2,
        f"--from '99999999999999999999': {TIME_RULE}",
    ),
    (["consume", "T", "--group", "g", "--count", "-1"], 2, "must not be negative"),
    (
        ["consume", "bad topic", "--group", "g", "--timeout", "1"],
        1,
        "topic 'bad topic': has a character outside [%|a-zA-Z0-9_-]",
    ),
    (
        ["consume", "T", "--group", "g", "--sql", "color = 'red' AND"],
        1,
        "sql_expression: syntax error at position",
    ),
    (
        ["consume", "T", "--group", "g", "--tag", "color = 'red'"],
        1,
        "tag_expression: \"color = 'red'\" looks like an SQL92 condition",
    ),
    (["dlq", "list", "--group", "g", "--since", "nan"], 2, "must be 0 or more"),
    (["dlq", "list", "--group", "g", "--limit", "-1"], 2, "--limit must be from 1 to 100000"),
    (["dlq", "redrive", "--group", "g", "--rate", "0"], 2, "must be above 0 messages per second"),
    (["dlq", "redrive", "--group", "g", "--filter", "nokey"], 2, "'nokey' must be key=K"),
    (["send", "T", "--delay-level", "99", "x"], 2, "--delay-level 99: must be from 1 to 18"),
    (
        ["send", "T", "--property", "REAL_TOPIC=X", "x"],
        1,
        "property 'REAL_TOPIC': is set by brokers only",
    ),
    (["send", "T", "--property", "noequals", "x"], 2, "--property 'noequals': use name=value"),
    (
        ["send", "T", "--deliver-at", "2026-01-01T00:00:00", "x"],
        2,
        "add a UTC offset (+01:00) or Z",
    ),
    (["send", "bad topic", "x"], 1, "topic 'bad topic': has a character outside"),
    (["topic", "create", "bad topic"], 1, "topic 'bad topic': has a character outside"),
    (["topic", "create", "T", "--queues", "0"], 1, "queues: must be an integer from 1 to 1024"),
    (["topic", "create", "T", "--queues", "x"], 2, "argument --queues: invalid int value: 'x'"),
    (["topic", "describe", "bad topic"], 1, "topic 'bad topic': has a character outside"),
    (
        ["topic", "create", "T", "--type", "ordered"],
        2,
        "argument --type: 'ordered': must be one of NORMAL, FIFO, DELAY, TRANSACTION, MIXED",
    ),
    (["topic", "update", "T", "--type", ""], 2, "argument --type: '': must be one of NORMAL"),
    (["broker"], 2, "the following arguments are required: ACTION"),
    (["broker", "elect"], 2, "the following arguments are required: name"),
    (["broker", "describe", ""], 1, "broker_name: must name a broker, got ''"),
    (["broker", "elect", "", "--to", "r1"], 1, "broker_name: must name a broker, got ''"),
    (
        ["broker", "elect", "broker-a", "--to", " r1"],
        1,
        "replica_id: must be a replica id (text without surrounding spaces) or '', got ' r1'",
    ),
]


@pytest.mark.parametrize(("argv", "status", "says"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_bad_argument_gets_one_line_and_a_failing_status(
    argv: list[str], status: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: int | str | None
    try:
        code = main(["--namesrv", "127.0.0.1:1", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == status, err
    assert says in err.strip().splitlines()[-1], err
