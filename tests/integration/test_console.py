"""The web console over HTTP (an aiohttp client against a real broker): every page, login and
sessions, CSRF refusals, dead-letter redrive and purge with their confirm step, 404/405, and the
page bounds. The same pages in a real browser: tests/browser/."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ferrymq import AdminClient
from ferrymq.broker.config import load
from ferrymq.broker.embedded import Broker
from ferrymq.errors import ConfigError
from ferrymq.ops.console_auth import COOKIE
from tests.console_helpers import (
    ADMIN,
    READER,
    VIEWER,
    admin_client,
    console_broker,
    consume_all,
    dead_letters,
    http_url,
    produce,
)
from tests.security_helpers import make_certs

pytestmark = pytest.mark.integration

Body = Callable[[aiohttp.ClientSession, str], Awaitable[None]]


def browse(b: Broker, body: Body) -> None:
    """Run ``body(session, base url)`` with a fresh cookie jar (IP hosts allowed)."""

    async def go() -> None:
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as s:
            await body(s, http_url(b))

    asyncio.run(go())


async def page(s: aiohttp.ClientSession, url: str, status: int = 200, **kw: Any) -> str:
    async with s.get(url, **kw) as r:
        text = await r.text()
        assert r.status == status, text
        return text


def csrf_of(text: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', text)
    assert found, "no CSRF token in the page"
    return found.group(1)


def cells(text: str, cls: str) -> list[list[str]]:
    """The body cells of the table of class ``cls`` (tags stripped)."""
    table = re.search(rf'<table class="{cls}">(.*?)</table>', text, re.S)
    assert table, f"no table {cls}"
    rows = re.findall(r"<tr>(.*?)</tr>", table.group(1).split("<tbody>", 1)[1], re.S)
    return [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>(.*?)</td>", r, re.S)]
            for r in rows]


def test_topics_topic_message_key_and_cluster_pages(tmp_path: Path) -> None:
    with console_broker(tmp_path) as b:
        produce(b, "orders", 10, key="k-1")

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            async with s.get(url + "/") as r:
                assert r.status == 200
                text = await r.text()
                cookie = r.headers["Set-Cookie"]
                assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
                assert r.headers["Content-Security-Policy"].startswith("default-src 'self'")
                assert r.headers["X-Frame-Options"] == "DENY"
            rows = {r[0]: r for r in cells(text, "topics")}
            assert rows["orders"][1:4] == ["2", "10", "10"]
            assert not any(n.startswith("%") for n in rows)
            conns = {state: int(n) for state, n in cells(text, "connections")}
            assert conns["active"] >= 1 and conns["write_stalled"] == 0  # the console's own
            produce(b, "orders", 5, create=False)
            time.sleep(1.05)
            rate = float(cells(await page(s, url + "/"), "topics")[0][6])
            assert 0 < rate <= 5 / 1.0
            queues = cells(await page(s, url + "/topic?name=orders"), "queues")
            assert sum(int(q[3]) for q in queues) == 15
            found = cells(await page(s, url + "/key?topic=orders&key=k-1"), "found")
            assert len(found) == 10
            msg_id = found[0][0]
            text = await page(s, url + "/message", params={"id": msg_id})
            assert "Topic orders, queue" in text and "No delivery group reads" in text
            text = await page(s, url + "/cluster")
            assert "A single broker" in text
            assert len(cells(text, "replication")) == 2
            for name, ctype in (("console.css", "text/css"), ("console.js", "text/javascript")):
                async with s.get(url + "/static/" + name) as r:
                    assert r.status == 200 and r.content_type == ctype
                    assert len(await r.read()) > 100

        browse(b, body)


def test_group_pages_show_lag_members_leases_and_dead_letters(tmp_path: Path) -> None:
    with console_broker(tmp_path) as b:
        produce(b, "orders", 6, queues=1)
        consume_all(b, "orders", "pg", 6)
        produce(b, "orders", 4, create=False)
        dead_letters(b, "orders", "dg", 3)

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            groups = {r[0]: r for r in cells(await page(s, url + "/groups"), "groups")}
            assert groups["pg"][1] == "consumer" and groups["dg"][1] == "delivery"
            text = await page(s, url + "/group?name=pg")
            (lag,) = cells(text, "lag")
            assert lag[:5] == ["orders", "0", "6", "10", "4"]
            assert lag[5].endswith(" s")  # the age of the oldest unconsumed message
            text = await page(s, url + "/group?name=dg")
            assert "3 dead letters" in text
            letters = cells(text, "letters")
            assert [x[0] for x in letters] == ["0", "1", "2"]
            assert all("bad payload" in x[5] for x in letters), letters
            text = await page(s, url + "/letter?group=dg&offset=1")
            assert "<pre class=\"body\">m1</pre>" in text
            assert 'href="/letter?group=dg&amp;offset=2">next letter' in text
            assert 'href="/letter?group=dg&amp;offset=0">« previous letter' in text
            await page(s, url + "/letter?group=dg&offset=99", 404)
            await page(s, url + "/group?name=nobody", 404)

        browse(b, body)


def test_redrive_and_purge_need_a_confirm_step_and_act_through_the_wire(tmp_path: Path) -> None:
    with console_broker(tmp_path) as b:
        produce(b, "orders", 5, queues=1)
        dead_letters(b, "orders", "dg", 5)
        admin = admin_client(b)

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            token = csrf_of(await page(s, url + "/group?name=dg"))
            origin = {"Origin": url}
            async with s.post(url + "/dlq/redrive", headers=origin,
                              data={"group": "dg", "count": "1", "csrf": token}) as r:
                text = await r.text()
                assert r.status == 200, text
            assert "1 dead letter (offsets 0..0) will be delivered again" in text
            assert admin.describe_delivery("dg").dlq_size == 5  # nothing done before confirm
            async with s.post(url + "/dlq/redrive", headers=origin, data={
                    "group": "dg", "count": "1", "csrf": token, "confirm": "yes"}) as r:
                assert "Redrove 1 dead letter of dg" in await r.text()
            assert admin.describe_delivery("dg").dlq_size == 4
            async with s.post(url + "/dlq/purge", headers=origin,
                              data={"group": "dg", "count": "0", "csrf": token}) as r:
                assert "4 dead letters (offsets 1..4) will be deleted for good" in await r.text()
            async with s.post(url + "/dlq/purge", headers=origin, data={
                    "group": "dg", "count": "0", "csrf": token, "confirm": "yes"}) as r:
                assert "Purged 4 dead letters of dg" in await r.text()
            assert admin.describe_delivery("dg").dlq_size == 0

        try:
            browse(b, body)
        finally:
            admin.close()


def test_one_dead_letter_is_redriven_or_purged_from_its_own_page(tmp_path: Path) -> None:
    """The letter page's buttons act on that letter only (one in the middle of the DLQ), with
    the same dry run, confirm step and CSRF check as the group's buttons."""
    with console_broker(tmp_path) as b:
        produce(b, "orders", 5, queues=1)
        dead_letters(b, "orders", "dg", 5)
        admin = admin_client(b)

        async def post(s: aiohttp.ClientSession, url: str, path: str, data: dict[str, str],
                       status: int = 200) -> str:
            async with s.post(url + path, headers={"Origin": url}, data=data) as r:
                text = await r.text()
                assert r.status == status, text
                return text

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            text = await page(s, url + "/letter?group=dg&offset=2")
            token = csrf_of(text)
            for what, label in (("redrive", "Redrive this letter"),
                                ("purge", "Purge this letter")):
                form = re.search(rf'<form method="post" action="/dlq/{what}"[^>]*>(.*?)</form>',
                                 text, re.S)
                assert form, what
                assert '<input type="hidden" name="offset" value="2">' in form.group(1)
                assert label in form.group(1)
            one = {"group": "dg", "offset": "2", "csrf": token}
            text = await post(s, url, "/dlq/redrive", one)
            assert "The dead letter at offset 2 (message " in text
            assert "will be delivered again to the group" in text
            assert admin.describe_delivery("dg").dlq_size == 5  # nothing before the confirm
            text = await post(s, url, "/dlq/redrive", {**one, "confirm": "yes"})
            assert "Redrove the dead letter at offset 2 of dg." in text
            assert admin.describe_delivery("dg").dlq_size == 4
            await page(s, url + "/letter?group=dg&offset=2", 404)
            text = await page(s, url + "/group?name=dg")
            assert [x[0] for x in cells(text, "letters")] == ["0", "1", "3", "4"]
            three = {"group": "dg", "offset": "3", "csrf": token}
            text = await post(s, url, "/dlq/purge", three)
            assert "The dead letter at offset 3 (message " in text and "deleted for good" in text
            text = await post(s, url, "/dlq/purge", {**three, "confirm": "yes"})
            assert "Purged the dead letter at offset 3 of dg." in text
            assert [x.dlq_offset for x in admin.dlq_list("dg")] == [0, 1, 4]
            # done already: refused at the dry run, nothing changes
            text = await post(s, url, "/dlq/purge", three, 400)
            assert "InvalidOffsetError" in text and "redriven or purged already" in text
            text = await post(s, url, "/dlq/redrive", {**one, "offset": "9", "confirm": "yes"},
                              400)
            assert "beyond the end of the dead-letter queue" in text
            await post(s, url, "/dlq/purge", {**one, "offset": "-1"}, 400)
            await post(s, url, "/dlq/purge", {**one, "offset": str(1 << 64)}, 400)
            await post(s, url, "/dlq/purge", {"group": "dg", "offset": "1", "confirm": "yes"},
                       403)  # no CSRF token
            assert admin.describe_delivery("dg").dlq_size == 3

        try:
            browse(b, body)
        finally:
            admin.close()


def test_writes_without_the_csrf_token_or_from_another_origin_are_refused(
        tmp_path: Path) -> None:
    with console_broker(tmp_path) as b:
        produce(b, "orders", 2, queues=1)
        dead_letters(b, "orders", "dg", 2)

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            token = csrf_of(await page(s, url + "/group?name=dg"))
            data = {"group": "dg", "count": "0", "confirm": "yes"}
            for headers, form in (
                    ({"Origin": url}, data),  # no token
                    ({"Origin": url}, {**data, "csrf": token[:-2] + "xx"}),  # a wrong one
                    ({"Origin": "http://evil.example"}, {**data, "csrf": token}),
                    ({}, {**data, "csrf": token}),  # neither Origin nor Referer
            ):
                async with s.post(url + "/dlq/purge", headers=headers, data=form) as r:
                    assert r.status == 403, (headers, form)
                    assert "Refused" in await r.text()
            # another browser, without the session cookie
            async with aiohttp.ClientSession() as other, other.post(
                    url + "/dlq/purge", headers={"Origin": url},
                    data={**data, "csrf": token}) as r:
                assert r.status == 403
            with admin_client(b) as admin:
                assert admin.describe_delivery("dg").dlq_size == 2

        browse(b, body)


def test_unknown_paths_wrong_methods_and_bad_parameters(tmp_path: Path) -> None:
    with console_broker(tmp_path, console_page_rows=2) as b:
        for i in range(5):
            produce(b, f"t{i}", 0, queues=1)

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            async with s.get(url + "/nope") as r:
                assert r.status == 404
            async with s.post(url + "/", data=b"") as r:
                assert r.status == 405 and r.headers["Allow"] == "GET, HEAD"
            async with s.get(url + "/dlq/redrive") as r:
                assert r.status == 405 and r.headers["Allow"] == "POST"
            first = await page(s, url + "/")
            assert [r[0] for r in cells(first, "topics")] == ["t0", "t1"]
            assert "5 topics" in first and 'href="/?page=1"' in first
            last = await page(s, url + "/?page=2")
            assert [r[0] for r in cells(last, "topics")] == ["t4"]
            assert "next" not in last.split('class="pager"')[1]
            await page(s, url + "/?page=abc", 400)
            await page(s, url + "/topic", 400)  # no name
            await page(s, url + "/topic?name=" + "x" * 600, 400)
            await page(s, url + "/topic?name=missing", 404)
            await page(s, url + "/letter?group=g&offset=x", 400)
            text = await page(s, url + "/message?id=nothex", 400)
            assert "InvalidRequestError" in text
            assert "<script>" not in await page(s, url + "/key?topic=<script>&key=k", 404)

        browse(b, body)


@pytest.mark.parametrize(("setting", "bad"), [("console_page_rows", 0),
                                              ("console_page_rows", 1001),
                                              ("console_max_sessions", 0),
                                              ("console_session_timeout_ms", 0)])
def test_console_limits_are_checked(tmp_path: Path, setting: str, bad: int) -> None:
    with pytest.raises(ConfigError, match=setting):
        load(overrides={"data_dir": str(tmp_path), setting: bad})


def test_login_wrong_password_is_delayed_then_sessions_expire_and_are_bounded(
        tmp_path: Path) -> None:
    with console_broker(tmp_path, auth=True, auth_failure_delay_ms=400,
                        console_max_sessions=2, console_session_timeout_ms=1500) as b:
        produce(b, "orders", 3, auth=ADMIN)

        async def login(s: aiohttp.ClientSession, url: str, user: str, password: str,
                        status: int = 200) -> str:
            async with s.post(url + "/login", headers={"Origin": url},
                              data={"user": user, "password": password}) as r:
                text = await r.text()
                assert r.status == status, text
                return text

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            async with s.get(url + "/topic?name=orders", allow_redirects=False) as r:
                assert r.status == 303
                assert r.headers["Location"] == "/login?next=%2Ftopic%3Fname%3Dorders"
            t0 = time.monotonic()
            text = await login(s, url, ADMIN[0], "wrong", 401)
            assert time.monotonic() - t0 >= 0.4  # the wire's auth_failure_delay_ms
            assert "Wrong user name or password" in text
            await login(s, url, "nobody", "x", 401)
            async with s.post(url + "/login", data={"user": ADMIN[0],
                                                    "password": ADMIN[1]}) as r:
                assert r.status == 403  # no Origin: refused
            text = await login(s, url, *ADMIN)
            assert "orders" in text and "root (admin)" in text
            cookie = next(c for c in s.cookie_jar if c.key == COOKIE)
            assert cookie["httponly"] and cookie["samesite"] == "Strict"
            assert b.server.http is not None and b.server.http.console is not None
            sessions = b.server.http.console.sessions
            assert len(sessions) == 1
            # two more logins: the first session (unused the longest) ends
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as o:
                await login(o, url, *READER)
                await login(o, url, *READER)
            assert len(sessions) == 2
            async with s.get(url + "/", allow_redirects=False) as r:
                assert r.status == 303
            await login(s, url, *ADMIN)
            await page(s, url + "/")
            time.sleep(1.6)  # console_session_timeout_ms
            async with s.get(url + "/", allow_redirects=False) as r:
                assert r.status == 303
            await login(s, url, *ADMIN)
            token = csrf_of(await page(s, url + "/"))
            async with s.post(url + "/logout", headers={"Origin": url},
                              data={"csrf": token}) as r:
                assert r.url.path == "/login"
            async with s.get(url + "/", allow_redirects=False) as r:
                assert r.status == 303

        browse(b, body)


def test_a_user_without_admin_rights_reads_what_the_wire_allows_and_cannot_write(
        tmp_path: Path) -> None:
    with console_broker(tmp_path, auth=True) as b:
        produce(b, "orders", 2, queues=1, auth=ADMIN)
        dead_letters(b, "orders", "dg", 2, auth=ADMIN)

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            async with s.post(url + "/login", headers={"Origin": url},
                              data={"user": READER[0], "password": READER[1]}) as r:
                assert r.status == 200  # logged in: the topics it may see (none)
            text = await page(s, url + "/")
            assert "0 topics" in text and cells(text, "topics") == []
            token = csrf_of(text)  # the logout form's
            text = await page(s, url + "/group?name=dg", 403)
            assert "AccessDeniedError" in text
            async with s.post(url + "/dlq/purge", headers={"Origin": url}, data={
                    "group": "dg", "count": "0", "csrf": token, "confirm": "yes"}) as r:
                assert r.status == 403
                assert "AccessDeniedError" in await r.text()
            with admin_client(b, ADMIN) as admin:
                assert admin.describe_delivery("dg").dlq_size == 2

        browse(b, body)


def test_a_user_without_admin_rights_sees_the_topics_and_groups_its_acls_allow(
        tmp_path: Path) -> None:
    """The topics, groups and cluster pages list what the wire lets the user describe (the
    broker leaves the rest out, as Kafka's Metadata does), instead of refusing the page; its
    delivery group's dead letters are browsable, without bodies or write buttons."""
    with console_broker(tmp_path, auth=True) as b:
        produce(b, "orders", 3, queues=1, auth=ADMIN)
        produce(b, "secret", 1, queues=1, auth=ADMIN)
        dead_letters(b, "orders", "dg", 2, auth=ADMIN)
        dead_letters(b, "secret", "other", 1, auth=ADMIN)

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            async with s.post(url + "/login", headers={"Origin": url},
                              data={"user": VIEWER[0], "password": VIEWER[1]}) as r:
                assert r.status == 200
                text = await r.text()
            assert [row[0] for row in cells(text, "topics")] == ["orders"]
            assert "1 topic " in text
            text = await page(s, url + "/?internal=1")  # its group's DLQ too, not other's
            assert [row[0] for row in cells(text, "topics")] == ["%DLQ%dg", "orders"]
            groups = cells(await page(s, url + "/groups"), "groups")
            assert [g[0] for g in groups] == ["dg"]
            text = await page(s, url + "/group?name=dg")
            assert [x[0] for x in cells(text, "letters")] == ["0", "1"]
            assert "/dlq/" not in text  # no write buttons
            text = await page(s, url + "/letter?group=dg&offset=1")
            assert "The body is shown to admins only." in text and "/dlq/" not in text
            text = await page(s, url + "/cluster")
            assert [q[0] for q in cells(text, "replication")] == ["%DLQ%dg", "orders"]
            await page(s, url + "/topic?name=secret", 403)
            await page(s, url + "/group?name=other", 403)
            with admin_client(b, ADMIN) as admin:
                assert admin.describe_delivery("dg").dlq_size == 2

        browse(b, body)


def test_without_authentication_only_localhost_is_answered(tmp_path: Path) -> None:
    """A DNS-rebinding page (Host: its own name) gets nothing from a console with no login."""
    with console_broker(tmp_path) as b:
        produce(b, "orders", 1, queues=1)
        dead_letters(b, "orders", "dg", 1)

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            port = url.rsplit(":", 1)[1]
            for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
                await page(s, url + "/", headers={"Host": host})
            rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
            text = await page(s, url + "/", 403, headers=rebound)
            assert "orders" not in text and "answers only requests for localhost" in text
            async with s.post(url + "/dlq/purge", headers=rebound, data={
                    "group": "dg", "count": "0", "confirm": "yes"}) as r:
                assert r.status == 403
            with admin_client(b) as admin:
                assert admin.describe_delivery("dg").dlq_size == 1

        browse(b, body)


def test_console_off(tmp_path: Path) -> None:
    with console_broker(tmp_path, console=False) as b:

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            await page(s, url + "/", 404)
            await page(s, url + "/healthz")

        browse(b, body)


def test_console_reaches_a_tls_wire_port(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "pki")
    with console_broker(tmp_path, tls_cert_file=str(certs.server_cert),
                        tls_key_file=str(certs.server_key), tls_ca_file=str(certs.ca)) as b:
        with AdminClient(b.address, tls=str(certs.ca)) as admin:
            admin.create_topic("secure", 1)

        async def body(s: aiohttp.ClientSession, url: str) -> None:
            assert [r[0] for r in cells(await page(s, url + "/"), "topics")] == ["secure"]
            async with s.head(url + "/topic?name=secure") as r:
                assert r.status == 200

        browse(b, body)
