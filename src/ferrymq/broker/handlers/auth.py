"""AUTH_START, AUTH_FINISH, WHOAMI: a connection's side of the SCRAM handshake.

The handshake's state lives on the connection (``conn.scram`` between AUTH_START and
AUTH_FINISH); :class:`~ferrymq.broker.auth.Authenticator` checks it. Any failure is answered
after ``auth_failure_delay_ms`` with AUTHENTICATION_FAILED, and the connection reads nothing more
(:mod:`ferrymq.broker.connection` closes it after the answer).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ferrymq._hints import AUTH_OFF
from ferrymq.errors import AuthenticationFailedError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection


def _delayed_failure(conn: ClientConnection, exc: AuthenticationFailedError,
                     user: str) -> asyncio.Future[m.Body]:
    auth = conn.server.auth
    assert auth is not None
    auth.failed(conn, user, str(exc))
    conn.stop_reading()
    fut: asyncio.Future[m.Body] = asyncio.get_running_loop().create_future()

    def fail() -> None:
        if not fut.done():
            fut.set_exception(exc)

    asyncio.get_running_loop().call_later(auth.failure_delay_s, fail)
    return fut


def _not_enabled() -> AuthenticationFailedError:
    return AuthenticationFailedError(
        f"authentication is off on this broker (no users_file); {AUTH_OFF}")


def auth_start(conn: ClientConnection, req: m.AuthStartRequest
               ) -> m.AuthStartResponse | asyncio.Future[m.Body]:
    """AUTH_START: the challenge, or a delayed AUTHENTICATION_FAILED."""
    auth = conn.server.auth
    if auth is None:
        raise _not_enabled()
    if conn.authenticated:
        raise AuthenticationFailedError("this connection is authenticated already")
    try:
        return auth.start(conn, req)
    except AuthenticationFailedError as exc:
        return _delayed_failure(conn, exc, req.user)


def auth_finish(conn: ClientConnection, req: m.AuthFinishRequest
                ) -> m.AuthFinishResponse | asyncio.Future[m.Body]:
    """AUTH_FINISH: the server signature, or a delayed AUTHENTICATION_FAILED."""
    auth = conn.server.auth
    if auth is None:
        raise _not_enabled()
    if conn.authenticated:
        raise AuthenticationFailedError("this connection is authenticated already")
    user = conn.scram.user if conn.scram is not None else ""
    try:
        return auth.finish(conn, req)
    except AuthenticationFailedError as exc:
        return _delayed_failure(conn, exc, user)


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
