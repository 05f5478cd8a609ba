"""The web console's HTML building blocks: escaping, paragraphs, links, forms, tables, pagers,
and the reading of query and form values (:mod:`ferrymq.ops.console` builds its pages with them).

Every value goes through :func:`esc` unless it is :class:`Html` written here; a page is a list
of such pieces (:class:`Page`). Query and form values are text of at most ``MAX_PARAM_CHARS``;
anything else raises :class:`BadParam`, answered 400.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from aiohttp import web

from ferrymq.errors import (
    AccessDeniedError,
    BrokerError,
    ClientError,
    FerryMQError,
    UnknownGroupError,
    UnknownTopicError,
)

if TYPE_CHECKING:
    from ferrymq.ops.console_auth import ConsoleSession

__all__ = ["MAX_PARAM_CHARS", "BadParam", "Html", "Page", "a", "byte_size", "count", "duration",
           "error_page", "esc", "form", "integer", "p", "page_number", "pager", "param",
           "redirect", "required", "table", "wall_time"]

MAX_PARAM_CHARS = 512
"""Longest query or form value accepted (a topic or group name, a key, an id)."""


class Html(str):
    """Markup written by the console itself (not escaped again)."""

    __slots__ = ()


def esc(value: object) -> Html:
    """``value`` as escaped HTML text."""
    return value if isinstance(value, Html) else Html(html.escape(str(value)))


class Page:
    """A page to answer: its title, its HTML body and status."""

    def __init__(self, title: str, body: Iterable[str], status: int = 200) -> None:
        self.title = title
        self.body = Html("".join(body))
        self.status = status


class BadParam(ValueError):
    """A query or form value is missing or wrong (answered 400 with this message)."""


def p(text: object) -> Html:
    """A paragraph of escaped text."""
    return Html(f"<p>{esc(text)}</p>")


def a(path: str, params: dict[str, object], text: object) -> Html:
    """A link to ``path`` with ``params`` as its query."""
    query = ("?" + urlencode({k: str(v) for k, v in params.items()})) if params else ""
    return Html(f'<a href="{esc(path + query)}">{esc(text)}</a>')


def form(action: str, fields: dict[str, str], button: str, session: ConsoleSession,
          cls: str = "") -> Html:
    """A POST form of hidden ``fields`` and the session's CSRF token, sent by one button."""
    hidden = "".join(f'<input type="hidden" name="{esc(k)}" value="{esc(v)}">'
                     for k, v in {**fields, "csrf": session.csrf}.items())
    return Html(f'<form method="post" action="{esc(action)}" class="{esc(cls)}">{hidden}'
                f'<button>{esc(button)}</button></form>')


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], cls: str = "") -> Html:
    """A table; cells are escaped unless :class:`Html`."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return Html(f'<table class="{esc(cls)}"><thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table>")


def pager(path: str, params: dict[str, object], page: int, more: bool) -> Html:
    """Links to the previous and next page (``more``: a next page exists)."""
    links = []
    if page > 0:
        links.append(a(path, {**params, "page": page - 1}, "« previous"))
    if more:
        links.append(a(path, {**params, "page": page + 1}, "next »"))
    return Html(f'<p class="pager">{" ".join(links)}</p>' if links else "")


def redirect(path: str, params: dict[str, str]) -> web.Response:
    """A 303 to ``path`` (a GET after a POST)."""
    resp = web.Response(status=303)
    resp.headers["Location"] = path + (("?" + urlencode(params)) if params else "")
    return resp


def error_page(exc: FerryMQError) -> Page:
    """The page of a refused or failed admin request, its status by the error's kind."""
    status = (403 if isinstance(exc, AccessDeniedError) else
              404 if isinstance(exc, UnknownGroupError | UnknownTopicError) else
              400 if isinstance(exc, BrokerError) else
              502 if isinstance(exc, ClientError) else 500)
    return Page("Refused" if status == 403 else "Error", [p(
        f"{type(exc).__name__}: {exc}")], status)


def count(n: int, noun: str) -> str:
    """``n noun`` with the plural's s."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def wall_time(ms: int) -> str:
    """Wall ms as a UTC time ('' for -1: none)."""
    if ms < 0:
        return ""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(s: float) -> str:
    """Seconds as s, min or h."""
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def byte_size(n: int) -> str:
    """Bytes as B, KiB, MiB or GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def param(params: Mapping[str, object], key: str, default: str) -> str:
    """The text value ``key`` (``default`` when absent)."""
    value = params.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or len(value) > MAX_PARAM_CHARS:
        raise BadParam(f"{key} must be text of at most {MAX_PARAM_CHARS} characters")
    return value


def required(params: Mapping[str, object], key: str) -> str:
    """The text value ``key``, which must be given and not empty."""
    value = param(params, key, "")
    if not value:
        raise BadParam(f"missing parameter: {key}")
    return value


def integer(params: Mapping[str, object], key: str) -> int:
    """The integer value ``key``."""
    text = required(params, key)
    try:
        return int(text)
    except ValueError:
        raise BadParam(f"{key} must be an integer, not {text[:40]!r}") from None


def page_number(params: Mapping[str, object]) -> int:
    """The ``page`` value (0 when absent)."""
    text = param(params, "page", "0")
    if not text.isdigit() or len(text) > 9:
        raise BadParam(f"page must be a page number (0, 1, ...), not {text[:40]!r}")
    return int(text)
