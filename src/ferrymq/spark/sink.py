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

* ``transactional`` (the default): built on the broker's *staged transactions*
  (docs/exactly-once.md). A task (partition p, attempt a) is the transactional producer
  ``{sink}#{p}.{a}`` (:func:`transactional_id`): INIT_TXN fences any older instance of that id
  and aborts what it left open, the rows go out as transactional batches, and END_TXN *stage*
  (sink, batch) makes them durable but invisible. The task returns the handle (transactional
  id, producer id, epoch) in its :class:`SinkCommitMessage`; the driver's ``commit`` sends one
  COMMIT_STAGED with every handle, fenced by (sink, batch id): readers with read_committed see
  the whole micro-batch at once, a batch already committed (a replay after a driver crash
  between the broker commit and Spark's checkpoint) is refused with BATCH_ALREADY_COMMITTED,
  which is success (the replay's staged rows are dropped), and staged attempts not named
  (failed or speculative) are aborted. ``abort`` aborts the batch's staged transactions;
  committed data is never touched. Before writing, a task asks the broker for the sink's last
  committed batch and writes nothing when its batch is at or below it. A retried task attempt
  aborts earlier attempts' transactions that are still open (a worker killed mid-write), so they
  do not hold the queues' last stable offset back until their timeout.
  The transactional id does not contain the batch id: ids are reused from batch to batch, so the
  broker keeps (partitions x attempts) ids per sink, not one per task ever run.
* ``idempotent``: the task's producer stamps producer id, epoch and sequence numbers, so a
  request retried after a timeout or a lost connection is stored once. A streaming sink also
  fences replays by micro-batch: the driver's ``commit`` records ``(sinkId, batchId)`` on the
  broker (one produce to ``__ferrymq_spark_sinks``, keyed ``sinkId#batchId``), and a task of a
  micro-batch already recorded writes nothing. Rows written by tasks of a batch whose commit was
  never recorded are written again on replay, and rows are visible as soon as written.
* ``atLeastOnce``: plain produce, no sequence numbers, no fence (Spark's Kafka sink semantics).
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
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
    BatchAlreadyCommittedError,
    BrokerError,
    ConfigError,
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    TopicAlreadyExistsError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.records import (
    ATTR_HAS_KEYS,
    ATTR_TRANSACTIONAL,
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
MAX_SINK_CHARS = 200
"""Longest sink id used as is on the broker (names have at most ``MAX_NAME_CHARS`` = 249
characters, and the transactional ids add ``#partition.attempt``); longer ones are shortened
with a digest (:func:`broker_sink_id`)."""

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
    ``handle`` (``deliveryMode=transactional``) is the task's staged transaction: (transactional
    id, producer id, epoch), as :class:`ferrymq.client.producer.StagedHandle`; None when the task
    had no rows or skipped a batch already committed.
    """

    partition_id: int
    rows: int = 0
    skipped: bool = False
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    handle: tuple[str, int, int] | None = None


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


@dataclass
class _QueueState:
    next_seq: int = 0
    first: int = -1
    last: int = -1


class TaskProducer:
    """Sends a task's rows: groups them by (topic, queue), encodes batches, one PRODUCE request
    in flight while the next is built, retries (byte for byte when idempotent or transactional).

    With ``transactional_id`` the rows form one transaction, begun (INIT_TXN) at the first row
    and ended by :meth:`stage` or :meth:`abort_txn`.
    """

    def __init__(self, opts: SinkOptions, partition_id: int, *,
                 transactional_id: str | None = None) -> None:
        self.opts = opts
        self.partition_id = partition_id
        self.conn = _wire.connection(opts.wire)
        hello = self.conn.hello
        self.max_records = min(opts.batch_max_records, hello.max_batch_records if hello else 16_384)
        self.max_bytes = min(MAX_BATCH_BYTES, (hello.max_message_bytes if hello else MAX_BATCH_BYTES))
        self.idempotent = opts.delivery_mode == "idempotent"
        self.transactional_id = transactional_id
        self.attributes = ATTR_TRANSACTIONAL if transactional_id is not None else 0
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
            # like a producer: the broker creates a missing topic if its auto_create_topics
            # setting (and the user's rights and the topic limits) allow
            resp = self.conn.request(m.MetadataRequest([topic], True), m.MetadataResponse)
            for name, _tid, queues, code, *_ in resp.topics:
                if name == topic and code:
                    if code == ErrorCode.UNKNOWN_TOPIC:
                        raise UnknownTopicError(
                            f"sink topic {topic!r} does not exist on {self.opts.wire} and the "
                            "broker does not create topics on first use (auto_create_topics): "
                            f"create it first (ferrymq topic create {topic})")
                    raise error_for_code(code, f"sink topic {topic!r}")
                if name == topic:
                    n = queues
            if n is None:
                raise UnknownTopicError(f"sink topic {topic!r} does not exist")
            self.topics[topic] = n
        return n

    def _init_txn(self) -> None:
        """INIT_TXN: this task's producer id and a new epoch; fences older instances of the id
        and aborts what they left open."""
        assert self.transactional_id is not None
        r = self.conn.request(
            m.InitTxnRequest(self.transactional_id, self.opts.transaction_timeout_ms or 0, -1, -1),
            m.InitTxnResponse)
        self.producer_id, self.epoch = r.producer_id, r.producer_epoch

    @property
    def in_txn(self) -> bool:
        """A transaction was begun (rows were added) and not yet staged or aborted."""
        return self.transactional_id is not None and self.producer_id >= 0

    def stage(self, sink: str, batch_id: int) -> tuple[str, int, int] | None:
        """Send everything, then stage the transaction for (``sink``, ``batch_id``): durable
        and invisible until the driver's COMMIT_STAGED. Returns the handle (None: no rows)."""
        self.flush()
        if not self.in_txn:
            return None
        assert self.transactional_id is not None
        handle = (self.transactional_id, self.producer_id, self.epoch)
        self.conn.request(m.EndTxnRequest(*handle, int(m.EndTxnAction.STAGE), sink, batch_id,
                                          self.opts.staged_ttl_ms or 0), m.EndTxnResponse)
        self.producer_id = NO_PRODUCER_ID
        return handle

    def abort_txn(self) -> None:
        """Abort the open transaction, best effort, on a fresh connection (the cached one may
        have an answer in flight). A transaction left open (this fails too, or the worker is
        killed) is aborted by the next INIT_TXN of its id or at its timeout."""
        if not self.in_txn:
            return
        assert self.transactional_id is not None
        conn = _wire.BlockingConnection(self.opts.wire)
        try:
            conn.request(m.EndTxnRequest(self.transactional_id, self.producer_id, self.epoch,
                                         int(m.EndTxnAction.ABORT), "", -1, 0), m.EndTxnResponse)
        except (FerryMQError, OSError) as exc:
            log.warning("could not abort transaction %s: %s", self.transactional_id, exc)
        finally:
            conn.close()
            self.producer_id = NO_PRODUCER_ID

    def add(self, rb: pa.RecordBatch) -> None:
        """Route, encode and (when enough is pending) send the rows of one Arrow batch."""
        n = rb.num_rows
        if n == 0:
            return
        if self.transactional_id is not None and self.producer_id < 0:
            self._init_txn()
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
                                         include_properties=self.opts.include_properties,
                                         attributes=self.attributes):
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

    def message(self, handle: tuple[str, int, int] | None = None) -> SinkCommitMessage:
        """The task's report to the driver."""
        return SinkCommitMessage(self.partition_id, self.rows, False, {
            f"{t}/{q}": (st.first, st.last) for (t, q), st in self.queues.items() if st.first >= 0
        }, handle)


@dataclass(frozen=True)
class TaskInfo:
    """Who is writing: Spark's partition id, attempt number and (streaming) micro-batch id."""

    partition_id: int = 0
    attempt: int = 0
    batch_id: int | None = None


def task_info() -> TaskInfo:
    """This task's :class:`TaskInfo` (from ``TaskContext``; the batch id is the local property
    ``streaming.sql.batchId``, since ``write()`` is not given it)."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        return TaskInfo()
    raw = ctx.getLocalProperty("streaming.sql.batchId")
    return TaskInfo(ctx.partitionId(), ctx.attemptNumber(),
                    int(raw) if raw not in (None, "") else None)


def broker_sink_id(sink_id: str) -> str:
    """The sink id used on the broker: ``sink_id`` itself, or when longer than
    ``MAX_SINK_CHARS`` its head and a SHA-256 digest (stable across runs and processes)."""
    if len(sink_id) <= MAX_SINK_CHARS:
        return sink_id
    digest = hashlib.sha256(sink_id.encode()).hexdigest()[:32]
    return f"{sink_id[:MAX_SINK_CHARS - 34]}~{digest}"


def transactional_id(sink: str, partition_id: int, attempt: int) -> str:
    """The transactional id of a task: one per (sink, partition, attempt), reused by every
    micro-batch (so INIT_TXN cleans up what the previous run of that slot left open)."""
    return f"{sink}#{partition_id}.{attempt}"


def write_rows(opts: SinkOptions, iterator: Iterator[pa.RecordBatch], *,
               fence: str | None = None, sink: str | None = None, batch_id: int | None = None,
               task: TaskInfo | None = None) -> SinkCommitMessage:
    """The body of a task: produce every row (or nothing when the micro-batch is already
    committed on the broker).

    ``fence`` (idempotent streaming sinks) names the ``__ferrymq_spark_sinks`` fence; ``sink``
    (transactional) the broker sink whose batch ``batch_id`` (default: the task's micro-batch)
    the rows are staged for.
    """
    task = task or task_info()
    if batch_id is None:
        batch_id = task.batch_id
    if fence is not None and batch_id is not None and batch_committed(opts.wire, fence, batch_id):
        skipped = sum(rb.num_rows for rb in iterator)
        log.info("sink %s: micro-batch %d already committed; %d rows not written again",
                 fence, batch_id, skipped)
        return SinkCommitMessage(task.partition_id, 0, True)
    tid = None
    if sink is not None:
        if batch_id is None:
            raise ConfigError("a transactional ferrymq sink task has no micro-batch id")
        last = last_committed_batch(opts.wire, sink)
        if batch_id <= last:
            skipped = sum(rb.num_rows for rb in iterator)
            log.info("sink %s: batch %d already committed (last %d); %d rows not written again",
                     sink, batch_id, last, skipped)
            return SinkCommitMessage(task.partition_id, 0, True)
        if task.attempt > 0:
            abort_open_attempts(opts.wire, sink, task)
        tid = transactional_id(sink, task.partition_id, task.attempt)
    producer = TaskProducer(opts, task.partition_id, transactional_id=tid)
    try:
        for rb in iterator:
            producer.add(rb)
        if sink is None:
            producer.flush()
            return producer.message()
        assert batch_id is not None
        return producer.message(producer.stage(sink, batch_id))
    except BatchAlreadyCommittedError:
        # the driver committed this batch while the task ran (a replay racing its commit):
        # the broker aborted this transaction, nothing of it is written
        log.info("sink %s: batch %s was committed meanwhile; rows of this task dropped",
                 sink, batch_id)
        return SinkCommitMessage(task.partition_id, 0, True)
    except BaseException:
        producer.conn.close()  # a request may be in flight: never reuse this socket
        producer.abort_txn()
        raise


def last_committed_batch(wire: _wire.WireConfig, sink: str) -> int:
    """The last batch id the broker committed for ``sink`` (-1: none)."""
    resp = _wire.connection(wire).request(m.DescribeTxnsRequest("", sink), m.DescribeTxnsResponse)
    return max((b for s, b, _at in resp.sinks if s == sink), default=-1)


def abort_open_attempts(wire: _wire.WireConfig, sink: str, task: TaskInfo) -> None:
    """Abort the transactions that earlier attempts of this task left *open* (their worker
    died mid-write), so they stop holding the queues' last stable offset back: INIT_TXN of
    their ids aborts and fences them. Staged ones are left alone (the driver's commit aborts
    those it does not name)."""
    conn = _wire.connection(wire)
    for attempt in range(task.attempt):
        tid = transactional_id(sink, task.partition_id, attempt)
        txns = conn.request(m.DescribeTxnsRequest(tid, ""), m.DescribeTxnsResponse).txns
        if any(t[0] == tid and t[3] == m.TxnState.ONGOING for t in txns):
            log.info("aborting the open transaction of failed attempt %s", tid)
            conn.request(m.InitTxnRequest(tid, 0, -1, -1), m.InitTxnResponse)


def commit_staged(wire: _wire.WireConfig, sink: str, batch_id: int,
                  messages: list[WriterCommitMessage | None]) -> None:
    """The driver's commit of a transactional batch: one COMMIT_STAGED with every task's handle.
    A batch the broker already committed (a replay) is success: its staged rows are dropped.

    Raises:
        StagedTxnExpiredError: a task's staged transaction expired or was aborted: nothing is
            committed (Spark fails the batch; a restart replays it).
    """
    done = [msg for msg in messages if isinstance(msg, SinkCommitMessage)]
    handles = [msg.handle for msg in done if msg.handle is not None]
    if not handles:
        return
    try:
        _wire.connection(wire).request(m.CommitStagedRequest(sink, batch_id, handles),
                                       m.CommitStagedResponse)
    except BatchAlreadyCommittedError as exc:
        log.info("sink %s: batch %d was committed before (a replay): %d staged rows dropped (%s)",
                 sink, batch_id, sum(msg.rows for msg in done), exc)
        return
    log.info("sink %s: committed batch %d (%d rows from %d tasks)", sink, batch_id,
             sum(msg.rows for msg in done), len(handles))


def abort_staged(wire: _wire.WireConfig, sink: str, batch_id: int) -> int:
    """Abort every staged transaction of (``sink``, ``batch_id``) (never committed data)."""
    resp = _wire.connection(wire).request(m.AbortStagedRequest(sink, batch_id, []),
                                          m.AbortStagedResponse)
    return resp.aborted


def fence_key(sink_id: str, batch_id: int) -> str:
    """The key under which a committed micro-batch is recorded."""
    return f"{sink_id.replace(chr(0), '')}#{batch_id}"


def batch_committed(wire: _wire.WireConfig, sink_id: str, batch_id: int) -> bool:
    """Whether the driver recorded ``batch_id`` of ``sink_id`` as committed."""
    resp = _wire.connection(wire).request(
        m.FindByKeyRequest(SINKS_TOPIC, fence_key(sink_id, batch_id), 1), m.FindByKeyResponse)
    return bool(resp.messages)


def ensure_sinks_topic(wire: _wire.WireConfig) -> None:
    """Create the topic of micro-batch records if it is missing."""
    conn = _wire.connection(wire)
    try:
        conn.request(m.CreateTopicRequest(SINKS_TOPIC, 1, {}), m.CreateTopicResponse)
    except TopicAlreadyExistsError:
        pass


def record_commit(wire: _wire.WireConfig, sink_id: str, batch_id: int, rows: int) -> None:
    """Record micro-batch ``batch_id`` of ``sink_id`` as committed (one produce, fsynced)."""
    from ferrymq.protocol.records import RecordInput, encode_batch

    now = int(time.time() * 1000)
    body = f'{{"sink": {sink_id!r}, "batch": {batch_id}, "rows": {rows}}}'.encode()
    batch = encode_batch([RecordInput(body, now, keys=fence_key(sink_id, batch_id).encode())])
    resp = _wire.connection(wire).request(
        m.ProduceRequest(PRODUCE_TIMEOUT_MS, [(SINKS_TOPIC, 0, batch)]), m.ProduceResponse)
    code = resp.results[0][2]
    if code:
        raise error_for_code(code, f"recording micro-batch {batch_id} of sink {sink_id}")


class FerryMQBatchWriter(DataSourceArrowWriter):
    """``df.write.format("ferrymq")``. Spark pickles this instance to the tasks and to the
    driver's commit, so a transactional write's sink id (fresh per write: a write is batch 0 of
    its own sink) is the same everywhere."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.opts = SinkOptions.parse(options)
        check_sink_schema(schema, self.opts)
        self.sink: str | None = None
        if self.opts.delivery_mode == "transactional":
            self.sink = broker_sink_id(f"{self.opts.sink_id or 'spark-write'}-{uuid.uuid4().hex}")

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        return write_rows(self.opts, iterator, sink=self.sink, batch_id=0)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        rows = sum(msg.rows for msg in messages if isinstance(msg, SinkCommitMessage))
        if self.sink is not None:
            commit_staged(self.opts.wire, self.sink, 0, messages)
        log.info("ferrymq sink: wrote %d rows", rows)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        rows = sum(msg.rows for msg in messages if isinstance(msg, SinkCommitMessage))
        if self.sink is not None:
            n = abort_staged(self.opts.wire, self.sink, 0)
            log.warning("ferrymq sink: write failed; %d staged transactions (%d rows) aborted",
                        n, rows)
            return
        log.warning("ferrymq sink: write failed; %d rows written by finished tasks stay", rows)


class FerryMQStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("ferrymq")``: one instance per micro-batch (driver), pickled to
    the tasks; ``commit``/``abort`` run on a fresh instance on the driver."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.opts = SinkOptions.parse(options)
        check_sink_schema(schema, self.opts)
        self.fence: str | None = None
        self.sink: str | None = None
        mode = self.opts.delivery_mode
        if mode in ("idempotent", "transactional") and self.opts.sink_id is None:
            raise ConfigError(f"a streaming ferrymq sink with deliveryMode={mode} needs option "
                              "'checkpointLocation' (or 'sinkId'): it names the sink whose "
                              "committed micro-batches the broker remembers")
        try:
            if mode == "transactional":
                assert self.opts.sink_id is not None
                self.sink = broker_sink_id(self.opts.sink_id)
                _wire.connection(self.opts.wire)  # fail at start: unreachable, refused login
            elif mode == "idempotent":
                self.fence = self.opts.sink_id
                ensure_sinks_topic(self.opts.wire)
        except ConnectionClosedError as exc:
            raise ConnectionClosedError(f"{exc} (option 'servers')") from None

    def write(self, iterator: Iterator[pa.RecordBatch]) -> SinkCommitMessage:
        return write_rows(self.opts, iterator, fence=self.fence, sink=self.sink)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        if self.sink is not None:
            commit_staged(self.opts.wire, self.sink, batchId, messages)
            return
        done = [msg for msg in messages if isinstance(msg, SinkCommitMessage)]
        if self.fence is None or not done or all(msg.skipped for msg in done):
            return
        record_commit(self.opts.wire, self.fence, batchId, sum(msg.rows for msg in done))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        rows = sum(msg.rows for msg in messages if isinstance(msg, SinkCommitMessage))
        if self.sink is not None:
            # only *staged* transactions are aborted: a batch whose commit in fact reached the
            # broker stays committed
            n = abort_staged(self.opts.wire, self.sink, batchId)
            log.warning("ferrymq sink: micro-batch %d aborted; %d staged transactions aborted",
                        batchId, n)
            return
        # Never undo: rows already on the broker stay (they may belong to a commit that
        # succeeded before Spark saw it fail).
        log.warning("ferrymq sink: micro-batch %d aborted; %d rows its finished tasks wrote stay",
                    batchId, rows)


__all__ = [
    "FerryMQBatchWriter",
    "FerryMQStreamWriter",
    "SinkCommitMessage",
    "TaskInfo",
    "check_sink_schema",
    "encode_batches",
]
