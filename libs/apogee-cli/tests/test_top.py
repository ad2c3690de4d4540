"""``apogee top``: rates from two scrapes (resets, new series, endpoints that do not answer),
lag per group and topic (summed, oldest, unknown), quantiles from histogram buckets, the text
of a frame, and the command against real ``/metrics`` endpoints served in this process."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from apogee.cli import top
from apogee.cli.main import main
from apogee.cli.top import Endpoint, Scrape
from apogee.common.metrics import Samples
from apogee.service.metrics import MetricsServer

pytestmark = pytest.mark.unit


def samples(*entries: tuple[str, dict[str, str], float]) -> Samples:
    out = Samples()
    for name, labels, value in entries:
        out[(name, frozenset(labels.items()))] = value
    return out


def buckets(name: str, counts: dict[str, float]) -> list[tuple[str, dict[str, str], float]]:
    """Histogram ``name``'s cumulative bucket samples (``le`` -> count) and its _count."""
    out = [(f"{name}_bucket", {"le": le}, c) for le, c in counts.items()]
    return [*out, (f"{name}_count", {}, counts["+Inf"])]


IN = "apogee_broker_messages_in_total"
OUT = "apogee_broker_messages_out_total"
BYTES_IN = "apogee_broker_bytes_in_total"
LAG = "apogee_broker_group_lag_messages"
LAG_S = "apogee_broker_group_lag_seconds"
SEND = "apogee_broker_send_latency_seconds"


# -- counters and quantiles ---------------------------------------------------------------------


def test_a_counter_that_went_down_was_reset_and_counts_from_zero() -> None:
    assert top.increase(10.0, 25.0) == 15.0
    assert top.increase(100.0, 7.0) == 7.0  # restarted: 7 since the restart
    assert top.increase(None, 4.0) == 4.0  # appeared between the scrapes


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.5, 0.0015),  # rank 50 of 100: halfway through the (0.001, 0.002] bucket
        (0.25, 0.001),  # rank 25: the end of the first bucket
        (0.1, 0.0004),  # rank 10 of the first 25, which starts at 0
        (0.99, 0.004),  # rank 99: in +Inf, so the highest finite bound
    ],
)
def test_quantiles_interpolate_within_a_bucket_as_prometheus_does(
    q: float, expected: float
) -> None:
    # 25 observations up to 1 ms, 50 more up to 2 ms, 20 up to 4 ms, 5 beyond
    hist = [(0.001, 25.0), (0.002, 75.0), (0.004, 95.0), (math.inf, 100.0)]
    got = top.histogram_quantile(q, hist)
    assert got is not None
    assert got == pytest.approx(expected)


def test_a_histogram_without_observations_has_no_quantile() -> None:
    assert top.histogram_quantile(0.99, [(0.001, 0.0), (math.inf, 0.0)]) is None
    assert top.histogram_quantile(0.99, []) is None


# -- frames -------------------------------------------------------------------------------------


def test_rates_per_topic_are_summed_over_brokers_and_divided_by_the_interval() -> None:
    prev = Scrape(
        100.0,
        {
            "broker-a": samples((IN, {"topic": "Orders"}, 1000.0), (OUT, {"topic": "Orders"}, 0)),
            "broker-b": samples((IN, {"topic": "Orders"}, 500.0)),
        },
    )
    cur = Scrape(
        102.0,
        {
            # 200 more on a, b restarted (now 100: 100 since its restart), a new topic on b
            "broker-a": samples(
                (IN, {"topic": "Orders"}, 1200.0),
                (OUT, {"topic": "Orders"}, 300.0),
                (BYTES_IN, {"topic": "Orders"}, 4096.0),
            ),
            "broker-b": samples((IN, {"topic": "Orders"}, 100.0), (IN, {"topic": "New"}, 10.0)),
        },
    )
    frame = top.compute(prev, cur)
    assert frame.seconds == 2.0
    rows = {t.topic: t for t in frame.topics}
    assert sorted(rows) == ["New", "Orders"]
    assert rows["Orders"].in_msgs == pytest.approx(150.0)  # (200 + 100) / 2 s
    assert rows["Orders"].out_msgs == pytest.approx(150.0)
    assert rows["Orders"].in_bytes == pytest.approx(2048.0)
    assert rows["New"].in_msgs == pytest.approx(5.0)


def test_an_endpoint_that_missed_a_scrape_adds_nothing_to_rates() -> None:
    prev = Scrape(0.0, {"broker-a": samples((IN, {"topic": "T"}, 0.0))}, {"broker-b": "x (down)"})
    cur = Scrape(
        1.0,
        {
            "broker-a": samples((IN, {"topic": "T"}, 10.0)),
            "broker-b": samples((IN, {"topic": "T"}, 1e6)),  # back: no interval yet
        },
        {"broker-c": "127.0.0.1:10932 (timed out)"},
    )
    frame = top.compute(prev, cur)
    assert [t.in_msgs for t in frame.topics] == [10.0]
    assert frame.unreachable == [("broker-c", "127.0.0.1:10932 (timed out)")]  # only now
    assert (frame.answered, frame.endpoints) == (2, 3)
    assert "not answering: broker-c: 127.0.0.1:10932 (timed out)" in top.render(frame)


def test_lag_is_summed_over_brokers_its_age_is_the_oldest_and_absent_lag_is_unknown() -> None:
    def at(t: float, lag_a: float, lag_b: float) -> Scrape:
        return Scrape(
            t,
            {
                "broker-a": samples(
                    (LAG, {"group": "billing", "topic": "Orders"}, lag_a),
                    (LAG_S, {"group": "billing", "topic": "Orders"}, 4.0),
                    ("apogee_broker_group_members", {"group": "billing"}, 2.0),
                    ("apogee_broker_group_members", {"group": "idle"}, 1.0),
                    ("apogee_broker_retry_messages_total", {"group": "billing"}, t * 3),
                ),
                "broker-b": samples(
                    (LAG, {"group": "billing", "topic": "Orders"}, lag_b),
                    (LAG_S, {"group": "billing", "topic": "Orders"}, 9.5),
                    # committed nothing on Audit: seconds known nowhere, messages on b only
                    (LAG, {"group": "billing", "topic": "Audit"}, 7.0),
                    ("apogee_broker_group_members", {"group": "billing"}, 2.0),
                ),
            },
        )

    frame = top.compute(at(10.0, 100.0, 50.0), at(12.0, 80.0, 30.0))
    rows = {(g.group, g.topic): g for g in frame.groups}
    orders = rows[("billing", "Orders")]
    assert orders.lag_messages == 110.0
    assert orders.lag_seconds == 9.5
    assert orders.lag_change == pytest.approx(-20.0)  # (110 - 150) / 2 s: catching up
    assert orders.members == 2.0
    assert orders.retries == pytest.approx(3.0)
    audit = rows[("billing", "Audit")]
    assert (audit.lag_messages, audit.lag_seconds) == (7.0, None)
    # a group online but with no lag anywhere still shows, its lag unknown
    idle = rows[("idle", top.NONE)]
    assert (idle.lag_messages, idle.members) == (None, 1.0)

    text = top.render(frame)
    assert _row(text, "billing", "Orders") == ["110", "9.5", "-20.0", "2", "3.0", "0.0"]
    assert _row(text, "billing", "Audit")[:3] == ["7", top.UNKNOWN, "+0.0"]
    assert _row(text, "idle", top.NONE)[:2] == [top.UNKNOWN, top.UNKNOWN]


def test_broker_latency_comes_from_the_buckets_filled_during_the_interval() -> None:
    before = {"0.001": 1000.0, "0.01": 1000.0, "+Inf": 1000.0}  # old, fast sends
    after = {"0.001": 1000.0, "0.01": 1100.0, "+Inf": 1100.0}  # 100 new, all 1-10 ms
    prev = Scrape(0.0, {"broker-a": samples(*buckets(SEND, before))})
    cur = Scrape(
        4.0,
        {
            "broker-a": samples(
                *buckets(SEND, after),
                ("apogee_broker_send_errors_total", {"kind": "DISK_FULL"}, 8.0),
                ("apogee_broker_disk_used_ratio", {}, 0.25),
            )
        },
    )
    [row] = top.compute(prev, cur).brokers
    assert row.sends == pytest.approx(25.0)
    assert row.send_p50 == pytest.approx(0.0055)
    assert row.send_p99 == pytest.approx(0.00991)
    assert row.append_p99 is None
    assert row.errors == pytest.approx(2.0)
    text = top.render(top.compute(prev, cur))
    assert _row(text, "broker-a") == ["25.0", "5.5ms", "9.9ms", "-", "-", "2.0", "25%"]


def test_an_empty_cluster_says_so() -> None:
    text = top.render(top.compute(Scrape(0.0, {"n": Samples()}), Scrape(1.0, {"n": Samples()})))
    assert "no topic has traffic counted yet" in text
    assert "no consumer group is known to the brokers" in text


def _row(text: str, *first: str) -> list[str]:
    """The cells after ``first`` of the line that starts with those cells."""
    for line in text.splitlines():
        cells = line.split()
        if cells[: len(first)] == list(first):
            return cells[len(first) :]
    raise AssertionError(f"no row {first} in:\n{text}")


# -- the command against real endpoints ---------------------------------------------------------


class FakeBroker:
    """A registry with some of the broker's metrics, served over HTTP on a free port."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.messages_in = Counter(
            "apogee_broker_messages_in", "in", ["topic"], registry=self.registry
        )
        self.lag = Gauge(
            "apogee_broker_group_lag_messages", "lag", ["group", "topic"], registry=self.registry
        )
        self.send = Histogram(
            "apogee_broker_send_latency_seconds",
            "send",
            buckets=(0.001, 0.01),
            registry=self.registry,
        )
        self.server = MetricsServer("127.0.0.1:0", self.registry, "fake broker")
        self.server.start()

    @property
    def address(self) -> str:
        return self.server.address


@pytest.fixture
def fake_brokers() -> Iterator[list[FakeBroker]]:
    brokers = [FakeBroker(), FakeBroker()]
    try:
        yield brokers
    finally:
        for b in brokers:
            b.server.stop_now()


class Clock:
    """Time that moves only when slept, and traffic that happens while it does."""

    def __init__(self, brokers: list[FakeBroker]) -> None:
        self.now = 1000.0
        self.brokers = brokers
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        for b in self.brokers:  # 100 messages/s on each broker meanwhile
            b.messages_in.labels("Orders").inc(100 * seconds)
            b.send.observe(0.005)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_frame_from_two_scrapes_of_real_endpoints(fake_brokers: list[FakeBroker]) -> None:
    for i, b in enumerate(fake_brokers):
        b.messages_in.labels("Orders").inc(12345)
        b.lag.labels("billing", "Orders").set(100 * (i + 1))
    clock = Clock(fake_brokers)
    out = io.StringIO()
    endpoints = [Endpoint(f"broker-{i}", b.address) for i, b in enumerate(fake_brokers)]
    top.run(endpoints, 2.0, True, out, sleep=clock.sleep, clock=clock)
    text = out.getvalue()
    assert clock.slept == [2.0]
    assert not text.startswith(top.CLEAR)  # not a terminal
    assert "2 of 2 endpoints answered" in text
    assert _row(text, "Orders")[:2] == ["200.0", "0.0"]  # 2 x 100/s; nothing out
    assert _row(text, "billing", "Orders")[0] == "300"
    assert _row(text, "broker-0")[:2] == ["0.5", "5.5ms"]


def test_live_frames_on_a_terminal_clear_the_screen_each_time(
    fake_brokers: list[FakeBroker],
) -> None:
    clock = Clock(fake_brokers)
    out = Tty()
    frames = 0

    def sleep(seconds: float) -> None:
        nonlocal frames
        if frames == 3:
            raise KeyboardInterrupt  # Ctrl-C
        frames += 1
        clock.sleep(seconds)

    endpoints = [Endpoint(b.address, b.address) for b in fake_brokers]
    with pytest.raises(KeyboardInterrupt):
        top.run(endpoints, 1.0, False, out, sleep=sleep, clock=clock)
    text = out.getvalue()
    assert text.count(top.CLEAR) == 3
    assert text.startswith(top.CLEAR)
    assert clock.slept == [1.0, 1.0, 1.0]  # the pace holds: scrapes take no fake time


def test_the_command_reads_endpoints_given_with_metrics(
    fake_brokers: list[FakeBroker], capsys: pytest.CaptureFixture[str]
) -> None:
    fake_brokers[0].lag.labels("billing", "Orders").set(42)
    args = ["top", "--once", "--interval", "0.05"]
    for b in fake_brokers:
        args += ["--metrics", b.address]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert _row(out, "billing", "Orders")[0] == "42"
    assert "2 of 2 endpoints answered" in out


def test_endpoints_that_do_not_answer_fail_once_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["top", "--once", "--interval", "0.01", "--metrics", "127.0.0.1:1"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("apogee: every metrics endpoint is unavailable: 127.0.0.1:1 ("), err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--interval", "0"], "--interval 0.0: must be a number of seconds above 0"),
        (["--interval", "nan"], "--interval nan: must be a number of seconds above 0"),
        (["--metrics", "localhost"], "--metrics 'localhost': use host:port"),
        (["--metrics", "h:99999"], "--metrics 'h:99999': use host:port"),
        ([], "no metrics endpoint: pass --metrics host:port (repeatable), or start a local"),
    ],
)
def test_bad_arguments_are_usage_errors(
    args: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data", str(tmp_path), "top", "--once", *args]) == 2
    assert says in capsys.readouterr().err.strip().splitlines()[-1]
