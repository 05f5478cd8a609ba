"""A connection's authentication deadline, shared by the native connection
(:mod:`ferrymq.broker.connection`) and the Kafka one (:mod:`ferrymq.kafka.listener`): a
connection not yet authenticated is closed after ``auth_timeout_ms`` (slow-loris), and a
successful handshake records the user, lifts the connection's pre-authentication limits and
ends the deadline."""

from __future__ import annotations

import asyncio

from ferrymq.protocol.codes import ErrorCode


class AuthDeadline:
    """Mixin for a client connection; the connection supplies :meth:`fail` and
    :meth:`_lift_pre_auth_limits`."""

    authenticated: bool
    principal: str | None
    closed: bool
    _auth_timer: asyncio.TimerHandle | None = None
    _auth_timeout_ms = 0

    def fail(self, code: ErrorCode, message: str) -> None:
        """Close the connection with a logged reason."""
        raise NotImplementedError

    def _lift_pre_auth_limits(self) -> None:
        """Raise the connection's limits to an authenticated one's (the frame size)."""
        raise NotImplementedError

    def start_auth_deadline(self, timeout_ms: int) -> None:
        """Close the connection if it has not authenticated within ``timeout_ms``."""
        self._auth_timeout_ms = timeout_ms
        self._auth_timer = asyncio.get_running_loop().call_later(timeout_ms / 1000,
                                                                 self._auth_timed_out)

    def cancel_auth_deadline(self) -> None:
        """No deadline any more (authenticated, or the connection is gone)."""
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None

    def authenticated_as(self, user: str) -> None:
        """The handshake succeeded: lift the pre-auth limits."""
        self.authenticated = True
        self.principal = user
        self._lift_pre_auth_limits()
        self.cancel_auth_deadline()

    def _auth_timed_out(self) -> None:
        self._auth_timer = None
        if not self.authenticated and not self.closed:
            self.fail(ErrorCode.AUTHENTICATION_REQUIRED,
                      f"not authenticated within auth_timeout_ms={self._auth_timeout_ms}")
