"""Draw every Grafana dashboard of the chart (``charts/apogee/dashboards/*.json``) as a PNG, from
the same PromQL its panels run, over a real run of a local cluster (Grafana itself does not run
here).

::

    uv run python scripts/render_dashboards.py                  # about 4 minutes
    uv run python scripts/render_dashboards.py --minutes 5 --out /tmp/boards --var group=billing

1. A local cluster (:mod:`apogee.local.cluster`) in a temporary folder: a nameserver, two
   brokers, the schedule service and the transaction checker, and a Prometheus scraping each of
   them every second (Debian's ``prometheus`` program); it waits until Prometheus has scraped
   every one (targets load on a 5 s tick).
2. ``--minutes`` of traffic through the SDK (``dashboard_traffic``): steady sends to two
   topics, transactions on a third (committed, rolled back, checked, given up, resolved by an
   operator), delayed and timer messages, refused sends, a consumer group that keeps up, one
   that falls behind and catches up (retries, dead letters, a consumer joining and leaving), a
   pull consumer and a reader.
3. Every panel's queries over the run with ``query_range`` (at most 300 points a series),
   Grafana's variables replaced as ``dashboard_model`` says: ``$__rate_interval`` is 15 s
   (``--rate-interval``; ``auto``: as Grafana computes it for a 1 s scrape, 4 s, which makes
   anything counted every few seconds jagged), a template variable takes a value the run has
   (``topic`` = ``Orders``, ``group`` = ``analytics``, ``instance``: All; ``--var`` sets one).
4. The cluster stopped and the folder removed (on failure too), a picture per dashboard
   (``dashboard_pictures``) written to ``--out`` as ``<dashboard file stem>.png``.

It prints where it wrote each picture, each panel or query that came back without data (a
finding about the run or the dashboard: it is drawn as *No data*, never hidden), and what the
run did when.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import dashboard_traffic
from dashboard_model import (
    Answer,
    Dashboard,
    Window,
    choose_value,
    findings,
    grafana_values,
    label_values_query,
    load_dashboard,
    substitute,
)
from dashboard_pictures import clock, draw

from apogee.local import cluster as local_cluster
from apogee.local import prometheus

ROOT: Final = Path(__file__).resolve().parent.parent
DASHBOARDS: Final = ROOT / "charts" / "apogee" / "dashboards"
OUT: Final = ROOT / "docs" / "img" / "dashboards"
SCRAPE_S: Final = 1.0
#: most points of a series: the step grows with the run
MAX_POINTS: Final = 300
#: rates over 15 s: smooth over what is counted every few seconds (check rounds, reader pulls)
RATE_INTERVAL: Final = "15s"
#: seconds of the window before the first send (the rates start from nothing)
LEAD_S: Final = 10.0
#: the template variables' values unless ``--var`` says otherwise (when the run has them)
PREFERRED: Final = {"topic": "Orders", "group": "analytics"}


def wait_scraped(state: local_cluster.ClusterState, timeout: float) -> None:
    """Until Prometheus has scraped every member."""
    address = state.prometheus[0].address
    wanted = {(p.role, p.metrics) for p in state.all() if p.metrics}
    deadline = time.monotonic() + timeout
    while True:
        up = {(t.job, t.address) for t in prometheus.targets(address) if t.health == "up"}
        if wanted <= up:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Prometheus did not scrape {sorted(wanted - up)} in {timeout}s")
        time.sleep(0.5)  # polling Prometheus, with a deadline


def variables(
    address: str, board: Dashboard, window: Window, wanted: Mapping[str, str]
) -> dict[str, tuple[str, str]]:
    """Each template variable of ``board``: (its value in queries, its value in a title)."""
    out = {}
    for var in board.variables:
        selector, label = label_values_query(var.query)
        promql = f"count by ({label}) ({selector})"
        series = prometheus.query_range(address, promql, window.start, window.end, window.step)
        found = sorted({s.labels[label] for s in series if label in s.labels})
        out[var.name] = choose_value(var, found, wanted.get(var.name))
    return out


def ask(
    address: str, board: Dashboard, window: Window, values: Mapping[str, str]
) -> dict[int, list[Answer]]:
    """Every query of every panel of ``board``, by panel id."""
    answers: dict[int, list[Answer]] = {}
    for p in board.panels:
        for t in p.targets:
            promql = substitute(t.expr, values)
            try:
                series = prometheus.query_range(
                    address, promql, window.start, window.end, window.step, timeout=30
                )
                answer = Answer(t, promql, series)
            except prometheus.QueryError as exc:
                answer = Answer(t, promql, [], str(exc))
            answers.setdefault(p.id, []).append(answer)
    return answers


Results = list[tuple[Dashboard, dict[str, tuple[str, str]], dict[int, list[Answer]]]]


def run(
    boards: Sequence[Dashboard], minutes: float, wanted: Mapping[str, str], rate: str | None
) -> tuple[dashboard_traffic.Timeline, Window, dict[str, str], Results]:
    """Start the cluster, drive the traffic, ask every query; the cluster is stopped and its
    folder removed whatever happens."""
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="apogee-dashboards-"))
    data = tmp / "cluster"
    try:
        state = local_cluster.up(
            data,
            brokers=2,
            broker_env=dict(dashboard_traffic.BROKER_ENV),
            schedule_env=dict(dashboard_traffic.SCHEDULE_ENV),
            txn_checker_env=dict(dashboard_traffic.CHECKER_ENV),
            monitoring=True,
            scrape_interval_s=SCRAPE_S,
            timeout=120,
            console=False,
        )
        wait_scraped(state, 60)
        print(f"cluster up and scraped in {time.monotonic() - began:.0f}s", flush=True)
        time.sleep(LEAD_S)  # the window starts with the cluster idle
        print(f"traffic for {minutes:g} min", flush=True)
        tl = asyncio.run(dashboard_traffic.traffic(state.namesrv, minutes * 60))
        time.sleep(2 * SCRAPE_S)  # the last scrape of the window
        start = tl.start - LEAD_S
        step = max(1.0, math.ceil((tl.end - start) / MAX_POINTS))
        window = Window(start, tl.end, step, origin=tl.start)
        grafana = grafana_values(SCRAPE_S, window.step, tl.end - start, rate)
        address = state.prometheus[0].address
        results: Results = []
        for board in boards:
            chosen = variables(address, board, window, wanted)
            values = {**grafana, **{name: value for name, (value, _) in chosen.items()}}
            results.append((board, chosen, ask(address, board, window, values)))
        return tl, window, grafana, results
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=3.0, help="of traffic (default 3)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the pictures")
    ap.add_argument("--dashboards", type=Path, default=DASHBOARDS, help="folder of the JSON")
    ap.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a template variable's value (All: every value); repeatable",
    )
    ap.add_argument(
        "--rate-interval",
        default=RATE_INTERVAL,
        help=f"$__rate_interval (default {RATE_INTERVAL}; auto: as Grafana computes it)",
    )
    ap.add_argument("--dpi", type=int, default=80, help="dots per inch (default 80)")
    args = ap.parse_args()
    wanted = dict(PREFERRED)
    for item in args.var:
        name, eq, value = item.partition("=")
        if not eq:
            ap.error(f"--var takes NAME=VALUE, got {item!r}")
        wanted[name] = value
    boards = [load_dashboard(p) for p in sorted(args.dashboards.glob("*.json"))]
    if not boards:
        ap.error(f"no dashboards (*.json) in {args.dashboards}")
    if args.minutes <= 0:
        ap.error("--minutes must be above 0")
    began = time.monotonic()
    rate = None if args.rate_interval == "auto" else args.rate_interval
    tl, window, grafana, results = run(boards, args.minutes, wanted, rate)
    args.out.mkdir(parents=True, exist_ok=True)
    day = datetime.fromtimestamp(tl.start, UTC).strftime("%Y-%m-%d")
    for board, chosen, answers in results:
        shown = "".join(f"; {name} = {title}" for name, (_, title) in chosen.items())
        subtitle = (
            f"The dashboard's PromQL over a {(tl.end - tl.start) / 60:.1f}-minute local run "
            f"({day}): a nameserver, 2 brokers, the schedule service and the txn-checker, "
            f"scraped every {SCRAPE_S:g} s; $__rate_interval = {grafana['__rate_interval']}"
            f"{shown}. Time: minutes from the first send."
        )
        path = draw(board, answers, window, subtitle, args.out / f"{board.stem}.png", args.dpi)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
        for line in findings(board, answers):
            print(f"  empty: {line}")
    print("the run (m:ss from the first send):")
    for t, what in tl.events:
        print(f"  {clock(t - tl.start):>6}  {what}")
    for what, n in sorted(tl.counts.items()):
        print(f"  {n:>6}  {what}")
    print(f"done in {time.monotonic() - began:.0f}s")


if __name__ == "__main__":
    main()
