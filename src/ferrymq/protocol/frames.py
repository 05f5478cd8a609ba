"""Frames: the length-prefixed envelope of every request and response.

Frame layout (little-endian, 12-byte header)::

    off  size  field
    0    4     length           u32  bytes after this field (8 + payload)
    4    2     api_key          u16  which request type (see messages.ApiKey)
    6    1     api_version      u8   version of that request type
    7    1     flags            u8   bit 0 RESPONSE, bit 1 ONEWAY (no response wanted)
    8    4     correlation_id   u32  chosen by the requester, echoed in the response
    12         payload

A response payload starts with a ``u16`` error code; the rest is the response body when the code
is 0 and a UTF-8 message otherwise. Many requests may be in flight on one connection; responses
may come back in any order and are matched by correlation id.

:class:`FrameDecoder` is incremental: feed it any chunking of the byte stream (one byte at a
time works) and it yields whole frames. It checks the declared length against
``max_frame_bytes`` *before* buffering the payload, so a hostile length cannot make it allocate.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ferrymq.errors import FrameSizeError, RemoteProtocolError

HEADER = struct.Struct("<IHBBI")
HEADER_SIZE = HEADER.size  # 12
_AFTER_LENGTH = HEADER_SIZE - 4
_U16 = struct.Struct("<H")

FLAG_RESPONSE = 0x01
FLAG_ONEWAY = 0x02
_KNOWN_FLAGS = FLAG_RESPONSE | FLAG_ONEWAY

DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024
"""Largest frame accepted by default (8 MiB): a batch of 4 MiB messages with room to spare."""

MAX_CORRELATION_ID = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame."""

    api_key: int
    api_version: int
    flags: int
    correlation_id: int
    payload: bytes | memoryview
    """A view into the received bytes (no copy): ``bytes(payload)`` to keep it alone."""

    @property
    def is_response(self) -> bool:
        """True when this frame answers a request."""
        return bool(self.flags & FLAG_RESPONSE)

    @property
    def oneway(self) -> bool:
        """True when the requester wants no response."""
        return bool(self.flags & FLAG_ONEWAY)


def encode_frame(
    api_key: int, api_version: int, flags: int, correlation_id: int, payload: bytes
) -> bytes:
    """Encode one frame."""
    return HEADER.pack(len(payload) + _AFTER_LENGTH, api_key, api_version, flags,
                       correlation_id) + payload


def encode_frame_parts(
    api_key: int, api_version: int, flags: int, correlation_id: int,
    parts: list[bytes | bytearray | memoryview],
) -> list[bytes | bytearray | memoryview]:
    """A frame as a list of buffers: the header, then the payload parts unchanged."""
    size = sum(len(p) for p in parts)
    return [HEADER.pack(size + _AFTER_LENGTH, api_key, api_version, flags, correlation_id),
            *parts]


def encode_response_parts(
    api_key: int, api_version: int, correlation_id: int, code: int,
    parts: list[bytes | bytearray | memoryview],
) -> list[bytes | bytearray | memoryview]:
    """A response frame as a list of buffers (header with the error code, then the body)."""
    size = sum(len(p) for p in parts)
    return [HEADER.pack(size + 2 + _AFTER_LENGTH, api_key, api_version, FLAG_RESPONSE,
                        correlation_id) + _U16.pack(code), *parts]


def encode_response(
    api_key: int, api_version: int, correlation_id: int, code: int, body: bytes
) -> bytes:
    """Encode a response frame: the error code, then the body (or the error message)."""
    return HEADER.pack(len(body) + 2 + _AFTER_LENGTH, api_key, api_version, FLAG_RESPONSE,
                       correlation_id) + _U16.pack(code) + body


def split_response(payload: bytes | memoryview) -> tuple[int, bytes | memoryview]:
    """Split a response payload into ``(error_code, body)``.

    Raises:
        RemoteProtocolError: the payload is shorter than its error code.
    """
    if len(payload) < 2:
        raise RemoteProtocolError("response payload shorter than its error code")
    return _U16.unpack_from(payload)[0], payload[2:]


class FrameDecoder:
    """Incremental frame decoder over a byte stream (sans-IO).

    Chunks are kept in a list and joined once per completed frame, so a large frame arriving in
    many reads is copied once, not once per read; a frame's payload is a view into the joined
    bytes, so a megabyte produce request or fetch response is not copied again.

    Args:
        max_frame_bytes: frames whose declared length exceeds this raise at once, before any
            payload is buffered.
    """

    __slots__ = ("_chunks", "_have", "_max", "_need", "error")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._chunks: list[bytes | memoryview] = []
        self._have = 0  # bytes held in _chunks
        self._need = HEADER_SIZE  # bytes needed before parsing can make progress
        self._max = max_frame_bytes
        self.error: RemoteProtocolError | None = None
        """Set when a bad header followed frames returned by the same ``feed`` call: handle
        those frames, then treat the stream as dead."""

    @property
    def max_frame_bytes(self) -> int:
        """The current frame size limit."""
        return self._max

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int) -> None:
        """Change the limit for frames whose header has not been read yet (the broker raises it
        once a connection has authenticated)."""
        self._max = value

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a frame."""
        return self._have

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Add bytes from the stream and return every frame they complete.

        Frames completed before a bad header are returned, whatever the chunking, and the error
        is left in :attr:`error` (the next call raises it).

        Raises:
            RemoteProtocolError: a frame is too large, too short or has unknown flags and no
                frame came before it. The stream cannot be resynchronised afterwards: close the
                connection.
        """
        if self.error is not None:
            raise self.error
        if data:
            self._chunks.append(bytes(data))
            self._have += len(data)
        if self._have < self._need:
            return []
        chunks = self._chunks
        first = chunks[0]
        buf = first if len(chunks) == 1 and isinstance(first, bytes) else b"".join(chunks)
        n = len(buf)
        view = memoryview(buf)
        frames: list[Frame] = []
        pos = 0
        unpack = HEADER.unpack_from
        need = HEADER_SIZE
        while n - pos >= HEADER_SIZE:
            length, api_key, version, flags, corr = unpack(buf, pos)
            problem: RemoteProtocolError | None = None
            if length > self._max - 4:
                problem = FrameSizeError(
                    f"frame of {length + 4} bytes exceeds max_frame_bytes={self._max}")
            elif length < _AFTER_LENGTH:
                problem = RemoteProtocolError(f"frame length {length} is shorter than its header")
            elif flags & ~_KNOWN_FLAGS:
                problem = RemoteProtocolError(f"unknown frame flags {flags:#x}")
            if problem is not None:
                self.error = problem
                self._chunks = []
                self._have = 0
                if frames:
                    return frames
                raise problem
            end = pos + 4 + length
            if end > n:
                need = end - pos
                break
            frames.append(Frame(api_key, version, flags, corr, view[pos + HEADER_SIZE : end]))
            pos = end
        rest = view[pos:] if pos else buf  # a view: the next join copies it once
        self._chunks = [rest] if len(rest) else []
        self._have = len(rest)
        self._need = need
        return frames
