"""Kafka's Produce request and response, versions 3 to 9, by hand. Sans-IO.

Every other API goes through ``kio`` (:mod:`ferrymq.protocol.kafka.apis`). Produce is the hot
path: a client sends one request per partition batch (librdkafka) or per broker, and kio's
generic reader and writer cost more per request than the whole append (about 70 µs to encode
one response; the records are copied out of the frame). Here the request is read with
``struct`` and each partition's records stay a ``memoryview`` of the frame, and the response is
packed in one pass. ``tests/unit/protocol/test_kafka_produce_codec.py`` checks both against kio
for every version, so the layouts below are Kafka's, not a guess::

    ProduceRequest (v3-v8; v9 is flexible: compact strings, arrays and bytes, tagged fields
    after every struct)
      transactional_id  nullable string
      acks              int16
      timeout_ms        int32
      topic_data        [name string, partition_data [index int32, records nullable bytes]]

    ProduceResponse
      responses         [name string, partition_responses [
                           index int32, error_code int16, base_offset int64,
                           log_append_time_ms int64, log_start_offset int64 (v5+),
                           record_errors [batch_index int32, message nullable string] (v8+),
                           error_message nullable string (v8+)]]
      throttle_time_ms  int32
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from ferrymq.errors import RemoteProtocolError

MIN_VERSION = 3
MAX_VERSION = 9
FLEXIBLE_FROM = 9

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_ACKS_TIMEOUT = struct.Struct(">hi")
_PARTITION_V3 = struct.Struct(">ihqq")  # index, error, base offset, append time
_PARTITION_V5 = struct.Struct(">ihqqq")  # ... and log start offset
_NO_TAGS = b"\x00"


class PartitionData(NamedTuple):
    """One partition's batch of a Produce request: ``records`` is a view of the frame
    (None: the client sent null). ``roomy``: when the ``room`` bytes right before the records
    in the frame's buffer were already decoded (free to overwrite) and the buffer is writable,
    a view of those bytes and the records together; else None."""

    partition: int
    records: memoryview | None
    roomy: memoryview | None = None


class TopicData(NamedTuple):
    """One topic of a Produce request."""

    name: str
    partitions: list[PartitionData]


class ProduceRequestView(NamedTuple):
    """A decoded Produce request."""

    transactional_id: str | None
    acks: int
    timeout_ms: int
    topics: list[TopicData]


class PartitionResult(NamedTuple):
    """One partition's answer (``error_message`` None: none; ``base_offset`` -1 on error)."""

    partition: int
    error_code: int
    base_offset: int
    error_message: str | None = None


class _Reader:
    """Bounds-checked reads from a frame; every fault is a :class:`RemoteProtocolError`."""

    __slots__ = ("buf", "end", "mv", "pos")

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int) -> None:
        self.buf = buf
        self.mv = memoryview(buf)
        self.pos = pos
        self.end = len(buf)

    def fail(self, what: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"cannot decode ProduceRequest: {what} at byte {self.pos}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise self.fail(f"{what} runs past the frame")

    def i16(self) -> int:
        self.need(2, "int16")
        (v,) = _I16.unpack_from(self.buf, self.pos)
        self.pos += 2
        return int(v)

    def i32(self) -> int:
        self.need(4, "int32")
        (v,) = _I32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(v)

    def uvarint(self) -> int:
        value = shift = 0
        buf, pos = self.buf, self.pos
        while True:
            if pos >= self.end or shift > 28:
                self.pos = pos
                raise self.fail("bad unsigned varint")
            b = buf[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            if b < 0x80:
                self.pos = pos
                return value
            shift += 7

    def length(self, flexible: bool, what: str) -> int:
        """A string, bytes or array length; -1: null."""
        if flexible:
            return self.uvarint() - 1
        return self.i16() if what == "string" else self.i32()

    def string(self, flexible: bool, *, nullable: bool) -> str | None:
        n = self.length(flexible, "string")
        if n < 0:
            if n == -1 and nullable:
                return None
            raise self.fail(f"string length {n}")
        self.need(n, "string")
        start = self.pos
        self.pos += n
        try:
            return str(self.mv[start:self.pos], "utf-8")
        except UnicodeDecodeError:
            raise self.fail("a string that is not UTF-8") from None

    def count(self, flexible: bool, what: str) -> int:
        n = self.length(flexible, "array")
        if n < 0:
            raise self.fail(f"{what} array of length {n}")
        # each element takes at least one byte: a count beyond the frame is refused before
        # anything is allocated for it
        self.need(n, f"{what} array")
        return n

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()  # tag
            size = self.uvarint()
            self.need(size, "tagged field")
            self.pos += size


def decode_request(frame: bytes | bytearray | memoryview, pos: int,
                   version: int, *, room: int = 0) -> ProduceRequestView:
    """The Produce request of ``version`` whose body starts at ``pos`` of ``frame``. Bytes
    after the body are ignored (as :func:`ferrymq.protocol.kafka.apis.decode_request`).

    ``room``: look for that many free bytes before each partition's records (everything before
    ``pos`` counts as free, and what this request's decoding has passed, up to the previous
    records' end), to fill :attr:`PartitionData.roomy`; 0: never.

    Raises:
        RemoteProtocolError: a version outside 3..9, or a body that does not parse.
    """
    if not MIN_VERSION <= version <= MAX_VERSION:
        raise RemoteProtocolError(f"ProduceRequest v{version}: versions {MIN_VERSION}.."
                                  f"{MAX_VERSION} are decoded here")
    flex = version >= FLEXIBLE_FROM
    r = _Reader(frame, pos)
    transactional_id = r.string(flex, nullable=True)
    r.need(_ACKS_TIMEOUT.size, "acks and timeout")
    acks, timeout_ms = _ACKS_TIMEOUT.unpack_from(frame, r.pos)
    r.pos += _ACKS_TIMEOUT.size
    topics: list[TopicData] = []
    writable = room > 0 and not r.mv.readonly
    free_from = 0  # bytes before this are decoded and belong to no records
    for _ in range(r.count(flex, "topic")):
        name = r.string(flex, nullable=False)
        assert name is not None
        parts: list[PartitionData] = []
        for _ in range(r.count(flex, "partition")):
            index = r.i32()
            n = r.length(flex, "bytes")
            if n < -1:
                raise r.fail(f"records length {n}")
            records: memoryview | None = None
            roomy: memoryview | None = None
            if n >= 0:
                r.need(n, "records")
                records = r.mv[r.pos:r.pos + n]
                if writable and r.pos - free_from >= room:
                    roomy = r.mv[r.pos - room:r.pos + n]
                r.pos += n
                free_from = r.pos
            if flex:
                r.skip_tags()
            parts.append(PartitionData(index, records, roomy))
        if flex:
            r.skip_tags()
        topics.append(TopicData(name, parts))
    if flex:
        r.skip_tags()
    return ProduceRequestView(transactional_id, int(acks), int(timeout_ms), topics)


def _put_length(out: bytearray, n: int, flex: bool, *, string: bool) -> None:
    """A length (-1: null) as the version writes it."""
    if flex:
        _put_uvarint(out, n + 1)
    elif string:
        out += _I16.pack(n)
    else:
        out += _I32.pack(n)


def _put_uvarint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _put_string(out: bytearray, value: str | None, flex: bool) -> None:
    if value is None:
        _put_length(out, -1, flex, string=True)
        return
    raw = value.encode()
    _put_length(out, len(raw), flex, string=True)
    out += raw


def encode_response(version: int, topics: list[tuple[str, list[PartitionResult]]],
                    throttle_ms: int = 0) -> bytes:
    """The body of a Produce response of ``version`` (3..9): for each topic its partitions'
    results in the order given; no append time (-1, CreateTime topics), no log start offset
    (-1), no per-record errors."""
    flex = version >= FLEXIBLE_FROM
    out = bytearray()
    _put_length(out, len(topics), flex, string=False)
    part = _PARTITION_V5 if version >= 5 else _PARTITION_V3
    for name, parts in topics:
        _put_string(out, name, flex)
        _put_length(out, len(parts), flex, string=False)
        for p in parts:
            if version >= 5:
                out += part.pack(p.partition, p.error_code, p.base_offset, -1, -1)
            else:
                out += part.pack(p.partition, p.error_code, p.base_offset, -1)
            if version >= 8:
                _put_length(out, 0, flex, string=False)  # record_errors: none
                _put_string(out, p.error_message, flex)
            if flex:
                out += _NO_TAGS
        if flex:
            out += _NO_TAGS
    out += _I32.pack(throttle_ms)
    if flex:
        out += _NO_TAGS
    return bytes(out)
