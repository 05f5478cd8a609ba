"""The clients' sans-IO connection core, without sockets: the handshake, correlation, error codes,
bad bytes.

A :class:`BrokerPeer` plays the broker's side from the protocol package alone (frame decoder,
the request table, ``encode_response``, :class:`~ferrymq.protocol.auth.ScramServer`), so bytes
go both ways as they would on a socket, in any chunking.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrymq.errors import (
    AuthenticationFailedError,
    BrokerShuttingDownError,
    BusyError,
    ConnectionClosedError,
    FrameSizeError,
    LocalProtocolError,
    RemoteProtocolError,
    UnknownTopicError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import (
    DEFAULT_ITERATIONS,
    MAX_ITERATIONS,
    ScramCredential,
    ScramServer,
    decoy_credential,
)
from ferrymq.protocol.client import (
    ClientConnection,
    ClientHandshake,
    ConnectionTerminated,
    Event,
    HandshakeStep,
    ResponseReceived,
    closed_error,
    decode_response,
)
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.frames import (
    BIG_FRAME_BYTES,
    FLAG_ONEWAY,
    HEADER,
    MAX_CORRELATION_ID,
    FrameDecoder,
    encode_frame,
    encode_response,
)

SECRET = "pencil"
CREDENTIAL = ScramCredential.derive(SECRET, b"s" * 16)
HELLO = m.HelloResponse("1.0", 7, 8 << 20, 4 << 20, 1000, "sync")


class BrokerPeer:
    """The broker's end of one connection, sans-IO: decodes requests, answers what it is told.

    Args:
        answer: request -> (error code, response body or error message).
    """

    def __init__(self, answer: Callable[[m.Request], tuple[int, m.Body | str]]) -> None:
        self.decoder = FrameDecoder()
        self.answer = answer
        self.received: list[tuple[int, int, m.Request]] = []  # (correlation id, flags, request)

    def receive(self, data: bytes) -> bytes:
        """Requests from the client; the bytes of the answers, in order."""
        out = b""
        for f in self.decoder.feed(data):
            req = m.REQUESTS[f.api_key].decode(f.payload)
            self.received.append((f.correlation_id, f.flags, req))
            if f.flags & FLAG_ONEWAY:
                continue
            code, body = self.answer(req)
            data = body.encode() if isinstance(body, m.Body) else body.encode("utf-8")
            out += encode_response(f.api_key, f.api_version, f.correlation_id, code, data)
        return out


class ScramBroker:
    """Answers HELLO and the SCRAM steps as the broker does (``users``: name -> credential)."""

    def __init__(self, users: dict[str, ScramCredential], *, iterations: int | None = None,
                 signature: bytes | None = None) -> None:
        self.users = users
        self.iterations = iterations
        self.signature = signature
        self.server: ScramServer | None = None

    def __call__(self, req: m.Request) -> tuple[int, m.Body | str]:
        if isinstance(req, m.HelloRequest):
            return 0, HELLO
        if isinstance(req, m.AuthStartRequest):
            self.server = ScramServer(req.user, self.users.get(req.user), req.client_nonce,
                                      b"S" * 24, decoy_credential(req.user, b"k" * 32))
            salt, iterations, nonce = self.server.challenge()
            return 0, m.AuthStartResponse(salt, self.iterations or iterations, nonce)
        if isinstance(req, m.AuthFinishRequest):
            assert self.server is not None
            signature = self.server.verify(req.client_proof)
            if signature is None:
                return ErrorCode.AUTHENTICATION_FAILED, "authentication failed"
            return 0, m.AuthFinishResponse(self.signature or signature, self.server.user, False)
        return ErrorCode.INVALID_REQUEST, f"unexpected {type(req).__name__}"


def _feed(conn: ClientConnection[str], data: bytes, chunk: int) -> list[Event[str]]:
    events: list[Event[str]] = []
    for i in range(0, len(data), chunk):
        events += conn.receive_data(data[i : i + chunk])
    return events


def _request(conn: ClientConnection[str], peer: BrokerPeer, req: m.Request,
             chunk: int = 1 << 20) -> m.Body:
    """One round trip: the decoded answer (or the broker's error raised)."""
    answer = peer.receive(b"".join(conn.send(req, f"token-{type(req).__name__}")))
    events = _feed(conn, answer, chunk)
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, ResponseReceived)
    assert event.token == f"token-{type(req).__name__}"
    return decode_response(event.payload, req.RESPONSE)


def _handshake(handshake: ClientHandshake, broker: Callable[[m.Request], tuple[int, m.Body | str]],
               chunk: int = 1 << 20) -> BrokerPeer:
    conn: ClientConnection[str] = ClientConnection()
    peer = BrokerPeer(broker)
    while (req := handshake.next_request()) is not None:
        handshake.receive(_request(conn, peer, req, chunk))
    return peer


# --- the handshake --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5, 1 << 20])
def test_handshake_without_credentials_is_hello_only(chunk: int) -> None:
    handshake = ClientHandshake("app", "9.9")
    peer = _handshake(handshake, ScramBroker({}), chunk)
    assert [type(r) for _, _, r in peer.received] == [m.HelloRequest]
    assert peer.received[0][2] == m.HelloRequest("app", "9.9")
    assert handshake.done
    assert handshake.hello == HELLO
    assert handshake.user is None
    assert handshake.next_request() is None


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_handshake_with_credentials_authenticates_both_ways(chunk: int) -> None:
    broker = ScramBroker({"alice": CREDENTIAL})
    handshake = ClientHandshake("app", "9.9", ("alice", SECRET), b"C" * 24)
    peer = _handshake(handshake, broker, chunk)
    sent = [r for _, _, r in peer.received]
    assert [type(r) for r in sent] == [m.HelloRequest, m.AuthStartRequest, m.AuthFinishRequest]
    assert sent[1] == m.AuthStartRequest("SCRAM-SHA-256", "alice", b"C" * 24)
    assert handshake.step is HandshakeStep.DONE
    assert handshake.user == "alice"
    assert handshake.hello == HELLO


@pytest.mark.parametrize(("user", "secret"), [("alice", "wrong"), ("mallory", SECRET)])
def test_handshake_refused_by_the_broker(user: str, secret: str) -> None:
    """A wrong secret and an unknown user fail alike, at AUTH_FINISH, as the broker's error."""
    handshake = ClientHandshake("app", "9.9", (user, secret), b"C" * 24)
    with pytest.raises(AuthenticationFailedError, match="authentication failed"):
        _handshake(handshake, ScramBroker({"alice": CREDENTIAL}))
    assert handshake.step is HandshakeStep.AUTH_FINISH
    assert handshake.user is None


def test_handshake_refuses_a_broker_that_does_not_know_the_keys() -> None:
    handshake = ClientHandshake("app", "9.9", ("alice", SECRET), b"C" * 24)
    with pytest.raises(AuthenticationFailedError, match="could not prove"):
        _handshake(handshake, ScramBroker({"alice": CREDENTIAL}, signature=b"\x00" * 32))
    assert handshake.step is HandshakeStep.FAILED
    assert handshake.user is None
    with pytest.raises(LocalProtocolError, match="failed"):
        handshake.next_request()


def test_handshake_refuses_an_invalid_challenge() -> None:
    handshake = ClientHandshake("app", "9.9", ("alice", SECRET), b"C" * 24)
    broker = ScramBroker({"alice": CREDENTIAL}, iterations=MAX_ITERATIONS + 1)
    with pytest.raises(AuthenticationFailedError, match=r"challenge is not valid.*PBKDF2 rounds"):
        _handshake(handshake, broker)
    assert handshake.step is HandshakeStep.FAILED


def test_handshake_takes_only_the_answer_it_waits_for() -> None:
    handshake = ClientHandshake("app", "9.9", ("alice", SECRET), b"C" * 24)
    with pytest.raises(LocalProtocolError, match="HELLO does not take a AuthStartResponse"):
        handshake.receive(m.AuthStartResponse(b"s" * 16, DEFAULT_ITERATIONS, b"S" * 24))
    assert handshake.step is HandshakeStep.HELLO
    handshake.receive(HELLO)
    assert handshake.step is HandshakeStep.AUTH_START
    with pytest.raises(LocalProtocolError):
        handshake.receive(HELLO)
    done = ClientHandshake("app", "9.9")
    done.receive(HELLO)
    with pytest.raises(LocalProtocolError, match="DONE"):
        done.receive(HELLO)


def test_handshake_needs_a_good_nonce_with_credentials() -> None:
    with pytest.raises(ValueError, match="nonce"):
        ClientHandshake("app", "9.9", ("alice", SECRET))
    with pytest.raises(RemoteProtocolError, match="client nonce"):
        ClientHandshake("app", "9.9", ("alice", SECRET), b"short")


# --- correlation ----------------------------------------------------------------------------


def _answer(corr: int, body: m.Body, code: int = 0) -> bytes:
    return encode_response(m.ApiKey.PING, 1, corr, code, body.encode())


def test_answers_in_any_order_find_their_requests() -> None:
    conn: ClientConnection[str] = ClientConnection()
    ids = []
    for token in ("a", "b", "c"):
        ids.append(conn.next_correlation_id)
        frame = b"".join(conn.send(m.PingRequest(), token))
        assert HEADER.unpack_from(frame)[4] == ids[-1]
    assert ids == [1, 2, 3]
    assert conn.in_flight == 3
    events = conn.receive_data(_answer(3, m.Empty()) + _answer(1, m.Empty()))
    assert [(e.correlation_id, e.token) for e in events if isinstance(e, ResponseReceived)] == [
        (3, "c"), (1, "a")]
    assert conn.in_flight == 1
    assert conn.is_pending(2)
    assert not conn.is_pending(1)
    (event,) = conn.receive_data(_answer(2, m.Empty()))
    assert isinstance(event, ResponseReceived)
    assert (event.correlation_id, event.token) == (2, "b")
    assert decode_response(event.payload, m.Empty) == m.Empty()
    assert conn.in_flight == 0


def test_an_answer_nobody_waits_for_is_dropped() -> None:
    conn: ClientConnection[str] = ClientConnection()
    conn.send(m.PingRequest(), "a")
    events = conn.receive_data(_answer(99, m.Empty()) + _answer(1, m.Empty())
                               + _answer(1, m.Empty()))  # a second answer to 1: dropped too
    assert [(e.correlation_id, e.token) for e in events if isinstance(e, ResponseReceived)] == [
        (1, "a")]
    assert len(events) == 1
    assert conn.error is None


def test_oneway_requests_wait_for_nothing() -> None:
    conn: ClientConnection[str] = ClientConnection()
    frame = b"".join(conn.send(m.PingRequest(), "unused", oneway=True))
    _length, api_key, version, flags, corr = HEADER.unpack_from(frame)
    assert (api_key, version, flags, corr) == (m.ApiKey.PING, 1, FLAG_ONEWAY, 1)
    assert conn.in_flight == 0
    assert conn.receive_data(_answer(1, m.Empty())) == []


def test_correlation_ids_wrap_and_skip_zero() -> None:
    conn: ClientConnection[str] = ClientConnection(first_correlation_id=MAX_CORRELATION_ID)
    conn.send(m.PingRequest(), "last")
    assert conn.next_correlation_id == 1
    conn.send(m.PingRequest(), "first")
    events = conn.receive_data(_answer(1, m.Empty()) + _answer(MAX_CORRELATION_ID, m.Empty()))
    assert [e.token for e in events if isinstance(e, ResponseReceived)] == ["first", "last"]
    with pytest.raises(ValueError, match="first_correlation_id"):
        ClientConnection(first_correlation_id=0)


@given(order=st.permutations(range(8)), seed=st.integers(0, 2**32 - 1))
def test_every_answer_reaches_its_request_once(order: list[int], seed: int) -> None:
    """Answers in any order and any chunking: each token comes back exactly once."""
    conn: ClientConnection[int] = ClientConnection()
    ids = {}
    for token in range(8):
        ids[token] = conn.next_correlation_id
        conn.send(m.MetadataRequest(None, False), token)
    stream = b"".join(_answer(ids[t], m.MetadataResponse([(f"t{t}", t, 1, 0, 0)])) for t in order)
    rng = random.Random(seed)
    events: list[Event[int]] = []
    i = 0
    while i < len(stream):
        n = rng.randint(1, 40)
        events += conn.receive_data(stream[i : i + n])
        i += n
    got = [(e.token, decode_response(e.payload, m.MetadataResponse).topics[0][1])
           for e in events if isinstance(e, ResponseReceived)]
    assert got == [(t, t) for t in order]
    assert conn.in_flight == 0


# --- error codes ----------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "exc_type"), [
    (ErrorCode.UNKNOWN_TOPIC, UnknownTopicError),
    (ErrorCode.BUSY, BusyError),
    (ErrorCode.AUTHENTICATION_FAILED, AuthenticationFailedError),
    (ErrorCode.BROKER_SHUTTING_DOWN, BrokerShuttingDownError),
])
def test_error_codes_raise_their_exception_class(code: ErrorCode, exc_type: type[Exception]
                                                 ) -> None:
    conn: ClientConnection[str] = ClientConnection()
    conn.send(m.MetadataRequest(["x"], False), "t")
    (event,) = conn.receive_data(encode_response(m.ApiKey.METADATA, 1, 1, code,
                                                 "no such thing: 'x' \u2603".encode()))
    assert isinstance(event, ResponseReceived)
    with pytest.raises(exc_type, match="no such thing: 'x' \u2603") as info:
        decode_response(event.payload, m.MetadataResponse)
    assert info.value.code == code  # type: ignore[attr-defined]


def test_a_connection_level_error_ends_the_connection() -> None:
    """Correlation id 0 (a refusal at admission, a shutdown): answers before it are delivered,
    nothing after it; the waiting tokens come back from close()."""
    conn: ClientConnection[str] = ClientConnection()
    for token in ("a", "b", "c"):
        conn.send(m.PingRequest(), token)
    busy = encode_response(0, 0, 0, ErrorCode.BUSY, b"too many connections")
    events = conn.receive_data(_answer(2, m.Empty()) + busy + _answer(1, m.Empty()))
    assert len(events) == 2
    first, last = events
    assert isinstance(first, ResponseReceived)
    assert first.token == "b"
    assert isinstance(last, ConnectionTerminated)
    assert isinstance(last.error, BusyError)
    assert str(last.error) == "too many connections"
    assert conn.error is last.error
    assert sorted(conn.close(ConnectionClosedError("later"))) == ["a", "c"]
    assert conn.close(ConnectionClosedError("again")) == []
    assert conn.error is last.error  # the first reason stays
    assert conn.receive_data(_answer(1, m.Empty())) == []
    with pytest.raises(ConnectionClosedError, match="too many connections"):
        conn.send(m.PingRequest(), "d")


def test_closed_error_keeps_a_connection_error_and_wraps_the_rest() -> None:
    lost = ConnectionClosedError("connection lost")
    assert closed_error(lost) is lost
    wrapped = closed_error(FrameSizeError("frame of 9 bytes"))
    assert type(wrapped) is ConnectionClosedError
    assert str(wrapped) == "frame of 9 bytes"


def test_close_by_the_client() -> None:
    conn: ClientConnection[str] = ClientConnection()
    conn.send(m.PingRequest(), "a")
    assert conn.close(ConnectionClosedError("closed by client")) == ["a"]
    assert str(conn.error) == "closed by client"
    with pytest.raises(ConnectionClosedError, match="closed by client"):
        conn.send(m.PingRequest(), "b")


# --- bad bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 1 << 20])
def test_a_bad_header_after_good_frames(chunk: int) -> None:
    conn: ClientConnection[str] = ClientConnection()
    conn.send(m.PingRequest(), "a")
    conn.send(m.PingRequest(), "b")
    bad_flags = encode_frame(m.ApiKey.PING, 1, 0x80, 2, b"\x00\x00")
    events = _feed(conn, _answer(1, m.Empty()) + bad_flags + _answer(2, m.Empty()), chunk)
    assert [type(e) for e in events] == [ResponseReceived, ConnectionTerminated]
    end = events[-1]
    assert isinstance(end, ConnectionTerminated)
    assert isinstance(end.error, RemoteProtocolError)
    assert "unknown frame flags" in str(end.error)
    assert conn.close(ConnectionClosedError("x")) == ["b"]


def test_an_oversized_answer_is_refused_on_its_header() -> None:
    conn: ClientConnection[str] = ClientConnection(max_frame_bytes=1024)
    conn.send(m.PingRequest(), "a")
    header = HEADER.pack(1 << 30, m.ApiKey.PING, 1, 1, 1)  # claims 1 GiB
    (event,) = conn.receive_data(header)
    assert isinstance(event, ConnectionTerminated)
    assert isinstance(event.error, FrameSizeError)
    assert "max_frame_bytes=1024" in str(event.error)


@pytest.mark.parametrize("payload", [b"", b"\x05"])
def test_an_answer_shorter_than_its_code(payload: bytes) -> None:
    conn: ClientConnection[str] = ClientConnection()
    conn.send(m.PingRequest(), "a")
    (event,) = conn.receive_data(encode_frame(m.ApiKey.PING, 1, 1, 1, payload))
    assert isinstance(event, ResponseReceived)
    with pytest.raises(RemoteProtocolError, match="shorter than its error code"):
        decode_response(event.payload, m.Empty)
    (end,) = ClientConnection[str]().receive_data(encode_frame(0, 0, 1, 0, payload))
    assert isinstance(end, ConnectionTerminated)
    assert isinstance(end.error, RemoteProtocolError)


def test_an_undecodable_body_is_a_protocol_error() -> None:
    conn: ClientConnection[str] = ClientConnection()
    conn.send(m.MetadataRequest(None, False), "a")
    (event,) = conn.receive_data(encode_response(m.ApiKey.METADATA, 1, 1, 0, b"\xc1junk"))
    assert isinstance(event, ResponseReceived)
    with pytest.raises(RemoteProtocolError, match="MetadataResponse"):
        decode_response(event.payload, m.MetadataResponse)


def test_a_large_answer_is_read_in_place() -> None:
    """The BufferedProtocol path: a large answer lands in a buffer of its own, in pieces."""
    conn: ClientConnection[str] = ClientConnection()
    conn.send(m.PingRequest(), "big")
    body = bytes(range(256)) * (4 * BIG_FRAME_BYTES // 256)
    stream = encode_response(m.ApiKey.PING, 1, 1, 0, body)
    events: list[Event[str]] = []
    pos = 0
    while pos < len(stream):
        buf = conn.get_buffer()
        n = min(len(buf), 1000, len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        pos += n
        events += conn.buffer_updated(n)
    (event,) = events
    assert isinstance(event, ResponseReceived)
    assert isinstance(event.payload, memoryview)
    assert event.payload[2:] == body


@given(data=st.binary(max_size=300), chunk=st.integers(1, 64))
def test_arbitrary_bytes_give_events_never_exceptions(data: bytes, chunk: int) -> None:
    """Whatever the broker sends, the core answers with events: at most one
    ConnectionTerminated, and nothing after it."""
    conn: ClientConnection[str] = ClientConnection(max_frame_bytes=256)
    for token in ("a", "b"):
        conn.send(m.PingRequest(), token)
    events = _feed(conn, data, chunk)
    ends = [i for i, e in enumerate(events) if isinstance(e, ConnectionTerminated)]
    assert ends in ([], [len(events) - 1])
    tokens = [e.token for e in events if isinstance(e, ResponseReceived)]
    assert len(tokens) == len(set(tokens))
    assert sorted(tokens + conn.close(ConnectionClosedError("end"))) == ["a", "b"]
