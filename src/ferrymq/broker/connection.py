"""One client connection on the broker: bytes to frames to handlers, responses back.

Theory of operation
-------------------
:class:`BrokerConnection` is an ``asyncio.BufferedProtocol``; the sans-IO :class:`FrameDecoder` turns the
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

Security (docs/security.md). A new connection is admitted by :class:`~ferrymq.broker.limits.
ConnectionLimits` (total and per IP) or answered with one BUSY frame and closed. With
authentication on, a connection starts *unauthenticated*: frames are limited to
``max_pre_auth_frame_bytes``, only HELLO, AUTH_START and AUTH_FINISH are dispatched, anything
else is answered with AUTHENTICATION_REQUIRED and the connection closed (so requests pipelined
ahead of the handshake never reach a handler), and a connection still unauthenticated after
``auth_timeout_ms`` is closed (slow-loris). An error answer to AUTH_START/AUTH_FINISH before
authentication closes the connection too. Once authenticated, every request is checked by
:func:`ferrymq.broker.acl.authorize` before its handler runs.

Slow readers. Reading pauses at ``max_write_buffer_bytes`` of unsent responses; responses that
are already in flight (long polls, fsync waits) still complete, so a response that would take
the queue past ``max_write_queue_bytes``, or a client that has read nothing for
``write_stall_timeout_ms`` (checked by the server's housekeeping), is cut off with a logged
reason instead of being buffered without bound.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from ferrymq import _sockets
from ferrymq._buffers import thread_scratch
from ferrymq._hints import AUTH_NEEDED
from ferrymq.broker.acl import authorize
from ferrymq.broker.auth_deadline import AuthDeadline
from ferrymq.broker.context import BrokerContext, Handler
from ferrymq.broker.read_gate import ReadGate
from ferrymq.broker.stats import RequestStats
from ferrymq.errors import BrokerError, FrameSizeError, RemoteProtocolError
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.frames import Frame, FrameDecoder, encode_response, encode_response_parts
from ferrymq.protocol.messages import REQUESTS, ApiKey, Body

if TYPE_CHECKING:
    from ferrymq.protocol.auth import ScramServer

log = logging.getLogger("ferrymq.broker")

PRE_AUTH_APIS = frozenset((ApiKey.HELLO, ApiKey.AUTH_START, ApiKey.AUTH_FINISH))
"""The only requests dispatched before a connection has authenticated."""
_AUTH_APIS = frozenset((ApiKey.AUTH_START, ApiKey.AUTH_FINISH))
_AUTH_FIRST = (f"authenticate first (AUTH_START, AUTH_FINISH): this broker needs credentials "
               f"({AUTH_NEEDED})").encode()


class ConnectionHost(BrokerContext, Protocol):
    """What a connection needs of the broker serving it, beyond what handlers see."""

    @property
    def handlers(self) -> Mapping[int, Handler]:
        """The handler of each api key."""

    def register(self, conn: BrokerConnection) -> str | None:
        """Admit a new connection; the reason it is refused, or None."""

    def unregister(self, conn: BrokerConnection) -> None:
        """Forget a closed connection that :meth:`register` admitted."""

    def produce_throttle(self, user: str, nbytes: int) -> float:
        """Seconds to stop reading from ``user``'s connection after a produce of ``nbytes``."""


class BrokerConnection(ReadGate, AuthDeadline, asyncio.BufferedProtocol):
    """Protocol instance for one accepted socket."""

    def __init__(self, server: ConnectionHost) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        cfg = server.config
        self.authenticated = server.auth is None
        """False until AUTH_FINISH succeeds (True at once when authentication is off)."""
        self.principal: str | None = None
        """The authenticated user's name (None when authentication is off)."""
        self.scram: ScramServer | None = None
        """The handshake in progress (between AUTH_START and AUTH_FINISH)."""
        self.decoder = FrameDecoder(cfg.max_frame_bytes if self.authenticated
                                    else cfg.max_pre_auth_frame_bytes, thread_scratch())
        self.peer = "?"
        self.ip = "?"
        self.client_id = ""
        self.in_flight = 0
        self.last_activity = time.monotonic()
        self.init_read_gate()
        self.closed = False
        self.close_reason: str | None = None
        """Why the broker closed this connection (None: the client closed it, or not closed)."""
        self._admitted = False
        self._read_paused = False
        self._stopped_reading = False
        self.pending: set[asyncio.Future[Any]] = set()
        self._backlog: deque[Frame] = deque()  # read past the in-flight cap, not dispatched yet

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        transport = self.transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.ip = str(peer[0]) if isinstance(peer, tuple) else self.peer
        refused = self.server.register(self)
        if refused is not None:
            log.warning("refusing connection from %s: %s", self.peer, refused, extra={"peer": self.peer})
            transport.write(encode_response(0, 0, 0, ErrorCode.BUSY, refused.encode()[:1024]))
            transport.close()
            self.closed = True
            return
        self._admitted = True
        cfg = self.server.config
        transport.set_write_buffer_limits(high=cfg.max_write_buffer_bytes)
        if not self.authenticated:
            self.start_auth_deadline(cfg.auth_timeout_ms)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _sockets.tune(sock)
        log.debug("connection from %s", self.peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._admitted and log.isEnabledFor(logging.DEBUG):
            reason = self.close_reason or (f"connection error: {exc}" if exc is not None
                                           else "closed by the client")
            log.debug("connection %s closed (client %r, user %s): %s", self.peer,
                      self.client_id, repr(self.principal) if self.principal else "-", reason)
        self.cancel_auth_deadline()
        if self._admitted:
            self._admitted = False
            self.server.unregister(self)
        for fut in list(self.pending):
            fut.cancel()
        self.pending.clear()
        self._backlog.clear()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.last_activity = time.monotonic()
        try:
            frames = self.decoder.buffer_updated(nbytes)
        except RemoteProtocolError as exc:
            self._fail_stream(exc)
            return
        self._handle(frames)

    def _handle(self, frames: list[Frame]) -> None:
        if self._backlog:
            self._backlog.extend(frames)
        else:
            limit = self.server.config.max_in_flight_per_connection
            for i, frame in enumerate(frames):
                if self.closed or self._stopped_reading:
                    return
                if self.in_flight >= limit:  # one read brought more than the cap allows
                    self._backlog.extend(frames[i:])
                    break
                self._dispatch(frame)
        if self.decoder.error is not None:
            self._fail_stream(self.decoder.error)

    def _drain_backlog(self) -> None:
        """Dispatch frames held back by the in-flight cap, in order, while it allows."""
        limit = self.server.config.max_in_flight_per_connection
        backlog = self._backlog
        while backlog and self.in_flight < limit and not (self.closed or self._stopped_reading):
            self._dispatch(backlog.popleft())

    def _fail_stream(self, exc: RemoteProtocolError) -> None:
        code = ErrorCode.FRAME_TOO_LARGE if isinstance(exc, FrameSizeError) else (
            ErrorCode.INVALID_REQUEST)
        self.fail(code, str(exc))

    # -- requests ----------------------------------------------------------------------------

    # -- authentication and limits -----------------------------------------------------------

    def _lift_pre_auth_limits(self) -> None:
        self.decoder.max_frame_bytes = self.server.config.max_frame_bytes

    def stop_reading(self) -> None:
        """Read nothing more from this client (a failed handshake is being answered)."""
        self._stopped_reading = True
        self._update_reading()

    def cut_off(self, reason: str) -> None:
        """Close at once, dropping unsent responses (a client too slow to read them)."""
        if self.closed:
            return
        log.warning("cutting off %s: %s", self.peer, reason, extra={"peer": self.peer})
        self.closed = True
        self.close_reason = f"cut off: {reason}"
        if self.transport is not None:
            self.transport.abort()

    def _room_for(self, size: int) -> bool:
        """False (and the client cut off) when ``size`` more bytes would pass the write cap."""
        if self.transport is None:
            return False
        queued = self.transport.get_write_buffer_size()
        cap = self.server.config.max_write_queue_bytes
        if queued + size > cap:
            self.cut_off(f"slow reader: {queued} response bytes unsent, another {size} would "
                         f"pass max_write_queue_bytes={cap}")
            return False
        return True

    def fail(self, code: ErrorCode, message: str) -> None:
        """Send a connection-level error (correlation id 0) and close."""
        log.info("closing connection %s: %s", self.peer, message, extra={"peer": self.peer})
        if not self.closed:
            self.close_reason = message
        if self.transport is not None and not self.closed:
            self.transport.write(encode_response(0, 0, 0, code, message.encode()[:1024]))
            self.transport.close()
        self.closed = True

    def _dispatch(self, frame: Frame) -> None:
        if frame.is_response:
            self.fail(ErrorCode.INVALID_REQUEST, "clients may not send response frames")
            return
        if not self.authenticated and frame.api_key not in PRE_AUTH_APIS:
            self._reply(frame, ErrorCode.AUTHENTICATION_REQUIRED, _AUTH_FIRST)
            self.fail_quietly(f"request {frame.api_key} before authentication")
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
        stats = self.server.request_stats.get(frame.api_key)  # PRODUCE and FETCH: /metrics
        t0 = time.perf_counter() if stats is not None else 0.0
        try:
            if self.principal is not None:
                authorize(self.server, self.principal, self.peer, frame.api_key, req)
                if frame.api_key == ApiKey.PRODUCE:
                    self.throttle(self.server.produce_throttle(self.principal,
                                                                len(frame.payload)))
            result = handler(self, req)
        except Exception as exc:  # noqa: BLE001 - every failure is answered
            self._reply_error(frame, exc)
            if stats is not None:
                stats.record(time.perf_counter() - t0, len(frame.payload), 0)
            return
        if isinstance(result, Body):
            sent = self._reply_body(frame, result)
            if stats is not None:
                stats.record(time.perf_counter() - t0, len(frame.payload), sent)
            return
        fut: asyncio.Future[Body] = asyncio.ensure_future(result)
        self.in_flight += 1
        self.pending.add(fut)
        self._update_reading()
        fut.add_done_callback(functools.partial(self._complete, frame, stats, t0))

    def _complete(self, frame: Frame, stats: RequestStats | None, t0: float,
                  fut: asyncio.Future[Body]) -> None:
        self.in_flight -= 1
        self.pending.discard(fut)
        if self._backlog:
            self._drain_backlog()
        self._update_reading()
        if fut.cancelled():
            return
        exc = fut.exception()
        sent = 0
        if exc is None:
            sent = self._reply_body(frame, fut.result())
        else:
            self._reply_error(frame, exc)
        if stats is not None:
            stats.record(time.perf_counter() - t0, len(frame.payload), sent)

    def _reply_error(self, frame: Frame, exc: BaseException) -> None:
        """Answer a request that failed: its BrokerError; BUSY or STORAGE_FULL with a
        retry-after when it lacked descriptors or disk space; else INTERNAL_ERROR (logged with
        its traceback, which never goes on the wire)."""
        if not isinstance(exc, BrokerError):
            what = f"serve {ApiKey(frame.api_key).name}"
            shortage = self.server.flusher.shortage_error(exc, what)
            if shortage is None:
                log.error("request %d failed", frame.api_key, exc_info=exc)
                self._reply(frame, ErrorCode.INTERNAL_ERROR, b"internal error (see broker log)")
                return
            log.warning("cannot %s: %s", what, exc)
            exc = shortage
        self._reply(frame, exc.code, str(exc).encode()[:4096])

    def _reply_body(self, frame: Frame, body: Body) -> int:
        """Answer ``body``; the bytes written (0: one-way, closed, or no room)."""
        if frame.oneway or self.closed or self.transport is None:
            return 0
        parts = encode_response_parts(
            frame.api_key, frame.api_version, frame.correlation_id, ErrorCode.NONE,
            body.encode_parts())
        size = sum(len(p) for p in parts)
        if self._room_for(size):
            self.transport.writelines(parts)
            return size
        return 0

    def _reply(self, frame: Frame, code: int, body: bytes) -> None:
        if self.closed or self.transport is None:
            return
        if not frame.oneway and self._room_for(len(body) + 14):
            self.transport.write(
                encode_response(frame.api_key, frame.api_version, frame.correlation_id, code,
                                body))
        if code and frame.api_key in _AUTH_APIS and not self.authenticated:
            self.fail_quietly("authentication failed")  # a failed handshake ends the connection

    def fail_quietly(self, reason: str) -> None:
        """Close after what was written (no connection-level error frame)."""
        if self.closed:
            return
        log.info("closing connection %s: %s", self.peer, reason, extra={"peer": self.peer})
        self.closed = True
        self.close_reason = reason
        if self.transport is not None:
            self.transport.close()

    def _update_reading(self) -> None:
        if self.transport is None or self.closed:
            return
        limit = self.server.config.max_in_flight_per_connection
        should_pause = (self._write_paused or self.in_flight >= limit or self._stopped_reading
                        or self._throttled or bool(self._backlog))
        if should_pause and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()
        elif not should_pause and self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
