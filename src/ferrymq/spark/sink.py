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

Where each part lives: this module is what Spark calls (:class:`FerryMQBatchWriter`,
:class:`FerryMQStreamWriter`: the driver's side); the columns, their record batches and queue
choice are :mod:`ferrymq.spark._sink_batches` (no I/O); a task's writing
(:func:`write_rows`, :class:`TaskProducer`) is :mod:`ferrymq.spark._sink_task`; the ids, fences
and staged commits on the broker are :mod:`ferrymq.spark._sink_commit`. Every name is
importable from here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Mapping

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from ferrymq import _deprecated
from ferrymq.errors import ConfigError, ConnectionClosedError
from ferrymq.spark import _wire
from ferrymq.spark._sink_batches import MAX_BATCH_BYTES, check_sink_schema, encode_batches, route
from ferrymq.spark._sink_commit import (
    FENCE_TIMEOUT_S,
    MAX_SINK_CHARS,
    PRODUCE_TIMEOUT_MS,
    SINKS_TOPIC,
    TXN_TIMEOUT_S,
    SinkCommitMessage,
    abort_staged,
    batch_committed,
    broker_sink_id,
    check_brokers,
    commit_staged,
    ensure_sinks_topic,
    fence_key,
    last_committed_batch,
    record_commit,
    transactional_id,
)
from ferrymq.spark._sink_task import (
    DELIVERY_TIMEOUT_S,
    MAX_REQUEST_BYTES,
    TaskInfo,
    TaskProducer,
    abort_open_attempts,
    task_info,
    write_rows,
)
from ferrymq.spark.options import SinkOptions

log = logging.getLogger("ferrymq.spark")


def _check_brokers(wire: _wire.WireConfig) -> None:
    try:
        check_brokers(wire)
    except ConnectionClosedError as exc:
        raise ConnectionClosedError(f"{exc} (option 'servers')") from None


class FerryMQBatchWriter(DataSourceArrowWriter):
    """``df.write.format("ferrymq")``. Spark pickles this instance to the tasks and to the
    driver's commit, so a transactional write's sink id (fresh per write: a write is batch 0 of
    its own sink) is the same everywhere."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.opts = SinkOptions.parse(options)
        check_sink_schema(schema, self.opts)
        self.sink: str | None = None
        if self.opts.delivery_mode == "transactional":
            _check_brokers(self.opts.wire)
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
                check_brokers(self.opts.wire)  # fails at start when
                # the broker is unreachable or refuses the login
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
    "DELIVERY_TIMEOUT_S",
    "FENCE_TIMEOUT_S",
    "MAX_BATCH_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_SINK_CHARS",
    "PRODUCE_TIMEOUT_MS",
    "SINKS_TOPIC",
    "FerryMQBatchWriter",
    "FerryMQStreamWriter",
    "TXN_TIMEOUT_S",
    "SinkCommitMessage",
    "TaskInfo",
    "TaskProducer",
    "abort_open_attempts",
    "abort_staged",
    "batch_committed",
    "broker_sink_id",
    "check_brokers",
    "check_sink_schema",
    "commit_staged",
    "encode_batches",
    "ensure_sinks_topic",
    "fence_key",
    "last_committed_batch",
    "record_commit",
    "route",
    "task_info",
    "transactional_id",
    "write_rows",
]

__getattr__ = _deprecated.module_getattr(
    __name__, {"refuse_transactions_on_a_cluster": "check_brokers"})
"""``refuse_transactions_on_a_cluster`` (before transactions failed over on a cluster: it
refused them there) is ``check_brokers`` now, with a DeprecationWarning."""
