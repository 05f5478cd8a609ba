"""A sink task: its rows sent to the broker by one producer, with retries and a transaction.

Theory of operation
-------------------
:func:`write_rows` is the body of a Spark task. It first asks the broker whether its
micro-batch is committed already (then it writes nothing, see :mod:`ferrymq.spark._sink_commit`)
and, on a retried attempt of a transactional sink, aborts what earlier attempts left open
(:func:`abort_open_attempts`). Then a :class:`TaskProducer` takes the task's Arrow batches: it
groups rows by destination (topic, queue), encodes record batches
(:mod:`ferrymq.spark._sink_batches`) and sends them in PRODUCE requests over blocking
connections (:mod:`ferrymq.spark._wire`), each queue's batches to its leader
(:mod:`ferrymq.spark._route`; a single broker leads them all), one request per leader in flight
while the next are encoded, retrying (byte for byte when idempotent or transactional, to the
leader named by a fresh look-up after NOT_LEADER or a lost connection) for up to
``DELIVERY_TIMEOUT_S``. Producer ids and transactions (INIT_PRODUCER, INIT_TXN, END_TXN) go to
the bootstrap connection.
A transactional task begins its transaction (INIT_TXN) at its first row and stages it at the
end; a task that fails aborts it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ferrymq.errors import (
    BatchAlreadyCommittedError,
    BrokerError,
    ConfigError,
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    LeaderNotAvailableError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.leaders import STALE_VIEW_CODES
from ferrymq.protocol.records import ATTR_TRANSACTIONAL, NO_PRODUCER_EPOCH, NO_PRODUCER_ID
from ferrymq.spark import _route, _wire
from ferrymq.spark._sink_batches import MAX_BATCH_BYTES, encode_batches, route
from ferrymq.spark._sink_commit import (
    PRODUCE_TIMEOUT_MS,
    TXN_TIMEOUT_S,
    SinkCommitMessage,
    batch_committed,
    last_committed_batch,
    transactional_id,
)
from ferrymq.spark.options import SinkOptions

log = logging.getLogger("ferrymq.spark")

MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""Bytes of batches per PRODUCE request (the broker's frame cap is 8 MiB by default)."""
DELIVERY_TIMEOUT_S = 120.0

_Entry = tuple[str, int, bytearray, int]
"""(topic, queue, an encoded record batch, its record count)."""
_Flight = tuple["_wire.BlockingConnection | None", int, list[_Entry]]
"""A PRODUCE request sent: (the leader's connection, correlation id, its entries); no
connection or a negative id: not sent (no leader known, or the send failed)."""


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
        self.router = _route.router(opts.wire)
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
        self.pending: list[_Entry] = []
        self.pending_bytes = 0
        self.in_flight: list[_Flight] = []
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
        r = self.router.txn_request(
            m.InitTxnRequest(self.transactional_id, self.opts.transaction_timeout_ms or 0, -1, -1),
            m.InitTxnResponse, timeout_s=TXN_TIMEOUT_S)
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
        self.router.txn_request(m.EndTxnRequest(*handle, int(m.EndTxnAction.STAGE), sink,
                                                batch_id, self.opts.staged_ttl_ms or 0),
                                m.EndTxnResponse, timeout_s=TXN_TIMEOUT_S)
        self.producer_id = NO_PRODUCER_ID
        return handle

    def abort_txn(self) -> None:
        """Abort the open transaction, best effort, at the coordinator (the caller closed the
        connections that may have an answer in flight). A transaction left open (this fails
        too, or the worker is killed) is aborted by the next INIT_TXN of its id or at its
        timeout."""
        if not self.in_txn:
            return
        assert self.transactional_id is not None
        try:
            self.router.txn_request(
                m.EndTxnRequest(self.transactional_id, self.producer_id, self.epoch,
                                int(m.EndTxnAction.ABORT), "", -1, 0), m.EndTxnResponse,
                timeout_s=TXN_TIMEOUT_S)
        except (FerryMQError, OSError) as exc:
            log.warning("could not abort transaction %s: %s", self.transactional_id, exc)
        finally:
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
        """Send what is pending (after the requests in flight are answered)."""
        if self.in_flight:
            self._complete()
        if not self.pending:
            return
        entries, self.pending, self.pending_bytes = self.pending, [], 0
        self.in_flight = self._send(entries)

    def _send(self, entries: list[_Entry]) -> list[_Flight]:
        """One PRODUCE per leader of the entries' queues."""
        try:
            groups, unrouted = self.router.split(entries)
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            log.info("leader look-up failed (%s); retrying", exc)
            return [(None, -1, entries)]
        flights: list[_Flight] = [(None, -1, unrouted)] if unrouted else []
        for conn, some in groups.items():
            try:
                corr = conn.send(m.ProduceRequest(PRODUCE_TIMEOUT_MS,
                                                  [(t, q, b) for t, q, b, _ in some]))
            except ConnectionClosedError:
                corr = -1
            flights.append((conn, corr, some))
        return flights

    def _complete(self) -> None:
        """Wait for the answers in flight; send again what a retriable error refused, to the
        leaders a fresh look-up names after a stale answer, until ``DELIVERY_TIMEOUT_S``."""
        flights, self.in_flight = self.in_flight, []
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        attempt = 0
        while True:
            retry: list[_Entry] = []
            stale = False
            last: FerryMQError = LeaderNotAvailableError("no live leader known")
            for conn, corr, entries in flights:
                if conn is None or corr < 0:
                    retry.extend(entries)
                    stale = True
                    continue
                try:
                    resp = conn.receive(corr, m.ProduceResponse)
                except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                    log.info("produce failed (%s); retrying", exc)
                    retry.extend(entries)
                    stale, last = True, exc
                    continue
                for entry, result in zip(entries, resp.results, strict=True):
                    t, q, code, msg, base, end = result[:6]
                    if code:
                        err = error_for_code(code, f"produce to {t}/{q}: {msg}")
                        if not (isinstance(err, BrokerError) and err.retriable):
                            raise err
                        retry.append(entry)
                        stale, last = stale or code in STALE_VIEW_CODES, err
                        continue
                    st = self.queues[(t, q)]
                    if base >= 0:
                        st.first = base if st.first < 0 else st.first
                        st.last = max(st.last, end)
            if not retry:
                return
            if time.monotonic() >= deadline:
                raise last
            attempt += 1
            time.sleep(min(0.05 * 2**attempt, 1.0))
            if stale:
                self.router.refresh_quietly({t for t, *_ in retry})
            flights = self._send(retry)

    def flush(self) -> None:
        """Send everything and wait for the answers."""
        self._ship()
        if self.in_flight:
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
        for conn, corr, _ in producer.in_flight:  # an answer may be coming: never reuse these
            if conn is not None and corr >= 0:
                conn.close()
        producer.conn.close()
        producer.abort_txn()
        raise


def abort_open_attempts(wire: _wire.WireConfig, sink: str, task: TaskInfo) -> None:
    """Abort the transactions that earlier attempts of this task left *open* (their worker
    died mid-write), so they stop holding the queues' last stable offset back: INIT_TXN of
    their ids aborts and fences them. Staged ones are left alone (the driver's commit aborts
    those it does not name)."""
    router = _route.router(wire)
    for attempt in range(task.attempt):
        tid = transactional_id(sink, task.partition_id, attempt)
        txns = router.txn_request(m.DescribeTxnsRequest(tid, ""), m.DescribeTxnsResponse,
                                  timeout_s=TXN_TIMEOUT_S).txns
        if any(t[0] == tid and t[3] == m.TxnState.ONGOING for t in txns):
            log.info("aborting the open transaction of failed attempt %s", tid)
            router.txn_request(m.InitTxnRequest(tid, 0, -1, -1), m.InitTxnResponse,
                               timeout_s=TXN_TIMEOUT_S)
