"""One client connection over asyncio: the sans-IO connection core under a socket.

Theory of operation
-------------------
:class:`Transport` is an ``asyncio.BufferedProtocol`` around
:class:`~ferrymq.protocol.client.ClientConnection`, which does the protocol: correlation ids,
matching answers, the broker's error codes as exceptions, bad bytes. This class only moves bytes
and wakes futures: each request's token is its future; the answer resolves it (or raises the
broker's error as its exception class). Many requests are in flight at once. When the
connection drops, every pending future fails with
:class:`~ferrymq.errors.ConnectionClosedError`; reconnecting, and the HELLO and SCRAM handshake
(:class:`~ferrymq.protocol.client.ClientHandshake`), are the session's job
(:mod:`ferrymq.client._session`), not this class's.

Addresses, TLS contexts and the words for a failed attempt are :mod:`ferrymq._connect`'s.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import TypeVar, cast

from ferrymq import _sockets
from ferrymq._buffers import thread_scratch
from ferrymq._connect import connect_failure
from ferrymq.errors import ConnectionClosedError, FerryMQTimeoutError
from ferrymq.protocol.client import (
    ClientConnection,
    ResponseReceived,
    closed_error,
    decode_response,
)
from ferrymq.protocol.messages import Body, Request

__all__ = ["Transport", "decode_response"]

B = TypeVar("B", bound=Body)


class Transport(asyncio.BufferedProtocol):
    """A connected socket to one broker."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._conn: ClientConnection[asyncio.Future[bytes | memoryview]] = ClientConnection(
            scratch=thread_scratch())
        self.closed = asyncio.Event()
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._paused = False

    @property
    def close_reason(self) -> BaseException | None:
        """Why the connection ended (None while it is open)."""
        return self._conn.error

    @classmethod
    async def connect(cls, host: str, port: int, timeout_s: float,
                      tls: ssl.SSLContext | None = None) -> Transport:
        """Open a connection (TLS when ``tls`` is given).

        Raises:
            ConnectionClosedError: refused, unreachable or timed out; for a failed TLS
                handshake its ``__cause__`` is the ``ssl.SSLError``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            sock = await asyncio.wait_for(_sockets.connect(host, port), timeout_s)
            # Not cancelled from outside: once create_connection made a transport, the transport
            # owns the socket (a cancelled TLS transport may still be flushing its shutdown;
            # closing the socket under it let the next socket reuse a descriptor asyncio still
            # had registered: "File descriptor N is used by transport"). asyncio's own TLS
            # handshake timeout bounds the rest.
            try:
                _, proto = await loop.create_connection(
                    cls, sock=sock, ssl=tls, server_hostname=host if tls else None,
                    ssl_handshake_timeout=max(deadline - loop.time(), 0.001) if tls else None)
            except Exception:  # the transport, if any, is closed by asyncio
                sock.close()
                raise
        except ssl.SSLError as exc:
            raise ConnectionClosedError(
                f"TLS handshake with {host}:{port} failed: {exc.reason or exc} (is the broker's "
                f"port TLS, and is its certificate trusted for {host!r}?)") from exc
        except (OSError, TimeoutError) as exc:
            raise ConnectionClosedError(
                f"cannot connect to {host}:{port} ({connect_failure(exc)})") from exc
        return proto

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _sockets.tune(sock)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._conn.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        for event in self._conn.buffer_updated(nbytes):
            if isinstance(event, ResponseReceived):
                fut = event.token
                if not fut.done():
                    fut.set_result(event.payload)
            else:  # ConnectionTerminated: the last event
                self._fail(event.error)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionClosedError(f"connection lost: {exc}" if exc else "connection closed"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()

    # -- API -----------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        for fut in self._conn.close(exc):
            if not fut.done():
                fut.set_exception(closed_error(exc))
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        if self._transport is not None:
            self._transport.close()
        self.closed.set()

    @property
    def is_open(self) -> bool:
        """True until the connection closes."""
        return not self.closed.is_set()

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        return self._conn.in_flight

    def send(self, req: Request, *, oneway: bool = False) -> asyncio.Future[bytes | memoryview]:
        """Write a request now; the future gets the raw response payload."""
        if self.closed.is_set() or self._transport is None:
            raise ConnectionClosedError(str(self.close_reason or "connection closed"))
        fut: asyncio.Future[bytes | memoryview] = asyncio.get_running_loop().create_future()
        self._transport.writelines(self._conn.send(req, fut, oneway=oneway))
        if oneway:
            fut.set_result(b"\x00\x00")
        return fut

    async def drain(self) -> None:
        """Wait while the socket's write buffer is above its high-water mark."""
        if self._paused and not self.closed.is_set():
            w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(w)
            await w

    async def request(self, req: Request, resp_type: type[B], timeout_s: float) -> B:
        """Send ``req`` and return its decoded response.

        Raises:
            BrokerError subclass: the broker answered with an error code.
            ConnectionClosedError: the connection dropped first.
            FerryMQTimeoutError: no answer within ``timeout_s``.
        """
        return await self.response(self.send(req), req, resp_type, timeout_s)

    async def response(self, fut: asyncio.Future[bytes | memoryview], req: Request,
                       resp_type: type[B], timeout_s: float) -> B:
        """The decoded answer to ``req``, whose :meth:`send` returned ``fut``. Raises as
        :meth:`request`."""
        try:
            payload = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise FerryMQTimeoutError(
                f"{req.API_KEY.name} got no answer within {timeout_s:.3g} s"
            ) from None
        return decode_response(payload, resp_type)

    def close(self, reason: str = "closed by client") -> None:
        """Close the connection; pending requests fail with ``reason``."""
        self._fail(ConnectionClosedError(reason))

