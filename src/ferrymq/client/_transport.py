"""One client connection: frames out, responses matched to futures by correlation id.

Theory of operation
-------------------
:class:`Transport` is an ``asyncio.BufferedProtocol`` around the sans-IO :class:`FrameDecoder`. Each
request gets a correlation id and a future; the response resolves it (or raises the broker's
error as its exception class). Many requests are in flight at once. When the connection drops,
every pending future fails with :class:`~ferrymq.errors.ConnectionClosedError`; reconnecting is
the session's job (:mod:`ferrymq.client._session`), not this class's.

TLS: :func:`client_tls_context` turns the clients' ``tls=`` option into an ``ssl.SSLContext``
(``True``: the system's CAs; a path: that CA bundle; a context: as given). The broker's
certificate is always verified, host name included.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
from typing import TypeVar, cast

from ferrymq import _sockets
from ferrymq._buffers import thread_scratch
from ferrymq.errors import (
    ConfigError,
    ConnectionClosedError,
    FerryMQTimeoutError,
    RemoteProtocolError,
    error_for_code,
)
from ferrymq.protocol.frames import (
    FLAG_ONEWAY,
    Frame,
    FrameDecoder,
    encode_frame_parts,
    split_response,
)
from ferrymq.protocol.messages import Body, Request

B = TypeVar("B", bound=Body)

CLIENT_MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest response a client accepts (the broker caps fetches far below this)."""

TLSOption = bool | str | ssl.SSLContext | None
"""The clients' ``tls=``: None/False plain TCP; True verify with the system's CAs; a path to a
CA bundle (PEM) to verify with; or a ready ``ssl.SSLContext`` (client certificates, pinning)."""


def client_tls_context(tls: TLSOption = True, *, cert_file: str | None = None,
                       key_file: str | None = None) -> ssl.SSLContext | None:
    """Build the client's TLS context from a ``tls=`` option.

    Args:
        tls: see :data:`TLSOption`.
        cert_file: a client certificate (PEM) to present (with ``key_file``).
        key_file: its private key.

    Raises:
        ConfigError: a file cannot be loaded, or ``tls`` is of the wrong type.
    """
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is None or tls is False:
        if cert_file:
            raise ConfigError("a TLS client certificate needs tls=")
        return None
    if not isinstance(tls, bool | str):
        raise ConfigError(f"tls= must be a bool, a CA file path or an ssl.SSLContext, "
                          f"not {type(tls).__name__}")
    try:
        ctx = ssl.create_default_context(cafile=None if tls is True else tls)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert_file:
            ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS files: {exc}") from None
    return ctx


TIMED_OUT = "timed out"
"""What :func:`connect_failure` says of an attempt that ran out of time."""


def connect_failure(exc: BaseException) -> str:
    """Why a connection attempt failed, in the words a user looks for: "connection refused",
    "timed out", "name not resolved", or the system's message for other socket errors."""
    if isinstance(exc, socket.gaierror):
        return "name not resolved"
    if isinstance(exc, TimeoutError):  # asyncio's timeout and a socket's ETIMEDOUT alike
        return TIMED_OUT
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


class Transport(asyncio.BufferedProtocol):
    """A connected socket to one broker."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._decoder = FrameDecoder(CLIENT_MAX_FRAME_BYTES, thread_scratch(), preallocate=True)
        self._pending: dict[int, tuple[asyncio.Future[bytes | memoryview], type[Request]]] = {}
        self._ids = itertools.count(1)
        self.closed = asyncio.Event()
        self.close_reason: BaseException | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._paused = False

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
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            frames = self._decoder.buffer_updated(nbytes)
        except RemoteProtocolError as exc:
            self._fail(exc)
            return
        self._handle(frames)

    def _handle(self, frames: list[Frame]) -> None:
        for f in frames:
            entry = self._pending.pop(f.correlation_id, None)
            if entry is None:
                if f.correlation_id == 0:  # connection-level error from the broker
                    try:
                        code, body = split_response(f.payload)
                    except RemoteProtocolError as exc:
                        self._fail(exc)
                        return
                    self._fail(error_for_code(code, str(body, "utf-8", "replace")))
                    return
                continue  # answer to a request we gave up on
            fut = entry[0]
            if not fut.done():
                fut.set_result(f.payload)
        if self._decoder.error is not None:
            self._fail(self._decoder.error)

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
        if self.close_reason is None:
            self.close_reason = exc
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionClosedError(str(exc)) if not isinstance(
                    exc, ConnectionClosedError) else exc)
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
        return len(self._pending)

    def send(self, req: Request, *, oneway: bool = False) -> asyncio.Future[bytes | memoryview]:
        """Write a request now; the future gets the raw response payload."""
        if self.closed.is_set() or self._transport is None:
            raise ConnectionClosedError(str(self.close_reason or "connection closed"))
        corr = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        fut: asyncio.Future[bytes | memoryview] = asyncio.get_running_loop().create_future()
        if not oneway:
            self._pending[corr] = (fut, type(req))
        self._transport.writelines(encode_frame_parts(
            req.API_KEY, 1, FLAG_ONEWAY if oneway else 0, corr, req.encode_parts()))
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


def decode_response(payload: bytes | memoryview, resp_type: type[B]) -> B:
    """Split off the error code; raise the broker's error or decode the body."""
    code, body = split_response(payload)
    if code:
        raise error_for_code(code, str(body, "utf-8", "replace"))
    return resp_type.decode(body)
