"""The web console in a real browser: Debian's chromium driven by Playwright, against the console
as a real process (``python -m apogee_console``) in front of a real local cluster.

One cluster, one console and one browser for the module; each test has a browser context of its
own (its own cookies). The console's users file holds an admin and a read-only user. The tests
log in, create a topic, send a message from the form and find it again, watch a group's lag rise
and fall as its consumer stops and runs, redrive a dead letter and see it consumed, and check
that a read-only user sees no action and that the API refuses one anyway.

Pages poll the API every few seconds; the tests wait on what the page shows, with deadlines
(Playwright's ``expect(...)`` and :func:`~e2e.harness.wait_until`), never fixed sleeps.

With ``APOGEE_CONSOLE_SCREENSHOTS=1`` the tests save a screenshot of each page into
``docs/img/console/`` (see :mod:`e2e.console_support`).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Page,
    expect,
    sync_playwright,
)

from apogee.client import (
    ConsumeResult,
    Message,
    ReceivedMessage,
    SyncAdminClient,
    SyncProducer,
    SyncTransactionProducer,
    TransactionDecision,
)
from apogee.client.consumer.sync import SyncPushConsumer
from e2e.console_support import (
    CHROMIUM,
    CHROMIUM_ARGS,
    ConsoleProcess,
    User,
    screenshot,
    write_users,
)
from e2e.harness import Cluster, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ADMIN = User("ada", "admin-password-1", "admin")
VIEWER = User("vic", "viewer-password-1", "read")
#: Milliseconds a page may take to show what the cluster did (pages refresh every 3-5 s).
SHOWN_MS = 20_000
QUEUES = 2
expect.set_options(timeout=SHOWN_MS)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
#: A foreign site's name that the browser resolves to 127.0.0.1, as DNS rebinding makes it.
REBOUND_HOST = "attacker.rebind.test"


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def console_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster.start(tmp_path_factory.mktemp("console-cluster"), brokers=1, nameservers=1)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def console(
    console_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleProcess]:
    folder = tmp_path_factory.mktemp("console")
    users = write_users(folder / "console-users.toml", [ADMIN, VIEWER])
    proc = ConsoleProcess(
        console_cluster.namesrv,
        folder,
        users,
        # samples every second, so that the charts have points within the tests
        env={"APOGEE_CONSOLE_SAMPLE_INTERVAL_S": "1"},
    )
    try:
        yield proc
    finally:
        status = proc.close()
        assert status == 0, f"the console exited with {status}:\n{proc.log_tail()}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        # a rebound name, and no local-network-access checks (as in browsers without them)
        rebound = [
            f"--host-resolver-rules=MAP {REBOUND_HOST} 127.0.0.1",
            "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests",
        ]
        b = p.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *rebound])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def context(
    browser: Browser, console: ConsoleProcess, request: pytest.FixtureRequest
) -> Iterator[BrowserContext]:
    failed_before = request.session.testsfailed
    ctx = browser.new_context(base_url=console.url, viewport={"width": 1280, "height": 860})
    ctx.set_default_timeout(SHOWN_MS)
    try:
        yield ctx
    finally:
        ctx.close()
        if request.session.testsfailed > failed_before:
            print(console.log_tail())  # shown with the failed test's report


#: Script errors of each page (by ``id(page)``): the console's own scripts must not fail.
_SCRIPT_ERRORS: dict[int, list[str]] = {}


def _console_error(errors: list[str], message: ConsoleMessage) -> None:
    # an HTTP error status is logged as a failed resource; the page shows those itself
    if message.type == "error" and not message.text.startswith("Failed to load resource"):
        errors.append(message.text)


@pytest.fixture
def page(context: BrowserContext) -> Iterator[Page]:
    p = context.new_page()
    errors = _SCRIPT_ERRORS.setdefault(id(p), [])
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    p.on("console", lambda m: _console_error(errors, m))
    try:
        yield p
    finally:
        _SCRIPT_ERRORS.pop(id(p), None)


@pytest.fixture(scope="module")
def admin(console_cluster: Cluster) -> Iterator[SyncAdminClient]:
    with SyncAdminClient(console_cluster.namesrv) as a:
        yield a


@pytest.fixture(scope="module")
def producer(console_cluster: Cluster) -> Iterator[SyncProducer]:
    with SyncProducer(console_cluster.namesrv, group="e2e-console") as p:
        yield p


# -- helpers -------------------------------------------------------------------------------------


def log_in(page: Page, user: User, target: str = "/ui/cluster") -> None:
    page.goto(target)
    expect(page).to_have_url(re.compile(r"/ui/login"))
    page.get_by_test_id("login-user").fill(user.name)
    page.get_by_test_id("login-password").fill(user.password)
    page.get_by_test_id("login-submit").click()
    expect(page.get_by_test_id("session-user")).to_have_text(user.name)
    expect(page.get_by_test_id("session-role")).to_have_text(user.role)
    expect(page).to_have_url(re.compile(re.escape(target) + "$"))


def no_errors(page: Page) -> None:
    """Nothing in the error area, and no script error in the page."""
    expect(page.get_by_test_id("error-area")).to_be_hidden()
    expect(page.get_by_test_id("page")).not_to_contain_text(re.compile(r"\b(null|undefined|NaN)\b"))
    errors = _SCRIPT_ERRORS.get(id(page), [])
    assert errors == [], errors


def make_topic(admin: SyncAdminClient, name: str) -> None:
    admin.create_or_update_topic(name, queues=QUEUES)
    wait_until(lambda: name in admin.list_topics(), 10.0, f"topic {name} listed")


def lag_shown(page: Page) -> int | None:
    text = page.get_by_test_id("group-lag-messages").text_content() or ""
    digits = text.replace(",", "").strip()
    return int(digits) if digits.isdigit() else None


class Received:
    """What a consumer's listener got, for waiting on from the test's thread."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.messages: list[ReceivedMessage] = []
        self._lock = threading.Lock()

    def __call__(self, messages: list[ReceivedMessage]) -> ConsumeResult | None:
        if self.fail:
            raise ValueError("the e2e listener refuses every message")
        with self._lock:
            self.messages.extend(messages)
        return None

    def having(self, check: Callable[[ReceivedMessage], bool]) -> list[ReceivedMessage]:
        with self._lock:
            return [m for m in self.messages if check(m)]


def consumer(
    cluster: Cluster, group: str, topic: str, listener: Received, **options: object
) -> SyncPushConsumer:
    c = SyncPushConsumer(
        cluster.namesrv,
        group,
        listener,
        consume_from="earliest",
        offset_persist_interval=0.5,
        rebalance_interval=2.0,
        **options,  # type: ignore[arg-type]
    )
    c.subscribe(topic)
    c.start()
    return c


# -- tests ---------------------------------------------------------------------------------------


def test_log_in(page: Page, console_cluster: Cluster) -> None:
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/ui/login\?next="))
    expect(page.get_by_test_id("nav")).to_be_hidden()
    no_errors(page)
    screenshot(page, "login")

    page.get_by_test_id("login-user").fill(ADMIN.name)
    page.get_by_test_id("login-password").fill("not the password")
    page.get_by_test_id("login-submit").click()
    expect(page.get_by_test_id("error-detail")).to_be_visible()
    expect(page).to_have_url(re.compile(r"/ui/login"))

    page.get_by_test_id("login-password").fill(ADMIN.password)
    page.get_by_test_id("login-submit").click()
    expect(page.get_by_test_id("session-user")).to_have_text(ADMIN.name)
    expect(page.get_by_test_id("session-role")).to_have_text("admin")
    expect(page.get_by_test_id("error-area")).to_be_hidden()
    expect(page.get_by_test_id("auth-off-banner")).to_be_hidden()
    expect(page).to_have_url(re.compile(r"/ui/cluster$"))
    broker = console_cluster.brokers[0].name
    row = page.locator(f'[data-testid=broker-row][data-name="{broker}"]')
    expect(row).to_contain_text("up")
    expect(page.get_by_test_id("nameserver-row")).to_have_count(1)
    no_errors(page)
    screenshot(page, "cluster")

    # the session ends behind the page's back: its next refresh (a 401) leads to the login
    csrf = page.request.get("/api/v1/session").json()["csrf"]
    assert page.request.delete("/api/v1/session", headers={"X-CSRF-Token": csrf}).ok
    expect(page).to_have_url(re.compile(r"/ui/login\?next=%2Fui%2Fcluster$"))
    log_in(page, ADMIN, "/ui/topics")

    page.get_by_test_id("logout").click()
    expect(page).to_have_url(re.compile(r"/ui/login"))
    page.goto("/ui/topics")
    expect(page).to_have_url(re.compile(r"/ui/login\?next=%2Fui%2Ftopics"))


def test_create_a_topic(page: Page) -> None:
    log_in(page, ADMIN, "/ui/topics")
    page.get_by_test_id("topic-create-name").fill("ConsoleOrders")
    page.get_by_test_id("topic-create-queues").fill("3")
    page.get_by_test_id("topic-create-submit").click()
    expect(page.get_by_test_id("topic-created-link")).to_have_text("ConsoleOrders")
    row = page.locator('[data-testid=topic-row][data-name="ConsoleOrders"]')
    expect(row).to_be_visible()
    no_errors(page)
    screenshot(page, "topics")

    row.get_by_test_id("topic-link").click()
    expect(page).to_have_url(re.compile(r"/ui/topics\?name=ConsoleOrders$"))
    expect(page.get_by_test_id("topic-name")).to_have_text("ConsoleOrders")
    expect(page.get_by_test_id("topic-queue-row")).to_have_count(3)
    expect(page.get_by_test_id("topic-rate-svg")).to_be_visible()
    expect(page.get_by_test_id("topic-update-perm")).to_have_value("rw")

    # delete it again: only once its name is typed
    page.get_by_test_id("topic-delete-submit").click()
    expect(page.get_by_test_id("error-detail")).to_contain_text("to confirm")
    page.get_by_test_id("topic-delete-confirm").fill("ConsoleOrders")
    page.get_by_test_id("topic-delete-submit").click()
    expect(page).to_have_url(re.compile(r"/ui/topics$"))
    expect(
        page.get_by_test_id("topics-table-empty").or_(page.get_by_test_id("topic-row")).first
    ).to_be_visible()
    expect(page.locator('[data-testid=topic-row][data-name="ConsoleOrders"]')).to_have_count(0)

    # a name the API refuses: its problem detail is shown
    page.goto("/ui/topics")
    page.get_by_test_id("topic-create-name").fill("bad name!")
    page.get_by_test_id("topic-create-form").evaluate("f => f.noValidate = true")
    page.get_by_test_id("topic-create-submit").click()
    expect(page.get_by_test_id("error-detail")).to_contain_text("name")


def test_send_a_message_find_it_by_key_and_open_it(
    page: Page, admin: SyncAdminClient, producer: SyncProducer
) -> None:
    make_topic(admin, "ConsoleMessages")
    # a few others, so that the search has something to leave out
    for i in range(3):
        producer.send(Message("ConsoleMessages", f"other {i}".encode(), keys=[f"other-{i}"]))
    log_in(page, ADMIN, "/ui/messages")

    page.get_by_test_id("send-topic").fill("ConsoleMessages")
    page.get_by_test_id("send-tags").fill("created")
    page.get_by_test_id("send-keys").fill("order-4711")
    page.get_by_test_id("send-properties").fill(f"region=eu\ntraceparent={TRACEPARENT}")
    page.get_by_test_id("send-body").fill('{"order": 4711, "total": 12.5}')
    page.get_by_test_id("send-submit").click()
    sent = page.get_by_test_id("send-result-link")
    expect(sent).to_be_visible()
    message_id = sent.text_content() or ""
    assert message_id

    page.get_by_test_id("search-topic").fill("ConsoleMessages")
    page.get_by_test_id("search-key").fill("order-4711")
    row = page.locator(f'[data-testid=message-row][data-id="{message_id}"]')

    def found() -> bool:
        # the key index is written as the broker dispatches: search until it is there
        page.get_by_test_id("search-submit").click()
        expect(page.get_by_test_id("search-count")).to_be_visible()
        return row.count() == 1

    wait_until(found, SHOWN_MS / 1000, f"message {message_id} found by its key")
    expect(page.get_by_test_id("message-row")).to_have_count(1)
    no_errors(page)
    screenshot(page, "messages")

    # by time range (empty fields: the last hour) and by id
    page.get_by_test_id("search-by").select_option("time")
    page.get_by_test_id("search-submit").click()
    expect(page.get_by_test_id("search-count")).to_have_text("4 found")
    page.get_by_test_id("search-by").select_option("id")
    page.get_by_test_id("search-id").fill(message_id)
    page.get_by_test_id("search-submit").click()
    expect(page.get_by_test_id("message-row")).to_have_count(1)
    expect(row).to_be_visible()
    no_errors(page)

    row.get_by_test_id("message-link").click()
    expect(page.get_by_test_id("message-id")).to_have_text(message_id)
    expect(page.get_by_test_id("message-topic")).to_have_text("ConsoleMessages")
    expect(page.get_by_test_id("message-keys")).to_have_text("order-4711")
    expect(page.get_by_test_id("message-tags")).to_have_text("created")
    expect(page.get_by_test_id("message-body-meta")).to_contain_text("json")
    body = json.loads(page.get_by_test_id("message-body").text_content() or "")
    assert body == {"order": 4711, "total": 12.5}
    expect(page.locator('[data-testid=property-row][data-name="region"]')).to_contain_text("eu")
    expect(page.get_by_test_id("message-trace-id")).to_have_text(TRACE_ID)
    no_errors(page)
    screenshot(page, "message")


def test_group_lag_rises_while_its_consumer_is_stopped_and_falls_when_it_runs(
    page: Page, console_cluster: Cluster, admin: SyncAdminClient, producer: SyncProducer
) -> None:
    topic, group = "ConsoleLag", "console-lag"
    make_topic(admin, topic)
    producer.send(Message(topic, b"first"))
    got = Received()
    c = consumer(console_cluster, group, topic, got)
    try:
        wait_until(lambda: len(got.messages) == 1, 20.0, "the first message consumed")
    finally:
        c.close()  # commits its offsets

    log_in(page, ADMIN, f"/ui/groups?name={group}")
    expect(page.get_by_test_id("group-lag-messages")).to_have_text("0")
    for i in range(25):
        producer.send(Message(topic, f"waiting {i}".encode()))
    expect(page.get_by_test_id("group-lag-messages")).to_have_text("25")
    expect(page.get_by_test_id("group-members")).to_have_text("none connected")

    c = consumer(console_cluster, group, topic, got)
    try:
        wait_until(lambda: len(got.messages) == 26, 20.0, "the waiting messages consumed")
        expect(page.get_by_test_id("group-lag-messages")).to_have_text("0")
        expect(page.get_by_test_id("group-members")).not_to_have_text("none connected")
        # the chart has samples of the rise and of the fall
        expect(page.get_by_test_id("group-lag-svg-summary")).to_contain_text("Latest")

        # a dry run of a reset to the earliest offset: all 26 would be consumed again
        page.get_by_test_id("reset-topic").select_option(topic)
        page.get_by_test_id("reset-to").select_option("earliest")
        page.get_by_test_id("reset-dry-run").click()
        expect(page.get_by_test_id("reset-summary")).to_contain_text("Dry run")
        expect(page.get_by_test_id("reset-summary")).to_contain_text("26")
        expect(page.get_by_test_id("reset-row")).to_have_count(QUEUES)
        expect(page.get_by_test_id("group-lag-messages")).to_have_text("0")
        no_errors(page)
        screenshot(page, "group")
    finally:
        c.close()
    assert len(got.messages) == 26  # the dry run moved nothing

    page.get_by_test_id("nav-groups").click()
    expect(page.locator(f'[data-testid=group-row][data-name="{group}"]')).to_be_visible()
    no_errors(page)
    screenshot(page, "groups")


def test_redrive_a_dead_letter_and_see_it_consumed(
    page: Page, console_cluster: Cluster, admin: SyncAdminClient, producer: SyncProducer
) -> None:
    topic, group = "ConsolePayments", "console-dlq"
    make_topic(admin, topic)
    listener = Received(fail=True)
    # no retries: the first failure goes straight to %DLQ%<group>
    c = consumer(console_cluster, group, topic, listener, max_reconsume_times=0)
    try:
        original = producer.send(Message(topic, b"pay 42", tags="paid", keys=["pay-42"]))
        log_in(page, ADMIN, f"/ui/dlq?group={group}")
        row = page.locator(f'[data-testid=dlq-row][data-id="{original.message_id}"]')
        expect(row).to_be_visible()
        expect(row.get_by_test_id("dlq-reason")).to_contain_text("refuses every message")
        expect(row.get_by_test_id("dlq-attempts")).to_have_text(re.compile(r"^\d+$"))
        listener.fail = False

        page.get_by_test_id("redrive-key").fill("pay-42")
        page.get_by_test_id("redrive-dry-run").click()
        expect(page.get_by_test_id("redrive-summary")).to_contain_text("Dry run: 1")
        no_errors(page)
        screenshot(page, "dlq")
        page.get_by_test_id("redrive-submit").click()
        expect(page.get_by_test_id("redrive-summary")).to_contain_text("Redriven: 1")
        no_errors(page)

        def redriven() -> list[ReceivedMessage]:
            return listener.having(
                lambda m: m.properties.get("ORIGIN_MSG_ID") == original.message_id
            )

        wait_until(lambda: len(redriven()) == 1, 20.0, "the redriven message consumed")
        assert redriven()[0].body == b"pay 42"
        assert list(redriven()[0].keys) == ["pay-42"]

        # the dead letter is a copy of the original under the same id: each page says which
        # copy it shows, and links to the other
        dlq_topic = f"%DLQ%{group}"
        row.get_by_test_id("dlq-link").click()
        expect(page.get_by_test_id("message-id")).to_have_text(original.message_id)
        expect(page.get_by_test_id("message-topic")).to_have_text(dlq_topic)
        copies = page.get_by_test_id("message-copies")
        expect(copies).to_contain_text(f"This is the copy in topic {dlq_topic}")
        expect(copies).to_contain_text(f"another copy is in topic {topic}")
        copies.get_by_test_id("message-copy-link").click()
        expect(page.get_by_test_id("message-topic")).to_have_text(topic)
        expect(page.get_by_test_id("message-copy-topic")).to_have_text(topic)
        expect(page.get_by_test_id("message-copy-link")).to_have_text(dlq_topic)
        no_errors(page)
    finally:
        c.close()


def fits(page: Page) -> None:
    """The page is no wider than the window: nothing scrolls sideways."""
    width, window = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert width <= window, f"{page.url} is {width} px wide in a window of {window} px"


def test_long_values_wrap_or_are_cut_and_are_whole_on_demand(
    page: Page, admin: SyncAdminClient, producer: SyncProducer
) -> None:
    long_topic = "ConsoleLong" + "x" * 116  # 127 characters, the longest name a topic may have
    make_topic(admin, long_topic)
    key = "k" * 10_000
    producer.send(Message(long_topic, b"the body of a long key", keys=[key]))

    log_in(page, ADMIN, "/ui/topics")
    link = page.locator(f'[data-testid=topic-row][data-name="{long_topic}"]').get_by_test_id(
        "topic-link"
    )
    expect(link).to_have_text(long_topic)  # wrapped, whole
    fits(page)
    link.click()
    expect(page.get_by_test_id("topic-queue-row")).to_have_count(QUEUES)
    fits(page)

    page.goto("/ui/messages")
    page.get_by_test_id("search-by").select_option("time")
    page.get_by_test_id("search-topic").fill(long_topic)
    page.get_by_test_id("search-submit").click()
    row = page.get_by_test_id("message-row")
    expect(row).to_have_count(1)
    fits(page)
    row.scroll_into_view_if_needed()  # below the forms; the Body column within the width
    expect(row.get_by_test_id("message-row-body")).to_be_in_viewport(ratio=1)
    expect(row.get_by_test_id("message-row-body")).to_have_text("the body of a long key")
    keys = row.get_by_test_id("message-row-keys")
    expect(keys).to_have_attribute("title", key)  # cut, whole in its tooltip
    no_errors(page)

    row.get_by_test_id("message-link").click()
    more = page.get_by_test_id("message-keys-more")
    expect(more).to_have_text("Show all (10,000 characters)")
    fits(page)
    more.click()
    expect(page.get_by_test_id("message-keys-text")).to_have_text(key)
    fits(page)
    no_errors(page)

    # a time no date can hold: a problem naming the field and the range, not a 500
    refused = page.request.get(
        "/api/v1/messages", params={"topic": long_topic, "begin_ms": "99999999999999999999999"}
    )
    assert refused.status == 400, refused.text()
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["detail"].startswith(
        "begin_ms: must be a time from 1970-01-01 to 9999-12-31 UTC"
    )


def test_a_read_only_user_sees_no_action_and_the_api_refuses_one(
    page: Page, console_cluster: Cluster, admin: SyncAdminClient
) -> None:
    make_topic(admin, "ConsoleReadOnly")
    log_in(page, VIEWER, "/ui/topics")
    expect(page.locator('[data-testid=topic-row][data-name="ConsoleReadOnly"]')).to_be_visible()
    expect(page.get_by_test_id("topic-create-form")).to_have_count(0)

    page.goto("/ui/topics?name=ConsoleReadOnly")
    expect(page.get_by_test_id("topic-queue-row")).to_have_count(QUEUES)
    expect(page.get_by_test_id("topic-update-form")).to_have_count(0)
    expect(page.get_by_test_id("topic-delete-form")).to_have_count(0)

    page.goto("/ui/messages")
    expect(page.get_by_test_id("search-form")).to_be_visible()
    expect(page.get_by_test_id("send-form")).to_have_count(0)

    page.goto("/ui/groups?name=console-lag")
    expect(page.get_by_test_id("group-queue-row").first).to_be_visible()
    expect(page.get_by_test_id("reset-form")).to_have_count(0)

    page.goto("/ui/dlq?group=console-dlq")
    expect(page.get_by_test_id("dlq-row").first).to_be_visible()
    expect(page.get_by_test_id("redrive-form")).to_have_count(0)

    page.goto("/ui/transactions")
    expect(page.get_by_test_id("txn-list")).not_to_be_empty()
    expect(page.get_by_test_id("txn-commit")).to_have_count(0)
    no_errors(page)

    # the API refuses the action anyway, with the viewer's own cookie and CSRF token
    session = page.request.get("/api/v1/session")
    assert session.ok, session.text()
    csrf = session.json()["csrf"]
    refused = page.request.post(
        "/api/v1/topics",
        data={"name": "ConsoleNotAllowed", "queues": 1},
        headers={"X-CSRF-Token": csrf},
    )
    assert refused.status == 403, refused.text()
    assert refused.headers["content-type"].startswith("application/problem+json")
    problem = refused.json()
    assert problem["status"] == 403
    assert "admin" in problem["detail"], problem
    assert "ConsoleNotAllowed" not in admin.list_topics()


def test_a_dns_rebinding_page_gets_nothing_from_the_open_console(
    browser: Browser, console_cluster: Cluster, admin: SyncAdminClient, tmp_path: Path
) -> None:
    """A foreign site's page, its name then resolved to 127.0.0.1, calls the console as its own
    origin: the Host it sends is the foreign name, so the open console answers 421, without
    its CSRF token, and creates nothing. Under its own name the console works."""
    console = ConsoleProcess(
        console_cluster.namesrv,
        tmp_path,
        tmp_path / "no-users.toml",
        env={"APOGEE_CONSOLE_CONSOLE_USERS_FILE": ""},  # open: every visitor an admin
    )
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        origin = f"http://{REBOUND_HOST}:{console.port}"
        # the attacker's page, as its own server gave it before the name was rebound
        page.route(
            f"{origin}/",
            lambda route: route.fulfill(content_type="text/html", body="<title>rebound</title>"),
        )
        page.goto(f"{origin}/")
        result = page.evaluate(
            """async () => {
                const who = await fetch("/api/v1/session");
                const text = await who.text();
                const csrf = text.includes('"csrf"') ? JSON.parse(text).csrf : "";
                const made = await fetch("/api/v1/topics", {
                    method: "POST",
                    headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf},
                    body: JSON.stringify({name: "ConsoleRebound"}),
                });
                return {who: who.status, csrf: csrf, made: made.status};
            }"""
        )
        assert result == {"who": 421, "csrf": "", "made": 421}
        assert "ConsoleRebound" not in admin.list_topics()

        page.goto(f"http://localhost:{console.port}/ui/topics")
        expect(page.get_by_test_id("auth-off-banner")).to_be_visible()
        expect(
            page.get_by_test_id("topics-table-empty").or_(page.get_by_test_id("topic-row")).first
        ).to_be_visible()
    finally:
        ctx.close()
        status = console.close()
    assert status == 0, console.log_tail()


def test_resolve_a_pending_transaction(
    page: Page, console_cluster: Cluster, admin: SyncAdminClient
) -> None:
    topic, group = "ConsoleTxn", "console-txn"
    make_topic(admin, topic)

    def undecided(*_: object) -> TransactionDecision:
        return TransactionDecision.UNKNOWN

    # the producer stays connected and never decides: the half stays pending
    with SyncTransactionProducer(console_cluster.namesrv, group, check_listener=undecided) as p:
        half = p.send_in_transaction(Message(topic, b"order 7", keys=["txn-7"]), undecided)
        assert half.decision is TransactionDecision.UNKNOWN
        log_in(page, ADMIN, f"/ui/transactions?topic={topic}")
        row = page.get_by_test_id("txn-row")
        expect(row).to_have_count(1)
        expect(row).to_contain_text(group)
        expect(row).to_contain_text("txn-7")
        no_errors(page)
        screenshot(page, "transactions")

        row.get_by_test_id("txn-commit").click()
        expect(page.get_by_test_id("txn-result")).to_contain_text("Committed")
        expect(row).to_have_count(0)
        no_errors(page)
    wait_until(
        lambda: admin.describe_topic(topic).messages == 1,
        10.0,
        "the committed message stored",
    )


def test_schedule_backlog(page: Page, admin: SyncAdminClient, producer: SyncProducer) -> None:
    topic = "ConsoleDelayed"
    make_topic(admin, topic)
    # delays of 1, 2 and 5 minutes: they wait for longer than the test runs
    for level, count in ((5, 4), (6, 2), (9, 6)):
        for i in range(count):
            producer.send(Message(topic, f"later {i}".encode(), delay_level=level))
    log_in(page, ADMIN, "/ui/schedule")
    expect(page.get_by_test_id("schedule-total")).to_have_text("12 messages waiting")
    expect(page.get_by_test_id("schedule-bar-svg")).to_be_visible()
    expect(page.get_by_test_id("schedule-line-svg-summary")).to_contain_text("all levels: 12")
    no_errors(page)
    screenshot(page, "schedule")


def test_a_topic_page_charts_its_traffic(
    page: Page, admin: SyncAdminClient, producer: SyncProducer
) -> None:
    """The topic page's rate chart while messages flow (and the screenshot of the topic page)."""
    topic = "ConsoleTraffic"
    make_topic(admin, topic)
    stop = threading.Event()
    sent: list[str] = []

    def send() -> None:
        while not stop.is_set():
            sent.append(producer.send(Message(topic, f"tick {len(sent)}".encode())).message_id)
            stop.wait(0.05)  # pacing the producer for a steady rate, not synchronisation

    sender = threading.Thread(target=send, name="e2e-console-traffic")
    sender.start()
    try:
        log_in(page, ADMIN, f"/ui/topics?name={topic}")
        expect(page.get_by_test_id("topic-rate")).not_to_have_text(re.compile(r"^(0|—) msg/s$"))
        expect(page.get_by_test_id("topic-rate-svg-summary")).not_to_have_text(
            re.compile(r": 0 msg/s$")
        )
        no_errors(page)
        screenshot(page, "topic")
    finally:
        stop.set()
        sender.join()
    expect(page.get_by_test_id("topic-messages")).to_have_text(f"{len(sent):,}")
