"""Benchmark of what TLS and authentication cost on the send path: async send throughput (1 KiB
bodies, ``send_nowait`` with at most ``--window`` sends unsettled, 64 by default), a producer in
this process, a nameserver and a broker as separate processes (``apogee.local.cluster``,
async flush), a fresh cluster for each run. The cases alternate, in a rotated order, for
``--rounds`` rounds, so that a noisy machine weighs on both alike.

Cases:

- ``plaintext``: as ``apogee cluster up`` runs: no TLS, no authentication;
- ``tls_auth``: every port over TLS (a CA of the benchmark's own, ECDSA P-256 certificates),
  ``auth_enabled`` with a users file, the producer signing every call with an access key that
  has ``PUB`` on the topic (the broker checks it once per topic per request, the producer's
  send stream is authenticated when it opens).

Prints one JSON object per run (see ``figures.emit``) with ``round``, ``client_us_per_msg`` and
``broker_us_per_msg`` (the CPU each process used per message), then one line per case with
``"summary": true``: the medians over the rounds and their ratios to ``plaintext``'s, and
``overhead``: 1 - the throughput ratio (target: at most 0.15).

    python bench/security_bench.py            # 5 rounds, a few minutes
    python bench/security_bench.py --quick    # 2 rounds of fewer sends
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from figures import ProcessMeter, emit, loop_name, run_async
from load import create_topics, windowed_sends

from apogee.client import Message, Producer
from apogee.common.auth import Credentials
from apogee.local import cluster as local_cluster
from apogee.rpc.security import ClientSecurity
from apogee.rpc.tls import ClientTls
from apogee.testkit.tls import TestCa

TOPIC = "BenchSecurity"
BODY = 1024
WARM = 2000
CASES = ["plaintext", "tls_auth"]
USERS = """
[[users]]
access_key = "bench-service"
secret_key = "bench-service-secret"
service = true

[[users]]
access_key = "bench-producer"
secret_key = "bench-producer-secret"
admin = "write"
[users.topics]
"BenchSecurity" = "PUB"
"""


@dataclass
class Run:
    case: str
    rate: float
    seconds: float
    row: dict[str, Any]


def secure_setup(folder: Path) -> tuple[dict[str, str], dict[str, str], ClientSecurity]:
    """The environment of the nameserver and the broker with TLS and authentication on, and
    the producer's security."""
    ca = TestCa.create(folder)
    users = folder / "users.toml"
    users.write_text(USERS)
    creds = folder / "service.toml"
    creds.write_text('access_key = "bench-service"\nsecret_key = "bench-service-secret"\n')
    envs = []
    for prefix, name in (("NAMESERVER", "nameserver"), ("BROKER", "broker")):
        cert = ca.issue(name, folder, client=True)
        envs.append(
            {
                f"APOGEE_{prefix}_TLS_CERT_FILE": str(cert.cert_file),
                f"APOGEE_{prefix}_TLS_KEY_FILE": str(cert.key_file),
                f"APOGEE_{prefix}_TLS_CA_FILE": str(ca.cert_file),
                f"APOGEE_{prefix}_AUTH_ENABLED": "true",
                f"APOGEE_{prefix}_AUTH_USERS_FILE": str(users),
                f"APOGEE_{prefix}_AUTH_CREDENTIALS_FILE": str(creds),
            }
        )
    os.environ["APOGEE_TLS_CA_FILE"] = str(ca.cert_file)  # local_cluster's own checks
    os.environ["APOGEE_CREDENTIALS_FILE"] = str(creds)
    security = ClientSecurity(
        tls=ClientTls(ca_file=str(ca.cert_file)),
        credentials=Credentials("bench-producer", "bench-producer-secret"),
    )
    return envs[0], envs[1], security


async def timed_sends(
    namesrv: str, security: ClientSecurity, count: int, window: int
) -> tuple[float, float, int]:
    """(seconds, this process's CPU seconds, errors) of ``count`` sends after a warm-up."""
    msg = Message(TOPIC, os.urandom(BODY), tags="TagA")
    async with Producer(namesrv, security=security) as producer:
        await asyncio.gather(*(producer.send(msg) for _ in range(WARM)))
        sent = await windowed_sends(producer, msg, count, window)
        return sent.seconds, sent.cpu_s, sent.errors


def run_case(case: str, round_no: int, args: argparse.Namespace, loop: str, base: Path) -> Run:
    data = Path(tempfile.mkdtemp(prefix=f"security-bench-{case}-", dir=base))
    saved = {k: os.environ.get(k) for k in ("APOGEE_TLS_CA_FILE", "APOGEE_CREDENTIALS_FILE")}
    try:
        ns_env: dict[str, str] = {}
        b_env: dict[str, str] = {}
        security = ClientSecurity()
        if case == "tls_auth":
            ns_env, b_env, security = secure_setup(data / "pki")
        state = local_cluster.up(
            data / "cluster",
            brokers=1,
            nameservers=1,
            nameserver_env=ns_env,
            broker_env=b_env,
            schedule=False,
            txn_checker=False,
            console=False,
        )
        broker = ProcessMeter(state.brokers[0].pid)
        run_async(create_topics(state.namesrv, [TOPIC], security=security), loop)
        out: list[tuple[float, float, int]] = []

        async def go() -> None:
            out.append(await timed_sends(state.namesrv, security, args.messages, args.window))

        broker_cpu0 = broker.cpu_s()
        run_async(go(), loop)
        broker_cpu = broker.cpu_s() - broker_cpu0
        local_cluster.down(data / "cluster")
        seconds, client_cpu, errors = out[0]
        row = {
            "round": round_no,
            "client_us_per_msg": round(client_cpu / args.messages * 1e6, 2),
            "broker_us_per_msg": round(broker_cpu / args.messages * 1e6, 2),
            "errors": errors,
            "window": args.window,
            "loop": loop,
        }
        return Run(case, args.messages / seconds, seconds, row)
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data / "cluster")
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(data, ignore_errors=True)


def summarize(runs: dict[str, list[Run]]) -> None:
    def median(case: str, key: str) -> float:
        return statistics.median(r.rate if key == "rate" else r.row[key] for r in runs[case])

    base = {k: median("plaintext", k) for k in ("rate", "client_us_per_msg", "broker_us_per_msg")}
    for case, rows in runs.items():
        rate = median(case, "rate")
        paired = statistics.median(
            r.rate / p.rate for r, p in zip(rows, runs["plaintext"], strict=True)
        )
        line = {
            "case": case,
            "summary": True,
            "rounds": len(rows),
            "msgs_per_s_median": round(rate),
            "msgs_per_s_all": [round(r.rate) for r in rows],
            "vs_plaintext": round(rate / base["rate"], 3),
            "vs_plaintext_paired_median": round(paired, 3),
            "overhead": round(1 - paired, 3),
            "client_us_per_msg_median": round(median(case, "client_us_per_msg"), 2),
            "client_cpu_vs_plaintext": round(
                median(case, "client_us_per_msg") / base["client_us_per_msg"], 3
            ),
            "broker_us_per_msg_median": round(median(case, "broker_us_per_msg"), 2),
            "broker_cpu_vs_plaintext": round(
                median(case, "broker_us_per_msg") / base["broker_us_per_msg"], 3
            ),
        }
        print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="2 rounds of fewer sends")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every case (5)")
    ap.add_argument("--messages", type=int, default=None, help="sends per run (100,000)")
    ap.add_argument("--window", type=int, default=64, help="unsettled sends at most")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default=None)
    ap.add_argument("--dir", default=None, help="where to put the clusters (default: a temp dir)")
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.messages = args.messages or (30_000 if args.quick else 100_000)
    loop = loop_name(args.loop)
    base = Path(args.dir or tempfile.gettempdir())
    runs: dict[str, list[Run]] = {c: [] for c in CASES}
    for r in range(args.rounds):
        order = CASES[r % len(CASES) :] + CASES[: r % len(CASES)]
        done = {case: run_case(case, r, args, loop, base) for case in order}
        for case in order:
            run = done[case]
            emit(
                case,
                args.messages,
                BODY,
                run.seconds,
                [],
                **run.row,
                vs_plaintext=round(run.rate / done["plaintext"].rate, 3),
            )
            runs[case].append(run)
    summarize(runs)


if __name__ == "__main__":
    main()
