"""AUTH_START, AUTH_FINISH, WHOAMI: a connection's side of the SCRAM handshake.

The handshake's state lives on the connection (``conn.scram`` between AUTH_START and
AUTH_FINISH); :class:`~ferrymq.broker.auth.Authenticator` checks it. Any failure is answered
after ``auth_failure_delay_ms`` with AUTHENTICATION_FAILED, and the connection reads nothing more
(:mod:`ferrymq.broker.connection` closes it after the answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ferrymq._hints import AUTH_OFF
from ferrymq.errors import AuthenticationFailedError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.broker.auth import Authenticator
    from ferrymq.broker.context import ClientConnection


B = TypeVar("B", bound=m.Body)


def _step(conn: ClientConnection, user: str,
          step: Callable[[Authenticator], B]) -> B | asyncio.Future[m.Body]:
    """Run one step of the handshake on a connection not yet authenticated; a failure of the
    step is answered AUTHENTICATION_FAILED after the failure delay, and nothing more is read."""
    auth = conn.server.auth
    if auth is None:
        raise AuthenticationFailedError(
            f"authentication is off on this broker (no users_file); {AUTH_OFF}")
    if conn.authenticated:
        raise AuthenticationFailedError("this connection is authenticated already")
    try:
        return step(auth)
    except AuthenticationFailedError as exc:
        auth.failed(conn, user, str(exc))
        conn.stop_reading()
        return _fail_later(exc, auth.failure_delay_s)


def _fail_later(exc: AuthenticationFailedError, delay_s: float) -> asyncio.Future[m.Body]:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[m.Body] = loop.create_future()

    def fail() -> None:
        if not fut.done():
            fut.set_exception(exc)

    loop.call_later(delay_s, fail)
    return fut


def auth_start(conn: ClientConnection, req: m.AuthStartRequest
               ) -> m.AuthStartResponse | asyncio.Future[m.Body]:
    """AUTH_START: the challenge, or a delayed AUTHENTICATION_FAILED."""
    return _step(conn, req.user, lambda auth: auth.start(conn, req))


def auth_finish(conn: ClientConnection, req: m.AuthFinishRequest
                ) -> m.AuthFinishResponse | asyncio.Future[m.Body]:
    """AUTH_FINISH: the server signature, or a delayed AUTHENTICATION_FAILED."""
    user = conn.scram.user if conn.scram is not None else ""  # finish() forgets the handshake
    return _step(conn, user, lambda auth: auth.finish(conn, req))


def whoami(conn: ClientConnection, req: m.WhoAmIRequest) -> m.WhoAmIResponse:
    """WHOAMI: the principal and its rights (everything when authentication is off)."""
    if conn.principal is None:
        return m.WhoAmIResponse("", True, ["*"], ["*"], ["*"])
    auth = conn.server.auth
    user = auth.store.get(conn.principal) if auth is not None else None
    if user is None:
        return m.WhoAmIResponse(conn.principal, False, [], [], [])
    return m.WhoAmIResponse(user.name, user.admin, list(user.produce), list(user.consume),
                            list(user.groups))
