"""The ``ferrymq`` sink: Arrow batches from Spark become record batches on the broker.

Theory of operation
-------------------
Spark hands each task its rows as Arrow record batches (``DataSourceArrowWriter``). The task
groups rows by destination (topic, queue), encodes FerryMQ record batches *column-wise*: the
22-byte record prefixes are a numpy structured array, and the records are assembled by one Arrow
``take`` that interleaves prefix, tag, sharding key, keys, properties and body of every row (no
Python object per row unless a row has properties). Batches are sent in PRODUCE requests over a
blocking connection, one request in flight while the next is encoded.

Queue choice: a ``queue`` column if given; else CRC32C of the sharding key modulo the queue count
(:func:`ferrymq.client.partitioner.queue_for_key`, stable across processes, unlike ``hash()``);
rows without a key go to one queue per Arrow batch, rotating (Kafka's sticky partitioner).

Delivery modes (``deliveryMode``):

* ``idempotent`` (the default *for now*): the task's producer stamps producer id, epoch and
  sequence numbers, so a request retried after a timeout or a lost connection is stored once.
  A streaming sink also fences replays by micro-batch: the driver's ``commit`` records
  ``(sinkId, batchId)`` on the broker (one produce to ``__ferrymq_spark_sinks``, keyed
  ``sinkId#batchId``), and a task of a micro-batch already recorded writes nothing. So a batch
  replayed after a driver crash between that record and Spark's checkpoint commit is not written
  twice. Rows written by tasks of a batch whose commit was never recorded are written again on
  replay (the transactional mode closes that gap).
* ``atLeastOnce``: plain produce, no sequence numbers, no fence (Spark's Kafka sink semantics).
* ``transactional``: needs the broker's staged transactions (``commit_staged``): refused with
  "not available yet". Its shape is already here: tasks return a :class:`SinkCommitMessage`, and
  the driver's :meth:`FerryMQStreamWriter.commit` is the one place for the fenced broker call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
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

from ferrymq.errors import (
    BrokerError,
    ConfigError,
    ConnectionClosedError,
    FerryMQTimeoutError,
    TopicAlreadyExistsError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.records import (
    ATTR_HAS_KEYS,
    HEADER,
    HEADER_SIZE,
    LENGTH_PREFIX,
    MAGIC,
    NO_PRODUCER_EPOCH,
    NO_PRODUCER_ID,
    NO_SEQUENCE,
    crc32c,
    encode_properties,
    seal_header_crc,
)
from ferrymq.spark import _wire
from ferrymq.spark.arrow import _PREFIX
from ferrymq.spark.options import SinkOptions

log = logging.getLogger("ferrymq.spark")

SINKS_TOPIC = "__ferrymq_spark_sinks"
"""Where streaming sinks record committed micro-batches (keys ``sinkId#batchId``)."""
MAX_BATCH_BYTES = 1024 * 1024
"""Bytes of one record batch (below the broker's default max_message_bytes)."""
MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""Bytes of batches per PRODUCE request (the broker's frame cap is 8 MiB by default)."""
PRODUCE_TIMEOUT_MS = 30_000
DELIVERY_TIMEOUT_S = 120.0

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


@dataclass
class SinkCommitMessage(WriterCommitMessage):
    """What a task reports to the driver's ``commit``/``abort``.

    ``ranges`` maps ``"topic/queue"`` to the first and last offset the task wrote there.
    A transactional mode adds the task's staged-transaction handles here.
    """

    partition_id: int
    rows: int = 0
    skipped: bool = False
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)


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
                   include_properties: bool = True) -> list[tuple[bytearray, int]]:
    """Record batches (wire format, base offset 0) for the rows of ``columns``, one queue.

    Returns ``[(batch, record count)]``; sequences continue from ``next_seq`` when
    ``producer_id`` >= 0.
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
                         ATTR_HAS_KEYS if has_keys else 0, k, now_ms, now_ms, producer_id,
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


@dataclass
class _QueueState:
    next_seq: int = 0
    first: int = -1
    last: int = -1


class TaskProducer:
    """Sends a task's rows: groups them by (topic, queue), encodes batches, one PRODUCE request
    in flight while the next is built, retries (byte for byte when idempotent)."""

    def __init__(self, opts: SinkOptions, partition_id: int) -> None:
        self.opts = opts
        self.partition_id = partition_id
        self.conn = _wire.connection(opts.servers)
        hello = self.conn.hello
        self.max_records = min(opts.batch_max_records, hello.max_batch_records if hello else 16_384)
        self.max_bytes = min(MAX_BATCH_BYTES, (hello.max_message_bytes if hello else MAX_BATCH_BYTES))
        self.idempotent = opts.delivery_mode == "idempotent"
        self.producer_id, self.epoch = NO_PRODUCER_ID, NO_PRODUCER_EPOCH
        if self.idempotent:
            r = self.conn.request(m.InitProducerRequest(None), m.InitProducerResponse)
            self.producer_id, self.epoch = r.producer_id, r.producer_epoch
        self.queues: dict[tuple[str, int], _QueueState] = {}
        self.topics: dict[str, int] = {}
        self.pending: list[tuple[str, int, bytearray, int]] = []
        self.pending_bytes = 0
        self.in_flight: tuple[int, list[tuple[str, int, bytearray, int]]] | None = None
        self.rows = 0
        self.sticky = partition_id

    def _queue_count(self, topic: str) -> int:
        n = self.topics.get(topic)
        if n is None:
            resp = self.conn.request(m.MetadataRequest([topic], False), m.MetadataResponse)
            for name, _tid, queues, code, *_ in resp.topics:
                if name == topic and code:
                    if code == ErrorCode.UNKNOWN_TOPIC:
                        raise UnknownTopicError(f"sink topic {topic!r} does not exist on "
                                                f"{self.opts.servers}")
                    raise error_for_code(code, f"sink topic {topic!r}")
                if name == topic:
                    n = queues
            if n is None:
                raise UnknownTopicError(f"sink topic {topic!r} does not exist")
            self.topics[topic] = n
        return n

    def add(self, rb: pa.RecordBatch) -> None:
        """Route, encode and (when enough is pending) send the rows of one Arrow batch."""
        n = rb.num_rows
        if n == 0:
            return
        cols = {name: rb.column(i) for i, name in enumerate(rb.schema.names)}
        self.rows += n
        if self.opts.topic is not None:
            topic_idx = np.zeros(n, dtype=np.int64)
            topic_names = [self.opts.topic]
        else:
            enc = pc.dictionary_encode(cols["topic"])
            if enc.null_count:
                raise ConfigError("a row has a null 'topic' and option 'topic' is not set")
            topic_idx = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            topic_names = enc.dictionary.to_pylist()
        counts = [self._queue_count(t) for t in topic_names]
        self.sticky += 1
        queue = route(cols, np.array(counts, dtype=np.int64)[topic_idx], self.sticky)
        dest = topic_idx * (1 << 20) + queue
        uniq = np.unique(dest)
        now_ms = int(time.time() * 1000)
        for d in uniq.tolist():
            topic, q = topic_names[d >> 20], d & ((1 << 20) - 1)
            if len(uniq) == 1:
                part = cols
            else:
                idx = pa.array(np.flatnonzero(dest == d))
                part = {name: c.take(idx) for name, c in cols.items()}
            st = self.queues.setdefault((topic, q), _QueueState())
            for buf, k in encode_batches(part, now_ms, producer_id=self.producer_id,
                                         epoch=self.epoch, next_seq=st.next_seq,
                                         max_records=self.max_records, max_bytes=self.max_bytes,
                                         include_properties=self.opts.include_properties):
                st.next_seq += k
                self.pending.append((topic, q, buf, k))
                self.pending_bytes += len(buf)
                if self.pending_bytes >= MAX_REQUEST_BYTES:
                    self._ship()

    def _ship(self) -> None:
        """Send what is pending (after the request in flight is answered)."""
        if self.in_flight is not None:
            self._complete()
        if not self.pending:
            return
        entries, self.pending, self.pending_bytes = self.pending, [], 0
        self.in_flight = (self._send(entries), entries)

    def _send(self, entries: list[tuple[str, int, bytearray, int]]) -> int:
        return self.conn.send(m.ProduceRequest(PRODUCE_TIMEOUT_MS,
                                               [(t, q, b) for t, q, b, _ in entries]))

    def _complete(self) -> None:
        assert self.in_flight is not None
        corr, entries = self.in_flight
        self.in_flight = None
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        attempt = 0
        while True:
            try:
                if corr < 0:
                    corr = self._send(entries)
                resp = self.conn.receive(corr, m.ProduceResponse)
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise
                attempt += 1
                log.info("produce failed (%s); retrying", exc)
                time.sleep(min(0.05 * 2**attempt, 1.0))
                corr = -1
                continue
            retry: list[tuple[str, int, bytearray, int]] = []
            for entry, result in zip(entries, resp.results, strict=True):
                t, q, code, msg, base, last = result[:6]
                if code:
                    err = error_for_code(code, f"produce to {t}/{q}: {msg}")
                    if isinstance(err, BrokerError) and err.retriable and time.monotonic() < deadline:
                        retry.append(entry)
                        continue
                    raise err
                st = self.queues[(t, q)]
                if base >= 0:
                    st.first = base if st.first < 0 else st.first
                    st.last = max(st.last, last)
            if not retry:
                return
            attempt += 1
            time.sleep(min(0.05 * 2**attempt, 1.0))
            entries, corr = retry, -1

    def flush(self) -> None:
        """Send everything and wait for the answers."""
        self._ship()
        if self.in_flight is not None:
            self._complete()

    def message(self) -> SinkCommitMessage:
        """The task's report to the driver."""
        return SinkCommitMessage(self.partition_id, self.rows, False, {
            f"{t}/{q}": (st.first, st.last) for (t, q), st in self.queues.items() if st.first >= 0
        })


def _task_context() -> tuple[int, int | None]:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return 0, None
    raw = ctx.getLocalProperty("streaming.sql.batchId")
    return ctx.partitionId(), int(raw) if raw not in (None, "") else None


def write_rows(opts: SinkOptions, iterator: Iterator[pa.RecordBatch], *,
               fence: str | None) -> SinkCommitMessage:
    """The body of a task: produce every row (or nothing when the micro-batch is already
    committed on the broker)."""
    partition_id, batch_id = _task_context()
    if fence is not None and batch_id is not None and batch_committed(opts.servers, fence, batch_id):
        skipped = sum(rb.num_rows for rb in iterator)
        log.info("sink %s: micro-batch %d already committed; %d rows not written again",
                 fence, batch_id, skipped)
        return SinkCommitMessage(partition_id, 0, True)
    producer = TaskProducer(opts, partition_id)
    try:
        for rb in iterator:
            producer.add(rb)
        producer.flush()
    except BaseException:
        producer.conn.close()  # a request may be in flight: never reuse this socket
        raise
    return producer.message()


def fence_key(sink_id: str, batch_id: int) -> str:
    """The key under which a committed micro-batch is recorded."""
    return f"{sink_id.replace(chr(0), '')}#{batch_id}"


def batch_committed(servers: str, sink_id: str, batch_id: int) -> bool:
    """Whether the driver recorded ``batch_id`` of ``sink_id`` as committed."""
    resp = _wire.connection(servers).request(
        m.FindByKeyRequest(SINKS_TOPIC, fence_key(sink_id, batch_id), 1), m.FindByKeyResponse)
    return bool(resp.messages)


def ensure_sinks_topic(servers: str) -> None:
    """Create the topic of micro-batch records if it is missing."""
    conn = _wire.connection(servers)
    try:
        conn.request(m.CreateTopicRequest(SINKS_TOPIC, 1, {}), m.CreateTopicResponse)
    except TopicAlreadyExistsError:
        pass


def record_commit(servers: str, sink_id: str, batch_id: int, rows: int) -> None:
    """Record micro-batch ``batch_id`` of ``sink_id`` as committed (one produce, fsynced)."""
    from ferrymq.protocol.records import RecordInput, encode_batch

    now = int(time.time() * 1000)
    body = f'{{"sink": {sink_id!r}, "batch": {batch_id}, "rows": {rows}}}'.encode()
    batch = encode_batch([RecordInput(body, now, keys=fence_key(sink_id, batch_id).encode())])
    resp = _wire.connection(servers).request(
        m.ProduceRequest(PRODUCE_TIMEOUT_MS, [(SINKS_TOPIC, 0, batch)]), m.ProduceResponse)
    code = resp.results[0][2]
    if code:
        raise error_for_code(code, f"recording micro-batch {batch_id} of sink {sink_id}")


class FerryMQBatchWriter(DataSourceArrowWriter):
    """``df.write.format("ferrymq")``."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.opts = SinkOptions.parse(options)
        check_sink_schema(schema, self.opts)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        return write_rows(self.opts, iterator, fence=None)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        rows = sum(msg.rows for msg in messages if isinstance(msg, SinkCommitMessage))
        log.info("ferrymq sink: wrote %d rows", rows)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        rows = sum(msg.rows for msg in messages if isinstance(msg, SinkCommitMessage))
        log.warning("ferrymq sink: write failed; %d rows written by finished tasks stay", rows)


class FerryMQStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("ferrymq")``: one instance per micro-batch (driver), pickled to
    the tasks; ``commit``/``abort`` run on a fresh instance on the driver."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.opts = SinkOptions.parse(options)
        check_sink_schema(schema, self.opts)
        self.fence: str | None = None
        if self.opts.delivery_mode == "idempotent":
            if self.opts.sink_id is None:
                raise ConfigError("a streaming ferrymq sink with deliveryMode=idempotent needs "
                                  "option 'checkpointLocation' (or 'sinkId'): it names the sink "
                                  "whose committed micro-batches are recorded on the broker")
            self.fence = self.opts.sink_id
            try:
                ensure_sinks_topic(self.opts.servers)
            except ConnectionClosedError as exc:
                raise ConnectionClosedError(f"{exc} (option 'servers')") from None

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        return write_rows(self.opts, iterator, fence=self.fence)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        done = [msg for msg in messages if isinstance(msg, SinkCommitMessage)]
        if self.fence is None or not done or all(msg.skipped for msg in done):
            return
        record_commit(self.opts.servers, self.fence, batchId, sum(msg.rows for msg in done))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        rows = sum(msg.rows for msg in messages if isinstance(msg, SinkCommitMessage))
        # Never undo: rows already on the broker stay (they may belong to a commit that
        # succeeded before Spark saw it fail).
        log.warning("ferrymq sink: micro-batch %d aborted; %d rows its finished tasks wrote stay",
                    batchId, rows)


__all__ = [
    "FerryMQBatchWriter",
    "FerryMQStreamWriter",
    "SinkCommitMessage",
    "check_sink_schema",
    "encode_batches",
]
