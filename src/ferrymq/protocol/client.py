"""The client side of one connection, sans-IO: requests out, answers matched, the handshake.

Theory of operation
-------------------
Every client drives this one implementation and does no more than move bytes and wait: the
asyncio transport (:mod:`ferrymq.client._transport`, under :mod:`ferrymq.client._session`)
and the Spark connector's blocking socket (:mod:`ferrymq.spark._wire`).

:class:`ClientConnection` (h11's idea, with h2's ``send`` / receive split) turns requests into
frames and bytes into events:

* :meth:`~ClientConnection.send` encodes a request as one frame under a fresh correlation id
  (never 0, wrapping at 2**32) and keeps the caller's *token* (a future, or anything the
  driver wants back) under that id; it returns the frame's buffers, for one vectored write.
* Bytes read from the socket go in through :meth:`~ClientConnection.receive_data`, or the
  ``asyncio.BufferedProtocol`` pair :meth:`~ClientConnection.get_buffer` /
  :meth:`~ClientConnection.buffer_updated` (reads land in the frame decoder's memory; a large
  answer is read in place, see :class:`~ferrymq.protocol.frames.FrameDecoder`).
  Out come events:

  - :class:`ResponseReceived`: the answer to a pending request, with its token. The payload
    still starts with the error code: :func:`decode_response` raises the broker's error as its
    exception class (:func:`ferrymq.errors.error_for_code`, the one mapping) or decodes the body.
  - :class:`ConnectionTerminated`: the stream is dead, and it is the last event: a frame that
    cannot be decoded (too large, bad header, unknown flags: the stream cannot be resynchronised)
    or a connection-level error from the broker (correlation id 0: refused at admission,
    shutting down, authentication required). Frames that came before it are still delivered.

  An answer whose id is not pending (a request its caller gave up on) is dropped.
* :meth:`~ClientConnection.close` ends the connection and returns the tokens still waiting;
  the driver fails them with :func:`closed_error`.

:class:`ClientHandshake` says what a client sends right after connecting and what the answers
mean: HELLO, then, with credentials, AUTH_START and AUTH_FINISH (SCRAM-SHA-256,
:mod:`ferrymq.protocol.auth`: the secret never crosses the wire and the broker must prove it
knows the user's keys). Its steps are a table. The driver sends each step's request through its
ordinary request path, so its timeouts and its handling of a lost connection apply, and feeds
the decoded answer back; a broker's refusal arrives as that answer's exception.

Hot path (produce and fetch): a request costs its correlation id, one dict entry and its frame
header; an answer, one :class:`ResponseReceived` (a tuple) written into the decoder's list of
frames in place. Randomness (the SCRAM nonce) and the client's version are passed in: this
module reads no clock and no random source.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar, cast

from ferrymq.errors import (
    AuthenticationFailedError,
    ConnectionClosedError,
    LocalProtocolError,
    RemoteProtocolError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import MECHANISM, ScramClient
from ferrymq.protocol.frames import (
    FLAG_ONEWAY,
    MAX_CORRELATION_ID,
    FrameDecoder,
    encode_frame_parts,
    split_response,
)

T = TypeVar("T")
B = TypeVar("B", bound=m.Body)

CLIENT_MAX_FRAME_BYTES = 64 * 1024 * 1024
"""Largest answer a client accepts (the broker caps fetches far below this: ``max_frame_bytes``,
8 MiB by default). Checked on the frame header, before the answer is buffered."""

Buffers = list[bytes | bytearray | memoryview]


class ResponseReceived(NamedTuple, Generic[T]):
    """The answer to a pending request."""

    correlation_id: int
    token: T
    """What the driver gave :meth:`ClientConnection.send` for this request."""
    payload: bytes | memoryview
    """The error code, then the body: see :func:`decode_response`."""


class ConnectionTerminated(NamedTuple):
    """The stream is dead (the last event of a connection)."""

    error: BaseException
    """A :class:`~ferrymq.errors.RemoteProtocolError` (a frame that cannot be decoded) or the
    broker's connection-level error (a :class:`~ferrymq.errors.BrokerError`)."""


Event = ResponseReceived[T] | ConnectionTerminated

_new_tuple = tuple.__new__  # builds a ResponseReceived without NamedTuple's Python-level __new__
_NOT_PENDING = object()


def decode_response(payload: bytes | memoryview, resp_type: type[B]) -> B:
    """Split off the error code; raise the broker's error or decode the body.

    Raises:
        BrokerError subclass: the code is not 0 (the body is the broker's message).
        RemoteProtocolError: the payload is shorter than its code, or the body does not decode.
    """
    code, body = split_response(payload)
    if code:
        raise error_for_code(code, str(body, "utf-8", "replace"))
    return resp_type.decode(body)


def closed_error(reason: BaseException) -> ConnectionClosedError:
    """The error a request waiting on a connection that ended with ``reason`` fails with."""
    if isinstance(reason, ConnectionClosedError):
        return reason
    return ConnectionClosedError(str(reason))


class ClientConnection(Generic[T]):
    """The client side of one connection (see the module's docstring).

    Args:
        max_frame_bytes: answers declaring more are a protocol error, before any of them is
            buffered.
        scratch: the buffer reads land in (see :class:`~ferrymq.protocol.frames.FrameDecoder`);
            default: one of its own.
        first_correlation_id: the id of the first request (a driver that reconnects may carry
            its ids on, so that an id never names two requests of one client).
    """

    __slots__ = ("_decoder", "_next_id", "_pending", "error")

    def __init__(self, *, max_frame_bytes: int = CLIENT_MAX_FRAME_BYTES,
                 scratch: memoryview | None = None, first_correlation_id: int = 1) -> None:
        if not 0 < first_correlation_id <= MAX_CORRELATION_ID:
            raise ValueError(f"first_correlation_id must be 1..{MAX_CORRELATION_ID}")
        # a client trusts its broker's declared lengths: a large answer is read in place
        self._decoder = FrameDecoder(max_frame_bytes, scratch, preallocate=True)
        self._pending: dict[int, T] = {}
        self._next_id = first_correlation_id
        self.error: BaseException | None = None
        """Why the connection ended (None while it is open)."""

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._pending)

    @property
    def next_correlation_id(self) -> int:
        """The id the next :meth:`send` gives its request."""
        return self._next_id

    def is_pending(self, correlation_id: int) -> bool:
        """Whether the request with this id waits for its answer on this connection."""
        return correlation_id in self._pending

    # -- out -------------------------------------------------------------------------------

    def send(self, req: m.Request, token: T, *, oneway: bool = False) -> Buffers:
        """Encode ``req`` as the next frame and keep ``token`` for its answer.

        Args:
            req: the request.
            token: given back with the answer (:class:`ResponseReceived`).
            oneway: the broker answers nothing (the token is not kept).

        Returns:
            The frame's buffers, to write in order.

        Raises:
            ConnectionClosedError: the connection has ended.
        """
        if self.error is not None:
            raise closed_error(self.error)
        corr = self._next_id
        self._next_id = (corr + 1) & MAX_CORRELATION_ID or 1
        if not oneway:
            self._pending[corr] = token
        return encode_frame_parts(req.API_KEY, req.wire_version(), FLAG_ONEWAY if oneway else 0,
                                  corr, req.encode_parts())

    # -- in --------------------------------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next read should land (``asyncio.BufferedProtocol.get_buffer``)."""
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> list[Event[T]]:
        """``nbytes`` were read into :meth:`get_buffer`'s buffer: the events they complete."""
        if self.error is not None:
            return []
        try:
            frames = self._decoder.buffer_updated(nbytes)
        except RemoteProtocolError as exc:
            return [self._terminate(exc)]
        # the decoder's fresh list is reused for the events: no second list per read
        events: list[Any] = frames
        pending = self._pending
        kept = 0
        for f in frames:
            corr = f.correlation_id
            token = pending.pop(corr, _NOT_PENDING)
            if token is not _NOT_PENDING:
                events[kept] = _new_tuple(ResponseReceived, (corr, token, f.payload))
                kept += 1
            elif corr == 0:  # a connection-level error from the broker: nothing follows
                try:
                    code, body = split_response(f.payload)
                except RemoteProtocolError as exc:
                    events[kept] = self._terminate(exc)
                else:
                    events[kept] = self._terminate(
                        error_for_code(code, str(body, "utf-8", "replace")))
                del events[kept + 1 :]
                return events
            # else: the answer to a request its caller gave up on
        if kept < len(events):
            del events[kept:]
        if self._decoder.error is not None:  # a bad header after these frames
            events.append(self._terminate(self._decoder.error))
        return events

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event[T]]:
        """Bytes read from the socket (any chunking): the events they complete."""
        src = memoryview(data).cast("B")
        events: list[Event[T]] = []
        pos = 0
        while pos < len(src) and self.error is None:
            buf = self.get_buffer()
            n = min(len(buf), len(src) - pos)
            buf[:n] = src[pos : pos + n]
            pos += n
            events += self.buffer_updated(n)
        return events

    def _terminate(self, error: BaseException) -> ConnectionTerminated:
        if self.error is None:
            self.error = error
        return ConnectionTerminated(error)

    # -- end -------------------------------------------------------------------------------

    def close(self, reason: BaseException) -> list[T]:
        """End the connection (if it has not ended: ``reason`` becomes :attr:`error`).

        Returns:
            The tokens of the requests still waiting (each once): fail them with
            :func:`closed_error`.
        """
        if self.error is None:
            self.error = reason
        pending, self._pending = self._pending, {}
        return list(pending.values())


# --- the handshake --------------------------------------------------------------------------


class HandshakeStep(enum.Enum):
    """Where a :class:`ClientHandshake` is."""

    HELLO = "HELLO"
    AUTH_START = "AUTH_START"
    AUTH_FINISH = "AUTH_FINISH"
    DONE = "DONE"
    FAILED = "FAILED"


class ClientHandshake:
    """What a client sends right after connecting, and what the answers mean.

    HELLO (who the client is; the broker's limits come back), then, when ``auth`` is given, the
    SCRAM exchange: AUTH_START (user and client nonce; a challenge comes back) and AUTH_FINISH
    (the client proof; the broker's signature comes back and is checked). Drive it with::

        while (req := handshake.next_request()) is not None:
            handshake.receive(<the decoded answer to req, of type req.RESPONSE>)

    Args:
        client_id: sent in HELLO.
        client_version: sent in HELLO (the client library's version).
        auth: ``(user, secret)``; None: no authentication.
        client_nonce: fresh random bytes for SCRAM (``secrets.token_bytes(NONCE_BYTES)``);
            needed with ``auth``.

    Raises:
        ValueError: ``auth`` without ``client_nonce``.
        RemoteProtocolError: a nonce of a bad length.
    """

    __slots__ = ("_proof", "_scram", "client_id", "client_version", "hello", "step", "user")

    def __init__(self, client_id: str, client_version: str, auth: tuple[str, str] | None = None,
                 client_nonce: bytes | None = None) -> None:
        self.client_id = client_id
        self.client_version = client_version
        self._scram: ScramClient | None = None
        if auth is not None:
            if client_nonce is None:
                raise ValueError("authentication needs a client nonce")
            self._scram = ScramClient(auth[0], auth[1], client_nonce)
        self._proof = b""
        self.step = HandshakeStep.HELLO
        self.hello: m.HelloResponse | None = None
        """The broker's HELLO answer (set once it came)."""
        self.user: str | None = None
        """The user the broker authenticated (None without ``auth``)."""

    @property
    def done(self) -> bool:
        """True once the connection may carry other requests."""
        return self.step is HandshakeStep.DONE

    def next_request(self) -> m.Request | None:
        """The request to send now (its answer's type is its ``RESPONSE``); None when done.

        Raises:
            LocalProtocolError: the handshake failed (it cannot go on).
        """
        step = self.step
        if step is HandshakeStep.HELLO:
            return m.HelloRequest(self.client_id, self.client_version)
        if step is HandshakeStep.AUTH_START:
            assert self._scram is not None
            return m.AuthStartRequest(MECHANISM, self._scram.user, self._scram.client_nonce)
        if step is HandshakeStep.AUTH_FINISH:
            return m.AuthFinishRequest(self._proof)
        if step is HandshakeStep.DONE:
            return None
        raise LocalProtocolError("the handshake failed: open a new connection")

    def receive(self, response: m.Body) -> None:
        """The answer to :meth:`next_request`'s request.

        Raises:
            AuthenticationFailedError: the broker's challenge is not valid, or the broker could
                not prove it knows the user's keys (do not use this connection).
            LocalProtocolError: not the answer this step waits for.
        """
        step = self.step
        entry = _TRANSITIONS.get(step)
        if entry is None or type(response) is not entry[0]:
            raise LocalProtocolError(
                f"handshake step {step.value} does not take a {type(response).__name__}")
        try:
            self.step = entry[1](self, response)
        except AuthenticationFailedError:
            self.step = HandshakeStep.FAILED
            raise

    def _on_hello(self, response: m.Body) -> HandshakeStep:
        self.hello = cast(m.HelloResponse, response)
        return HandshakeStep.DONE if self._scram is None else HandshakeStep.AUTH_START

    def _on_challenge(self, response: m.Body) -> HandshakeStep:
        challenge = cast(m.AuthStartResponse, response)
        assert self._scram is not None
        try:
            self._proof = self._scram.proof(challenge.salt, challenge.iterations,
                                            challenge.server_nonce)
        except RemoteProtocolError as exc:
            raise AuthenticationFailedError(f"the broker's challenge is not valid: {exc}") from None
        return HandshakeStep.AUTH_FINISH

    def _on_finish(self, response: m.Body) -> HandshakeStep:
        done = cast(m.AuthFinishResponse, response)
        assert self._scram is not None
        if not self._scram.server_signature_ok(done.server_signature):
            raise AuthenticationFailedError(
                "the broker could not prove it knows this user's keys (a different broker, or "
                "someone in between): not using this connection")
        self.user = done.user
        return HandshakeStep.DONE


_TRANSITIONS: dict[HandshakeStep, tuple[type[m.Body],
                                        Callable[[ClientHandshake, m.Body], HandshakeStep]]] = {
    HandshakeStep.HELLO: (m.HelloResponse, ClientHandshake._on_hello),
    HandshakeStep.AUTH_START: (m.AuthStartResponse, ClientHandshake._on_challenge),
    HandshakeStep.AUTH_FINISH: (m.AuthFinishResponse, ClientHandshake._on_finish),
}
"""Step -> (the answer it takes, what it does with it and the next step). DONE and FAILED take
nothing."""
