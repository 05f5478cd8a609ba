"""The web console's login sessions and CSRF protection.

Theory of operation
-------------------
The console asks the broker through its own wire port, as the user logged in to the console
(:mod:`ferrymq.ops.console`), so a login is a wire login: :meth:`SessionStore.login` opens an
:class:`~ferrymq.client.admin.AsyncAdminClient` with the user's name and password and asks
WHOAMI. A wrong password is refused by the wire's SCRAM after ``auth_failure_delay_ms``, exactly
as for the CLI, and counted in ``ferrymq_authentication_failures_total``. The client, with its
one connection, is the session: it is closed when the session ends (logout, expiry after
``console_session_timeout_ms`` unused, or eviction when ``console_max_sessions`` are open). The
password lives only in that client's memory, never in a cookie or on disk.

With authentication off (no ``users_file``) there is no login: the first page opens an
anonymous session over one shared client (the wire then treats everyone as an admin, as it
does for the CLI).

The session id is 256 random bits in a cookie that is ``HttpOnly`` (no script reads it) and
``SameSite=Strict`` (no other site's page sends it). Every form that writes carries the
session's CSRF token, also 256 random bits, which :meth:`ConsoleSession.check_csrf` compares in
constant time; the console also checks the ``Origin`` header (:func:`same_origin`).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ferrymq.client.admin import AsyncAdminClient

__all__ = ["COOKIE", "ConsoleSession", "SessionStore", "local_path", "same_origin"]

COOKIE = "ferrymq_console"
"""Name of the session cookie."""

ClientFactory = Callable[[tuple[str, str] | None], AsyncAdminClient]
"""Opens an admin client to the broker's wire port, as a user (None: without login)."""


@dataclass(slots=True, eq=False)
class ConsoleSession:
    """One browser's session: who, its admin client, its CSRF token, when last used."""

    user: str
    """The users-file user ("" with authentication off)."""
    client: AsyncAdminClient
    admin: bool
    """The user has admin rights (from WHOAMI at login); the wire checks them again."""
    shared: bool = False
    """``client`` is the store's shared anonymous client (not closed with the session)."""
    sid: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    last_used: float = field(default_factory=time.monotonic)

    def check_csrf(self, token: str) -> bool:
        """True when ``token`` is this session's CSRF token (compared in constant time)."""
        return hmac.compare_digest(token.encode(), self.csrf.encode())


class SessionStore:
    """The console's sessions, bounded in number and in idle time (see the module docstring).

    Args:
        open_client: opens an admin client as a user.
        auth: the broker has authentication on (a login is needed).
        timeout_s: a session unused this long expires.
        max_sessions: most sessions at once (the one unused the longest ends first).
    """

    def __init__(self, open_client: ClientFactory, *, auth: bool, timeout_s: float,
                 max_sessions: int) -> None:
        self._open = open_client
        self.auth = auth
        self.timeout_s = timeout_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()
        self._shared: AsyncAdminClient | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, sid: str | None) -> ConsoleSession | None:
        """The live session of cookie value ``sid`` (its use noted), or None."""
        self._expire()
        if not sid:
            return None
        s = self._sessions.get(sid)
        if s is None:
            return None
        s.last_used = time.monotonic()
        self._sessions.move_to_end(sid)
        return s

    async def login(self, user: str, password: str) -> ConsoleSession:
        """A new session for ``user``, after the wire accepted the password.

        Raises:
            AuthenticationFailedError: wrong user or password (after the broker's
                ``auth_failure_delay_ms``).
            FerryMQError: the broker could not be reached.
        """
        client = self._open((user, password))
        try:
            who = await client.whoami()
        except BaseException:
            await client.close()
            raise
        return self._add(ConsoleSession(who.user or user, client, who.admin))

    async def anonymous(self) -> ConsoleSession:
        """A new session without login (authentication off), over the shared client.

        Raises:
            FerryMQError: the broker could not be reached.
        """
        assert not self.auth
        if self._shared is None:
            self._shared = self._open(None)
        who = await self._shared.whoami()
        return self._add(ConsoleSession("", self._shared, who.admin, shared=True))

    def logout(self, session: ConsoleSession) -> None:
        """End ``session`` (its client is closed in the background)."""
        if self._sessions.pop(session.sid, None) is not None:
            self._end(session)

    async def close(self) -> None:
        """End every session and close every client."""
        for s in list(self._sessions.values()):
            self.logout(s)
        if self._shared is not None:
            await self._shared.close()
            self._shared = None
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _add(self, session: ConsoleSession) -> ConsoleSession:
        self._expire()
        while len(self._sessions) >= self.max_sessions:
            _, oldest = self._sessions.popitem(last=False)
            self._end(oldest)
        self._sessions[session.sid] = session
        return session

    def _expire(self) -> None:
        deadline = time.monotonic() - self.timeout_s
        while self._sessions:
            s = next(iter(self._sessions.values()))
            if s.last_used > deadline:
                break
            del self._sessions[s.sid]
            self._end(s)

    def _end(self, session: ConsoleSession) -> None:
        if session.shared:
            return
        task = asyncio.get_running_loop().create_task(session.client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def same_origin(origin: str | None, referer: str | None, host: str | None) -> bool:
    """True when a write comes from a page of this listener: its ``Origin`` header (or, from
    a browser that sends none, its ``Referer``) names the host and port of ``Host``. Neither
    header: refused (every browser sends ``Origin`` with a form's POST)."""
    source = origin if origin and origin != "null" else referer
    if not source or not host:
        return False
    parts = urlsplit(source)
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()


def local_path(target: str) -> str:
    """``target`` when it is a path of this console (where a login may send the browser on),
    else ``/``: no open redirect to another site (``//host``, ``/\\host``, ``http:...``)."""
    if (not target.startswith("/") or target.startswith("//") or "\\" in target
            or any(ord(ch) < 0x20 for ch in target)):
        return "/"
    return target
