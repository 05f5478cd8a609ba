"""Rows to record batches: the columns the sink takes, their encoding, and each row's queue.

Theory of operation
-------------------
:func:`encode_batches` encodes the rows of one destination queue *column-wise*: the 22-byte
record prefixes are a numpy structured array, and the records are assembled by one Arrow
``take`` that interleaves prefix, tag, sharding key, keys, properties and body of every row (no
Python object per row unless a row has properties); batches are cut by record count and bytes.

:func:`route` chooses each row's queue: a ``queue`` column if given; else CRC32C of the sharding
key modulo the queue count (:func:`ferrymq.client.partitioner.queue_for_key`, stable across
processes, unlike ``hash()``); rows without a key go to the ``sticky`` queue, which the task
rotates per Arrow batch (Kafka's sticky partitioner).

:func:`check_sink_schema` says which columns the sink understands and checks their types
before any task runs. No I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructType,
)

from ferrymq.errors import ConfigError
from ferrymq.protocol.records import (
    ATTR_HAS_KEYS,
    HEADER,
    HEADER_SIZE,
    LENGTH_PREFIX,
    MAGIC,
    NO_PRODUCER_EPOCH,
    NO_SEQUENCE,
    crc32c,
    encode_properties,
    seal_header_crc,
)
from ferrymq.spark.arrow import _PREFIX
from ferrymq.spark.options import SinkOptions

MAX_BATCH_BYTES = 1024 * 1024
"""Bytes of one record batch (below the broker's default max_message_bytes)."""

_ALLOWED: dict[str, tuple[type[DataType], ...]] = {
    "value": (BinaryType, StringType),
    "key": (BinaryType, StringType),
    "topic": (StringType,),
    "queue": (IntegerType, LongType),
    "tags": (StringType,),
    "keys": (ArrayType,),
    "sharding_key": (StringType,),
    "properties": (MapType,),
}


def check_sink_schema(schema: StructType, opts: SinkOptions) -> None:
    """Columns the sink understands must have usable types; ``value`` is required.

    Other columns (for example the source's ``offset``) are ignored, so a topic can be copied
    with ``readStream...writeStream`` unchanged.

    Raises:
        ConfigError: a missing ``value`` column, no topic, or a column of the wrong type.
    """
    names = {f.name: f.dataType for f in schema.fields}
    if "value" not in names:
        raise ConfigError(f"the ferrymq sink needs a 'value' column (binary or string); "
                          f"got columns {sorted(names)}")
    if opts.topic is None and "topic" not in names:
        raise ConfigError("the ferrymq sink needs option 'topic' or a 'topic' column")
    for name, types in _ALLOWED.items():
        dt = names.get(name)
        if dt is not None and not isinstance(dt, types):
            raise ConfigError(f"sink column {name!r} has type {dt.simpleString()}; expected "
                              + " or ".join(t.typeName() for t in types))
    keys = names.get("keys")
    if isinstance(keys, ArrayType) and not isinstance(keys.elementType, StringType):
        raise ConfigError("sink column 'keys' must be array<string>")
    props = names.get("properties")
    if isinstance(props, MapType) and not (isinstance(props.keyType, StringType)
                                           and isinstance(props.valueType, StringType)):
        raise ConfigError("sink column 'properties' must be map<string,string>")


def _binary(col: pa.Array) -> pa.Array:
    """A non-null binary view of a binary or string column."""
    if col.null_count:
        col = pc.fill_null(col, pa.scalar(b"" if pa.types.is_binary(col.type) else "", col.type))
    if pa.types.is_string(col.type):
        return col.view(pa.binary())
    if pa.types.is_large_binary(col.type) or pa.types.is_large_string(col.type):
        return col.cast(pa.binary())
    return col


def encode_batches(columns: Mapping[str, pa.Array], now_ms: int, *, producer_id: int, epoch: int,
                   next_seq: int, max_records: int, max_bytes: int = MAX_BATCH_BYTES,
                   include_properties: bool = True, attributes: int = 0,
                   ) -> list[tuple[bytearray, int]]:
    """Record batches (wire format, base offset 0) for the rows of ``columns``, one queue.

    Returns ``[(batch, record count)]``; sequences continue from ``next_seq`` when
    ``producer_id`` >= 0. ``attributes`` are or-ed into each batch's (``ATTR_TRANSACTIONAL``).
    """
    value = _binary(columns["value"])
    n = len(value)
    if n == 0:
        return []
    fields: list[pa.Array] = []
    lens: dict[str, np.ndarray] = {}

    def add(name: str, arr: pa.Array | None) -> None:
        if arr is None:
            lens[name] = np.zeros(n, dtype=np.int64)
            return
        arr = _binary(arr)
        lens[name] = pc.binary_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        if lens[name].any():
            fields.append(arr)

    add("tag", columns.get("tags"))
    sk = columns.get("sharding_key")
    if sk is None and columns.get("key") is not None:
        sk = columns["key"]
    add("sk", sk)
    keys = columns.get("keys")
    if keys is not None:
        keys = pc.binary_join(keys.cast(pa.list_(pa.string())), "\x00")
    add("keys", keys)
    props = columns.get("properties") if include_properties else None
    if props is not None and len(props.keys) > 0:
        encoded = [encode_properties(dict(p)) if p else b"" for p in props.to_pylist()]
        add("props", pa.array(encoded, pa.binary()))
    else:
        add("props", None)
    body_len = pc.binary_length(value).to_numpy(zero_copy_only=False).astype(np.int64)
    fields.append(value)
    if lens["tag"].max() > 255:
        raise ConfigError("a 'tags' value is longer than 255 bytes")
    if max(lens["sk"].max(), lens["keys"].max()) > 0xFFFF:
        raise ConfigError("a sharding key or keys value is longer than 65535 bytes")
    rec_len = 18 + lens["tag"] + lens["sk"] + lens["keys"] + lens["props"] + body_len
    has_keys = bool(lens["keys"].any())

    # split into batches by record count and bytes
    sizes = np.cumsum(rec_len + 4)
    out: list[tuple[bytearray, int]] = []
    i = 0
    seq = next_seq
    while i < n:
        base_bytes = sizes[i - 1] if i else 0
        j = int(np.searchsorted(sizes, base_bytes + max_bytes, side="right"))
        j = min(max(j, i + 1), i + max_records, n)
        k = j - i
        prefix = np.zeros(k, dtype=_PREFIX)
        prefix["length"] = rec_len[i:j]
        prefix["odelta"] = np.arange(k, dtype=np.uint32)
        prefix["tag_len"] = lens["tag"][i:j]
        prefix["sk_len"] = lens["sk"][i:j]
        prefix["keys_len"] = lens["keys"][i:j]
        prefix["props_len"] = lens["props"][i:j]
        parts = [pa.Array.from_buffers(pa.binary(), k, [
            None, pa.py_buffer(np.arange(k + 1, dtype=np.int32) * 22), pa.py_buffer(prefix.tobytes())])]
        parts += [f.slice(i, k) for f in fields]
        joined = pa.concat_arrays(parts)
        order = (np.arange(k, dtype=np.int64)[:, None] + np.arange(len(parts), dtype=np.int64) * k).ravel()
        records = joined.take(pa.array(order))
        offs = np.frombuffer(records.buffers()[1], dtype=np.int32, count=len(order) + 1,
                             offset=records.offset * 4)
        blob = memoryview(records.buffers()[2])[int(offs[0]):int(offs[-1])]
        buf = bytearray(HEADER_SIZE) + blob
        HEADER.pack_into(buf, 0, 0, len(buf) - LENGTH_PREFIX, 0, 0, 0, MAGIC,
                         (ATTR_HAS_KEYS if has_keys else 0) | attributes, k, now_ms, now_ms,
                         producer_id,
                         epoch if producer_id >= 0 else NO_PRODUCER_EPOCH,
                         seq if producer_id >= 0 else NO_SEQUENCE)
        buf[24:28] = int(crc32c(memoryview(buf)[28:])).to_bytes(4, "little")
        seal_header_crc(buf, 0)
        out.append((buf, k))
        seq += k
        i = j
    return out


def route(cols: Mapping[str, pa.Array], qcount: np.ndarray, sticky: int) -> np.ndarray:
    """Queue per row: the ``queue`` column where given; else CRC32C of the sharding key (or
    ``key``) modulo the topic's queue count (:func:`~ferrymq.client.partitioner.queue_for_key`;
    each distinct key is hashed once); else ``sticky`` modulo the queue count.

    Raises:
        ConfigError: a ``queue`` value the topic does not have.
    """
    n = len(qcount)
    queue = np.full(n, -1, dtype=np.int64)
    given = cols.get("queue")
    if given is not None and given.null_count < n:
        valid = pc.is_valid(given).to_numpy(zero_copy_only=False)
        values = pc.fill_null(given, 0).to_numpy(zero_copy_only=False).astype(np.int64)
        if ((values[valid] < 0) | (values[valid] >= qcount[valid])).any():
            raise ConfigError("a 'queue' value is outside its topic's queues")
        queue[valid] = values[valid]
    rest = queue < 0
    key_col = cols.get("sharding_key", cols.get("key"))
    if rest.any() and key_col is not None and key_col.null_count < n:
        enc = pc.dictionary_encode(key_col)
        distinct = enc.dictionary.to_pylist()
        hashes = np.array([crc32c(k if isinstance(k, bytes) else k.encode()) if k else -1
                           for k in distinct] + [-1], dtype=np.int64)
        idx = pc.fill_null(enc.indices, len(distinct)).to_numpy(zero_copy_only=False)
        h = hashes[idx]
        keyed = rest & (h >= 0)
        queue[keyed] = h[keyed] % qcount[keyed]
        rest &= ~keyed
    queue[rest] = sticky % qcount[rest]
    return queue
