"""The web console at ``/`` of the HTTP listener: topics, groups, dead letters, messages, cluster.

Theory of operation
-------------------
Every page is plain HTML built on the server (no template engine, every value escaped), with
one small stylesheet and one small script shipped in the package (``console_static/``; no CDN,
it works without internet). A page is built from the same admin operations as the CLI: the
handlers call :class:`~ferrymq.client.admin.AsyncAdminClient` over the broker's own wire port,
as the user logged in to the console (:mod:`ferrymq.ops.console_auth`), so ACLs, admin rights
and the failed-login delay are the wire's, and nothing here reads the broker's internals except
the connection counts (no wire request lists connections; they are read as ``/metrics`` reads
them). Every call is async on the broker's loop, so a page never blocks it.

Bounded work per request: lists are paged by ``console_page_rows`` (a page of topics is one
METADATA plus one DESCRIBE_TOPIC per row shown; a group's dead letters are its oldest
``console_page_rows``; a letter is browsed by its offset, one FETCH); nothing scans a topic,
so a page costs the same on a topic of a million messages as on an empty one. Rates are the
difference of end offsets between two views of a topic (at most ``RATE_TOPICS`` remembered).

Writes (redrive and purge dead letters: the oldest, all, or one letter from its own page) are
POSTs that need the session's CSRF token and a same-origin ``Origin``, and happen in two steps:
the first POST answers a page saying what would be done (a dry run) with a confirm button, the
second (``confirm=yes``) does it. The wire refuses them to users without admin rights.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import urlencode, urlsplit

from aiohttp import web

from ferrymq.broker.config import is_loopback
from ferrymq.broker.tls import peer_context
from ferrymq.client.admin import MAX_DLQ_OFFSET, AsyncAdminClient, DeadLetter, GroupDescription
from ferrymq.client.admin import DeliveryGroupDescription as DeliveryDescription
from ferrymq.errors import (
    AuthenticationFailedError,
    FerryMQError,
    InvalidRequestError,
    OffsetOutOfRangeError,
    UnknownGroupError,
    UnknownTopicError,
)
from ferrymq.ops import console_html as h
from ferrymq.ops.console_auth import (
    COOKIE,
    ConsoleSession,
    SessionStore,
    local_path,
    same_origin,
)
from ferrymq.ops.console_html import BadParam, Html, Page, esc
from ferrymq.ops.metrics import connection_states
from ferrymq.protocol.messages import DELIVERY_GROUP_STATE
from ferrymq.protocol.records import encode_msg_id

if TYPE_CHECKING:
    from ferrymq.broker.server import BrokerServer

__all__ = ["Console"]

RATE_TOPICS = 4096
"""Most topics whose last end offsets the console remembers, for rates."""
RATE_MIN_INTERVAL_S = 1.0
"""Views of a topic closer than this reuse the older sample (a rate over at least 1 s)."""
ADMIN_REQUEST_TIMEOUT_S = 10.0
"""Deadline of each admin request the console makes."""
STATIC = ("console.css", "console.js")
"""The files of ``console_static/``, served at ``/static/<name>``."""
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

View = Callable[[web.BaseRequest, ConsoleSession], Awaitable["Page | web.Response"]]


class Console:
    """The web console of one broker (see the module docstring)."""

    def __init__(self, srv: BrokerServer) -> None:
        self.srv = srv
        cfg = srv.config
        self.rows = cfg.console_page_rows
        self.sessions = SessionStore(
            self._open_client, auth=bool(cfg.users_file),
            timeout_s=cfg.console_session_timeout_ms / 1000,
            max_sessions=cfg.console_max_sessions)
        self._rates: OrderedDict[str, tuple[float, list[int]]] = OrderedDict()
        self._loopback_only = not cfg.users_file and is_loopback(cfg.host)
        """No login and a loopback broker: answer only requests naming a loopback host (a
        DNS-rebinding page would otherwise be same-origin with the console)."""
        folder = resources.files("ferrymq.ops") / "console_static"
        self._static = {name: (folder / name).read_bytes() for name in STATIC}

    def routes(self) -> dict[str, tuple[Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                                        tuple[str, ...]]]:
        """Path -> (handler, methods) of every page of the console."""
        get = ("GET", "HEAD")
        post = ("POST",)
        out: dict[str, tuple[Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                             tuple[str, ...]]] = {
            "/": (self._wrap(self._topics), get),
            "/topic": (self._wrap(self._topic), get),
            "/groups": (self._wrap(self._groups), get),
            "/group": (self._wrap(self._group), get),
            "/letter": (self._wrap(self._letter), get),
            "/message": (self._wrap(self._message), get),
            "/key": (self._wrap(self._key), get),
            "/cluster": (self._wrap(self._cluster), get),
            "/dlq/redrive": (self._wrap(self._dlq_write, write=True), post),
            "/dlq/purge": (self._wrap(self._dlq_write, write=True), post),
            "/login": (self._login, (*get, *post)),
            "/logout": (self._wrap(self._logout, write=True), post),
        }
        for name in STATIC:
            out[f"/static/{name}"] = (self._asset, get)
        return out

    async def close(self) -> None:
        """End every session (the listener is closing)."""
        await self.sessions.close()

    def _open_client(self, auth: tuple[str, str] | None) -> AsyncAdminClient:
        host, port = self.srv.address
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
        return AsyncAdminClient(f"{host}:{port}" if ":" not in host else f"[{host}]:{port}",
                                request_timeout_s=ADMIN_REQUEST_TIMEOUT_S,
                                connect_timeout_s=ADMIN_REQUEST_TIMEOUT_S,
                                reconnect_timeout_s=ADMIN_REQUEST_TIMEOUT_S,
                                auth=auth, tls=peer_context(self.srv.config))

    # -- request handling -------------------------------------------------------------------------

    def _wrap(self, view: View, *, write: bool = False
              ) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            if self._loopback_only and not is_loopback(urlsplit("//" + request.host).hostname
                                                       or ""):
                return self._answer(Page("Refused", [h.p(
                    "Without authentication (no users_file) the console answers only "
                    "requests for localhost (Host header), against DNS rebinding.")], 403), None)
            session = self.sessions.get(request.cookies.get(COOKIE))
            new_cookie = False
            if session is None:
                if self.sessions.auth or write:
                    if write:
                        return self._answer(Page("Refused", [
                            "<p>Your session has ended: ", h.a("/login", {}, "log in"),
                            " again.</p>"], 403), None)
                    return h.redirect("/login", {"next": request.path_qs})
                try:
                    session = await self.sessions.anonymous()
                except FerryMQError as exc:
                    return self._answer(h.error_page(exc), None)
                new_cookie = True
            if write:
                refused = await self._check_write(request, session)
                if refused is not None:
                    return self._answer(refused, session)
            try:
                result = await view(request, session)
            except BadParam as exc:
                result = Page("Bad request", [h.p(str(exc))], 400)
            except FerryMQError as exc:
                result = h.error_page(exc)
            resp = (result if isinstance(result, web.Response) else
                    self._answer(result, session, live=not write))
            if new_cookie:
                self._set_cookie(resp, session)
            return resp
        return handle

    async def _check_write(self, request: web.BaseRequest,
                           session: ConsoleSession) -> Page | None:
        """A refusal page when a POST is not from this console's own page (CSRF)."""
        if not same_origin(request.headers.get("Origin"), request.headers.get("Referer"),
                           request.host):
            return Page("Refused", [h.p("Refused: this form was not sent from the console's own "
                                       "page (Origin check).")], 403)
        form = await request.post()
        token = form.get("csrf")
        if not isinstance(token, str) or not session.check_csrf(token):
            return Page("Refused", [h.p("Refused: the form's CSRF token is missing or wrong "
                                       "(reload the page and try again).")], 403)
        return None

    def _answer(self, page: Page, session: ConsoleSession | None, *,
                live: bool = False) -> web.Response:
        """The HTML of ``page``; ``live``: a page that only reads (its script may reload it)."""
        nav = ""
        if session is not None:
            who = f"{session.user} (admin)" if session.admin and session.user else session.user
            logout = (h.form("/logout", {}, "Log out", session, cls="inline")
                      if self.sessions.auth else "")
            nav = (f'<nav><a href="/">Topics</a> <a href="/groups">Groups</a> '
                   f'<a href="/cluster">Cluster</a>'
                   f'<form method="get" action="/message" class="inline">'
                   f'<input name="id" placeholder="message id" size="30" maxlength="64">'
                   f'<button>Find</button></form>'
                   f'<span class="who">{esc(who)} {logout}</span></nav>')
        text = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f'<title>{esc(page.title)} · FerryMQ</title>'
                f'<link rel="stylesheet" href="/static/console.css">'
                f'<script src="/static/console.js" defer></script></head>'
                f'<body{" data-live" if live and page.status == 200 else ""}>{nav}'
                f'<main><h1>{esc(page.title)}</h1>{page.body}</main></body></html>')
        resp = web.Response(status=page.status, text=text, content_type="text/html")
        resp.headers.update(_SECURITY_HEADERS)
        return resp

    def _set_cookie(self, resp: web.StreamResponse, session: ConsoleSession) -> None:
        resp.set_cookie(COOKIE, session.sid, httponly=True, samesite="Strict", path="/",
                        max_age=int(self.sessions.timeout_s))

    async def _asset(self, request: web.BaseRequest) -> web.StreamResponse:
        name = request.path.rsplit("/", 1)[1]
        ctype = "text/css" if name.endswith(".css") else "text/javascript"
        resp = web.Response(body=self._static[name], content_type=ctype)
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Cache-Control"] = "max-age=300"
        return resp

    # -- login -------------------------------------------------------------------------------

    async def _login(self, request: web.BaseRequest) -> web.StreamResponse:
        nxt = local_path(h.param(request.query, "next", "/"))
        if not self.sessions.auth:
            return h.redirect(nxt, {})
        error = ""
        status = 200
        if request.method == "POST":
            if not same_origin(request.headers.get("Origin"), request.headers.get("Referer"),
                               request.host):
                return self._answer(Page("Refused", [h.p(
                    "Refused: the login form was not sent from the console's own page.")], 403),
                    None)
            form = await request.post()
            user, password = form.get("user"), form.get("password")
            if isinstance(user, str) and isinstance(password, str) and user and password:
                try:
                    session = await self.sessions.login(user[:h.MAX_PARAM_CHARS],
                                                        password[:h.MAX_PARAM_CHARS])
                except AuthenticationFailedError:
                    error, status = "Wrong user name or password.", 401
                except FerryMQError as exc:
                    error, status = f"The broker did not answer: {exc}", 502
                else:
                    resp = h.redirect(nxt, {})
                    self._set_cookie(resp, session)
                    return resp
            else:
                error, status = "Give a user name and a password.", 400
        body = [f'<p class="error">{esc(error)}</p>' if error else "",
                f'<form method="post" action="/login?{urlencode({"next": nxt})}" class="login">'
                '<label>User <input name="user" autocomplete="username" required '
                'maxlength="256"></label>'
                '<label>Password <input name="password" type="password" '
                'autocomplete="current-password" required maxlength="512"></label>'
                '<button>Log in</button></form>',
                h.p("A user of the broker's users file (ferrymq user add).")]
        return self._answer(Page("Log in", body, status), None)

    async def _logout(self, request: web.BaseRequest, session: ConsoleSession) -> web.Response:
        self.sessions.logout(session)
        resp = h.redirect("/login", {})
        resp.del_cookie(COOKIE, path="/")
        return resp

    # -- topics ------------------------------------------------------------------------------

    async def _topics(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        client = session.client
        internal = request.query.get("internal") == "1"
        page = h.page_number(request.query)
        names = sorted(t.name for t in await client.list_topics()
                       if internal or not t.name.startswith("%"))
        shown = names[page * self.rows:(page + 1) * self.rows]
        described = await asyncio.gather(*(client.describe_topic(n) for n in shown),
                                         return_exceptions=True)
        rows: list[list[object]] = []
        for name, d in zip(shown, described, strict=True):
            if isinstance(d, BaseException):
                if not isinstance(d, FerryMQError):
                    raise d
                rows.append([h.a("/topic", {"name": name}, name), "", "", "", "", "", esc(d)])
                continue
            ends = [q.end_offset for q in d.queues]
            rate = self._rate(name, ends)
            rows.append([h.a("/topic", {"name": name}, name), len(d.queues),
                         sum(q.end_offset - q.first_offset for q in d.queues), sum(ends),
                         h.byte_size(sum(q.size_bytes for q in d.queues)), d.scheduled_pending,
                         "" if rate is None else f"{sum(rate):.1f}"])
        conns = connection_states(self.srv)
        body = [
            Html(h.p(h.count(len(names), "topic")) if internal else
                 f'<p>{h.count(len(names), "topic")} (internal % topics hidden: '
                 f'{h.a("/", {"internal": "1"}, "show them")})</p>'),
            h.table(["topic", "queues", "messages", "end offsets (sum)", "size",
                    "delayed pending", "messages/s"], rows, cls="topics"),
            h.pager("/", {"internal": "1"} if internal else {}, page,
                   (page + 1) * self.rows < len(names)),
            "<h2>Connections</h2>",
            h.table(["state", "connections"], [[k, v] for k, v in conns.items()],
                   cls="connections"),
        ]
        return Page("Topics", body)

    def _rate(self, topic: str, ends: list[int]) -> list[float] | None:
        """Messages per second per queue since the topic was last viewed (None: first view)."""
        now = time.monotonic()
        prev = self._rates.get(topic)
        rate = None
        if prev is not None and len(prev[1]) == len(ends) and now > prev[0]:
            rate = [max(0, e - p) / (now - prev[0]) for e, p in zip(ends, prev[1], strict=True)]
        if prev is None or now - prev[0] >= RATE_MIN_INTERVAL_S:
            self._rates[topic] = (now, ends)
            self._rates.move_to_end(topic)
            while len(self._rates) > RATE_TOPICS:
                self._rates.popitem(last=False)
        return rate

    async def _topic(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        name = h.required(request.query, "name")
        d = await session.client.describe_topic(name)
        rate = self._rate(name, [q.end_offset for q in d.queues])
        page = h.page_number(request.query)
        rows = [[q.queue, q.first_offset, q.end_offset, q.end_offset - q.first_offset,
                 h.byte_size(q.size_bytes), q.segments, h.wall_time(q.last_append_ms),
                 "" if rate is None else f"{rate[q.queue]:.1f}"]
                for q in d.queues[page * self.rows:(page + 1) * self.rows]]
        body = [
            h.p(f"Topic id {d.topic_id}; {len(d.queues)} queues; "
               f"{d.scheduled_pending} delayed messages pending"
               + (f" (next due {h.wall_time(d.next_due_ms)})" if d.next_due_ms >= 0 else "")
               + (f"; dedup window {d.dedup_window_ms} ms, {d.dedup_keys} keys"
                  if d.dedup_window_ms else "")),
            h.table(["queue", "first offset", "end offset", "messages", "size", "segments",
                    "last append", "messages/s"], rows, cls="queues"),
            h.pager("/topic", {"name": name}, page, (page + 1) * self.rows < len(d.queues)),
            "<h2>Find by key</h2>",
            f'<form method="get" action="/key"><input type="hidden" name="topic" '
            f'value="{esc(name)}"><input name="key" placeholder="key" required maxlength="512">'
            f'<button>Find</button></form>',
        ]
        if d.config:
            body += ["<h2>Settings</h2>", h.table(["setting", "value"],
                                                 [[k, v] for k, v in sorted(d.config.items())])]
        return Page(f"Topic {name}", body)

    async def _key(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        topic, key = h.required(request.query, "topic"), h.required(request.query, "key")
        found = await session.client.find_by_key(topic, key, self.rows)
        rows = [[h.a("/message", {"id": x.msg_id}, x.msg_id), x.queue, x.offset,
                 h.wall_time(x.stored_ms), ", ".join(x.keys)] for x in found.messages]
        body = [h.p(f"Newest first, at most {self.rows}."
                   + (f" {found.unindexed} offsets are not indexed yet (not searched)."
                      if found.unindexed else "")),
                h.table(["message id", "queue", "offset", "stored", "keys"], rows, cls="found")]
        return Page(f"Key {key!r} in {topic}", body)

    async def _message(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        msg_id = h.required(request.query, "id")
        st = await session.client.message_status(msg_id)
        rows = [[h.a("/group", {"name": s.group}, s.group), s.state, s.member,
                 h.wall_time(s.lease_until_ms), s.reconsume_times, h.wall_time(s.next_attempt_ms), s.reason,
                 h.wall_time(s.at_ms)] for s in st.statuses]
        where = (f"Topic {st.topic}, queue {st.queue}, offset {st.offset}." if st.offset >= 0
                 else f"A half message of topic {st.topic} not committed yet.")
        body = [h.p(where), "<h2>Status per delivery group</h2>",
                h.table(["group", "state", "member", "lease until", "attempts",
                        "next attempt", "reason", "at"], rows, cls="statuses")
                if rows else h.p("No delivery group reads this topic.")]
        return Page(f"Message {msg_id}", body)

    # -- groups ------------------------------------------------------------------------------

    async def _groups(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        groups = await session.client.list_groups()
        page = h.page_number(request.query)
        rows = [[h.a("/group", {"name": g.group}, g.group),
                 "delivery" if g.state == DELIVERY_GROUP_STATE else "consumer",
                 "" if g.state == DELIVERY_GROUP_STATE else g.state, g.members]
                for g in groups[page * self.rows:(page + 1) * self.rows]]
        body = [h.p("Consumer groups are offset-based pull groups; delivery groups are push "
                   "and simple consumers (leases, retries, dead letters)."),
                h.table(["group", "kind", "state", "members"], rows, cls="groups"),
                h.pager("/groups", {}, page, (page + 1) * self.rows < len(groups))]
        return Page("Groups", body)

    async def _group(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        name = h.required(request.query, "name")
        client = session.client
        pull, push = await asyncio.gather(client.describe_group(name),
                                          client.describe_delivery(name),
                                          return_exceptions=True)
        body: list[str] = []
        for part in (pull, push):
            if isinstance(part, BaseException) and not isinstance(part, UnknownGroupError):
                raise part
        if isinstance(pull, GroupDescription) and (pull.members or pull.offsets
                                                   or not isinstance(push,
                                                                     DeliveryDescription)):
            body += await self._consumer_group(request, session, pull)
        if isinstance(push, DeliveryDescription):
            body += await self._delivery_group(session, push)
        if not body:
            return Page("No such group", [h.p(f"No group is named {name!r}.")], 404)
        return Page(f"Group {name}", body)

    async def _consumer_group(self, request: web.BaseRequest, session: ConsoleSession,
                              g: GroupDescription) -> list[str]:
        page = h.page_number(request.query)
        offsets = g.offsets[page * self.rows:(page + 1) * self.rows]
        # the oldest unconsumed message is lag messages before the end (also when nothing is
        # committed: the lag then counts from the queue's first offset, as `group describe`)
        ages = await self._lag_ages(session, [(o.topic, o.queue, o.end_offset - o.lag)
                                              for o in offsets if o.lag > 0])
        members = [[m.member_id, m.client_id, m.host,
                    ", ".join(f"{t}/{q}" for t, q in m.queues)] for m in g.members]
        rows = [[o.topic, o.queue, o.committed if o.committed >= 0 else "none", o.end_offset,
                 o.lag, ages.get((o.topic, o.queue), "")] for o in offsets]
        return [
            "<h2>Consumer group</h2>",
            h.p(f"State {g.state}, generation {g.generation}, {len(g.members)} members; "
               f"total lag {sum(o.lag for o in g.offsets)} messages."),
            "<h3>Members</h3>",
            h.table(["member", "client", "host", "queues"], members, cls="members")
            if members else h.p("No member online."),
            "<h3>Offsets and lag</h3>",
            h.table(["topic", "queue", "committed", "end offset", "lag (messages)",
                    "lag (age of the oldest unconsumed)"], rows, cls="lag"),
            h.pager("/group", {"name": g.group}, page, (page + 1) * self.rows < len(g.offsets)),
        ]

    async def _lag_ages(self, session: ConsoleSession, at: Sequence[tuple[str, int, int]]
                        ) -> dict[tuple[str, int], str]:
        """The age of the message at each ``(topic, queue, offset)`` (one FETCH each)."""
        if not at:
            return {}
        ids = {t.name: t.topic_id for t in await session.client.list_topics()}
        now = time.time() * 1000

        async def age(topic: str, queue: int, offset: int) -> str:
            if topic not in ids:
                return ""
            try:
                msg = await session.client.get_message(encode_msg_id(ids[topic], queue, offset))
            except (OffsetOutOfRangeError, UnknownTopicError, InvalidRequestError):
                return ""
            return h.duration(max(0.0, now - msg.stored_ms) / 1000)

        found = await asyncio.gather(*(age(*x) for x in at))
        return {(t, q): a for (t, q, _), a in zip(at, found, strict=True)}

    async def _delivery_group(self, session: ConsoleSession,
                              g: DeliveryDescription) -> list[str]:
        members = [[m.member_id, m.client_id, m.host, f"{m.last_heartbeat_ms_ago} ms ago",
                    m.in_flight] for m in g.members]
        lags = g.queue_lags()
        queues = [[q.topic, q.queue, q.acked_below, q.next_offset, q.end_offset, q.in_flight,
                   lag, "" if q.oldest_age_ms < 0 else h.duration(q.oldest_age_ms / 1000)]
                  for q, lag in zip(g.queues[:self.rows], lags, strict=False)]
        letters = await session.client.dlq_list(g.group, self.rows)
        out = [
            "<h2>Delivery group</h2>",
            h.p(f"{len(g.members)} members; lag {g.total_lag} messages; "
               f"{sum(q.in_flight for q in g.queues)} leased now; retries: {g.retry_pending} "
               f"waiting, {g.retry_in_flight} leased; {g.dlq_size} dead letters; retry delays "
               f"{', '.join(h.duration(d / 1000) for d in g.retry_delays_ms)}, at most "
               f"{g.max_reconsume} attempts" + ("; orderly" if g.orderly else "") + "."),
            "<h3>Members</h3>",
            h.table(["member", "client", "host", "last heartbeat", "leases"], members,
                   cls="members") if members else h.p("No member online."),
            "<h3>Queues</h3>",
            h.table(["topic", "queue", "acked below", "next offset", "end offset", "leased",
                    "lag", "oldest unacked"], queues, cls="queues"),
        ]
        if g.blocked:
            out += ["<h3>Blocked keys (orderly)</h3>", h.table(
                ["topic", "queue", "key", "message", "attempts", "since", "reason"],
                [[b.topic, b.queue, b.key, b.msg_id, b.attempts, h.wall_time(b.since_ms), b.reason]
                 for b in g.blocked])]
        out.append(f"<h3>Dead letters ({g.dlq_size})</h3>")
        if letters:
            out += [h.p(f"The oldest {len(letters)}:" if g.dlq_size > len(letters) else ""),
                    h.table(["dead-letter offset", "message", "topic", "queue", "attempts",
                            "reason", "dead since"],
                           [[h.a("/letter", {"group": g.group, "offset": x.dlq_offset},
                                x.dlq_offset), x.msg_id, x.topic, x.queue, x.attempts,
                             x.reason, h.wall_time(x.dead_ms)] for x in letters], cls="letters")]
        if g.dlq_size and session.admin:
            out.append('<div class="actions">' + "".join(
                h.form(f"/dlq/{what}", {"group": g.group, "count": str(count)}, label, session)
                for what, count, label in (("redrive", 1, "Redrive the oldest"),
                                           ("redrive", 0, "Redrive all"),
                                           ("purge", 1, "Purge the oldest"),
                                           ("purge", 0, "Purge all"))) + "</div>")
        elif not letters:
            out.append(h.p("None."))
        return out

    async def _letter(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        group = h.required(request.query, "group")
        offset = h.integer(request.query, "offset")
        letter = await session.client.dlq_at(group, offset)
        if letter is None:
            return Page("No such dead letter", [h.p(
                f"Group {group!r} has no dead letter at offset {offset} (redriven or purged?)."
            ), h.a("/group", {"name": group}, "Back to the group")], 404)
        return Page(f"Dead letter {offset} of {group}", self._letter_body(session, letter))

    def _letter_body(self, session: ConsoleSession, x: DeadLetter) -> list[str]:
        rows: list[list[object]] = [
                ["message id", h.a("/message", {"id": x.msg_id}, x.msg_id)],
                ["stored at", f"{x.topic} queue {x.queue} offset {x.offset}"],
                ["attempts", x.attempts], ["reason", x.reason],
                ["dead since", h.wall_time(x.dead_ms)], ["born", h.wall_time(x.born_ms)],
                ["tag", x.tag or ""], ["keys", ", ".join(x.keys)],
                ["sharding key", x.sharding_key or ""]]
        rows += [[f"property {k}", v] for k, v in sorted(x.properties.items())]
        out: list[str] = [h.table(["field", "value"], rows, cls="letter")]
        if session.admin:
            cap = self.srv.config.console_body_preview_bytes
            text = x.body[:cap].decode("utf-8", "replace")
            cut = (f" (first {cap} of {len(x.body)} bytes)" if len(x.body) > cap
                   else f" ({len(x.body)} bytes)")
            out += [f"<h2>Body{esc(cut)}</h2>", f'<pre class="body">{esc(text)}</pre>']
        else:
            out.append(h.p("The body is shown to admins only."))
        if session.admin:
            out.append('<div class="actions">' + "".join(
                h.form(f"/dlq/{what}", {"group": x.group, "offset": str(x.dlq_offset)}, label,
                       session)
                for what, label in (("redrive", "Redrive this letter"),
                                    ("purge", "Purge this letter"))) + "</div>")
        steps = [h.a("/letter", {"group": x.group, "offset": x.dlq_offset + d}, text)
                 for d, text in ((-1, "« previous letter"), (1, "next letter »"))
                 if x.dlq_offset + d >= 0]
        out.append(f'<p class="pager">{" ".join(steps)} '
                   f'{h.a("/group", {"name": x.group}, "Back to the group")}</p>')
        return out

    async def _dlq_write(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        what = request.path.rsplit("/", 1)[1]
        form = await request.post()
        group = h.required(form, "group")
        if "offset" in form:
            return await self._dlq_write_one(request, session, what, group,
                                             h.integer(form, "offset"),
                                             confirmed=form.get("confirm") == "yes")
        count = h.integer(form, "count")
        if count < 0:
            raise BadParam("count must be >= 0 (0: all)")
        client = session.client
        act = client.dlq_redrive if what == "redrive" else client.dlq_purge
        verb = "Redrive" if what == "redrive" else "Purge"
        if form.get("confirm") != "yes":
            dry = await act(group, count, dry_run=True)
            n = dry.count
            if n == 0:
                return Page(f"{verb} dead letters of {group}", [
                    h.p("There is no dead letter to " + what + "."),
                    h.a("/group", {"name": group}, "Back to the group")])
            effect = ("delivered again to the group, with a fresh attempt count"
                      if what == "redrive" else "deleted for good")
            return Page(f"{verb} dead letters of {group}?", [
                h.p(f"{n} dead letter{'s' if n != 1 else ''} (offsets {dry.first}.."
                   f"{dry.first + n - 1}) will be {effect}."),
                '<div class="actions">',
                h.form(request.path, {"group": group, "count": str(count), "confirm": "yes"},
                      f"Yes, {what} {n}", session, cls="confirm"),
                str(h.a("/group", {"name": group}, "Cancel")), "</div>"])
        done = await act(group, count)
        return Page(f"{verb} done", [
            h.p(f"{'Redrove' if what == 'redrive' else 'Purged'} {done.count} dead letter"
               f"{'s' if done.count != 1 else ''} of {group}."),
            h.a("/group", {"name": group}, "Back to the group")])

    async def _dlq_write_one(self, request: web.BaseRequest, session: ConsoleSession,
                             what: str, group: str, offset: int, *,
                             confirmed: bool) -> Page:
        """Redrive or purge the one dead letter at ``offset`` (the letter page's buttons):
        the same dry run, confirm step and CSRF check as the group's buttons."""
        if not 0 <= offset <= MAX_DLQ_OFFSET:
            raise BadParam(f"offset must be 0..{MAX_DLQ_OFFSET} (a dead letter's offset)")
        client = session.client
        act = client.dlq_redrive if what == "redrive" else client.dlq_purge
        verb = "Redrive" if what == "redrive" else "Purge"
        back = h.a("/group", {"name": group}, "Back to the group")
        if not confirmed:
            await act(group, dry_run=True, offset=offset)  # refused if it is no live letter
            letter = await client.dlq_at(group, offset)
            about = f" (message {letter.msg_id} of {letter.topic})" if letter is not None else ""
            effect = ("delivered again to the group, with a fresh attempt count"
                      if what == "redrive" else "deleted for good")
            return Page(f"{verb} dead letter {offset} of {group}?", [
                h.p(f"The dead letter at offset {offset}{about} will be {effect}; the other "
                    "dead letters stay."),
                '<div class="actions">',
                h.form(request.path, {"group": group, "offset": str(offset), "confirm": "yes"},
                       f"Yes, {what} it", session, cls="confirm"),
                str(h.a("/letter", {"group": group, "offset": offset}, "Cancel")), "</div>"])
        await act(group, offset=offset)
        return Page(f"{verb} done", [
            h.p(f"{'Redrove' if what == 'redrive' else 'Purged'} the dead letter at offset "
                f"{offset} of {group}."), back])

    # -- cluster -----------------------------------------------------------------------------

    async def _cluster(self, request: web.BaseRequest, session: ConsoleSession) -> Page:
        c = await session.client.cluster_describe()
        page = h.page_number(request.query)
        brokers = [[b.broker_id, b.address, "yes" if b.alive else "no",
                    "controller" if b.broker_id == c.controller else ""] for b in c.brokers]
        queues = [[q.topic, q.queue, q.leader if q.leader >= 0 else "none", q.leader_epoch,
                   ", ".join(map(str, q.replicas)), ", ".join(map(str, q.isr)),
                   "offline" if q.offline else "under-replicated" if q.under_replicated else ""]
                  for q in c.queues[page * self.rows:(page + 1) * self.rows]]
        body = [h.p(f"Cluster {c.cluster!r}: {len(c.brokers)} brokers, {len(c.offline)} queues "
                   f"offline, {len(c.under_replicated)} under-replicated." if c.cluster else
                   "A single broker (not in a cluster): it leads every queue."),
                "<h2>Brokers</h2>",
                h.table(["broker", "address", "alive", ""], brokers, cls="brokers"),
                "<h2>Queues (offline and under-replicated first)</h2>",
                h.table(["topic", "queue", "leader", "epoch", "replicas", "in-sync replicas",
                        ""], queues, cls="replication"),
                h.pager("/cluster", {}, page, (page + 1) * self.rows < len(c.queues))]
        return Page("Cluster", body)
