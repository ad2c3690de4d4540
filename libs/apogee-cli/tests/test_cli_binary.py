"""Bytes that are not UTF-8: ``apogee send`` sends standard input's lines and ``--body-file``
as the bytes they are (``printf '\\xff\\xfe\\n' | apogee send T``), readers print such bodies
without failing, and a text argument that is not UTF-8 (Python hands its bytes on as lone
surrogates) is a usage error naming the option."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from apogee.cli.common import not_utf8
from apogee.cli.main import main
from apogee.client import AdminClient
from apogee.testkit.cluster import InProcessCluster

TOPIC = "BinaryCli"
CLOSED = "127.0.0.1:1"  # nothing is asked of it: every case is refused before
#: "a", the byte 0xff as Python decodes it from argv (surrogateescape), "b"
BAD = "a\udcffb"
NOT_UTF8 = "b'a\\xffb' must be UTF-8 text, and byte 0xff at position 1 is not"
TEXT_ONLY = "tags, keys and properties are text: binary data belongs in the body (--body-file)"

#: (arguments, what the last line of stderr says); each exits 2, the status of a usage error
CASES: list[tuple[list[str], str]] = [
    (
        ["send", "T", BAD],
        f"BODY {NOT_UTF8}; send bytes as they are with --body-file PATH (- for standard input)",
    ),
    (["send", "T", "x", "--key", BAD], f"argument --key: {NOT_UTF8}; {TEXT_ONLY}"),
    (["send", "T", "x", "--tag", BAD], f"argument --tag: {NOT_UTF8}; {TEXT_ONLY}"),
    (
        ["send", "T", "x", "--property", f"n={BAD}"],
        f"argument --property: b'n=a\\xffb' must be UTF-8 text, and byte 0xff at position 3 "
        f"is not; {TEXT_ONLY}",
    ),
    (["send", "T", "x", "--body-file", "-"], "give BODY or --body-file, not both"),
    (["send", "T", "--body-file", "/nonexistent"], "--body-file '/nonexistent': cannot be read"),
    (["consume", "T", "--group", "g", "--tag", BAD], f"argument --tag: {NOT_UTF8}"),
    (
        ["consume", "T", "--group", "g", "--sql", f"a = '{BAD}'"],
        "argument --sql: b\"a = 'a\\xffb'\"",
    ),
    (["message", "read", "T", "--tag", BAD], f"argument --tag: {NOT_UTF8}"),
    (["message", "query", "--topic", "T", "--key", BAD], f"argument --key: {NOT_UTF8}"),
    (["message", "get", BAD], f"argument id: {NOT_UTF8}"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "says"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_text_that_is_not_utf8_is_a_usage_error(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: int | str | None
    try:
        code = main(["--namesrv", CLOSED, *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code == 2, err
    assert says in err.strip().splitlines()[-1], err


async def apogee(namesrv: str, *args: str | bytes, stdin: bytes = b"") -> tuple[int, str, str]:
    """``apogee --namesrv NAMESRV ARGS`` as a user runs it: exit status, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "apogee.cli",
        "--namesrv",
        namesrv,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")},
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.unit
def test_why_text_is_not_utf8_names_the_byte_or_the_surrogate() -> None:
    assert not_utf8("plain é") is None
    # a byte of argv that was not UTF-8 (Python's surrogateescape) is named as the byte
    assert (
        not_utf8("a\udcffb") == "b'a\\xffb' must be UTF-8 text, and byte 0xff at position 1 is not"
    )
    # a surrogate no byte stands for is named as the SDK names it
    assert not_utf8("a\ud800b") == (
        "'a\\ud800b' must be valid Unicode text: lone surrogate U+D800 at position 1 cannot be "
        "encoded as UTF-8"
    )


@pytest.mark.integration
async def test_send_takes_bytes_as_they_are_and_readers_print_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = b"\x89PNG\r\n\x1a\n\x00\xff"
    every_byte = bytes(range(256))
    (tmp_path / "body.bin").write_bytes(every_byte)
    async with InProcessCluster(tmp_path / "cluster", nameservers=1) as cluster:
        ns = cluster.namesrv
        async with AdminClient(ns) as admin:
            await admin.create_or_update_topic(TOPIC, queues=1, brokers=["broker-a"])
        sends = await asyncio.gather(
            # printf '\xff\xfe\n\x00last' | apogee send T: one message a line, without the newline
            apogee(ns, "send", TOPIC, stdin=b"\xff\xfe\n\x00last"),
            apogee(ns, "send", TOPIC, "--body-file", "-", stdin=png),
            # the bytes of argv as the shell passes them
            apogee(ns, "send", TOPIC, b"\xff"),
        )
        sent_ids = []
        for code, out, err in sends[:2]:
            assert (code, err) == (0, ""), err
            sent_ids += out.split()
        args = ["--namesrv", ns, "send", TOPIC, "--body-file", str(tmp_path / "body.bin")]
        assert await asyncio.to_thread(main, args) == 0
        sent_ids += capsys.readouterr().out.split()
        expected = [b"\xff\xfe", b"\x00last", png, every_byte]
        assert len(sent_ids) == len(expected)
        async with AdminClient(ns) as admin:
            for uid, body in zip(sent_ids, expected, strict=True):
                assert (await admin.get_message(uid)).body == body

        code, out, err = sends[2]
        assert (code, out) == (2, ""), err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1] == (
            "apogee: error: BODY b'\\xff' must be UTF-8 text, and byte 0xff at position 0 is "
            "not; send bytes as they are with --body-file PATH (- for standard input)"
        )

        # readers print a body that is not UTF-8 as a bytes literal, and go on
        args = ["--namesrv", ns, "message", "read", TOPIC]
        assert await asyncio.to_thread(main, args) == 0
        rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
        printed = {row[0]: row[5] for row in rows}
        shown = ["b'\\xff\\xfe'", "\x00last", repr(png), repr(every_byte)]
        assert printed == dict(zip(sent_ids, shown, strict=True))
        assert await asyncio.to_thread(main, ["--namesrv", ns, "message", "get", sent_ids[0]]) == 0
        assert "body:        \ufffd\ufffd\n" in capsys.readouterr().out
