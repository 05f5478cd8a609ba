"""Kafka's record batch (magic 2) and its conversion to and from FerryMQ's batch. Sans-IO.

Kafka batch layout (big-endian, 61-byte header; KIP-98, kafka.apache.org/documentation/#recordbatch)::

    off  size  field
    0    8     baseOffset            i64
    8    4     batchLength           i32  bytes after this field
    12   4     partitionLeaderEpoch  i32
    16   1     magic                 i8   2
    17   4     crc                   u32  CRC-32C of bytes [21, end)
    21   2     attributes            i16  bits 0-2 compression (0 none, 1 gzip, 2 snappy,
                                          3 lz4, 4 zstd); bit 3 timestamp type (1: log append
                                          time); bit 4 transactional; bit 5 control
    23   4     lastOffsetDelta       i32
    27   8     baseTimestamp         i64
    35   8     maxTimestamp          i64
    43   8     producerId            i64
    51   2     producerEpoch         i16
    53   4     baseSequence          i32
    57   4     recordCount           i32
    61         records (compressed together when bits 0-2 say so)

Record: ``length`` varint, ``attributes`` i8, ``timestampDelta`` varlong, ``offsetDelta``
varint, ``keyLength`` varint (-1: null) and key, ``valueLength`` varint (-1: null) and value,
``headerCount`` varint, then per header ``keyLength`` varint, key (UTF-8), ``valueLength``
varint (-1: null), value. Varints are zig-zag encoded (protobuf's sint).

FerryMQ stores what Kafka clients produce as it came (:mod:`ferrymq.protocol.kafka.envelope`);
the conversions here run only for a reader of the other protocol: a stored Kafka batch read by
a FerryMQ reader becomes a FerryMQ batch (:func:`to_ferrymq`), FerryMQ batches read by a Kafka
reader become Kafka batches (:func:`to_kafka`), record by record, with the same offsets; the
mapping of keys, tags and properties to Kafka keys and headers is in docs/kafka.md. The CRC-32C
of a Kafka batch is checked before anything of it is used.
"""

from __future__ import annotations

import base64
import binascii
import struct
import zlib
from collections.abc import Iterator
from typing import NamedTuple

from ferrymq.errors import CorruptRecordError, InvalidRequestError, MessageTooLargeError
from ferrymq.protocol.markers import marker_of
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    MAX_SHARDING_KEY_BYTES,
    MAX_TAG_BYTES,
    MAX_TIMESTAMP_DELTA_MS,
    BatchHeader,
    RecordInput,
    crc32c,
    decode_properties,
    encode_batch,
    encode_properties,
    iter_batches,
    iter_raw_records,
)

MAGIC = 2
HEADER = struct.Struct(">qiibIhiqqqhii")
HEADER_SIZE = HEADER.size  # 61
assert HEADER_SIZE == 61
CRC_START = 21
"""The CRC-32C covers the batch from its attributes (offset 21) to its end."""

COMPRESSION_MASK = 0x07
COMPRESSION_NONE = 0
COMPRESSION_GZIP = 1
COMPRESSION_SNAPPY = 2
COMPRESSION_LZ4 = 3
COMPRESSION_ZSTD = 4
CODEC_NAMES = {COMPRESSION_GZIP: "gzip", COMPRESSION_SNAPPY: "snappy", COMPRESSION_LZ4: "lz4",
               COMPRESSION_ZSTD: "zstd"}
KAFKA_ATTR_LOG_APPEND_TIME = 0x08
KAFKA_ATTR_TRANSACTIONAL = 0x10
KAFKA_ATTR_CONTROL = 0x20

TAG_HEADER = "ferrymq.tag"
"""The Kafka header carrying a FerryMQ message's tag (one; UTF-8, at most 255 bytes)."""
KEY_HEADER = "ferrymq.key"
"""The Kafka header carrying one of a FerryMQ message's keys (one header per key)."""
BINARY_KEY_PROPERTY = "%KAFKA_KEY_B64"
"""Where a Kafka key that is no UTF-8 text (or longer than a sharding key may be) is kept:
base64 in this property (the message then has no sharding key)."""
NULL_VALUE_PROPERTY = "%KAFKA_NULL_VALUE"
"""Present (empty) on a message stored from a Kafka record whose value was null (a
tombstone): its FerryMQ body is empty, and Kafka readers get null back."""
BINARY_HEADER_PREFIX = "%KAFKA_B64:"
"""A Kafka header whose value is no UTF-8 text is kept as the property ``%KAFKA_B64:<name>``
with the value in base64."""

_B64_PREFIX_LEN = len(BINARY_HEADER_PREFIX)
_CONTROL_KEY = struct.Struct(">hh")  # version 0, type (0 abort, 1 commit)
_CONTROL_VALUE = struct.Struct(">hi")  # version 0, coordinator epoch


class KafkaBatchHeader(NamedTuple):
    """The decoded header of a Kafka batch."""

    base_offset: int
    batch_length: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    record_count: int


class KafkaRecord(NamedTuple):
    """One Kafka record, its offset and timestamp resolved."""

    offset_delta: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


# -- varints -------------------------------------------------------------------------------------


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """Decode a zig-zag varint (at most 10 bytes) at ``pos``: (value, position after it).

    Raises:
        CorruptRecordError: it runs past the buffer or is longer than 10 bytes.
    """
    if pos < len(buf):
        b = buf[pos]
        if b < 0x80:  # one byte: most lengths, deltas and counts
            return (b >> 1) ^ -(b & 1), pos + 1
    shift = 0
    raw = 0
    n = len(buf)
    while True:
        if pos >= n or shift > 63:
            raise CorruptRecordError("Kafka record: truncated or overlong varint")
        b = buf[pos]
        pos += 1
        raw |= (b & 0x7F) << shift
        if b < 0x80:
            return (raw >> 1) ^ -(raw & 1), pos
        shift += 7


def write_varint(out: bytearray, value: int) -> None:
    """Append ``value`` zig-zag encoded as a varint."""
    raw = (value << 1) ^ (value >> 63)
    raw &= 0xFFFFFFFFFFFFFFFF
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    out.append(raw)


def _read_bytes(buf: bytes | memoryview, pos: int, end: int) -> tuple[bytes | None, int]:
    n, pos = read_varint(buf, pos)
    if n < 0:
        return None, pos
    if pos + n > end:
        raise CorruptRecordError("Kafka record: a field runs past its record")
    return bytes(buf[pos:pos + n]), pos + n


def _write_bytes(out: bytearray, value: bytes | None) -> None:
    if value is None:
        out.append(1)  # zig-zag -1
        return
    write_varint(out, len(value))
    out += value


# -- decoding ------------------------------------------------------------------------------------


def decode_header(buf: bytes | memoryview, pos: int = 0) -> KafkaBatchHeader:
    """Decode the 61-byte header at ``pos`` (no check).

    Raises:
        CorruptRecordError: fewer than 61 bytes.
    """
    if len(buf) - pos < HEADER_SIZE:
        raise CorruptRecordError(f"Kafka record batch shorter than its {HEADER_SIZE}-byte header")
    return KafkaBatchHeader(*HEADER.unpack_from(buf, pos))


def check_batch(data: bytes | memoryview) -> KafkaBatchHeader:
    """Check that ``data`` is exactly one Kafka batch of magic 2 whose CRC-32C is right.

    Raises:
        CorruptRecordError: not magic 2, a length that is not the data's, a CRC mismatch, a
            record count below 1.
    """
    h = decode_header(data)
    if h.magic != MAGIC:
        raise CorruptRecordError(f"Kafka record batch of magic {h.magic}: only magic 2 (Kafka "
                                 "0.11 and later) is accepted")
    if h.batch_length + 12 != len(data):
        raise CorruptRecordError(
            f"Kafka produce data of {len(data)} bytes is not one record batch (its header says "
            f"{h.batch_length + 12}): send one batch per partition")
    crc = crc32c(memoryview(data)[CRC_START:]) & 0xFFFFFFFF
    if crc != h.crc & 0xFFFFFFFF:
        raise CorruptRecordError(f"Kafka record batch CRC-32C mismatch (header {h.crc & 0xFFFFFFFF:#010x}, "
                                 f"data {crc:#010x})")
    if h.record_count < 1:
        raise CorruptRecordError(f"Kafka record batch with {h.record_count} records")
    return h


def decompress(codec: int, data: bytes | memoryview, max_bytes: int) -> bytes:
    """The records of a compressed batch, at most ``max_bytes`` of them: the output buffer is
    bounded before anything is decompressed (a small batch that inflates without bound is
    refused, never held).

    Raises:
        CorruptRecordError: an unknown codec, data the codec cannot read.
        MessageTooLargeError: more than ``max_bytes`` once decompressed.
    """
    name = CODEC_NAMES.get(codec)
    if name is None:
        raise CorruptRecordError(f"Kafka record batch with unknown compression codec {codec}")
    try:
        if codec == COMPRESSION_GZIP:
            d = zlib.decompressobj(wbits=47)  # gzip or zlib header
            out = d.decompress(bytes(data), max_bytes + 1)
        else:
            out = _cramjam_decompress(codec, bytes(data), max_bytes)
    except MessageTooLargeError:
        raise
    except Exception as exc:  # noqa: BLE001 - zlib.error, cramjam's DecompressionError
        raise CorruptRecordError(f"Kafka record batch: its {name} data cannot be read: "
                                 f"{exc}") from None
    if len(out) > max_bytes:
        raise _too_large(max_bytes)
    return out


def _too_large(max_bytes: int) -> MessageTooLargeError:
    return MessageTooLargeError(f"Kafka record batch decompresses to more than "
                                f"{max_bytes} bytes (max_frame_bytes: a batch must fit a frame)")


_XERIAL_MAGIC = b"\x82SNAPPY\x00"
_CRAMJAM_FULL = ("failed to write whole buffer", "smaller than required")
"""What cramjam says when the output buffer is too small (the batch inflates past the limit)."""


def _cramjam_decompress(codec: int, data: bytes, max_bytes: int) -> bytes:
    """snappy (raw, or the Java client's xerial framing), lz4 (frame) or zstd into a buffer of
    ``max_bytes + 1``."""
    import cramjam  # only when a compressed batch arrives

    out = bytearray(max_bytes + 1)
    try:
        if codec == COMPRESSION_SNAPPY and data.startswith(_XERIAL_MAGIC):
            n = 0  # (i32 length, raw snappy block) pairs after a 16-byte header
            p = 16
            while p + 4 <= len(data):
                (size,) = struct.unpack_from(">i", data, p)
                block = data[p + 4:p + 4 + size]
                if n + cramjam.snappy.decompress_raw_len(block) > max_bytes:
                    raise _too_large(max_bytes)
                n += cramjam.snappy.decompress_raw_into(block, memoryview(out)[n:])
                p += 4 + size
        elif codec == COMPRESSION_SNAPPY:
            n = cramjam.snappy.decompress_raw_into(data, out)
        elif codec == COMPRESSION_LZ4:
            n = cramjam.lz4.decompress_into(data, out)
        else:
            n = cramjam.zstd.decompress_into(data, out)
    except cramjam.DecompressionError as exc:
        if any(s in str(exc) for s in _CRAMJAM_FULL):
            raise _too_large(max_bytes) from None
        raise
    return bytes(memoryview(out)[:n])


def iter_records(h: KafkaBatchHeader, data: bytes | memoryview) -> Iterator[KafkaRecord]:
    """The records of a checked batch (``data`` its records, decompressed).

    Raises:
        CorruptRecordError: a record that does not parse, fewer or more records than the count.
    """
    pos = 0
    end = len(data)
    for _ in range(h.record_count):
        length, pos = read_varint(data, pos)
        rend = pos + length
        if length < 6 or rend > end:
            raise CorruptRecordError("Kafka record batch: a record runs past its batch")
        pos += 1  # attributes
        ts_delta, pos = read_varint(data, pos)
        off_delta, pos = read_varint(data, pos)
        key, pos = _read_bytes(data, pos, rend)
        value, pos = _read_bytes(data, pos, rend)
        count, pos = read_varint(data, pos)
        if count < 0 or count > length:
            raise CorruptRecordError(f"Kafka record with {count} headers")
        headers: list[tuple[str, bytes | None]] = []
        for _h in range(count):
            hk, pos = _read_bytes(data, pos, rend)
            hv, pos = _read_bytes(data, pos, rend)
            if hk is None:
                raise CorruptRecordError("Kafka record header with a null key")
            try:
                headers.append((hk.decode(), hv))
            except UnicodeDecodeError:
                raise CorruptRecordError("Kafka record header key is not UTF-8") from None
        if pos != rend:
            raise CorruptRecordError("Kafka record: its fields do not fill its length")
        yield KafkaRecord(off_delta, h.base_timestamp + ts_delta, key, value, headers)
    if pos != end:
        raise CorruptRecordError(f"Kafka record batch holds more than its {h.record_count} records")


# -- Kafka -> FerryMQ ----------------------------------------------------------------------------


def to_ferrymq(data: bytes | memoryview, *, max_batch_bytes: int) -> bytearray:
    """Convert one Kafka batch (a produce's data for one partition) into a FerryMQ batch with
    the same producer id, epoch and base sequence; the CRC-32C is checked first.

    Raises:
        CorruptRecordError: see :func:`check_batch`, :func:`iter_records`; offset deltas that
            are not 0, 1, 2, ... (a producer's batch has them contiguous).
        MessageTooLargeError: it decompresses to more than ``max_batch_bytes``.
        CorruptRecordError: a control batch (only the broker writes markers).
        InvalidRequestError: timestamps further apart than a FerryMQ batch can hold.
    """
    h = check_batch(data)
    if h.attributes & KAFKA_ATTR_CONTROL:
        raise CorruptRecordError("a control batch from a client: only the broker writes "
                                 "transaction markers")
    body = bytes(memoryview(data)[HEADER_SIZE:])  # bytes: faster to index and slice
    codec = h.attributes & COMPRESSION_MASK
    records = iter_records(h, decompress(codec, body, max_batch_bytes) if codec else body)
    inputs: list[RecordInput] = []
    for i, r in enumerate(records):
        if r.offset_delta != i:
            raise CorruptRecordError(f"Kafka record {i} of a produced batch has offset delta "
                                     f"{r.offset_delta}")
        if inputs and not -MAX_TIMESTAMP_DELTA_MS <= r.timestamp - inputs[0].timestamp \
                <= MAX_TIMESTAMP_DELTA_MS:
            raise InvalidRequestError(
                f"Kafka record {i} is timestamped {r.timestamp - inputs[0].timestamp} ms from "
                f"the first of its batch: FerryMQ keeps a batch within +-{MAX_TIMESTAMP_DELTA_MS} "
                "ms (24.8 days); send such records in separate batches")
        inputs.append(_record_input(r))
    return encode_batch(inputs, producer_id=h.producer_id, producer_epoch=h.producer_epoch,
                        base_sequence=h.base_sequence,
                        attributes=ATTR_TRANSACTIONAL if h.attributes & KAFKA_ATTR_TRANSACTIONAL
                        else 0)


def _record_input(r: KafkaRecord) -> RecordInput:
    tag = b""
    keys: list[bytes] = []
    props: dict[str, str] = {}
    for name, value in r.headers:
        if name == TAG_HEADER and value is not None and len(value) <= MAX_TAG_BYTES \
                and _is_text(value):
            tag = value
        elif name == KEY_HEADER and value and b"\x00" not in value and _is_text(value):
            keys.append(value)
        elif value is None:
            props[name] = ""
        else:
            try:
                props[name] = value.decode()
            except UnicodeDecodeError:
                props[BINARY_HEADER_PREFIX + name] = base64.b64encode(value).decode()
    sharding_key = b""
    if r.key is not None:
        if r.key and len(r.key) <= MAX_SHARDING_KEY_BYTES and _is_text(r.key):
            sharding_key = r.key
        else:
            props[BINARY_KEY_PROPERTY] = base64.b64encode(r.key).decode()
    if r.value is None:
        props[NULL_VALUE_PROPERTY] = ""
    return RecordInput(r.value or b"", r.timestamp, tag, sharding_key, b"\x00".join(keys),
                       encode_properties(props))


def _is_text(value: bytes) -> bool:
    try:
        value.decode()
    except UnicodeDecodeError:
        return False
    return True


# -- FerryMQ -> Kafka ----------------------------------------------------------------------------


def to_kafka(data: bytes | memoryview) -> bytes:
    """Convert the FerryMQ batches of a fetch into Kafka batches with the same offsets.

    A trailing partial batch is left out (as Kafka clients ignore one). Scheduled originals
    (hidden from every reader) become empty Kafka batches spanning their offsets, so a Kafka
    reader moves past them; transaction markers become Kafka control batches.

    Raises:
        CorruptRecordError: a batch whose records do not parse.
    """
    mv = memoryview(data)
    out = bytearray()
    for pos, h in iter_batches(mv):
        start = len(out)
        out += bytes(HEADER_SIZE)
        count = 0
        attributes = KAFKA_ATTR_TRANSACTIONAL if h.attributes & ATTR_TRANSACTIONAL else 0
        if h.attributes & ATTR_CONTROL:
            attributes |= KAFKA_ATTR_CONTROL
            marker = marker_of(mv, pos, h)
            _append_record(out, 0, 0, _CONTROL_KEY.pack(0, 1 if marker.commit else 0),
                           _CONTROL_VALUE.pack(0, 0), [])
            count = 1
        elif not h.attributes & ATTR_SCHEDULED:
            count = _append_records(out, mv, pos, h)
        _seal(out, start, h, attributes, count)
    return bytes(out)


def _append_records(out: bytearray, mv: memoryview, pos: int, h: BatchHeader) -> int:
    count = 0
    for off, ts, t0, t1, s1, k1, p1, rend in iter_raw_records(mv, pos, h):
        headers: list[tuple[bytes, bytes | None]] = []
        if t1 > t0:
            headers.append((TAG_HEADER.encode(), bytes(mv[t0:t1])))
        if k1 > s1:
            headers.extend((KEY_HEADER.encode(), k) for k in bytes(mv[s1:k1]).split(b"\x00"))
        key: bytes | None = bytes(mv[t1:s1]) if s1 > t1 else None
        value: bytes | None = bytes(mv[p1:rend])
        if p1 > k1:
            for name, text in decode_properties(bytes(mv[k1:p1])).items():
                if name == BINARY_KEY_PROPERTY:
                    key = _b64(text)
                elif name == NULL_VALUE_PROPERTY:
                    value = None
                elif name.startswith(BINARY_HEADER_PREFIX):
                    headers.append((name[_B64_PREFIX_LEN:].encode(), _b64(text)))
                else:
                    headers.append((name.encode(), text.encode()))
        _append_record(out, off - h.base_offset, ts - h.first_timestamp, key, value, headers)
        count += 1
    return count


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise CorruptRecordError(
            f"a Kafka binary field stored as base64 is not base64: {text[:40]!r}") from None


def _append_record(out: bytearray, offset_delta: int, ts_delta: int, key: bytes | None,
                   value: bytes | None, headers: list[tuple[bytes, bytes | None]]) -> None:
    rec = bytearray(b"\x00")  # attributes
    write_varint(rec, ts_delta)
    write_varint(rec, offset_delta)
    _write_bytes(rec, key)
    _write_bytes(rec, value)
    write_varint(rec, len(headers))
    for hk, hv in headers:
        _write_bytes(rec, hk)
        _write_bytes(rec, hv)
    write_varint(out, len(rec))
    out += rec


def _seal(out: bytearray, start: int, h: BatchHeader, attributes: int, count: int) -> None:
    """Write the Kafka header of the batch that starts at ``start`` and its CRC."""
    HEADER.pack_into(out, start, h.base_offset, len(out) - start - 12, -1, MAGIC, 0, attributes,
                     h.record_count - 1, h.first_timestamp, h.max_timestamp, h.producer_id,
                     h.producer_epoch, h.base_sequence, count)
    crc = crc32c(memoryview(out)[start + CRC_START:])
    struct.pack_into(">I", out, start + 17, crc & 0xFFFFFFFF)
