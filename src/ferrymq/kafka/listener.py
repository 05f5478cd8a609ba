"""The Kafka listener: a second port on the broker's event loop that speaks the Kafka protocol.

Theory of operation
-------------------
:class:`KafkaListener` is bound and started by the broker server next to its native port
(``kafka_port``, 0: off). Each accepted socket is a :class:`KafkaConnection`, an
``asyncio.BufferedProtocol``: reads land in the buffers of the sans-IO
:class:`~ferrymq.protocol.kafka.frames.KafkaFrameDecoder`, which cuts frames (a large one read
in place), the header says the API and version, ``kio`` decodes the body
(:mod:`ferrymq.protocol.kafka.apis`; Produce by hand, :mod:`ferrymq.protocol.kafka.produce_codec`),
a handler of :mod:`ferrymq.kafka.handlers` answers it by way of FerryMQ's own handlers.

Kafka clients expect the responses of one connection in the order of its requests (the Java
client checks each correlation id against its oldest request). Requests are dispatched at once
as on the native port; an answer that is ready while an earlier one still waits (an fsync, a
long poll) is held until the earlier one is written. Answers that complete in one event-loop
pass (the produce requests one flush round made durable) are written together.

Limits are the native port's: ``max_connections`` and ``max_connections_per_ip`` (counted
together with native connections), ``max_frame_bytes`` (checked on the size prefix, before
buffering), ``max_in_flight_per_connection`` (reading stops while that many answers are
pending), ``max_write_buffer_bytes`` (reading stops while the transport holds that much),
``idle_timeout_ms`` and ``write_stall_timeout_ms`` (:meth:`KafkaListener.check_connections`).
A frame of a bad size or a request that does not decode ends the connection with a logged
reason (a Kafka broker does the same; the stream cannot be trusted after it). An API key or
version not served is answered with UNSUPPORTED_VERSION in that API's response (ApiVersions:
its v0 response listing what is served), never by closing the connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol, cast

from kio.schema.errors import ErrorCode as KafkaError

from ferrymq import _sockets
from ferrymq._buffers import thread_scratch
from ferrymq.broker.auth_deadline import AuthDeadline
from ferrymq.broker.context import BrokerContext
from ferrymq.broker.read_gate import ReadGate
from ferrymq.broker.stats import RequestStats
from ferrymq.errors import BrokerError, RemoteProtocolError
from ferrymq.kafka.cluster import drop_moved_groups
from ferrymq.kafka.groups import KafkaGroupCoordinator
from ferrymq.kafka.handlers import HANDLERS
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.kafka import apis, produce_codec
from ferrymq.protocol.kafka.fetch_codec import Piece
from ferrymq.protocol.kafka.frames import (
    FRAME_HEADROOM,
    KafkaFrameDecoder,
    decode_request_header,
    frame,
    frame_pieces,
    peek_header,
    response_header,
)
from ferrymq.protocol.records import HEADER_SIZE

if TYPE_CHECKING:
    import ssl

    from ferrymq.broker.context import ClientConnection
    from ferrymq.broker.limits import ConnectionLimits
    from ferrymq.protocol.auth import ScramServer
    from ferrymq.protocol.kafka.scram import KafkaScramServer

log = logging.getLogger("ferrymq.kafka")

_UNSUPPORTED = int(KafkaError.unsupported_version).to_bytes(2, "big", signed=True)


class KafkaHost(BrokerContext, Protocol):
    """What the listener needs of the broker: what handlers see, and its connection limits."""

    @property
    def limits(self) -> ConnectionLimits:
        """``max_connections`` and ``max_connections_per_ip``, shared with the native port."""

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        """The listeners' TLS (None: plain TCP)."""

    def produce_throttle(self, user: str, nbytes: int) -> float:
        """Seconds to stop reading from ``user``'s connection after a produce of ``nbytes``."""


class KafkaListener:
    """The Kafka port of one broker."""

    def __init__(self, host: KafkaHost) -> None:
        self.host = host
        self.connections: set[KafkaConnection] = set()
        self.groups = KafkaGroupCoordinator(host.clock.monotonic)
        """Kafka consumer groups' membership (:mod:`ferrymq.kafka.groups`)."""
        self.address: tuple[str, int] = (host.config.host, host.config.kafka_port)
        self._server: asyncio.Server | None = None
        self.request_stats: dict[str, RequestStats] = {
            "produce": RequestStats(), "fetch": RequestStats()}
        """Produce and Fetch counts, bytes and latency (``/metrics``, api ``kafka_produce``
        and ``kafka_fetch``)."""

    async def bind(self) -> None:
        """Bind the port (not accepting yet).

        Raises:
            OSError: the port cannot be bound.
        """
        cfg = self.host.config
        loop = asyncio.get_running_loop()
        tls = self.host.ssl_context  # the native port's TLS (SSL, SASL_SSL for Kafka clients)
        self._server = await loop.create_server(
            lambda: KafkaConnection(self), cfg.host, cfg.kafka_port, reuse_address=True,
            backlog=1024, ssl=tls, start_serving=False,
            ssl_handshake_timeout=cfg.auth_timeout_ms / 1000 if tls else None)
        sock = self._server.sockets[0].getsockname()
        self.address = (sock[0], sock[1])

    async def start(self) -> None:
        """Accept connections."""
        assert self._server is not None
        await self._server.start_serving()
        for listener in self._server.sockets:
            _sockets.tune_listener(listener)
        log.info("Kafka protocol on %s:%d", *self.address)

    def stop_accepting(self) -> None:
        """Close the port (connections stay)."""
        if self._server is not None:
            self._server.close()

    @property
    def pending(self) -> bool:
        """Whether a connection still has a request in progress."""
        return any(c.slots for c in self.connections)

    def check_connections(self, now: float) -> None:
        """Expire Kafka group members without heartbeats, forget groups this broker no longer
        coordinates (a cluster's: :func:`~ferrymq.kafka.cluster.drop_moved_groups`); close
        connections idle for
        ``idle_timeout_ms`` (nothing pending) and cut off those
        whose client took no answer bytes for ``write_stall_timeout_ms`` (the native port's
        limits; the server's housekeeping calls this with its monotonic clock)."""
        self.groups.expire()
        drop_moved_groups(self.host, self.groups)
        cfg = self.host.config
        idle_s = cfg.idle_timeout_ms / 1000
        stall_s = cfg.write_stall_timeout_ms / 1000
        for c in list(self.connections):
            if now - c.last_activity > idle_s and not c.slots:
                c.close(f"idle for idle_timeout_ms={cfg.idle_timeout_ms}")
            elif c.write_paused_since is not None and now - c.write_paused_since > stall_s:
                c.close(f"stalled reader: no answer bytes taken for "
                        f"write_stall_timeout_ms={cfg.write_stall_timeout_ms}", abort=True)

    def close_removed_users(self, users: Collection[str]) -> None:
        """Close the connections of users no longer in ``users`` (the users file changed)."""
        for c in list(self.connections):
            if c.principal is not None and c.principal not in users:
                c.close(f"user {c.principal!r} was removed from the users file")

    def close(self) -> None:
        """Close the port and every connection."""
        self.stop_accepting()
        self.groups.close()
        for c in list(self.connections):
            c.close("broker stopping")


class _Slot:
    """The answer to one request, in request order: its frame (bytes, or pieces to write
    together) once ready."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | list[Piece] | None = None) -> None:
        self.data = data

    def size(self) -> int:
        """Bytes of the answer (0 until ready)."""
        data = self.data
        if isinstance(data, list):
            return sum(len(p) for p in data)
        return 0 if data is None else len(data)


_STATS_OF = {apis.PRODUCE: "produce", apis.FETCH: "fetch"}
"""The APIs whose requests are counted for ``/metrics``."""


class _Timed:
    """A counted request: its stats, when it was read and its size."""

    __slots__ = ("bytes_in", "stats", "t0")

    def __init__(self, stats: RequestStats, t0: float, bytes_in: int) -> None:
        self.stats = stats
        self.t0 = t0
        self.bytes_in = bytes_in

    def done(self, bytes_out: int) -> None:
        """It was answered with ``bytes_out`` bytes (0: no answer, acks=0)."""
        self.stats.record(time.perf_counter() - self.t0, self.bytes_in, bytes_out)


class KafkaConnection(ReadGate, AuthDeadline, asyncio.BufferedProtocol):
    """One Kafka client connection. Also what FerryMQ's handlers see as their connection
    (:class:`~ferrymq.broker.context.ClientConnection`): its principal is the user SASL
    authenticated (:mod:`ferrymq.kafka.sasl`), None when authentication is off."""

    def __init__(self, listener: KafkaListener) -> None:
        self.listener = listener
        self.server: KafkaHost = listener.host
        cfg = self.server.config
        self.authenticated = self.server.auth is None
        """False until SASL succeeds (True at once when authentication is off)."""
        self.decoder = KafkaFrameDecoder(cfg.max_frame_bytes if self.authenticated
                                         else cfg.max_pre_auth_frame_bytes, thread_scratch())
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.ip = "?"
        self.client_id = ""
        self.principal: str | None = None
        self.scram: ScramServer | None = None
        self.sasl_mechanism: str | None = None
        self.sasl: KafkaScramServer | None = None
        self.closed = False
        self.close_reason: str | None = None
        self.local_address: tuple[str, int] = listener.address
        """What Metadata, FindCoordinator and DescribeCluster name as this broker:
        ``kafka_advertised_address``, else the address the client connected to."""
        self.slots: deque[_Slot] = deque()
        self.last_activity = time.monotonic()
        self.init_read_gate()
        self._admitted = False
        self._closing = False
        self._read_paused = False
        self._tasks: set[asyncio.Future[Any]] = set()
        self._flush_due = False

    @property
    def conn(self) -> ClientConnection:
        """This connection, as FerryMQ's handlers see it."""
        return self

    @property
    def groups(self) -> KafkaGroupCoordinator:
        """The Kafka port's group membership."""
        return self.listener.groups

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.ip = str(peer[0]) if isinstance(peer, tuple) else self.peer
        advertised = self.server.config.kafka_advertised_address
        local = transport.get_extra_info("sockname")
        if advertised:
            host, _, port = advertised.rpartition(":")
            self.local_address = (host, int(port))
        elif isinstance(local, tuple):
            self.local_address = (str(local[0]), int(local[1]))
        refused = ("broker is shutting down" if self.server.shutting_down
                   else self.server.limits.admit(self.ip))
        if refused is not None:
            log.warning("refusing Kafka connection from %s: %s", self.peer, refused,
                        extra={"peer": self.peer})
            self.closed = True
            self.transport.close()
            return
        self._admitted = True
        self.listener.connections.add(self)
        self.transport.set_write_buffer_limits(high=self.server.config.max_write_buffer_bytes)
        if not self.authenticated:
            self.start_auth_deadline(self.server.config.auth_timeout_ms)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _sockets.tune(sock)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.cancel_auth_deadline()
        if self._admitted:
            self._admitted = False
            self.listener.connections.discard(self)
            self.server.limits.release(self.ip)
        for t in list(self._tasks):
            t.cancel()
        self._tasks.clear()
        self.slots.clear()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        self.last_activity = time.monotonic()
        try:
            frames = self.decoder.buffer_updated(nbytes)
        except RemoteProtocolError as exc:
            self.close(str(exc))
            return
        for f in frames:
            self._dispatch(f)

    # -- what FerryMQ's handlers may call ------------------------------------------------------

    def stop_reading(self) -> None:
        """Read nothing more (FerryMQ handlers call this on a failed handshake)."""
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def fail(self, code: ErrorCode, message: str) -> None:
        """Close with a logged reason (Kafka has no connection-level error frame)."""
        self.close(f"{code.name}: {message}")

    def _lift_pre_auth_limits(self) -> None:
        self.decoder.max_frame_bytes = self.server.config.max_frame_bytes

    def _user_exists(self) -> bool:
        auth = self.server.auth
        return auth is not None and self.principal is not None \
            and auth.store.get(self.principal) is not None

    def close_after_answer(self) -> None:
        """Read nothing more; close once every pending answer is written (a failed SASL
        exchange)."""
        self._closing = True
        self.stop_reading()

    def close(self, reason: str, *, abort: bool = False) -> None:
        """Close the connection, logging why (``abort``: dropping unsent answers)."""
        if self.closed:
            return
        log.info("closing Kafka connection %s (client %r): %s", self.peer, self.client_id,
                 reason, extra={"peer": self.peer})
        self.closed = True
        self.close_reason = reason
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    # -- requests ----------------------------------------------------------------------------

    def _dispatch(self, data: bytes | memoryview) -> None:
        if self.closed:  # an earlier frame of the same read closed it
            return
        try:
            key, version, correlation_id = peek_header(data)
        except RemoteProtocolError as exc:
            self.close(str(exc))
            return
        if self._closing:
            return
        if self.principal is not None and not self._user_exists():
            self.close(f"user {self.principal!r} no longer exists: connection closed")
            return
        if not self.authenticated and key not in apis.PRE_AUTH:
            self.close(f"api key {key} before SASL authentication (this broker has users: "
                       f"SaslHandshake and SaslAuthenticate first)")
            return
        if not apis.is_supported(key, version):
            self._unsupported(key, version, correlation_id)
            return
        req_cls = apis.request_class(key, version)
        res_cls = apis.response_class(key, version)
        assert req_cls is not None  # every served version is in kio
        assert res_cls is not None
        flexible = bool(res_cls.__flexible__)
        try:
            header = decode_request_header(data, flexible=flexible)
            if key == apis.PRODUCE:  # the hot path: records stay views of the frame
                req = self._decode_produce(data, header.body, version)
            else:
                req = apis.decode_request(req_cls, bytes(data) if isinstance(data, memoryview)
                                          else data, header.body)
        except RemoteProtocolError as exc:
            self.close(f"malformed request (api key {key} v{version}): {exc}")
            return
        if header.client_id:
            self.client_id = header.client_id[:256]
        head = response_header(key, correlation_id, flexible=flexible)
        if key == apis.PRODUCE and self.principal is not None:  # the user's produce quota
            self.throttle(self.server.produce_throttle(self.principal, len(data)))
        stats = _STATS_OF.get(key)
        timed = _Timed(self.listener.request_stats[stats], time.perf_counter(), len(data)) \
            if stats is not None else None
        try:
            result = HANDLERS[key](self, res_cls, req)
        except Exception as exc:  # noqa: BLE001 - every failure is answered
            result = self._failed(res_cls, exc)
        if result is None:  # produce with acks=0
            if timed is not None:
                timed.done(0)
            return
        if not asyncio.isfuture(result) and not asyncio.iscoroutine(result):
            slot = _Slot(self._framed(head, res_cls, result))
            if timed is not None:
                timed.done(slot.size())
            self._answer(slot)
            return
        slot = _Slot()
        self.slots.append(slot)
        fut = asyncio.ensure_future(result)
        self._tasks.add(fut)
        fut.add_done_callback(lambda f: self._completed(slot, head, res_cls, f, timed))
        self._update_reading()

    @staticmethod
    def _decode_produce(data: bytes | memoryview, body: int,
                        version: int) -> produce_codec.ProduceRequestView:
        """A Produce request; a frame read in place is decoded from its whole buffer, so the
        first batch can be wrapped in the free bytes before it (:data:`FRAME_HEADROOM`)."""
        if isinstance(data, memoryview) and isinstance(data.obj, bytearray):
            return produce_codec.decode_request(data.obj, FRAME_HEADROOM + body, version,
                                                room=HEADER_SIZE)
        return produce_codec.decode_request(data, body, version)

    def _unsupported(self, key: int, version: int, correlation_id: int) -> None:
        """Answer an API key or version this listener does not serve (UNSUPPORTED_VERSION)."""
        log.debug("Kafka client %s asked for api key %d v%d: not served", self.peer, key, version)
        if key == apis.API_VERSIONS:  # KIP-511: answer v0, which lists what is served
            body = apis.api_versions_body(KafkaError.unsupported_version, 0)
            self._answer(_Slot(frame(response_header(key, correlation_id, flexible=False), body)))
            return
        cls = apis.response_class(key, version)
        if cls is None:  # unknown even to kio: the header and the error code alone
            self._answer(_Slot(frame(response_header(key, correlation_id, flexible=False),
                                     _UNSUPPORTED)))
            return
        body = apis.encode(apis.error_response(cls, KafkaError.unsupported_version))
        self._answer(_Slot(frame(response_header(key, correlation_id,
                                                 flexible=bool(cls.__flexible__)), body)))

    def _failed(self, res_cls: type[Any], exc: BaseException) -> Any:
        if isinstance(exc, BrokerError):
            error = apis.kafka_error(exc.code)
            log.info("Kafka request from %s refused: %s", self.peer, exc)
        else:
            error = KafkaError.unknown_server_error
            log.error("Kafka request %s from %s failed", res_cls.__name__, self.peer,
                      exc_info=exc)
        return apis.error_response(res_cls, error)

    def _completed(self, slot: _Slot, head: bytes, res_cls: type[Any],
                   fut: asyncio.Future[Any], timed: _Timed | None) -> None:
        self._tasks.discard(fut)
        if fut.cancelled() or self.closed:
            return
        exc = fut.exception()
        value = fut.result() if exc is None else self._failed(res_cls, exc)
        slot.data = self._framed(head, res_cls, value)
        if timed is not None:
            timed.done(slot.size())
        if not self._flush_due:  # answers completed by one fsync round go out in one write
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _framed(self, head: bytes, res_cls: type[Any], value: Any) -> bytes | list[Piece]:
        """The frame of an answer: ``value`` a kio response, or a body the handler encoded
        itself (Produce's bytes; Fetch's pieces, joined when written)."""
        if isinstance(value, list):
            return frame_pieces(head, value)
        return frame(head, self._encode(res_cls, value))

    def _encode(self, res_cls: type[Any], value: Any) -> bytes:
        """``value`` encoded (bytes: a body the handler encoded itself, Produce's); a value kio
        cannot encode (a handler bug) is logged and answered UNKNOWN_SERVER_ERROR."""
        if isinstance(value, bytes):
            return value
        try:
            return apis.encode(value)
        except Exception as exc:  # noqa: BLE001 - the client gets an answer whatever broke
            return apis.encode(self._failed(res_cls, exc))

    def _answer(self, slot: _Slot) -> None:
        self.slots.append(slot)
        self._flush()

    def _flush(self) -> None:
        """Write the answers that are ready, in request order (one write for all of them)."""
        self._flush_due = False
        slots = self.slots
        ready: list[Piece] = []
        while slots and slots[0].data is not None:
            data = slots.popleft().data
            if isinstance(data, list):
                ready += data
            elif data is not None:
                ready.append(data)
        if ready and self.transport is not None and not self.closed:
            # One write of the pieces joined: a Fetch answer's records were views of the log
            # read, copied here once. writelines() of the views copied nothing but read 40 %
            # slower (10 KB messages, confluent-kafka consumer, uvloop 0.23): measured, kept.
            self.transport.write(ready[0] if len(ready) == 1 else b"".join(ready))
        if self._closing and not slots:
            self.close("SASL authentication failed")
            return
        self._update_reading()

    def _update_reading(self) -> None:
        if self.transport is None or self.closed:
            return
        pause = (self._write_paused or self._closing or self._throttled
                 or len(self.slots) >= self.server.config.max_in_flight_per_connection)
        if pause and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()
        elif not pause and self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
