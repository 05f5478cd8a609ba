"""A small blocking connection to the broker for Spark's Python workers.

Theory of operation
-------------------
Spark calls the data source from short-lived, single-threaded Python workers (planner workers,
the streaming source runner, executor tasks). An asyncio client with a background loop thread
would be wasted there, so this module speaks the same sans-IO codec
(:mod:`ferrymq.protocol.frames`, :mod:`ferrymq.protocol.messages`) over a plain blocking socket.

Requests can be *pipelined*: :meth:`BlockingConnection.send` writes a request and returns its
correlation id, :meth:`BlockingConnection.receive` waits for that answer. An executor reading a
queue range sends the next FETCH before it turns the current answer into Arrow, so the broker
works while the task decodes.

Connections are cached per process and server list (:func:`connection`): a Python worker that
runs many tasks reuses its socket. A request that fails on a dead connection is retried once on
a fresh one (every request sent through :meth:`BlockingConnection.request` is safe to repeat).
"""

from __future__ import annotations

import itertools
import socket
import time
from typing import TypeVar

from ferrymq._version import __version__
from ferrymq.client._session import parse_servers
from ferrymq.client._transport import decode_response
from ferrymq.errors import BrokerError, ConnectionClosedError, FerryMQTimeoutError
from ferrymq.protocol import messages as m
from ferrymq.protocol.frames import HEADER, HEADER_SIZE, encode_frame_parts

B = TypeVar("B", bound=m.Body)

DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 60.0
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Largest answer accepted (the broker caps fetches at ``max_frame_bytes``, 8 MiB by default)."""


class BlockingConnection:
    """One blocking socket to a broker (the first of ``servers`` that answers)."""

    def __init__(self, servers: str, *, client_id: str = "ferrymq-spark",
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.servers = servers
        self.addresses = parse_servers(servers)
        self.client_id = client_id
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.hello: m.HelloResponse | None = None
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._early: dict[int, bytes | memoryview] = {}

    # -- connection ------------------------------------------------------------------------

    def connect(self) -> BlockingConnection:
        """Connect and handshake with the first broker that answers.

        Raises:
            ConnectionClosedError: no broker answered.
        """
        if self._sock is not None:
            return self
        errors = []
        for host, port in self.addresses:
            try:
                sock = socket.create_connection((host, port), timeout=self.connect_timeout_s)
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.request_timeout_s)
            self._sock = sock
            try:
                self.hello = self._request_once(m.HelloRequest(self.client_id, __version__),
                                                m.HelloResponse)
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                self.close()
                errors.append(f"{host}:{port}: {exc}")
                continue
            return self
        raise ConnectionClosedError(
            f"FerryMQ broker unreachable at {self.servers!r} ({'; '.join(errors)})"
        )

    def close(self) -> None:
        """Close the socket (a later request reconnects)."""
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
        corr = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        parts = encode_frame_parts(req.API_KEY, 1, 0, corr, req.encode_parts())
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
            ConnectionClosedError, FerryMQTimeoutError: the connection failed (it is closed).
        """
        payload = self._early.pop(corr, None)
        while payload is None:
            got, body = self._read_frame()
            if got == corr:
                payload = body
            elif got != 0:
                self._early[got] = body
        return decode_response(payload, resp_type)

    def _read_frame(self) -> tuple[int, memoryview]:
        header = self._read_exact(HEADER_SIZE)
        length, _api, _ver, _flags, corr = HEADER.unpack(header)
        if length > MAX_RESPONSE_BYTES or length < HEADER_SIZE - 4:
            self.close()
            raise ConnectionClosedError(f"bad frame length {length} from {self.servers}")
        return corr, memoryview(self._read_exact(length - (HEADER_SIZE - 4)))

    def _read_exact(self, n: int) -> bytearray:
        sock = self._sock
        if sock is None:
            raise ConnectionClosedError("connection closed")
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        try:
            while got < n:
                k = sock.recv_into(view[got:])
                if k == 0:
                    raise ConnectionClosedError(f"{self.servers} closed the connection")
                got += k
        except TimeoutError as exc:
            self.close()
            raise FerryMQTimeoutError(f"no answer from {self.servers} in "
                                      f"{self.request_timeout_s:.3g} s") from exc
        except OSError as exc:
            self.close()
            raise ConnectionClosedError(f"receive from {self.servers}: {exc}") from exc
        except ConnectionClosedError:
            self.close()
            raise
        return buf

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


_CACHE: dict[str, BlockingConnection] = {}


def connection(servers: str) -> BlockingConnection:
    """The cached connection of this process to ``servers`` (connected).

    Raises:
        ConnectionClosedError: no broker answered.
    """
    conn = _CACHE.get(servers)
    if conn is None:
        conn = _CACHE[servers] = BlockingConnection(servers)
    return conn.connect()
