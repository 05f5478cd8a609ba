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
It also serves ``asyncio.BufferedProtocol``: :meth:`FrameDecoder.get_buffer` hands out the memory
the next read lands in, so a large frame is received in place, in one buffer of its own size,
with no copy in user space.
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
    """Bytes (a frame that arrived in one read, copied out of the read buffer) or a view of the
    frame's own buffer (a large one): never shared with another frame."""

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


SCRATCH_BYTES = 128 * 1024
"""Size of the scratch buffer reads land in while no large frame is in progress."""

BIG_FRAME_BYTES = 32 * 1024
"""With ``preallocate``, frames larger than this that do not arrive in one read get a buffer of
their own size, which the rest of the frame is read into directly."""


class FrameDecoder:
    """Incremental frame decoder over a byte stream (sans-IO).

    Two ways in: :meth:`feed` takes bytes already read; :meth:`get_buffer` and
    :meth:`buffer_updated` follow ``asyncio.BufferedProtocol``, so reads land in the decoder's
    memory. Reads go to a scratch buffer; a frame that is complete in it is copied out, and
    the rest of a frame that is not is appended to a buffer of its own as it arrives (one copy,
    where reading into fresh bytes and joining them took two). A payload is a view of that
    buffer, never copied again.

    Args:
        max_frame_bytes: frames whose declared length exceeds this raise at once, before any
            payload is buffered.
        scratch: the buffer reads land in; the IO layer may share one among all the decoders of
            one event loop (nothing refers to it once :meth:`buffer_updated` returns), so an idle
            connection holds no buffer. Default: one of :data:`SCRATCH_BYTES` of its own.
        preallocate: for a peer whose declared lengths are trusted (a client reading its
            broker): a large frame gets a buffer of its declared size as soon as its header is
            read, and the rest of it is read straight into that buffer (no copy at all). A
            broker leaves this off, so memory grows only with the bytes a peer really sent.
    """

    __slots__ = ("_big", "_big_have", "_max", "_part", "_prealloc", "_scratch", "error")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 scratch: memoryview | None = None, *, preallocate: bool = False) -> None:
        self._scratch = scratch if scratch is not None else memoryview(bytearray(SCRATCH_BYTES))
        self._prealloc = preallocate
        self._part = bytearray()  # the start of a small frame (or of a header) awaiting the rest
        self._big: bytearray | None = None  # a large frame being read in place
        self._big_have = 0
        self._max = max_frame_bytes
        self.error: RemoteProtocolError | None = None
        """Set when a bad header followed frames returned by the same call: handle those
        frames, then treat the stream as dead."""

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
        return self._big_have if self._big is not None else len(self._part)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next read should land (``asyncio.BufferedProtocol.get_buffer``)."""
        if self._big is not None:
            return memoryview(self._big)[self._big_have :]
        return self._scratch

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
        src = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        frames: list[Frame] = []
        i = 0
        n = len(src)
        while True:
            buf = self.get_buffer()
            k = min(len(buf), n - i)
            buf[:k] = src[i : i + k]
            i += k
            try:
                frames += self.buffer_updated(k)
            except RemoteProtocolError:
                if frames:
                    return frames
                raise
            if self.error is not None or i >= n:
                return frames

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """``nbytes`` were read into the buffer :meth:`get_buffer` returned: the frames they
        complete (``asyncio.BufferedProtocol.buffer_updated``). Errors as in :meth:`feed`."""
        if self.error is not None:
            raise self.error
        big = self._big
        if big is not None:
            self._big_have += nbytes
            if self._big_have < len(big):
                return []
            self._big = None
            self._big_have = 0
            return [_frame_of(big)]
        frames: list[Frame] = []
        view = self._scratch
        pos = 0
        part = self._part
        if part:  # finish the frame (or header) begun by earlier reads
            pos = self._complete_part(view, nbytes, frames)
            if pos < 0:
                return frames
        unpack = HEADER.unpack_from
        while nbytes - pos >= HEADER_SIZE:
            length, api_key, version, flags, corr = unpack(view, pos)
            problem = self._check(length, flags)
            if problem is not None:
                return self._fail(problem, frames)
            end = pos + 4 + length
            if end <= nbytes:
                frames.append(Frame(api_key, version, flags, corr,
                                    bytes(view[pos + HEADER_SIZE : end])))
                pos = end
                continue
            if self._prealloc and 4 + length > BIG_FRAME_BYTES:
                big = bytearray(4 + length)
                have = nbytes - pos
                big[:have] = view[pos:nbytes]
                self._big = big
                self._big_have = have
                return frames
            break
        if pos < nbytes:
            self._part = bytearray(view[pos:nbytes])
        return frames

    def _complete_part(self, view: memoryview, nbytes: int, frames: list[Frame]) -> int:
        """Feed the start of a new read to the partial frame; where parsing of the read
        continues, or -1 when the read is used up (or the stream failed)."""
        part = self._part
        pos = 0
        if len(part) < HEADER_SIZE:
            take = min(HEADER_SIZE - len(part), nbytes)
            part += view[:take]
            pos = take
            if len(part) < HEADER_SIZE:
                return -1
        length, _key, _version, flags, _corr = HEADER.unpack_from(part)
        problem = self._check(length, flags)
        if problem is not None:
            self._fail(problem, frames)
            return -1
        need: int = 4 + length - len(part)
        if self._prealloc and need > nbytes - pos and 4 + length > BIG_FRAME_BYTES:
            big = bytearray(4 + length)
            big[: len(part)] = part
            have = len(part) + nbytes - pos
            big[len(part) : have] = view[pos:nbytes]
            self._part = bytearray()
            self._big = big
            self._big_have = have
            return -1
        take = min(need, nbytes - pos)
        part += view[pos : pos + take]
        pos += take
        if take < need:
            return -1
        self._part = bytearray()
        frames.append(_frame_of(part))
        return pos

    def _check(self, length: int, flags: int) -> RemoteProtocolError | None:
        if length > self._max - 4:
            return FrameSizeError(
                f"frame of {length + 4} bytes exceeds max_frame_bytes={self._max}")
        if length < _AFTER_LENGTH:
            return RemoteProtocolError(f"frame length {length} is shorter than its header")
        if flags & ~_KNOWN_FLAGS:
            return RemoteProtocolError(f"unknown frame flags {flags:#x}")
        return None

    def _fail(self, problem: RemoteProtocolError, frames: list[Frame]) -> list[Frame]:
        self.error = problem
        self._part = bytearray()
        self._big = None
        self._big_have = 0
        if frames:
            return frames
        raise problem


def _frame_of(buf: bytearray) -> Frame:
    """A frame held whole in its own buffer (header included); the payload is a view of it."""
    _length, api_key, version, flags, corr = HEADER.unpack_from(buf)
    return Frame(api_key, version, flags, corr, memoryview(buf)[HEADER_SIZE:])
