"""The web console in headless Chromium: what an operator sees and clicks, checked against
what the broker's wire says."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from ferrymq import SimpleConsumer
from ferrymq.broker.embedded import Broker
from tests.console_helpers import (
    ADMIN,
    VIEWER,
    admin_client,
    console_broker,
    consume_all,
    dead_letters,
    http_url,
    produce,
    receive,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def open_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker with the console and authentication off."""
    with console_broker(tmp_path) as b:
        yield b


def test_topics_page_shows_a_topic_made_by_a_producer(open_broker: Broker, page: Page) -> None:
    produce(open_broker, "orders", 7)
    page.goto(http_url(open_broker) + "/")
    row = page.locator("table.topics tbody tr", has_text="orders")
    expect(row.locator("td").nth(2)).to_have_text("7")
    expect(page.locator("label.refresh")).to_be_visible()  # the shipped script ran (CSP 'self')
    row.get_by_role("link", name="orders").click()
    expect(page.get_by_role("heading", name="Topic orders")).to_be_visible()
    expect(page.locator("table.queues tbody tr")).to_have_count(2)


def test_group_page_shows_lag(open_broker: Broker, page: Page) -> None:
    produce(open_broker, "orders", 5, queues=1)
    consume_all(open_broker, "orders", "billing", 5)
    produce(open_broker, "orders", 3, create=False)
    page.goto(http_url(open_broker) + "/groups")
    page.get_by_role("link", name="billing").click()
    cells = page.locator("table.lag tbody tr").first.locator("td")
    expect(cells.nth(2)).to_have_text("5")  # committed
    expect(cells.nth(4)).to_have_text("3")  # lag in messages
    expect(cells.nth(5)).to_have_text(re.compile(r"^\d+\.\d s$"))  # its age


def test_login_wrong_then_right_password(tmp_path: Path, page: Page) -> None:
    with console_broker(tmp_path, auth=True) as b:
        produce(b, "orders", 2, auth=ADMIN)
        page.goto(http_url(b) + "/topic?name=orders")
        expect(page.get_by_role("heading", name="Log in")).to_be_visible()
        page.get_by_label("User").fill(ADMIN[0])
        page.get_by_label("Password").fill("not-the-password")
        t0 = time.monotonic()
        page.get_by_role("button", name="Log in").click()
        expect(page.locator("p.error")).to_have_text("Wrong user name or password.")
        assert time.monotonic() - t0 >= b.server.config.auth_failure_delay_ms / 1000
        page.get_by_label("User").fill(ADMIN[0])
        page.get_by_label("Password").fill(ADMIN[1])
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("heading", name="Topic orders")).to_be_visible()
        expect(page.locator("nav .who")).to_contain_text("root (admin)")
        cookies = page.context.cookies()
        (cookie,) = [c for c in cookies if c["name"] == "ferrymq_console"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # no script reads the session


def test_a_user_without_admin_rights_sees_its_topics_and_groups(tmp_path: Path,
                                                              page: Page) -> None:
    with console_broker(tmp_path, auth=True) as b:
        produce(b, "orders", 2, queues=1, auth=ADMIN)
        produce(b, "secret", 1, queues=1, auth=ADMIN)
        dead_letters(b, "orders", "dg", 1, auth=ADMIN)
        dead_letters(b, "secret", "other", 1, auth=ADMIN)
        page.goto(http_url(b) + "/")
        page.get_by_label("User").fill(VIEWER[0])
        page.get_by_label("Password").fill(VIEWER[1])
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("heading", name="Topics")).to_be_visible()
        expect(page.locator("nav .who")).to_have_text(re.compile(r"^viewer\b"))
        expect(page.locator("table.topics tbody tr")).to_have_count(1)
        expect(page.locator("table.topics tbody tr td").first).to_have_text("orders")
        page.get_by_role("link", name="Groups").click()
        expect(page.locator("table.groups tbody tr")).to_have_count(1)
        page.get_by_role("link", name="dg").click()
        expect(page.locator("table.letters tbody tr")).to_have_count(1)
        expect(page.get_by_role("button", name="Purge all")).to_have_count(0)


def test_dead_letter_redrive_confirmed_in_the_page(open_broker: Broker, page: Page) -> None:
    b = open_broker
    produce(b, "orders", 3, queues=1)
    dead_letters(b, "orders", "workers", 3)
    page.goto(http_url(b) + "/group?name=workers")
    expect(page.locator("table.letters tbody tr")).to_have_count(3)
    page.locator("table.letters").get_by_role("link", name="1", exact=True).click()
    expect(page.locator("pre.body")).to_have_text("m1")
    page.go_back()
    page.get_by_role("button", name="Redrive all").click()
    expect(page.get_by_text("3 dead letters (offsets 0..2) will be delivered again")).to_be_visible()
    with admin_client(b) as admin:
        assert admin.describe_delivery("workers").dlq_size == 3  # not before the confirm
        page.get_by_role("button", name="Yes, redrive 3").click()
        expect(page.get_by_text("Redrove 3 dead letters of workers.")).to_be_visible()
        expect(page.locator("label.refresh")).to_have_count(0)  # a POST's answer: no reload
        assert admin.describe_delivery("workers").dlq_size == 0
    with SimpleConsumer(b.address, "workers") as sc:  # delivered again
        sc.subscribe("orders")
        got = receive(sc, 3)
        assert sorted(m.body for m in got) == [b"m0", b"m1", b"m2"]
        for m in got:
            sc.ack(m)


def test_one_dead_letter_redriven_and_another_purged_from_their_pages(
        open_broker: Broker, page: Page) -> None:
    b = open_broker
    produce(b, "orders", 4, queues=1)
    dead_letters(b, "orders", "workers", 4)
    with admin_client(b) as admin:
        body_at = {x.dlq_offset: x.body for x in admin.dlq_list("workers")}
    url = http_url(b)
    page.goto(url + "/group?name=workers")
    page.locator("table.letters").get_by_role("link", name="2", exact=True).click()
    expect(page.get_by_role("heading", name="Dead letter 2 of workers")).to_be_visible()
    page.get_by_role("button", name="Redrive this letter").click()
    expect(page.get_by_text("The dead letter at offset 2 (message")).to_be_visible()
    with admin_client(b) as admin:
        assert admin.describe_delivery("workers").dlq_size == 4  # not before the confirm
        page.get_by_role("button", name="Yes, redrive it").click()
        expect(page.get_by_text("Redrove the dead letter at offset 2 of workers.")).to_be_visible()
        assert [x.dlq_offset for x in admin.dlq_list("workers")] == [0, 1, 3]
    page.goto(url + "/letter?group=workers&offset=1")
    page.get_by_role("button", name="Purge this letter").click()
    expect(page.get_by_text("will be deleted for good")).to_be_visible()
    page.get_by_role("button", name="Yes, purge it").click()
    expect(page.get_by_text("Purged the dead letter at offset 1 of workers.")).to_be_visible()
    page.get_by_role("link", name="Back to the group").click()
    expect(page.locator("table.letters tbody tr")).to_have_count(2)
    expect(page.get_by_text("Dead letters (2)")).to_be_visible()
    with SimpleConsumer(b.address, "workers") as sc:  # only the redriven one comes back
        sc.subscribe("orders")
        got = receive(sc, 1)
        assert [m.body for m in got] == [body_at[2]]
        assert sc.receive(4, wait=0.5) == []
        sc.ack(got[0])


class _Forger(BaseHTTPRequestHandler):
    """Another site's page: a form that posts to the console (its URL in ``server.target``)."""

    def do_GET(self) -> None:
        target = self.server.target  # type: ignore[attr-defined]
        body = (f'<html><body><form id="f" method="post" action="{target}/dlq/purge">'
                f'<input name="group" value="workers"><input name="count" value="0">'
                f'<input name="confirm" value="yes"><button>win a prize</button></form>'
                f'</body></html>').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_forged_post_from_another_origin_is_refused(open_broker: Broker, page: Page) -> None:
    b = open_broker
    produce(b, "orders", 2, queues=1)
    dead_letters(b, "orders", "workers", 2)
    page.goto(http_url(b) + "/group?name=workers")  # the victim has a console session
    expect(page.locator("table.letters tbody tr")).to_have_count(2)
    forger = ThreadingHTTPServer(("127.0.0.1", 0), _Forger)
    forger.target = http_url(b)  # type: ignore[attr-defined]
    threading.Thread(target=forger.serve_forever, daemon=True).start()
    try:
        page.goto(f"http://127.0.0.1:{forger.server_address[1]}/")
        page.get_by_role("button", name="win a prize").click()
        expect(page.get_by_role("heading", name="Refused")).to_be_visible()
        expect(page.locator("main p")).to_contain_text("Refused")
    finally:
        forger.shutdown()
        forger.server_close()
    with admin_client(b) as admin:
        assert admin.describe_delivery("workers").dlq_size == 2
