"""Kafka batches stored as they came: the envelope, FerryMQ's second record format. Sans-IO.

A batch a Kafka client produces is stored as sent, inside an *envelope*: a FerryMQ batch
header of magic 2 followed by the Kafka batch (magic 2 too, KIP-98), its records untouched and
still compressed when the client compressed them. The header carries what the log, the
producer state, transactions, the indexes, retention and replication read (offsets, record
count, timestamps, producer id, epoch and sequence, the transactional bit), copied from the
Kafka header on arrival, so all of them treat an envelope as any batch. A Kafka reader gets the
Kafka batch back by slicing (:func:`kafka_pieces`: no per-record work); a FerryMQ reader gets the
envelope converted into a FerryMQ batch of the same offsets (:func:`to_native`, through
:func:`~ferrymq.protocol.kafka.records.to_ferrymq`), only when it reads one.

Envelope layout (the FerryMQ header is little-endian, the Kafka batch big-endian)::

    off  size  field
    0    64    FerryMQ header (ferrymq.protocol.records), with
                 batch_length    52 + the Kafka batch's size
                 crc             CRC32C of bytes [28, 64) then [72, 85): the header's tail and
                                 the Kafka batch's batchLength, partitionLeaderEpoch, magic
                                 and CRC (the Kafka CRC-32C covers the rest, [85, end))
                 magic           2
                 attributes      bit 4 (transactional) as Kafka's bit 4; bit 3 (has keys)
                                 when the batch is uncompressed and holds the bytes
                                 ``ferrymq.key`` (a record may carry FerryMQ keys: the key
                                 index converts only such envelopes); nothing else
                 record_count, first_timestamp (baseTimestamp), max_timestamp, producer_id,
                 producer_epoch, base_sequence: from the Kafka header
    64   8     the Kafka batch's baseOffset: stamped by the broker with base_offset (covered by
               no CRC: it must equal base_offset, which the header CRC covers)
    72   4     batchLength
    76   4     partitionLeaderEpoch: -1 (this broker names no leader epochs to Kafka clients)
    80   ...   the rest of the Kafka batch as sent

The two formats cannot be told apart by their first bytes (FerryMQ's magic is at byte 28,
Kafka's at 16) and the log walks batches by FerryMQ's length prefix: hence the envelope, and
not Kafka batches side by side with FerryMQ's.
"""

from __future__ import annotations

import struct

from ferrymq.errors import BatchTooLargeError, CorruptRecordError, MessageTooLargeError
from ferrymq.protocol.kafka import records as kafka
from ferrymq.protocol.records import (
    ATTR_HAS_KEYS,
    ATTR_TRANSACTIONAL,
    HEADER,
    HEADER_SIZE,
    LENGTH_PREFIX,
    MAGIC,
    MAX_TIMESTAMP_DELTA_MS,
    BatchHeader,
    check_stored_batch,
    crc32c,
    iter_batches,
    seal_header_crc,
    stamp_batch,
)

ENVELOPE_MAGIC = 2
"""The FerryMQ magic of an envelope (FerryMQ's own batches are magic 1)."""
STORED_MAGICS = (MAGIC, ENVELOPE_MAGIC)
"""The magics a log may hold."""
STAMPED_HEAD_SIZE = HEADER_SIZE + 8
"""The bytes of an envelope the broker stamps on append: its header and the Kafka baseOffset."""
_KAFKA_CRC_END = HEADER_SIZE + kafka.CRC_START  # 85
_BASE_OFFSET = struct.Struct(">q")
_LEADER_EPOCH = struct.Struct(">i")
_I = struct.Struct("<I")
_NO_LEADER_EPOCH = -1
_TIMESTAMP = struct.Struct(">q")
_MAX_TIMESTAMP_AT = 35  # the Kafka header's maxTimestamp
_KAFKA_CRC = struct.Struct(">I")
_KAFKA_CRC_AT = 17
_KEY_HEADER = kafka.KEY_HEADER.encode()


def _envelope_crc(buf: bytes | bytearray | memoryview, pos: int) -> int:
    mv = memoryview(buf)
    return crc32c(mv[pos + HEADER_SIZE + 8:pos + _KAFKA_CRC_END],
                  crc32c(mv[pos + 28:pos + HEADER_SIZE]))


def wrap(data: bytes | memoryview, *, max_batch_bytes: int, max_records: int,
         max_decompressed_bytes: int | None = None, mark_keys: bool = False,
         roomy: memoryview | None = None) -> bytearray | memoryview:
    """The envelope of one Kafka batch a client produced (base offset and append time left 0).

    Checked: exactly one batch of magic 2, its CRC-32C, a record count of 1 to
    ``max_records``, contiguous offsets (``lastOffsetDelta`` is the count less one), no control
    batch, timestamps within a FerryMQ batch's range; nothing per record, except in a batch
    whose ``maxTimestamp`` is below its first timestamp (unset: Sarama 1.22 sends -1): that one
    is set from the records, as a Kafka broker sets it (decompressing at most
    ``max_decompressed_bytes``, by default ``max_batch_bytes``).

    ``mark_keys``: set the has-keys bit of an uncompressed batch holding the bytes
    ``ferrymq.key`` (a scan of the whole batch, the only per-byte work here besides the CRC),
    so the key index converts it (the broker's ``kafka_key_headers_indexed``); False (the
    default, as the broker's): never set.

    ``roomy``: a writable view of :data:`HEADER_SIZE` free bytes followed by ``data`` (the
    Produce codec's :attr:`~ferrymq.protocol.kafka.produce_codec.PartitionData.roomy`): the
    envelope is built in it and returned, the batch not copied (a batch whose
    ``maxTimestamp`` must be set, or that is scanned for keys, is copied all the same).

    Raises:
        CorruptRecordError: see :func:`~ferrymq.protocol.kafka.records.check_batch`; a control
            batch (only the broker writes markers); a ``lastOffsetDelta`` that is not the
            record count less one.
        MessageTooLargeError: the batch is larger than ``max_batch_bytes`` (Kafka's
            ``max.message.bytes`` limits a batch as sent, compressed or not).
        BatchTooLargeError: more than ``max_records`` records, or timestamps further apart
            than a FerryMQ batch can hold.
    """
    if len(data) > max_batch_bytes:
        raise MessageTooLargeError(f"Kafka record batch of {len(data)} bytes, max "
                                   f"{max_batch_bytes} (max_message_bytes)")
    h = kafka.check_batch(data)
    sent = data
    if h.attributes & kafka.KAFKA_ATTR_CONTROL:
        raise CorruptRecordError("a control batch from a client: only the broker writes "
                                 "transaction markers")
    if h.last_offset_delta != h.record_count - 1:
        raise CorruptRecordError(f"Kafka record batch of {h.record_count} records has last "
                                 f"offset delta {h.last_offset_delta}")
    if h.record_count > max_records:
        raise BatchTooLargeError(f"batch has {h.record_count} records, max {max_records}")
    if h.max_timestamp < h.base_timestamp:
        data = _set_max_timestamp(data, h, max_decompressed_bytes or max_batch_bytes)
        h = kafka.decode_header(data)
    if not 0 <= h.max_timestamp - h.base_timestamp <= MAX_TIMESTAMP_DELTA_MS:
        raise BatchTooLargeError(
            f"Kafka record batch spans {h.max_timestamp - h.base_timestamp} ms from its first "
            f"timestamp to its largest: FerryMQ keeps a batch within 0..{MAX_TIMESTAMP_DELTA_MS} "
            "ms (24.8 days); send such records in separate batches")
    attributes = ATTR_TRANSACTIONAL if h.attributes & kafka.KAFKA_ATTR_TRANSACTIONAL else 0
    scan = mark_keys and not h.attributes & kafka.COMPRESSION_MASK
    out: bytearray | memoryview
    if roomy is not None and not scan and data is sent and len(roomy) == HEADER_SIZE + len(data):
        out = roomy  # every byte of it is written below: the header fills HEADER_SIZE
    else:
        out = bytearray(HEADER_SIZE)
        out += data
        if scan and _KEY_HEADER in out:
            attributes |= ATTR_HAS_KEYS  # may carry FerryMQ keys: the key index converts it
    _LEADER_EPOCH.pack_into(out, HEADER_SIZE + 12, _NO_LEADER_EPOCH)
    HEADER.pack_into(
        out, 0, 0, len(out) - LENGTH_PREFIX, 0, 0, 0, ENVELOPE_MAGIC, attributes, h.record_count,
        h.base_timestamp, h.max_timestamp, h.producer_id, h.producer_epoch, h.base_sequence)
    _I.pack_into(out, 24, _envelope_crc(out, 0))
    seal_header_crc(out, 0)
    return out


def _set_max_timestamp(data: bytes | memoryview, h: kafka.KafkaBatchHeader,
                       max_decompressed_bytes: int) -> bytes:
    """A copy of the Kafka batch ``data`` (``h`` its header) whose ``maxTimestamp`` is its
    records' largest timestamp, the CRC-32C resealed: what a Kafka broker writes into every
    batch it appends.

    Raises:
        CorruptRecordError: the records do not parse.
        MessageTooLargeError: they decompress to more than ``max_decompressed_bytes``.
    """
    body = memoryview(data)[kafka.HEADER_SIZE:]
    codec = h.attributes & kafka.COMPRESSION_MASK
    records = kafka.iter_records(
        h, kafka.decompress(codec, body, max_decompressed_bytes) if codec else bytes(body))
    out = bytearray(data)
    top = max((r.timestamp for r in records), default=h.base_timestamp)
    _TIMESTAMP.pack_into(out, _MAX_TIMESTAMP_AT, top)
    _KAFKA_CRC.pack_into(out, _KAFKA_CRC_AT, crc32c(memoryview(out)[kafka.CRC_START:]))
    return bytes(out)


def stamp(head: bytearray, base_offset: int, append_time_ms: int) -> None:
    """Stamp the first :data:`STAMPED_HEAD_SIZE` bytes of an envelope (a copy of them, on
    append): base offset and append time in its header (header CRC fixed) and the Kafka
    batch's baseOffset."""
    stamp_batch(head, 0, base_offset, append_time_ms)
    _BASE_OFFSET.pack_into(head, HEADER_SIZE, base_offset)


def check_stored(buf: bytes | bytearray | memoryview, pos: int = 0) -> BatchHeader:
    """Check a stored batch of either magic (recovery, replication): every CRC, and for an
    envelope that it holds exactly one Kafka batch whose baseOffset is the envelope's.

    Raises:
        CorruptRecordError: any CRC or structural failure.
    """
    if len(buf) - pos < HEADER_SIZE or buf[pos + 28] != ENVELOPE_MAGIC:
        return check_stored_batch(buf, pos)
    h = BatchHeader._make(HEADER.unpack_from(buf, pos))
    size = LENGTH_PREFIX + h.batch_length
    if size < _KAFKA_CRC_END + kafka.HEADER_SIZE - kafka.CRC_START or size > len(buf) - pos:
        raise CorruptRecordError("truncated envelope")
    if _I.unpack_from(buf, pos + 20)[0] != crc32c(
            memoryview(buf)[pos + 24:pos + 28], crc32c(memoryview(buf)[pos:pos + 20])):
        raise CorruptRecordError("batch header CRC mismatch")
    if _envelope_crc(buf, pos) != h.crc:
        raise CorruptRecordError("envelope CRC mismatch")
    k = kafka.decode_header(memoryview(buf), pos + HEADER_SIZE)
    if (k.magic != kafka.MAGIC or k.batch_length + 12 != size - HEADER_SIZE
            or k.base_offset != h.base_offset or h.record_count < 1):
        raise CorruptRecordError("envelope does not hold its Kafka batch")
    if crc32c(memoryview(buf)[pos + _KAFKA_CRC_END:pos + size]) != k.crc & 0xFFFFFFFF:
        raise CorruptRecordError("Kafka batch CRC-32C mismatch")
    return h


def envelope_header(batch: bytes | bytearray | memoryview) -> BatchHeader:
    """The header of an envelope :func:`wrap` built (the produce path: nothing to check again).

    Raises:
        CorruptRecordError: not an envelope.
    """
    h = BatchHeader._make(HEADER.unpack_from(batch, 0))
    if h.magic != ENVELOPE_MAGIC or LENGTH_PREFIX + h.batch_length != len(batch):
        raise CorruptRecordError("not one envelope")
    return h


def to_native(data: bytes | memoryview, *, max_batch_bytes: int,
              max_bytes: int | None = None) -> bytes:
    """The complete batches of ``data`` with every envelope converted into a FerryMQ batch of
    the same offsets, append time and producer fields (FerryMQ batches are kept as they are):
    what a FerryMQ reader of a log holding envelopes gets. With ``max_bytes``, the batches that
    fit it (at least the first): converted batches are larger than stored ones, and a read's
    budget bounds what it returns.

    Raises:
        CorruptRecordError: an envelope whose Kafka batch fails its CRC or does not parse.
        MessageTooLargeError: one decompresses to more than ``max_batch_bytes``.
        InvalidRequestError: records timestamped further apart than a FerryMQ batch holds.
    """
    mv = memoryview(data)
    out: list[bytes | bytearray | memoryview] = []
    total = 0
    for pos, h in iter_batches(mv):
        size = LENGTH_PREFIX + h.batch_length
        batch: bytearray | memoryview = mv[pos:pos + size]
        if h.magic == ENVELOPE_MAGIC:
            batch = native_batch(mv, pos, h, max_batch_bytes=max_batch_bytes)
        if max_bytes is not None and out and total + len(batch) > max_bytes:
            break
        out.append(batch)
        total += len(batch)
    return b"".join(out)


def native_batch(buf: bytes | memoryview, pos: int, h: BatchHeader, *,
                 max_batch_bytes: int) -> bytearray:
    """The envelope at ``pos`` (``h`` its header) as a FerryMQ batch of the same offsets,
    append time and producer fields.

    Raises:
        CorruptRecordError, MessageTooLargeError, InvalidRequestError: see :func:`to_native`.
    """
    mv = memoryview(buf)
    batch = kafka.to_ferrymq(mv[pos + HEADER_SIZE:pos + LENGTH_PREFIX + h.batch_length],
                             max_batch_bytes=max_batch_bytes)
    stamp_batch(batch, 0, h.base_offset, h.append_time_ms)
    return batch


def kafka_pieces(data: bytes | memoryview) -> list[bytes | memoryview]:
    """The complete batches of ``data`` as Kafka batches, in order: an envelope's Kafka batch
    as stored (a view of ``data``, not copied), runs of FerryMQ batches converted
    (:func:`~ferrymq.protocol.kafka.records.to_kafka`).

    Raises:
        CorruptRecordError: a FerryMQ batch whose records do not parse.
    """
    mv = memoryview(data)
    out: list[bytes | memoryview] = []
    run = -1  # start of a run of FerryMQ batches
    end = 0
    for pos, h in iter_batches(mv):
        if h.magic == ENVELOPE_MAGIC:
            if run >= 0:
                out.append(kafka.to_kafka(mv[run:pos]))
                run = -1
            out.append(mv[pos + HEADER_SIZE:pos + LENGTH_PREFIX + h.batch_length])
        elif run < 0:
            run = pos
        end = pos + LENGTH_PREFIX + h.batch_length
    if run >= 0:
        out.append(kafka.to_kafka(mv[run:end]))
    return out
