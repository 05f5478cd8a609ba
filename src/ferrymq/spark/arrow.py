"""Arrow record batches built straight from FETCH bytes: the source's hot path.

Theory of operation
-------------------
A FETCH answer holds record batches exactly as stored (layout: :mod:`ferrymq.protocol.records`).
Spark wants one Arrow ``RecordBatch`` per chunk of rows. Building Python objects per record would
cap the source at about 0.5 M rows/s, so the decoder does only this per record in Python: one
``unpack_from`` of the record length to find the next record (records are variable-length, so
finding them is inherently sequential). Everything else is vectorised:

1. the 22-byte prefixes of all records are gathered in one numpy fancy index and viewed through
   a structured dtype: lengths, offset and time deltas, field lengths, without a Python loop;
2. field boundaries follow by arithmetic (tag, sharding key, keys, properties, body);
3. each variable-length column (``value``, ``key``, ...) is a zero-copy Arrow ``binary`` array
   over the fetch bytes whose elements alternate *wanted span, gap* (the spans are ordered and
   do not overlap, so the offsets are monotone); one Arrow ``take`` of the even elements copies
   the spans into a compact column in C++;
4. ``msg_id`` (hex of topic id, queue, offset) is formatted with numpy nibble arithmetic.

Only ``properties`` (msgpack maps) needs per-record Python work, and only when
``includeProperties`` is set and a record has any.

Batch filtering lives in one place, :func:`readable_batch`: scheduled originals
(``ATTR_SCHEDULED``: their copies arrive when due) and control batches (``ATTR_CONTROL``:
transaction markers) are never rows; the ``read_committed`` filter (aborted transactional data)
is applied there too (``isolationLevel=read_committed``).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.markers import ReadCommittedFilter
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_SCHEDULED,
    HEADER_SIZE,
    RECORD_PREFIX_SIZE,
    BatchHeader,
    check_stored_batch,
    decode_properties,
    iter_batches,
)

log = logging.getLogger("ferrymq.spark")

SOURCE_COLUMNS = ("key binary, value binary, topic string, queue int, offset long, "
                  "timestamp timestamp, tags string, keys array<string>, sharding_key string, "
                  "msg_id string")
PROPERTIES_COLUMN = "properties map<string,string>"


def source_ddl(include_properties: bool) -> str:
    """The source's Spark schema as DDL."""
    return SOURCE_COLUMNS + (", " + PROPERTIES_COLUMN if include_properties else "")


def arrow_schema(include_properties: bool) -> pa.Schema:
    """The Arrow schema Spark expects for :func:`source_ddl` (``to_arrow_schema``, UTC)."""
    fields = [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("topic", pa.string()),
        pa.field("queue", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("tags", pa.string()),
        pa.field("keys", pa.list_(pa.field("element", pa.string()))),
        pa.field("sharding_key", pa.string()),
        pa.field("msg_id", pa.string()),
    ]
    if include_properties:
        fields.append(pa.field("properties", pa.map_(pa.string(), pa.string())))
    return pa.schema(fields)


def readable_batch(h: BatchHeader, committed: ReadCommittedFilter | None = None) -> bool:
    """Whether the records of a stored batch become rows: the one place batches are filtered.

    Scheduled originals are delivered as copies when due; control batches are transaction
    markers; with ``committed`` (read_committed: built from the FETCH answer's aborted
    transactions, called for every batch of the answer in order) aborted transactional batches
    are dropped too.
    """
    if committed is not None and not committed.keep(h.producer_id, h.base_offset, h.attributes):
        return False
    return not h.attributes & (ATTR_SCHEDULED | ATTR_CONTROL)


_PREFIX = np.dtype([("length", "<u4"), ("odelta", "<u4"), ("tdelta", "<i4"), ("attrs", "u1"),
                    ("tag_len", "u1"), ("sk_len", "<u2"), ("keys_len", "<u2"), ("props_len", "<u4")])
assert _PREFIX.itemsize == RECORD_PREFIX_SIZE
_PREFIX_INDEX = np.arange(RECORD_PREFIX_SIZE, dtype=np.int64)
_HEX_PAIRS = np.frombuffer(b"".join(f"{i:02X}".encode() for i in range(256)), dtype="<u2")
"""Two hex digits per byte value, as the uint16 whose little-endian bytes they are."""
_unpack_len = struct.Struct("<I").unpack_from


@dataclass
class FetchChunk:
    """Record positions found in one FETCH answer for one queue."""

    data: bytes
    starts: list[int] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)
    """Per batch: base offset, first timestamp, record count."""
    first_ts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    next_offset: int = -1
    """The offset after the last batch seen (readable or not)."""
    first_offset: int = -1
    """Base offset of the first batch at or after the start (-1: no batch)."""


def scan(data: bytes, start: int, *, verify_crc: bool = True,
         committed: ReadCommittedFilter | None = None) -> FetchChunk:
    """Find every record of the readable batches in ``data`` (record batches as fetched).

    Batches that end before ``start`` are passed over; the first batch may begin before it
    (its early records are dropped later). A partial batch at the end is ignored. ``committed``
    (read_committed) sees every batch of the answer, in order.

    Raises:
        CorruptRecordError: a CRC mismatch, or record lengths that do not add up to a batch.
    """
    chunk = FetchChunk(data)
    starts = chunk.starts
    app = starts.append
    unpack = _unpack_len
    for pos, h in iter_batches(data):
        readable = readable_batch(h, committed)
        last = h.last_offset
        if last < start:
            continue
        if verify_crc:
            check_stored_batch(data, pos)
        if chunk.first_offset < 0:
            chunk.first_offset = h.base_offset
        chunk.next_offset = last + 1
        if not readable:
            continue
        p = pos + HEADER_SIZE
        end = pos + 12 + h.batch_length
        before = len(starts)
        try:
            while p < end:
                app(p)
                p += 4 + unpack(data, p)[0]
        except struct.error:
            p = -1
        if p != end:
            raise CorruptRecordError(
                f"batch at offsets {h.base_offset}..{last}: record lengths do not add up")
        n = len(starts) - before
        if n:
            chunk.bases.append(h.base_offset)
            chunk.first_ts.append(h.first_timestamp)
            chunk.counts.append(n)
    return chunk


def _spans(data_buf: pa.Buffer, a: np.ndarray, b: np.ndarray, typ: pa.DataType,
           nullable: bool) -> pa.Array:
    """Compact array of ``data[a[i]:b[i]]`` (spans in increasing, non-overlapping order);
    null where the span is empty when ``nullable``."""
    n = len(a)
    if nullable:
        present = b > a
        if not present.any():
            return pa.nulls(n, typ)
    offsets = np.empty(2 * n + 1, dtype=np.int32)
    offsets[0:2 * n:2] = a
    offsets[1:2 * n:2] = b
    offsets[2 * n] = b[-1]
    interleaved = pa.Array.from_buffers(pa.binary(), 2 * n, [None, pa.py_buffer(offsets), data_buf])
    compact = interleaved.take(pa.array(np.arange(0, 2 * n, 2, dtype=np.int64)))
    bufs = compact.buffers()
    validity = None
    null_count = 0
    if nullable and not present.all():
        validity = pa.py_buffer(np.packbits(present, bitorder="little"))
        null_count = int(n - present.sum())
    return pa.Array.from_buffers(typ, n, [validity, bufs[1], bufs[2]], null_count=null_count)


def _constant_string(value: str, n: int) -> pa.Array:
    raw = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(raw)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(raw * n)])


def _msg_ids(topic_id: int, queue: int, offsets: np.ndarray) -> pa.Array:
    """``f"{topic_id:08X}{queue:04X}{offset:016X}"`` for every offset, vectorised."""
    n = len(offsets)
    prefix = np.frombuffer(f"{topic_id & 0xFFFFFFFF:08X}{queue:04X}".encode(), dtype=np.uint8)
    out = np.empty((n, 28), dtype=np.uint8)
    out[:, :12] = prefix
    octets = offsets.astype(">u8").view(np.uint8).reshape(n, 8)
    out[:, 12:] = _HEX_PAIRS[octets].view(np.uint8).reshape(n, 16)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(np.arange(n + 1, dtype=np.int32) * 28),
                                                  pa.py_buffer(out)])


def _keys(data: bytes, data_buf: pa.Buffer, a: np.ndarray, b: np.ndarray, typ: pa.DataType) -> pa.Array:
    n = len(a)
    present = b > a
    if not present.any():
        return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)),
                                        pa.array([], pa.string()), type=typ)
    joined = _spans(data_buf, a, b, pa.string(), nullable=False)
    parts = pc.split_pattern(joined, "\x00")
    lens = pc.list_value_length(parts).to_numpy(zero_copy_only=False).astype(np.int32)
    lens[~present] = 0  # an empty field splits into [""]: no keys
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    flat = parts.flatten()
    keep = np.repeat(present, pc.list_value_length(parts).to_numpy(zero_copy_only=False))
    values = flat.filter(pa.array(keep))
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=typ)


def _properties(data: bytes, a: np.ndarray, b: np.ndarray, typ: pa.DataType) -> pa.Array:
    n = len(a)
    offsets = np.zeros(n + 1, dtype=np.int32)
    keys: list[str] = []
    values: list[str] = []
    mv = memoryview(data)
    for i in np.flatnonzero(b > a).tolist():
        props = decode_properties(mv[a[i]:b[i]])
        keys.extend(props)
        values.extend(props.values())
        offsets[i + 1] = len(props)
    np.cumsum(offsets, out=offsets)
    return pa.MapArray.from_arrays(pa.array(offsets), pa.array(keys, pa.string()),
                                   pa.array(values, pa.string()), type=typ)


def to_record_batch(chunk: FetchChunk, topic: str, queue: int, topic_id: int, start: int, end: int,
                    schema: pa.Schema) -> pa.RecordBatch | None:
    """Rows of ``chunk`` with offsets in ``[start, end)`` as one Arrow batch (None: no rows).

    Raises:
        CorruptRecordError: a record whose fields run past its length.
    """
    n_all = len(chunk.starts)
    if n_all == 0:
        return None
    data = chunk.data
    arr = np.frombuffer(data, dtype=np.uint8)
    starts = np.array(chunk.starts, dtype=np.int64)
    prefix = arr[starts[:, None] + _PREFIX_INDEX].view(_PREFIX).reshape(n_all)
    counts = np.array(chunk.counts, dtype=np.int64)
    offsets = np.repeat(np.array(chunk.bases, dtype=np.int64), counts) + prefix["odelta"]
    keep = (offsets >= start) & (offsets < end)
    if not keep.all():
        if not keep.any():
            return None
        starts, prefix, offsets = starts[keep], prefix[keep], offsets[keep]
        ts_base = np.repeat(np.array(chunk.first_ts, dtype=np.int64), counts)[keep]
    else:
        ts_base = np.repeat(np.array(chunk.first_ts, dtype=np.int64), counts)
    n = len(starts)
    t0 = starts + RECORD_PREFIX_SIZE
    t1 = t0 + prefix["tag_len"]
    s1 = t1 + prefix["sk_len"]
    k1 = s1 + prefix["keys_len"]
    p1 = k1 + prefix["props_len"]
    rend = starts + 4 + prefix["length"]
    if (p1 > rend).any():
        bad = int(offsets[np.argmax(p1 > rend)])
        raise CorruptRecordError(f"{topic}/{queue}: record at offset {bad}: fields run past the record")
    buf = pa.py_buffer(data)
    ts_us = (ts_base + prefix["tdelta"]) * 1000
    sk = _spans(buf, t1, s1, pa.binary(), nullable=True)
    columns = [
        sk,
        _spans(buf, p1, rend, pa.binary(), nullable=False),
        _constant_string(topic, n),
        pa.array(np.full(n, queue, dtype=np.int32)),
        pa.array(offsets),
        pa.Array.from_buffers(pa.timestamp("us", tz="UTC"), n, [None, pa.py_buffer(ts_us)]),
        _spans(buf, t0, t1, pa.string(), nullable=True),
        _keys(data, buf, s1, k1, schema.field("keys").type),
        sk.view(pa.string()),
        _msg_ids(topic_id, queue, offsets),
    ]
    if len(schema) > len(columns):
        columns.append(_properties(data, k1, p1, schema.field("properties").type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def decode_range(data: bytes, topic: str, queue: int, topic_id: int, start: int, end: int,
                 schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Convenience for tests and tools: rows of one fetch answer in ``[start, end)``."""
    batch = to_record_batch(scan(data, start), topic, queue, topic_id, start, end, schema)
    if batch is not None:
        yield batch
