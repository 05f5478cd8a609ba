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
connection is closed). It reads large frames in place (``asyncio.BufferedProtocol``).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ferrymq.errors import FrameSizeError, RemoteProtocolError
from ferrymq.protocol.frames import SCRATCH_BYTES

_SIZE = struct.Struct(">i")
_HEADER = struct.Struct(">hhi")
_CLIENT_ID_LEN = struct.Struct(">h")
API_VERSIONS_KEY = 18
MIN_HEADER_BYTES = _HEADER.size + _CLIENT_ID_LEN.size  # 10
BIG_FRAME_BYTES = 16 * 1024
"""A frame above this size that one read leaves incomplete is read in place."""
FRAME_HEADROOM = 64
"""Free bytes before a frame read in place, in its buffer (the frame is a ``memoryview`` of
the ``bytearray`` from this offset on): a Produce's first batch gets its envelope header written
there instead of being copied behind one (:mod:`ferrymq.protocol.kafka.envelope`)."""


class RequestHeader(NamedTuple):
    """A decoded request header; ``body`` is where the request's body starts in its frame."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: int


class KafkaFrameDecoder:
    """Cut a byte stream into Kafka frames of at most ``max_frame_bytes`` each.

    It serves an ``asyncio.BufferedProtocol`` (:meth:`get_buffer`, :meth:`buffer_updated`): a
    read lands in a reused ``scratch`` buffer (the broker passes its thread's, shared by every
    connection of the event loop, :func:`ferrymq._buffers.thread_scratch`), from which small
    frames are copied once, and a partial one is kept aside before the callback returns; a frame
    larger than ``big_frame_bytes`` that a read leaves incomplete gets a buffer of its exact
    size (its size checked first), and the rest of it is read into that buffer in place, so a
    large Produce is never copied on its way in. :meth:`feed` takes bytes already read (tests,
    fuzzing). Frames come out as ``bytes`` or, read in place, a writable ``memoryview`` with
    :data:`FRAME_HEADROOM` free bytes before it in its ``bytearray``.
    """

    def __init__(self, max_frame_bytes: int, scratch: memoryview | None = None, *,
                 big_frame_bytes: int = BIG_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._scratch = scratch if scratch is not None else memoryview(bytearray(SCRATCH_BYTES))
        self._big_at = big_frame_bytes
        self._part = bytearray()  # the start of a frame (or of its size) awaiting the rest
        self._big: bytearray | None = None  # a large frame being read in place
        self._big_have = 0

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next read should land (``asyncio.BufferedProtocol.get_buffer``)."""
        if self._big is not None:
            return memoryview(self._big)[self._big_have:]
        return self._scratch

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes | memoryview]:
        """Take ``data``; return the frames it completed (their bodies, without the size).

        Raises:
            FrameSizeError: a frame's size is below 1 or above ``max_frame_bytes``.
        """
        src = memoryview(data).cast("B")
        frames: list[bytes | memoryview] = []
        i = 0
        while i < len(src):
            buf = self.get_buffer()
            k = min(len(buf), len(src) - i)
            buf[:k] = src[i:i + k]
            i += k
            frames += self.buffer_updated(k)
        return frames

    def buffer_updated(self, nbytes: int) -> list[bytes | memoryview]:
        """``nbytes`` were read into the buffer :meth:`get_buffer` returned: the frames they
        complete (``asyncio.BufferedProtocol.buffer_updated``). Errors as in :meth:`feed`;
        the stream cannot be trusted after one (close the connection)."""
        big = self._big
        if big is not None:
            self._big_have += nbytes
            if self._big_have < len(big):
                return []
            self._big = None
            self._big_have = 0
            return [memoryview(big)[FRAME_HEADROOM:]]
        view = self._scratch
        frames: list[bytes | memoryview] = []
        pos = 0
        if self._part:
            pos = self._complete_part(view, nbytes, frames)
            if pos < 0:
                return frames
        while nbytes - pos >= 4:
            size = self._size(view, pos)
            end = pos + 4 + size
            if end <= nbytes:
                frames.append(bytes(view[pos + 4:end]))
                pos = end
                continue
            if size > self._big_at:
                self._read_in_place(size, view[pos + 4:nbytes])
                return frames
            break
        if pos < nbytes:
            self._part = bytearray(view[pos:nbytes])
        return frames

    def _complete_part(self, view: memoryview, nbytes: int,
                       frames: list[bytes | memoryview]) -> int:
        """Feed the start of a read to the frame begun by earlier reads; where parsing of the
        read goes on, or -1 when the read is used up."""
        part = self._part
        pos = 0
        if len(part) < 4:
            pos = min(4 - len(part), nbytes)
            part += view[:pos]
            if len(part) < 4:
                return -1
        size = self._size(part, 0)
        need = 4 + size - len(part)
        if need > nbytes - pos and size > self._big_at:
            have = bytes(part[4:])
            self._part = bytearray()
            self._read_in_place(size, have, view[pos:nbytes])
            return -1
        take = min(need, nbytes - pos)
        part += view[pos:pos + take]
        pos += take
        if take < need:
            return -1
        self._part = bytearray()
        frames.append(bytes(part[4:]))
        return pos

    def _read_in_place(self, size: int, *starts: bytes | memoryview) -> None:
        big = bytearray(FRAME_HEADROOM + size)
        have = FRAME_HEADROOM
        for s in starts:
            big[have:have + len(s)] = s
            have += len(s)
        self._big = big
        self._big_have = have

    def _size(self, buf: bytearray | memoryview, pos: int) -> int:
        (size,) = _SIZE.unpack_from(buf, pos)
        if not 0 < size <= self.max_frame_bytes:
            raise FrameSizeError(f"Kafka frame of {size} bytes: frames must be 1.."
                                 f"{self.max_frame_bytes} bytes (max_frame_bytes)")
        return int(size)

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held."""
        return self._big_have - FRAME_HEADROOM if self._big is not None else len(self._part)


def peek_header(frame: bytes | memoryview) -> tuple[int, int, int]:
    """The api key, version and correlation id of a request frame.

    Raises:
        RemoteProtocolError: shorter than a request header.
    """
    if len(frame) < MIN_HEADER_BYTES:
        raise RemoteProtocolError(f"Kafka request of {len(frame)} bytes: shorter than a "
                                  f"request header ({MIN_HEADER_BYTES} bytes)")
    key, version, correlation_id = _HEADER.unpack_from(frame, 0)
    return key, version, correlation_id


def decode_request_header(frame: bytes | memoryview, *, flexible: bool) -> RequestHeader:
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
        client_id = str(frame[pos:pos + n], "utf-8", "replace")
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


def _read_uvarint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
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


def frame_pieces(header: bytes, body: list[bytes | bytearray | memoryview]
                 ) -> list[bytes | bytearray | memoryview]:
    """A complete frame in pieces (for ``writelines``): the size and the header, then the
    body's pieces as they are."""
    return [_SIZE.pack(len(header) + sum(len(b) for b in body)) + header, *body]
