"""Kafka's framing and request/response headers. Sans-IO.

Every Kafka request and response is one frame: a big-endian i32 size, then that many bytes. A
request starts with its header::

    request_api_key      i16
    request_api_version  i16
    correlation_id       i32
    client_id            nullable string (i16 length, -1: null)  -- header v1
    tagged fields        uvarint count, then (tag, size, bytes)   -- header v2: flexible versions

A response starts with the correlation id (header v0), followed by an empty tagged-field
section (header v1) when the request's version is flexible, except for ApiVersions, whose
response header is always v0 so a client can read it whatever version it asked for (KIP-511).

:class:`KafkaFrameDecoder` cuts a byte stream into frames and refuses a size outside
``1..max_frame_bytes`` before buffering it (the stream cannot be trusted after that: the
connection is closed).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ferrymq.errors import FrameSizeError, RemoteProtocolError

_SIZE = struct.Struct(">i")
_HEADER = struct.Struct(">hhi")
_CLIENT_ID_LEN = struct.Struct(">h")
API_VERSIONS_KEY = 18
MIN_HEADER_BYTES = _HEADER.size + _CLIENT_ID_LEN.size  # 10


class RequestHeader(NamedTuple):
    """A decoded request header; ``body`` is where the request's body starts in its frame."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: int


class KafkaFrameDecoder:
    """Cut a byte stream into Kafka frames of at most ``max_frame_bytes`` each."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Take ``data``; return the frames it completed (their bodies, without the size).

        Raises:
            FrameSizeError: a frame's size is below 1 or above ``max_frame_bytes``.
        """
        buf = self._buf
        if buf:
            buf += data
        src = buf if buf else data  # nothing held: frames are cut from ``data`` directly
        frames: list[bytes] = []
        pos = 0
        n = len(src)
        with memoryview(src) as mv:  # one copy per frame, not two
            while n - pos >= 4:
                (size,) = _SIZE.unpack_from(mv, pos)
                if not 0 < size <= self.max_frame_bytes:
                    raise FrameSizeError(f"Kafka frame of {size} bytes: frames must be 1.."
                                         f"{self.max_frame_bytes} bytes (max_frame_bytes)")
                if n - pos - 4 < size:
                    break
                frames.append(bytes(mv[pos + 4:pos + 4 + size]))
                pos += 4 + size
            if src is not buf and pos < n:
                buf += mv[pos:]  # the start of a frame: held until it is complete
        if src is buf and pos:
            del buf[:pos]
        return frames

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)


def peek_header(frame: bytes) -> tuple[int, int, int]:
    """The api key, version and correlation id of a request frame.

    Raises:
        RemoteProtocolError: shorter than a request header.
    """
    if len(frame) < MIN_HEADER_BYTES:
        raise RemoteProtocolError(f"Kafka request of {len(frame)} bytes: shorter than a "
                                  f"request header ({MIN_HEADER_BYTES} bytes)")
    key, version, correlation_id = _HEADER.unpack_from(frame, 0)
    return key, version, correlation_id


def decode_request_header(frame: bytes, *, flexible: bool) -> RequestHeader:
    """Decode the header of a request frame (v2 when ``flexible``, else v1).

    Raises:
        RemoteProtocolError: truncated, a negative client id length other than -1, a tagged
            field section that runs past the frame.
    """
    key, version, correlation_id = peek_header(frame)
    (n,) = _CLIENT_ID_LEN.unpack_from(frame, _HEADER.size)
    pos = MIN_HEADER_BYTES
    client_id: str | None = None
    if n >= 0:
        if pos + n > len(frame):
            raise RemoteProtocolError("Kafka request header: client id runs past the frame")
        client_id = frame[pos:pos + n].decode("utf-8", "replace")
        pos += n
    elif n != -1:
        raise RemoteProtocolError(f"Kafka request header: client id length {n}")
    if flexible:
        count, pos = _read_uvarint(frame, pos)
        for _ in range(count):
            _tag, pos = _read_uvarint(frame, pos)
            size, pos = _read_uvarint(frame, pos)
            pos += size
            if pos > len(frame):
                raise RemoteProtocolError("Kafka request header: tagged field runs past the frame")
    return RequestHeader(key, version, correlation_id, client_id, pos)


def _read_uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = 0
    value = 0
    while True:
        if pos >= len(buf) or shift > 28:
            raise RemoteProtocolError("Kafka request header: bad unsigned varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def response_header(api_key: int, correlation_id: int, *, flexible: bool) -> bytes:
    """The header of a response (v1 for flexible versions, except ApiVersions: always v0)."""
    if flexible and api_key != API_VERSIONS_KEY:
        return struct.pack(">iB", correlation_id, 0)
    return struct.pack(">i", correlation_id)


def frame(header: bytes, body: bytes) -> bytes:
    """A complete frame: the size, the header, the body."""
    return _SIZE.pack(len(header) + len(body)) + header + body
