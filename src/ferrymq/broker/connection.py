"""One client connection on the broker: bytes to frames to handlers, responses back.

Theory of operation
-------------------
:class:`BrokerConnection` is an ``asyncio.Protocol``; the sans-IO :class:`FrameDecoder` turns the
byte stream into frames. Each request is dispatched at once (no task per request): a handler
returns either a response body or a future of one (a produce waiting for its fsync, a fetch
waiting for data). Responses are written as they complete, matched by correlation id.

Back-pressure: the connection stops reading from the socket while more than
``max_in_flight_per_connection`` requests are unanswered or while the transport's write buffer is
above its high-water mark; a client that does not read its responses therefore stops being read,
and the broker's memory stays bounded.

A frame that cannot be decoded (too large, bad header) ends the connection: the stream cannot be
trusted after it. A well-framed request with a bad body gets an INVALID_REQUEST response and the
connection lives on. Nothing a peer sends can raise out of this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, cast

from ferrymq.errors import BrokerError, FrameSizeError, RemoteProtocolError
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.frames import Frame, FrameDecoder, encode_response, encode_response_parts
from ferrymq.protocol.messages import REQUESTS, Body

if TYPE_CHECKING:
    from ferrymq.broker.server import BrokerServer

log = logging.getLogger("ferrymq.broker")


class BrokerConnection(asyncio.Protocol):
    """Protocol instance for one accepted socket."""

    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder(server.config.max_frame_bytes)
        self.peer = "?"
        self.client_id = ""
        self.in_flight = 0
        self.last_activity = time.monotonic()
        self.closed = False
        self._read_paused = False
        self._write_paused = False
        self.pending: set[asyncio.Future[Any]] = set()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        transport = self.transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if not self.server.register(self):
            log.warning("refusing connection from %s: max_connections reached", self.peer)
            transport.abort()
            self.closed = True
            return
        transport.set_write_buffer_limits(high=self.server.config.max_write_buffer_bytes)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # the kernel notices peers that vanished without a FIN
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.unregister(self)
        for fut in list(self.pending):
            fut.cancel()
        self.pending.clear()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def data_received(self, data: bytes) -> None:
        self.last_activity = time.monotonic()
        try:
            frames = self.decoder.feed(data)
        except RemoteProtocolError as exc:
            self._fail_stream(exc)
            return
        for frame in frames:
            if self.closed:
                return
            self._dispatch(frame)
        if self.decoder.error is not None:
            self._fail_stream(self.decoder.error)

    def _fail_stream(self, exc: RemoteProtocolError) -> None:
        code = ErrorCode.FRAME_TOO_LARGE if isinstance(exc, FrameSizeError) else (
            ErrorCode.INVALID_REQUEST)
        self.fail(code, str(exc))

    # -- requests ----------------------------------------------------------------------------

    def fail(self, code: ErrorCode, message: str) -> None:
        """Send a connection-level error (correlation id 0) and close."""
        log.info("closing connection %s: %s", self.peer, message)
        if self.transport is not None and not self.closed:
            self.transport.write(encode_response(0, 0, 0, code, message.encode()[:1024]))
            self.transport.close()
        self.closed = True

    def _dispatch(self, frame: Frame) -> None:
        if frame.is_response:
            self.fail(ErrorCode.INVALID_REQUEST, "clients may not send response frames")
            return
        cls = REQUESTS.get(frame.api_key)
        if cls is None:
            self._reply(frame, ErrorCode.UNKNOWN_API, f"unknown api key {frame.api_key}".encode())
            return
        if not cls.MIN_VERSION <= frame.api_version <= cls.MAX_VERSION:
            self._reply(frame, ErrorCode.UNSUPPORTED_VERSION,
                        f"{cls.API_KEY.name} supports versions {cls.MIN_VERSION}.."
                        f"{cls.MAX_VERSION}, not {frame.api_version}".encode())
            return
        try:
            req = cls.decode(frame.payload)
        except RemoteProtocolError as exc:
            self._reply(frame, ErrorCode.INVALID_REQUEST, str(exc).encode()[:1024])
            return
        except Exception:  # a decoder bug must not take the connection down
            log.exception("decoding %s failed", cls.API_KEY.name)
            self._reply(frame, ErrorCode.INVALID_REQUEST, b"undecodable request body")
            return
        handler = self.server.handlers[frame.api_key]
        try:
            result = handler(self, req)
        except BrokerError as exc:
            self._reply(frame, exc.code, str(exc).encode()[:4096])
            return
        except Exception:
            log.exception("handler %s failed", cls.API_KEY.name)
            self._reply(frame, ErrorCode.INTERNAL_ERROR, b"internal error (see broker log)")
            return
        if isinstance(result, Body):
            self._reply_body(frame, result)
            return
        fut: asyncio.Future[Body] = asyncio.ensure_future(result)
        self.in_flight += 1
        self.pending.add(fut)
        self._update_reading()
        fut.add_done_callback(functools.partial(self._complete, frame))

    def _complete(self, frame: Frame, fut: asyncio.Future[Body]) -> None:
        self.in_flight -= 1
        self.pending.discard(fut)
        self._update_reading()
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self._reply_body(frame, fut.result())
        elif isinstance(exc, BrokerError):
            self._reply(frame, exc.code, str(exc).encode()[:4096])
        else:
            log.error("request %d failed", frame.api_key, exc_info=exc)
            self._reply(frame, ErrorCode.INTERNAL_ERROR, b"internal error (see broker log)")

    def _reply_body(self, frame: Frame, body: Body) -> None:
        if frame.oneway or self.closed or self.transport is None:
            return
        self.transport.writelines(encode_response_parts(
            frame.api_key, frame.api_version, frame.correlation_id, ErrorCode.NONE,
            body.encode_parts()))

    def _reply(self, frame: Frame, code: int, body: bytes) -> None:
        if frame.oneway or self.closed or self.transport is None:
            return
        self.transport.write(
            encode_response(frame.api_key, frame.api_version, frame.correlation_id, code, body)
        )

    def _update_reading(self) -> None:
        if self.transport is None or self.closed:
            return
        limit = self.server.config.max_in_flight_per_connection
        should_pause = self._write_paused or self.in_flight >= limit
        if should_pause and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()
        elif not should_pause and self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
