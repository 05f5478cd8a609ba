"""A client's link to the broker: connect, handshake, reconnect with backoff, keepalive, metadata.

Theory of operation
-------------------
:class:`Session` hands out the current :class:`Transport`, opening a new one (HELLO handshake
included) when there is none or the last one died. Connection attempts go round the server list
with jittered exponential backoff, each attempt bounded by ``connect_timeout_s``, within a budget:

* the *first* connection of a client gets ``connect_timeout_s`` (default 5 s) in all: a wrong
  address fails fast with ``ConnectionClosedError("cannot connect to HOST:PORT (connection
  refused) within 5 s (connect_timeout_s)")``, naming every address tried and why it failed
  (connection refused, timed out, name not resolved, ...);
* once a client was connected, a lost connection is an *outage*: reconnecting gets
  ``reconnect_timeout_s`` (the seeds' 断线重连), logs one warning when the outage starts and one
  info line when it ends, however many attempts it takes (attempts are logged at DEBUG).

Requests that are safe to repeat (reads, metadata, commits, idempotent produce batches) are
retried across reconnects by their callers through :meth:`Session.request`; the producer and
consumer build on it. A connection that could not be opened within its budget fails the request
at once (the budget was the retrying).

A keepalive task pings an idle connection every ``keepalive_s``; a ping without an answer within
``request_timeout_s`` closes the connection so that the next request reconnects.

Every new connection starts with the handshake of :class:`~ferrymq.protocol.client.
ClientHandshake` (HELLO, then SCRAM with ``auth=``), each step sent as an ordinary request.

Security: with ``auth=(user, secret)`` every new connection authenticates right after HELLO
(SCRAM-SHA-256 style, :mod:`ferrymq.protocol.auth`: the secret never crosses the wire, and the
broker's signature is checked, so a broker that does not know the user's keys is refused). An
authentication failure is not retried: it raises
:class:`~ferrymq.errors.AuthenticationFailedError` at once. ``tls=`` (see
:data:`~ferrymq._connect.TLSOption`) wraps every connection in TLS; a failed TLS
handshake (wrong port, untrusted certificate) is not retried either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

from ferrymq._connect import REFUSED, TIMED_OUT, client_tls_context, connect_failure
from ferrymq._connect import TLSOption as TLSOption
from ferrymq._connect import parse_servers as parse_servers
from ferrymq._hints import CONNECT_TIMEOUT, RECONNECT_TIMEOUT, TLS_NEEDED
from ferrymq._version import __version__
from ferrymq.client._transport import Transport
from ferrymq.client.retry import Backoff, refused_before_effect
from ferrymq.errors import (
    BrokerError,
    ConfigError,
    ConnectionClosedError,
    FerryMQTimeoutError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import NONCE_BYTES, check_user_name
from ferrymq.protocol.client import ClientHandshake, HandshakeStep
from ferrymq.protocol.codes import ErrorCode

log = logging.getLogger("ferrymq.client")
B = TypeVar("B", bound=m.Body)

MIN_ATTEMPT_S = 0.05
"""A connection attempt is not started with less of its budget left than this: it could only
time out (and a refused port would be reported as timed out)."""

Auth = tuple[str, str]
"""``(user, secret)`` -- the seeds' (app key, app secret)."""


def check_auth(auth: object) -> Auth | None:
    """Validate the clients' ``auth=`` option.

    Raises:
        ConfigError: not a (user, secret) pair of strings, a bad user name or an empty secret.
    """
    if auth is None:
        return None
    if (not isinstance(auth, tuple | list) or len(auth) != 2
            or not all(isinstance(x, str) for x in auth)):
        raise ConfigError("auth= must be a (user, secret) pair of strings")
    user, secret = auth
    try:
        check_user_name(user)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not secret:
        raise ConfigError("auth=: the secret must not be empty")
    return user, secret


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """What a client knows of a topic."""

    name: str
    topic_id: int
    queues: int
    dedup_window_ms: int = 0
    """The topic's dedup window (0: none): dedup-keyed messages go in dedup batches only then."""


def _topic_error(code: int, name: str) -> BrokerError:
    what = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
    return error_for_code(code, f"{what.lower().replace('_', ' ')}: {name!r}")


def _addresses(addresses: list[tuple[str, int]]) -> str:
    return ", ".join(f"{h}:{p}" for h, p in addresses)


class Session:
    """Connection management shared by every client type.

    Args:
        servers: ``"host:port"`` (or several, comma separated, or a list).
        connect_timeout_s: the first connection's budget (every address tried, backoff
            included), and the longest single attempt later.
        reconnect_timeout_s: after a connection was lost, how long to keep trying to reconnect
            before the request waiting for it fails.
        request_timeout_s: a request's deadline (:meth:`request`).
        give_up_when_refused: fail at the first refused attempt instead of retrying for
            ``connect_timeout_s`` / ``reconnect_timeout_s`` (a cluster client's session to one
            leader: a refused port means that broker is down, and the others know who leads
            now).
    """

    def __init__(
        self,
        servers: str | list[str] | tuple[str, ...],
        *,
        client_id: str = "ferrymq-python",
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = 30.0,
        reconnect_timeout_s: float = 60.0,
        keepalive_s: float = 30.0,
        backoff: Backoff | None = None,
        auth: Auth | None = None,
        tls: TLSOption = None,
        give_up_when_refused: bool = False,
    ) -> None:
        if connect_timeout_s <= 0 or reconnect_timeout_s <= 0:
            raise ConfigError("connect_timeout_s and reconnect_timeout_s must be > 0")
        self.addresses = parse_servers(servers)
        self._auth = check_auth(auth)
        self._tls: ssl.SSLContext | None = client_tls_context(tls)
        self.user: str | None = None
        """The user this session authenticated as (None without ``auth=``)."""
        self.client_id = client_id
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.give_up_when_refused = give_up_when_refused
        self.keepalive_s = keepalive_s
        self.backoff = backoff or Backoff()
        self.hello: m.HelloResponse | None = None
        self._conn: Transport | None = None
        self._connecting: asyncio.Future[Transport] | None = None
        self._next_addr = 0
        self._outage_since: float | None = None  # loop time the current outage began
        self._closed = False
        self._keepalive: asyncio.Task[None] | None = None
        self.topics: dict[str, TopicInfo] = {}
        self.reconnects = 0

    def for_broker(self, host: str, port: int) -> Session:
        """A new session to the one broker at ``host:port`` with this session's options
        (credentials, TLS, timeouts, backoff), except that a lost connection is given up
        after ``connect_timeout_s`` instead of ``reconnect_timeout_s``, and at once when the
        port refuses it: a cluster client whose leader is gone asks the others who leads now
        rather than wait for it (:mod:`ferrymq.client._cluster`)."""
        return Session([f"{host}:{port}"], client_id=self.client_id,
                       connect_timeout_s=self.connect_timeout_s,
                       request_timeout_s=self.request_timeout_s,
                       reconnect_timeout_s=self.connect_timeout_s, keepalive_s=self.keepalive_s,
                       backoff=self.backoff, auth=self._auth, tls=self._tls,
                       give_up_when_refused=True)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def open_connection(self) -> Transport | None:
        """The connection if it is open now (None: :meth:`connection` would have to connect)."""
        conn = self._conn
        return conn if conn is not None and conn.is_open else None

    async def connection(self) -> Transport:
        """The open connection, connecting (with backoff) if needed.

        Raises:
            ConnectionClosedError: no broker answered within ``connect_timeout_s`` (the first
                connection) or ``reconnect_timeout_s`` (after a lost one); the message names
                every address tried and why it failed.
            AuthenticationFailedError: the broker refused the credentials (not retried).
        """
        conn = self._conn
        if conn is not None and conn.is_open:
            return conn
        if self._closed:
            raise ConnectionClosedError("client is closed")
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
            # its callers may all be gone (cancelled) when it fails: its error is theirs, not
            # an unretrieved task's
            self._connecting.add_done_callback(_seen)
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> Transport:
        loop = asyncio.get_running_loop()
        first = self.hello is None
        budget_name = CONNECT_TIMEOUT if first else RECONNECT_TIMEOUT
        budget = self.connect_timeout_s if first else self.reconnect_timeout_s
        deadline = loop.time() + budget
        if not first and self._outage_since is None:
            self._outage_since = loop.time()
            lost = self._conn
            log.warning("lost the connection to the broker (%s); reconnecting to %s for up to "
                        "reconnect_timeout_s=%g s", lost.close_reason if lost else "not open",
                        _addresses(self.addresses), budget)
        failures: dict[tuple[str, int], str] = {}
        attempt = 0
        while not self._closed:
            host, port = addr = self.addresses[self._next_addr % len(self.addresses)]
            # every address gets its turn within the budget, none more than connect_timeout_s
            untried = max(1, len(self.addresses) - len(failures))
            timeout = min(self.connect_timeout_s, max(deadline - loop.time(), 0.0) / untried)
            result = await self._attempt(host, port, max(timeout, 0.001))
            if isinstance(result, str):
                if result != TIMED_OUT or timeout >= self.connect_timeout_s or addr not in failures:
                    failures[addr] = result  # (an attempt the budget cut short says less)
                log.debug("connecting to %s:%d failed: %s", host, port, result)
                self._next_addr += 1
                attempt += 1
                if result == REFUSED and self.give_up_when_refused:
                    raise ConnectionClosedError(
                        f"cannot {'connect' if first else 'reconnect'} to {host}:{port} "
                        f"({result}): that broker is down")
                if loop.time() >= deadline:
                    break
                await asyncio.sleep(min(self.backoff.delay(attempt), max(0.0, deadline - loop.time())))
                if deadline - loop.time() < MIN_ATTEMPT_S:
                    break
                continue
            conn = result
            if self._outage_since is not None:
                self.reconnects += 1
                log.info("reconnected to %s:%d after %.1f s", host, port,
                         loop.time() - self._outage_since)
                self._outage_since = None
            self._conn = conn
            if self._keepalive is None or self._keepalive.done():
                self._keepalive = loop.create_task(self._keepalive_loop())
            return conn
        if not failures:
            raise ConnectionClosedError("client is closed")
        tried = ", ".join(f"{h}:{p} ({why})" for (h, p), why in failures.items())
        raise ConnectionClosedError(
            f"cannot {'connect' if first else 'reconnect'} to {tried} within {budget:g} s "
            f"{budget_name}")

    async def _attempt(self, host: str, port: int, timeout_s: float) -> Transport | str:
        """One connection attempt, handshake included: the open connection (``self.hello`` set),
        or why it failed when another attempt may succeed.

        Raises:
            ConnectionClosedError: a TLS handshake failed (retrying cannot help).
            AuthenticationFailedError, BrokerError: the broker refused us.
        """
        try:
            conn = await Transport.connect(host, port, timeout_s, self._tls)
        except ConnectionClosedError as exc:
            if isinstance(exc.__cause__, ssl.SSLError):
                raise  # a TLS mismatch or an untrusted certificate: retrying cannot help
            return connect_failure(exc.__cause__ or exc)
        auth = self._auth
        handshake = ClientHandshake(self.client_id, __version__, auth,
                                    None if auth is None else secrets.token_bytes(NONCE_BYTES))
        try:
            while (req := handshake.next_request()) is not None:
                # HELLO gets this attempt's time; each authentication step connect_timeout_s
                step_timeout = (timeout_s if handshake.step is HandshakeStep.HELLO
                                else self.connect_timeout_s)
                handshake.receive(await conn.request(req, req.RESPONSE, step_timeout))
        except ConnectionClosedError as exc:
            conn.close()
            hint = "" if self._tls is not None else f" (if the broker's port is TLS, {TLS_NEEDED})"
            return f"closed during the handshake: {exc}{hint}"
        except FerryMQTimeoutError:
            conn.close()
            return f"no answer to the handshake within {timeout_s:.3g} s"
        except BaseException:
            conn.close()
            raise
        self.hello = handshake.hello
        if handshake.user is not None:
            self.user = handshake.user
        return conn

    async def _keepalive_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.keepalive_s)
            conn = self._conn
            if conn is None or not conn.is_open or conn.in_flight:
                continue
            try:
                await conn.request(m.PingRequest(), m.Empty, self.request_timeout_s)
            except (ConnectionClosedError, FerryMQTimeoutError, BrokerError) as exc:
                conn.close(f"keepalive ping failed: {exc}")

    async def request(
        self,
        req: m.Request,
        resp_type: type[B],
        *,
        timeout_s: float | None = None,
        retry: bool = True,
        retry_codes: frozenset[int] | None = None,
    ) -> B:
        """Send a request, reconnecting and retrying retriable failures until the deadline.

        Args:
            req: the request (must be safe to repeat when ``retry`` is true).
            resp_type: the response body type.
            timeout_s: overall deadline (default ``request_timeout_s``).
            retry: retry on connection loss and retriable broker errors. A refusal that had no
                effect (BUSY / STORAGE_FULL with a retry-after: a watermark) is retried even
                when false, waiting at least its retry-after.
            retry_codes: if given, only these broker error codes are retried.

        Raises:
            BrokerError subclass, ConnectionClosedError, FerryMQTimeoutError.
        """
        loop = asyncio.get_running_loop()
        total = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = loop.time() + total
        attempt = 0
        while True:
            remaining = deadline - loop.time()
            try:
                conn = await asyncio.wait_for(self.connection(), max(remaining, 0.001))
            except TimeoutError:
                raise FerryMQTimeoutError(
                    f"{req.API_KEY.name}: not sent: no connection to the broker within "
                    f"{total:.3g} s (still trying to reconnect)") from None
            # a ConnectionClosedError from connection() propagates: its budget was the retrying
            try:
                return await conn.request(req, resp_type, max(remaining, 0.001))
            except TimeoutError:
                raise FerryMQTimeoutError(f"{req.API_KEY.name}: no answer in {total:.3g} s") from None
            except (ConnectionClosedError, BrokerError) as exc:
                retriable = isinstance(exc, ConnectionClosedError) or (
                    exc.retriable if retry_codes is None else exc.code in retry_codes
                )
                attempt += 1
                refused = refused_before_effect(exc)  # a watermark: safe even when not idempotent
                if not ((retry and retriable) or refused) or self._closed:
                    raise
                wait = self.backoff.delay_after(exc, attempt)
                if loop.time() + wait >= deadline:
                    raise
                await asyncio.sleep(wait)

    async def topic(self, name: str, *, auto_create: bool = True, refresh: bool = False) -> TopicInfo:
        """Metadata of one topic (cached).

        Raises:
            UnknownTopicError, InvalidTopicNameError.
        """
        info = self.topics.get(name)
        if info is not None and not refresh:
            return info
        resp = await self.request(m.MetadataRequest([name], auto_create), m.MetadataResponse)
        for tname, tid, queues, code, window in resp.topics:
            if tname != name:
                continue
            if code:
                raise _topic_error(code, name)
            info = TopicInfo(tname, tid, queues, window)
            self.topics[name] = info
            return info
        raise UnknownTopicError(f"unknown topic {name!r}")

    async def existing_topics(self, names: Iterable[str], *,
                              timeout_s: float | None = None) -> dict[str, TopicInfo]:
        """Fresh metadata of those of ``names`` that exist now (one request, nothing created;
        ``timeout_s`` as in :meth:`request`).

        Raises:
            InvalidTopicNameError: a name no topic can have.
        """
        resp = await self.request(m.MetadataRequest(sorted(set(names)), False),
                                  m.MetadataResponse, timeout_s=timeout_s)
        out: dict[str, TopicInfo] = {}
        for tname, tid, queues, code, window in resp.topics:
            if code == ErrorCode.UNKNOWN_TOPIC:
                continue
            if code:
                raise _topic_error(code, tname)
            out[tname] = self.topics[tname] = TopicInfo(tname, tid, queues, window)
        return out

    async def close(self) -> None:
        """Close the connection and stop the keepalive."""
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._keepalive
        if self._conn is not None:
            self._conn.close()


def _seen(fut: asyncio.Future[Transport]) -> None:
    """Mark a connection attempt's outcome as retrieved (see :meth:`Session.connection`)."""
    if not fut.cancelled():
        fut.exception()
