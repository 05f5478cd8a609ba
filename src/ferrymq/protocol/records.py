"""The record batch: FerryMQ's unit of storage and of transfer.

A producer encodes messages into a batch; the broker checks it, stamps the base offset and the
append time into the header and appends the bytes unchanged; a consumer receives the same bytes.
There is no per-message work on the broker's produce path beyond a structural walk.

Batch layout (little-endian, 64-byte header)::

    off  size  field
    0    8     base_offset       i64  stamped by the broker (0 from the producer)
    8    4     batch_length      i32  bytes after this field: total size = 12 + batch_length
    12   8     append_time_ms    i64  stamped by the broker (wall clock, never decreasing per queue)
    20   4     header_crc        u32  CRC32C of bytes [0, 20) then [24, 28)
    24   4     crc               u32  CRC32C of bytes [28, end): computed by the producer
    28   1     magic             u8   format version, 1 (2: an envelope, a Kafka batch
                                      stored as it came instead of these records, see
                                      ferrymq.protocol.kafka.envelope; a log holds both,
                                      readers get magic 1 only)
    29   1     attributes        u8   bits 0-1 compression (0 = none; format 1 accepts
                                      only 0); bit 2 dedup (every record carries a dedup
                                      key in a reserved property, see
                                      ferrymq.protocol.dedup: the broker reads keys only
                                      of such batches); bit 3 has keys (some
                                      record carries keys: the broker's key index reads
                                      only such batches); bit 4 transactional;
                                      bit 5 control batch (a commit/abort marker, see
                                      ferrymq.protocol.markers); bit 6 filtered (set by the broker
                                      on fetch: fewer records than record_count); bit 7
                                      scheduled (every record carries a due time in a
                                      reserved property, see ferrymq.protocol.schedule;
                                      readers skip the batch: consumers get the broker's
                                      copy when it is due)
    30   4     record_count      i32  >= 1
    34   8     first_timestamp   i64  producer's "born" time of the first record (ms)
    42   8     max_timestamp     i64  largest born time in the batch (ms)
    50   8     producer_id       i64  -1 when not idempotent
    58   2     producer_epoch    i16  -1 when not idempotent
    60   4     base_sequence     i32  sequence of the first record, per (producer, queue); -1 none
    64         records

Record layout (22-byte prefix)::

    off  size  field
    0    4     length            u32  bytes after this field
    4    4     offset_delta      u32  offset - base_offset (records of a filtered batch keep theirs)
    8    4     timestamp_delta   i32  born time - first_timestamp (ms)
    12   1     attributes        u8   reserved, 0
    13   1     tag_length        u8   the message's tag, UTF-8
    14   2     sharding_key_len  u16  UTF-8
    16   2     keys_length       u16  keys, UTF-8, joined by NUL
    18   4     properties_length u32  msgpack map str -> str
    22         tag, sharding key, keys, properties, then the body (the rest of the record)

Every byte of a batch is covered by one of the two CRCs, so a single flipped bit anywhere,
including in a length field, is detected.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import crc32c as _crc32c
import msgpack

from ferrymq.errors import BatchTooLargeError, CorruptRecordError, MessageTooLargeError

crc32c = _crc32c.crc32c

MAGIC = 1
HEADER = struct.Struct("<qiqIIBBiqqqhi")
HEADER_SIZE = HEADER.size  # 64
assert HEADER_SIZE == 64
LENGTH_PREFIX = 12  # base_offset + batch_length: what must be read to know a batch's size
RECORD_PREFIX = struct.Struct("<IIiBBHHI")
RECORD_PREFIX_SIZE = RECORD_PREFIX.size  # 22
assert RECORD_PREFIX_SIZE == 22
_LEN = struct.Struct("<i")
_BASE_LEN = struct.Struct("<qi")
_I = struct.Struct("<I")
_STAMP = struct.Struct("<qiq")
_PRODUCER = struct.Struct("<qhi")  # producer_id, producer_epoch, base_sequence at offset 50

ATTR_COMPRESSION_MASK = 0x03
"""Bits 0-1: the compression codec (0 = none, the only one format 1 accepts; 1-3 reserved).
Bit 2 was part of this field until dedup batches took it; a broker older than that refuses a
dedup batch as compressed rather than storing it without deduplicating."""
ATTR_DEDUP = 0x04
"""A dedup batch: every record carries a dedup key (``%DEDUP``, :mod:`ferrymq.protocol.dedup`).
The broker reads the keys only of such batches, and only for topics with a dedup window; the
batch carries no producer sequence (the key is what makes a retry harmless)."""
ATTR_HAS_KEYS = 0x08
ATTR_TRANSACTIONAL = 0x10
"""A data batch written inside a transaction (an idempotent batch of a transactional producer)."""
ATTR_CONTROL = 0x20
"""A control batch: a transaction's COMMIT/ABORT marker, written only by the broker
(:mod:`ferrymq.protocol.markers`); always set together with :data:`ATTR_TRANSACTIONAL`."""
ATTR_FILTERED = 0x40
"""Set by the broker on batches rebuilt by tag filtering: ``record_count`` still spans the
original offsets (so the consumer knows where to continue) but fewer records are present."""
ATTR_SCHEDULED = 0x80
"""A scheduled (delayed) batch: each record names its due time in a reserved property
(:mod:`ferrymq.protocol.schedule`). No reader hands its records to an application; when a
record is due the broker appends a copy (a normal batch) to the same queue. Its offsets are a
gap to consumers."""

NO_PRODUCER_ID = -1
NO_PRODUCER_EPOCH = -1
NO_SEQUENCE = -1
MAX_PRODUCER_EPOCH = 2**15 - 1  # i16

MAX_TAG_BYTES = 255  # u8 length field
MAX_TIMESTAMP_DELTA_MS = 2**31 - 1  # i32 timestamp_delta
MAX_SHARDING_KEY_BYTES = 0xFFFF  # u16 length field
MAX_KEYS_BYTES = 0xFFFF  # u16 length field

_pack_record = RECORD_PREFIX.pack
T = TypeVar("T")
C = TypeVar("C")


class BatchHeader(NamedTuple):
    """The decoded fixed header of a record batch."""

    base_offset: int
    batch_length: int
    append_time_ms: int
    header_crc: int
    crc: int
    magic: int
    attributes: int
    record_count: int
    first_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int

    @property
    def size(self) -> int:
        """Total size of the batch in bytes."""
        return LENGTH_PREFIX + self.batch_length

    @property
    def last_offset(self) -> int:
        """Offset of the last record (records of one batch have contiguous offsets)."""
        return self.base_offset + self.record_count - 1

    @property
    def last_sequence(self) -> int:
        """Sequence number of the last record, or -1."""
        if self.base_sequence < 0:
            return NO_SEQUENCE
        return self.base_sequence + self.record_count - 1


def decode_header(buf: bytes | bytearray | memoryview, pos: int = 0) -> BatchHeader:
    """Decode the header of the batch at ``pos`` (no CRC check)."""
    if len(buf) - pos < HEADER_SIZE:
        raise CorruptRecordError(f"truncated batch header at {pos}")
    return BatchHeader._make(HEADER.unpack_from(buf, pos))


def batch_size_at(buf: bytes | bytearray | memoryview, pos: int) -> int:
    """Size of the batch at ``pos`` from its length field, or -1 if fewer than 12 bytes remain."""
    if len(buf) - pos < LENGTH_PREFIX:
        return -1
    return LENGTH_PREFIX + int(_LEN.unpack_from(buf, pos + 8)[0])


def _header_crc(buf: bytes | bytearray | memoryview, pos: int) -> int:
    mv = memoryview(buf)
    return crc32c(mv[pos + 24 : pos + 28], crc32c(mv[pos : pos + 20]))


def seal_header_crc(buf: bytearray | memoryview, pos: int) -> None:
    """Recompute and store the header CRC of the batch at ``pos``."""
    _I.pack_into(buf, pos + 20, _header_crc(buf, pos))


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded record (message) of a batch."""

    offset: int
    timestamp: int
    tag: str | None
    sharding_key: str | None
    keys: tuple[str, ...]
    properties: dict[str, str]
    body: bytes


def encode_properties(properties: Mapping[str, str] | None) -> bytes:
    """Encode a message's properties (str -> str) as a msgpack map; empty when none."""
    if not properties:
        return b""
    return bytes(msgpack.packb(dict(properties), use_bin_type=True))


def decode_properties(raw: bytes | memoryview) -> dict[str, str]:
    """Decode properties written by :func:`encode_properties`."""
    if not raw:
        return {}
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types
        raise CorruptRecordError(f"bad properties: {exc}") from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise CorruptRecordError("properties must be a map of str to str")
    return value


class RecordInput(NamedTuple):
    """One message to encode: all fields already in their wire form."""

    body: bytes
    timestamp: int
    tag: bytes = b""
    sharding_key: bytes = b""
    keys: bytes = b""
    properties: bytes = b""


LARGE_BODY_BYTES = 2048
"""A body at least this large stays its own buffer in :func:`encode_batch_buffers`."""


@dataclass(eq=False, slots=True)
class BatchBuffers:
    """An encoded batch as buffers to be written together (``writev``), for batches of large
    bodies: the 64-byte header, then the records with each large body a buffer of its own, so
    encoding copies no body. ``len()`` is the batch's size; ``bytes()`` joins it."""

    header: bytearray
    parts: list[bytes | bytearray]
    size: int

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return bytes(self.header) + b"".join(self.parts)


def encode_batch(
    records: Sequence[RecordInput],
    *,
    producer_id: int = NO_PRODUCER_ID,
    producer_epoch: int = NO_PRODUCER_EPOCH,
    base_sequence: int = NO_SEQUENCE,
    attributes: int = 0,
) -> bytearray:
    """Encode messages into one record batch (base offset and append time left 0).

    Raises:
        BatchTooLargeError: no records.
        MessageTooLargeError: a field is larger than its length field can hold.
    """
    parts, first_ts, max_ts, attributes = _record_parts(records, attributes)
    buf = bytearray().join(parts)
    HEADER.pack_into(
        buf, 0, 0, len(buf) - LENGTH_PREFIX, 0, 0, 0, MAGIC, attributes, len(records),
        first_ts, max_ts, producer_id, producer_epoch, base_sequence,
    )
    _I.pack_into(buf, 24, crc32c(memoryview(buf)[28:]))
    seal_header_crc(buf, 0)
    return buf


def encode_batch_buffers(
    records: Sequence[RecordInput],
    *,
    producer_id: int = NO_PRODUCER_ID,
    producer_epoch: int = NO_PRODUCER_EPOCH,
    base_sequence: int = NO_SEQUENCE,
    attributes: int = 0,
) -> BatchBuffers:
    """Encode like :func:`encode_batch`, the same bytes, but as :class:`BatchBuffers`: bodies
    of at least ``LARGE_BODY_BYTES`` are not copied, everything between them is joined.

    Raises:
        BatchTooLargeError: no records.
        MessageTooLargeError: a field is larger than its length field can hold.
    """
    parts, first_ts, max_ts, attributes = _record_parts(records, attributes)
    out: list[bytes | bytearray] = []
    small: list[bytes] = []
    size = HEADER_SIZE
    for p in parts[1:]:
        size += len(p)
        if len(p) >= LARGE_BODY_BYTES:
            if small:
                out.append(bytearray().join(small))
                small = []
            out.append(p)
        else:
            small.append(p)
    if small:
        out.append(bytearray().join(small))
    header = bytearray(HEADER_SIZE)
    HEADER.pack_into(
        header, 0, 0, size - LENGTH_PREFIX, 0, 0, 0, MAGIC, attributes, len(records),
        first_ts, max_ts, producer_id, producer_epoch, base_sequence,
    )
    batch = BatchBuffers(header, out, size)
    _seal_buffers(batch)
    return batch


def _seal_buffers(batch: BatchBuffers) -> None:
    crc = crc32c(memoryview(batch.header)[28:])
    for p in batch.parts:
        crc = crc32c(p, crc)
    _I.pack_into(batch.header, 24, crc)
    seal_header_crc(batch.header, 0)


def _record_parts(records: Sequence[RecordInput], attributes: int
                  ) -> tuple[list[bytes], int, int, int]:
    """The batch's pieces (a placeholder header, then per record its prefix, its fields when it
    has any, and its body), the first and largest born times and the attributes."""
    if not records:
        raise BatchTooLargeError("a batch needs at least one record")
    first_ts = records[0][1]
    max_ts = first_ts
    if any(r[4] for r in records):
        attributes |= ATTR_HAS_KEYS
    parts: list[bytes] = [bytes(HEADER_SIZE)]
    append = parts.append
    try:
        for i, (body, ts, tag, sk, keys, props) in enumerate(records):
            if ts > max_ts:
                max_ts = ts
            if tag or sk or keys or props:
                if len(tag) > MAX_TAG_BYTES:
                    raise MessageTooLargeError(f"tag is {len(tag)} bytes, max {MAX_TAG_BYTES}")
                if len(sk) > MAX_SHARDING_KEY_BYTES or len(keys) > MAX_KEYS_BYTES:
                    raise MessageTooLargeError("sharding key or keys longer than 65535 bytes")
                append(
                    _pack_record(
                        18 + len(tag) + len(sk) + len(keys) + len(props) + len(body),
                        i, ts - first_ts, 0, len(tag), len(sk), len(keys), len(props),
                    )
                )
                append(tag + sk + keys + props)
            else:
                append(_pack_record(18 + len(body), i, ts - first_ts, 0, 0, 0, 0, 0))
            append(body)
    except struct.error:  # a timestamp delta beyond i32
        raise BatchTooLargeError("the born times of one batch must lie within 24 days") from None
    return parts, first_ts, max_ts, attributes


def stamp_batch(buf: bytearray, pos: int, base_offset: int, append_time_ms: int) -> None:
    """Write the broker-owned fields (base offset, append time) and fix the header CRC."""
    length = _LEN.unpack_from(buf, pos + 8)[0]
    _STAMP.pack_into(buf, pos, base_offset, length, append_time_ms)
    seal_header_crc(buf, pos)


def restamp_producer(buf: bytearray | BatchBuffers, producer_id: int, producer_epoch: int,
                     base_sequence: int) -> None:
    """Give the encoded batch in ``buf`` a new producer id, epoch and base sequence and fix
    both CRCs (an idempotent producer re-sending a batch under a new epoch)."""
    if isinstance(buf, BatchBuffers):
        _PRODUCER.pack_into(buf.header, 50, producer_id, producer_epoch, base_sequence)
        _seal_buffers(buf)
        return
    _PRODUCER.pack_into(buf, 50, producer_id, producer_epoch, base_sequence)
    _I.pack_into(buf, 24, crc32c(memoryview(buf)[28:]))
    seal_header_crc(buf, 0)


def validate_batch(
    buf: bytes | bytearray | memoryview,
    pos: int = 0,
    *,
    max_message_bytes: int,
    max_records: int,
    check_header_crc: bool = False,
) -> BatchHeader:
    """Check one batch from a producer (or from disk) and return its header.

    Checks the length against the buffer, the magic, the body CRC (and the header CRC when
    asked: batches from producers carry no stamped fields yet) and the record count. It does no
    per-record work unless the batch is larger than ``max_message_bytes``, the only case in which
    one record could be too large: then it walks the record lengths. Records are structurally
    checked by consumers when they decode them (:func:`iter_raw_records`), never trusted.

    Raises:
        CorruptRecordError: any structural or CRC failure.
        MessageTooLargeError: a record above ``max_message_bytes``.
        BatchTooLargeError: more records than ``max_records``.
    """
    avail = len(buf) - pos
    if avail < HEADER_SIZE:
        raise CorruptRecordError(f"batch of {avail} bytes is shorter than its header")
    h = BatchHeader._make(HEADER.unpack_from(buf, pos))
    size = LENGTH_PREFIX + h.batch_length
    if h.batch_length < HEADER_SIZE - LENGTH_PREFIX or size > avail:
        raise CorruptRecordError(f"batch length {h.batch_length} does not fit {avail} bytes")
    if h.magic != MAGIC:
        raise CorruptRecordError(f"unknown batch magic {h.magic}")
    mv = memoryview(buf)
    if crc32c(mv[pos + 28 : pos + size]) != h.crc:
        raise CorruptRecordError("batch CRC mismatch")
    if check_header_crc and _header_crc(buf, pos) != h.header_crc:
        raise CorruptRecordError("batch header CRC mismatch")
    count = h.record_count
    if count < 1:
        raise CorruptRecordError(f"batch has {count} records")
    if count > max_records:
        raise BatchTooLargeError(f"batch has {count} records, max {max_records}")
    if h.attributes & ATTR_COMPRESSION_MASK:
        raise CorruptRecordError("compressed batches are not supported in format 1")
    if size - HEADER_SIZE > max_message_bytes + 4:
        _check_record_lengths(buf, pos, size, count, max_message_bytes)
    return h


def _check_record_lengths(
    buf: bytes | bytearray | memoryview, pos: int, size: int, count: int, max_message_bytes: int
) -> None:
    end = pos + size
    p = pos + HEADER_SIZE
    unpack_len = _I.unpack_from
    for _ in range(count):
        if end - p < RECORD_PREFIX_SIZE:
            raise CorruptRecordError("record runs past the end of its batch")
        n = unpack_len(buf, p)[0]
        if n > max_message_bytes:
            raise MessageTooLargeError(f"message of {n} bytes, max {max_message_bytes}")
        if n < RECORD_PREFIX_SIZE - 4:
            raise CorruptRecordError(f"record length {n} is shorter than its prefix")
        p += 4 + n
    if p != end:
        raise CorruptRecordError("record lengths do not add up to the batch length")


def check_stored_batch(buf: bytes | bytearray | memoryview, pos: int = 0) -> BatchHeader:
    """Check both CRCs of a stamped batch (recovery): cheaper than a full record walk."""
    avail = len(buf) - pos
    if avail < HEADER_SIZE:
        raise CorruptRecordError("truncated batch header")
    h = BatchHeader._make(HEADER.unpack_from(buf, pos))
    size = LENGTH_PREFIX + h.batch_length
    if h.batch_length < HEADER_SIZE - LENGTH_PREFIX or size > avail:
        raise CorruptRecordError("truncated batch")
    if _header_crc(buf, pos) != h.header_crc:
        raise CorruptRecordError("batch header CRC mismatch")
    if h.magic != MAGIC or h.record_count < 1:
        raise CorruptRecordError("bad batch magic or record count")
    if crc32c(memoryview(buf)[pos + 28 : pos + size]) != h.crc:
        raise CorruptRecordError("batch CRC mismatch")
    return h


def iter_batches(buf: bytes | bytearray | memoryview) -> Iterator[tuple[int, BatchHeader]]:
    """Yield ``(position, header)`` for each complete batch in ``buf`` (no CRC check).

    A partial batch at the end (a fetch cut at ``max_bytes``) is ignored.
    """
    pos = 0
    n = len(buf)
    while n - pos >= HEADER_SIZE:
        h = BatchHeader._make(HEADER.unpack_from(buf, pos))
        size = LENGTH_PREFIX + h.batch_length
        if h.batch_length < HEADER_SIZE - LENGTH_PREFIX or pos + size > n:
            return
        yield pos, h
        pos += size


RawRecord = tuple[int, int, int, int, int, int, int, int]
"""(offset, timestamp, tag_start, tag_end, sk_end, keys_end, props_end, body_end) positions."""


_LENGTHS = struct.Struct("<I9xBHHI")  # a record's length, then tag/sk/keys/properties lengths
_unpack_lengths = _LENGTHS.unpack_from
_LEN_DELTA = struct.Struct("<II")  # a record's length and offset delta
_TS_DELTA = struct.Struct("<i")
_LEN_DELTA_TS = struct.Struct("<IIi")


def record_fields(buf: bytes | bytearray | memoryview, p: int) -> tuple[int, int, int, int, int, int]:
    """Field boundaries of the record at ``p``: (tag start, tag end = sharding key start,
    sharding key end, keys end, properties end = body start, body end).

    Raises:
        CorruptRecordError: the lengths run past the record.
    """
    n, tl, skl, kl, pl = _unpack_lengths(buf, p)
    t0 = p + RECORD_PREFIX_SIZE
    t1 = t0 + tl
    s1 = t1 + skl
    k1 = s1 + kl
    p1 = k1 + pl
    rend = p + 4 + n
    if p1 > rend:
        raise CorruptRecordError(f"record at position {p}: fields run past the record")
    return t0, t1, s1, k1, p1, rend


def record_body(buf: bytes, p: int) -> bytes:
    """The body of the record at ``p`` (the hot path of consumers: one unpack, one slice)."""
    n, tl, skl, kl, pl = _unpack_lengths(buf, p)
    start = p + RECORD_PREFIX_SIZE + tl + skl + kl + pl
    end = p + 4 + n
    if start > end:
        raise CorruptRecordError(f"record at position {p}: fields run past the record")
    return buf[start:end]


def record_timestamp_delta(buf: bytes | bytearray | memoryview, p: int) -> int:
    """The born-time delta (ms) of the record at ``p``."""
    return int(_TS_DELTA.unpack_from(buf, p + 8)[0])


def walk_records(
    buf: bytes, pos: int, h: BatchHeader, start: int,
    make: Callable[[C, bytes, int, int], T], ctx: C,
) -> list[T] | None:
    """``make(ctx, buf, record position, offset)`` for each record of the batch at ``pos`` whose offset is
    at least ``start``; None when the record lengths do not add up to the batch (a batch that
    is CRC-valid but malformed inside). One ``unpack_from`` per record: consumers build their
    lazy messages with it.
    """
    out: list[T] = []
    app = out.append
    unpack = _LEN_DELTA.unpack_from
    base = h.base_offset
    p = pos + HEADER_SIZE
    end = pos + LENGTH_PREFIX + h.batch_length
    try:
        while p < end:
            length, delta = unpack(buf, p)
            off = base + delta
            if off >= start:
                app(make(ctx, buf, p, off))
            p += 4 + length
    except struct.error:
        return None
    return out if p == end else None


def iter_raw_records(
    buf: bytes | bytearray | memoryview, pos: int, h: BatchHeader
) -> Iterator[RawRecord]:
    """Yield the positions of each record's fields in a batch; decode nothing.

    Consumers build lazy messages from these positions, so a message that is skipped costs one
    ``unpack_from``.
    """
    p = pos + HEADER_SIZE
    end = pos + LENGTH_PREFIX + h.batch_length
    base = h.base_offset
    first_ts = h.first_timestamp
    unpack = _LEN_DELTA_TS.unpack_from
    n_left = h.record_count
    while p < end:
        if end - p < RECORD_PREFIX_SIZE or n_left <= 0:
            raise CorruptRecordError(f"batch at offset {base}: records do not fit the batch")
        _n, odelta, tdelta = unpack(buf, p)
        t0, t1, s1, k1, p1, rend = record_fields(buf, p)
        if rend > end:
            raise CorruptRecordError(f"batch at offset {base}: record runs past its batch")
        n_left -= 1
        yield (base + odelta, first_ts + tdelta, t0, t1, s1, k1, p1, rend)
        p = rend
    if n_left and not h.attributes & ATTR_FILTERED:
        raise CorruptRecordError(f"batch at offset {base}: fewer records than its count")


def decode_records(buf: bytes | bytearray | memoryview) -> list[Record]:
    """Decode every record of every complete batch in ``buf`` (tests and tools; not hot)."""
    mv = memoryview(buf)
    out: list[Record] = []
    for pos, h in iter_batches(mv):
        for off, ts, t0, t1, s1, k1, p1, rend in iter_raw_records(mv, pos, h):
            try:
                tag = bytes(mv[t0:t1]).decode() if t1 > t0 else None
                sk = bytes(mv[t1:s1]).decode() if s1 > t1 else None
                keys = tuple(bytes(mv[s1:k1]).decode().split("\x00")) if k1 > s1 else ()
            except UnicodeDecodeError:
                raise CorruptRecordError(f"record at offset {off}: text field is not UTF-8") from None
            props = decode_properties(bytes(mv[k1:p1]))
            out.append(Record(off, ts, tag, sk, keys, props, bytes(mv[p1:rend])))
    return out


def filter_batch(
    buf: bytes | bytearray | memoryview, pos: int, h: BatchHeader, keep: Sequence[RawRecord]
) -> bytes:
    """Build a batch with the same header holding only ``keep`` (records keep their offsets).

    Used by server-side tag filtering: ``record_count`` is kept (it tells the consumer where the
    original batch ended), ``ATTR_FILTERED`` is set, both CRCs are recomputed.
    """
    mv = memoryview(buf)
    parts: list[bytes | memoryview] = [bytes(HEADER_SIZE)]
    for rec in keep:
        start = rec[2] - RECORD_PREFIX_SIZE
        parts.append(mv[start : rec[7]])
    out = bytearray().join(parts)
    out[0:HEADER_SIZE] = mv[pos : pos + HEADER_SIZE]
    _LEN.pack_into(out, 8, len(out) - LENGTH_PREFIX)
    out[29] |= ATTR_FILTERED
    _I.pack_into(out, 24, crc32c(memoryview(out)[28:]))
    seal_header_crc(out, 0)
    return bytes(out)


def select_records(
    buf: bytes | bytearray | memoryview, pos: int, h: BatchHeader, keep: Sequence[RawRecord]
) -> bytearray:
    """A new batch holding only ``keep`` (records of the batch at ``pos``, in order), renumbered.

    Unlike :func:`filter_batch` the result is an ordinary batch: its records get offset deltas
    ``0..len(keep)-1`` and ``record_count`` is ``len(keep)``, so it can be appended like one a
    producer built. The header is otherwise kept (``first_timestamp`` too, so the records'
    timestamp deltas stay valid even when the first record is not kept; ``max_timestamp`` is
    that of the kept records), both CRCs are fresh. Used by
    the broker to store the new records of a dedup batch without its duplicates.

    Raises:
        BatchTooLargeError: ``keep`` is empty (a batch needs a record).
    """
    if not keep:
        raise BatchTooLargeError("a batch needs at least one record")
    mv = memoryview(buf)
    parts: list[bytes | memoryview] = [mv[pos : pos + HEADER_SIZE]]
    max_ts = keep[0][1]
    for rec in keep:
        parts.append(mv[rec[2] - RECORD_PREFIX_SIZE : rec[7]])
        if rec[1] > max_ts:
            max_ts = rec[1]
    out = bytearray().join(parts)
    fields = list(HEADER.unpack_from(out, 0))
    fields[1] = len(out) - LENGTH_PREFIX
    fields[7] = len(keep)
    fields[9] = max_ts
    HEADER.pack_into(out, 0, *fields)
    p = HEADER_SIZE
    for i, rec in enumerate(keep):
        _I.pack_into(out, p + 4, i)  # offset_delta
        p += rec[7] - rec[2] + RECORD_PREFIX_SIZE
    _I.pack_into(out, 24, crc32c(memoryview(out)[28:]))
    seal_header_crc(out, 0)
    return out


def encode_skip_batch(header: bytes | bytearray | memoryview, first: int, last: int) -> bytes:
    """A header-only batch covering offsets ``first..last`` whose records were all filtered out
    (from ``header``, the first of them): the consumer moves past them without records. It is
    never a transactional or control batch, whatever the first one was."""
    buf = bytearray(header[:HEADER_SIZE])
    fields = list(HEADER.unpack_from(buf, 0))
    fields[0] = first
    fields[1] = HEADER_SIZE - LENGTH_PREFIX
    fields[6] = (fields[6] & ~(ATTR_TRANSACTIONAL | ATTR_CONTROL)) | ATTR_FILTERED
    fields[7] = last - first + 1
    HEADER.pack_into(buf, 0, *fields)
    _I.pack_into(buf, 24, crc32c(memoryview(buf)[28:]))
    seal_header_crc(buf, 0)
    return bytes(buf)


def encode_msg_id(topic_id: int, queue: int, offset: int) -> str:
    """A message id: topic id, queue and offset in 28 hex digits (RocketMQ's offsetMsgId idea).

    It is derived, so it needs no storage and no index: the broker finds a message by its id
    directly.
    """
    return f"{topic_id:08X}{queue:04X}{offset:016X}"


def decode_msg_id(msg_id: str) -> tuple[int, int, int]:
    """Split a message id into ``(topic_id, queue, offset)``.

    Raises:
        ValueError: not a FerryMQ message id.
    """
    if len(msg_id) != 28:
        raise ValueError(f"not a message id: {msg_id!r}")
    return int(msg_id[:8], 16), int(msg_id[8:12], 16), int(msg_id[12:], 16)
