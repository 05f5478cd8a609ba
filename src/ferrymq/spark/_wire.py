"""A small blocking connection to the broker for Spark's Python workers.

Theory of operation
-------------------
Spark calls the data source from short-lived, single-threaded Python workers (planner workers,
the streaming source runner, executor tasks). An asyncio client with a background loop thread
would be wasted there, so this module drives the clients' sans-IO connection core
(:class:`ferrymq.protocol.client.ClientConnection`: correlation ids, answers, the broker's error
codes as exceptions, bad bytes) over a plain blocking socket; reads land in the core's frame
decoder, a large answer in a buffer of its own size.

Requests can be *pipelined*: :meth:`BlockingConnection.send` writes a request and returns its
correlation id, :meth:`BlockingConnection.receive` waits for that answer. An executor reading a
queue range sends the next FETCH before it turns the current answer into Arrow, so the broker
works while the task decodes.

Connections are cached per process and :class:`WireConfig` (:func:`connection`): a Python worker
that runs many tasks reuses its socket. A request that fails on a dead connection is retried once
on a fresh one (every request sent through :meth:`BlockingConnection.request` is safe to repeat).

Security (``docs/security.md``): with ``tls`` the socket is wrapped in TLS (the broker's
certificate and host name are always verified, as in the asyncio client); with a user the
connection authenticates right after HELLO with the handshake the asyncio clients use
(:class:`ferrymq.protocol.client.ClientHandshake`, SCRAM-SHA-256: the secret never crosses the
wire, and the broker must prove it knows the user's keys). A failed login or TLS handshake is
never retried: it cannot get better.
"""

from __future__ import annotations

import secrets
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import TypeVar

from ferrymq import _sockets
from ferrymq._connect import client_tls_context, parse_servers
from ferrymq._version import __version__
from ferrymq.errors import (
    AuthenticationFailedError,
    BrokerError,
    ConnectionClosedError,
    FerryMQTimeoutError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import NONCE_BYTES
from ferrymq.protocol.client import (
    ClientConnection,
    ClientHandshake,
    ConnectionTerminated,
    Event,
    closed_error,
    decode_response,
)

B = TypeVar("B", bound=m.Body)

DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WireConfig:
    """Where the brokers are and how to talk to them: what every Spark worker needs to connect
    (picklable, hashable: it keys the connection cache). Built from the data source's options by
    :mod:`ferrymq.spark.options`; ``str()`` gives the server list (for messages)."""

    servers: str
    user: str | None = None
    secret: str | None = field(default=None, repr=False)
    """Kept out of ``repr`` (and so out of logs and Spark's plans)."""
    tls: bool = False
    tls_cafile: str | None = None
    """CA bundle (PEM) to verify the broker with; None: the system's CAs."""
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    """A client certificate and its key (brokers with ``tls_client_auth``)."""

    def __str__(self) -> str:
        return self.servers

    def tls_context(self) -> ssl.SSLContext | None:
        """The client TLS context (None: plain TCP).

        Raises:
            ConfigError: a TLS file cannot be loaded.
        """
        if not self.tls:
            return None
        return client_tls_context(self.tls_cafile or True, cert_file=self.tls_certfile,
                                  key_file=self.tls_keyfile)


def _config(target: WireConfig | str) -> WireConfig:
    return target if isinstance(target, WireConfig) else WireConfig(target)


class BlockingConnection:
    """One blocking socket to a broker (the first of ``servers`` that answers)."""

    def __init__(self, target: WireConfig | str, *, client_id: str = "ferrymq-spark",
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.config = _config(target)
        self.servers = self.config.servers
        self.addresses = parse_servers(self.servers)
        self._tls = self.config.tls_context()
        self.client_id = client_id
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.hello: m.HelloResponse | None = None
        self._sock: socket.socket | None = None
        self._conn: ClientConnection[None] | None = None
        self._next_id = 1  # carried across reconnects: an id never names two requests
        self._early: dict[int, bytes | memoryview] = {}

    # -- connection ------------------------------------------------------------------------

    def connect(self) -> BlockingConnection:
        """Connect and handshake with the first broker that answers.

        Raises:
            ConnectionClosedError: no broker answered, or a TLS handshake failed (its
                ``__cause__`` is the ``ssl.SSLError``; not retried).
            AuthenticationFailedError: the broker refused the user (not retried).
        """
        if self._sock is not None:
            return self
        errors = []
        for host, port in self.addresses:
            try:
                sock = _sockets.connect_blocking(host, port, self.connect_timeout_s)
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            _sockets.tune(sock)
            if self._tls is not None:
                sock = self._tls_handshake(sock, host, port)
            sock.settimeout(self.request_timeout_s)
            self._sock = sock
            self._conn = ClientConnection(first_correlation_id=self._next_id)
            try:
                self._handshake()
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                self.close()
                hint = "" if self._tls is not None else " (if the broker's port is TLS, set option 'tls')"
                errors.append(f"{host}:{port}: {exc}{hint}")
                continue
            except BaseException:
                self.close()
                raise
            return self
        raise ConnectionClosedError(
            f"FerryMQ broker unreachable at {self.servers!r} ({'; '.join(errors)})"
        )

    def _tls_handshake(self, sock: socket.socket, host: str, port: int) -> socket.socket:
        assert self._tls is not None
        sock.settimeout(self.connect_timeout_s)
        try:
            return self._tls.wrap_socket(sock, server_hostname=host)
        except ssl.SSLError as exc:
            sock.close()
            raise ConnectionClosedError(
                f"TLS handshake with {host}:{port} failed: {exc.reason or exc} (is the broker's "
                f"port TLS, and is its certificate trusted for {host!r}? options 'tls', "
                "'tls.cafile')") from exc
        except OSError as exc:
            sock.close()
            raise ConnectionClosedError(f"TLS handshake with {host}:{port} failed: {exc}") from exc

    def _handshake(self) -> None:
        """HELLO, then with a user the SCRAM exchange (:class:`ClientHandshake`).

        Raises:
            AuthenticationFailedError: a wrong user or secret, or a broker that could not prove
                it knows the user's keys.
        """
        user, secret = self.config.user, self.config.secret
        auth: tuple[str, str] | None = None
        if user is not None:
            if not secret:
                raise AuthenticationFailedError("option 'auth.user' needs 'auth.secret'")
            auth = (user, secret)
        handshake = ClientHandshake(self.client_id, __version__, auth,
                                    None if auth is None else secrets.token_bytes(NONCE_BYTES))
        while (req := handshake.next_request()) is not None:
            handshake.receive(self._request_once(req, req.RESPONSE))
        self.hello = handshake.hello

    def close(self) -> None:
        """Close the socket (a later request reconnects)."""
        if self._conn is not None:
            self._next_id = self._conn.next_correlation_id
            self._conn.close(ConnectionClosedError("connection closed"))
            self._conn = None
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._early.clear()

    @property
    def is_open(self) -> bool:
        """True while a socket is held."""
        return self._sock is not None

    # -- requests --------------------------------------------------------------------------

    def send(self, req: m.Request) -> int:
        """Write ``req``; return its correlation id for :meth:`receive`.

        Raises:
            ConnectionClosedError: the socket failed (the connection is closed).
        """
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        assert self._conn is not None
        corr = self._conn.next_correlation_id
        parts = self._conn.send(req, None)
        try:
            self._sock.sendall(b"".join(parts))
        except OSError as exc:
            self.close()
            raise ConnectionClosedError(f"send to {self.servers}: {exc}") from exc
        return corr

    def receive(self, corr: int, resp_type: type[B]) -> B:
        """Wait for the answer to request ``corr`` and decode it.

        Raises:
            BrokerError subclass: the broker answered with an error.
            ConnectionClosedError, FerryMQTimeoutError: the connection failed (it is closed),
                or the request went out on a connection that has been closed since.
        """
        payload = self._early.pop(corr, None)
        while payload is None:
            conn = self._conn
            if conn is None or not conn.is_pending(corr):
                raise ConnectionClosedError("connection closed")
            for event in self._read(conn):
                if isinstance(event, ConnectionTerminated):
                    self.close()
                    if payload is None:
                        raise closed_error(event.error)
                elif event.correlation_id == corr:
                    payload = event.payload
                else:
                    self._early[event.correlation_id] = event.payload
        return decode_response(payload, resp_type)

    def _read(self, conn: ClientConnection[None]) -> list[Event[None]]:
        """One read from the socket into the connection core: the events it completes.

        Raises:
            ConnectionClosedError, FerryMQTimeoutError: the socket failed or the broker closed
                it (the connection is closed).
        """
        sock = self._sock
        assert sock is not None
        try:
            n = sock.recv_into(conn.get_buffer())
        except TimeoutError as exc:
            self.close()
            raise FerryMQTimeoutError(f"no answer from {self.servers} in "
                                      f"{self.request_timeout_s:.3g} s") from exc
        except OSError as exc:
            self.close()
            raise ConnectionClosedError(f"receive from {self.servers}: {exc}") from exc
        if n == 0:
            self.close()
            raise ConnectionClosedError(f"{self.servers} closed the connection")
        return conn.buffer_updated(n)

    def _request_once(self, req: m.Request, resp_type: type[B]) -> B:
        return self.receive(self.send(req), resp_type)

    def request(self, req: m.Request, resp_type: type[B], *, attempts: int = 3) -> B:
        """Send ``req`` (safe to repeat) and return its answer, reconnecting on a dead socket
        and retrying retriable broker errors with a short backoff.

        Raises:
            BrokerError subclass, ConnectionClosedError, FerryMQTimeoutError.
        """
        for attempt in range(1, attempts + 1):
            try:
                return self._request_once(req, resp_type)
            except ConnectionClosedError:
                if attempt == attempts:
                    raise
            except BrokerError as exc:
                if not exc.retriable or attempt == attempts:
                    raise
            time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")


_CACHE: dict[WireConfig, BlockingConnection] = {}


def connection(target: WireConfig | str) -> BlockingConnection:
    """The cached connection of this process to ``target`` (connected).

    Raises:
        ConnectionClosedError: no broker answered.
        AuthenticationFailedError: the broker refused the user.
    """
    config = _config(target)
    conn = _CACHE.get(config)
    if conn is None:
        conn = _CACHE[config] = BlockingConnection(config)
    return conn.connect()


def forget(target: WireConfig | str) -> None:
    """Close and drop the cached connection to ``target`` (if any)."""
    conn = _CACHE.pop(_config(target), None)
    if conn is not None:
        conn.close()
