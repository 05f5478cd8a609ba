"""The sink's bookkeeping on the broker: sink and transactional ids, fences, staged commits.

Theory of operation
-------------------
Each task reports a :class:`SinkCommitMessage` to the driver. With ``deliveryMode=
transactional`` a sink has one id on the broker (:func:`broker_sink_id`) and each task slot
(partition, attempt) one transactional id (:func:`transactional_id`); tasks stage their
transactions, the driver's :func:`commit_staged` commits every handle of a micro-batch at once
(COMMIT_STAGED, fenced by sink and batch id) and :func:`abort_staged` aborts them;
:func:`last_committed_batch` tells a task whether its batch is committed already. With
``deliveryMode=idempotent`` a streaming sink's driver records each committed micro-batch
(:func:`record_commit`, one produce to ``SINKS_TOPIC`` keyed :func:`fence_key`), and a task
asks :func:`batch_committed` before writing. The whole protocol: :mod:`ferrymq.spark.sink` and
docs/exactly-once.md. Transaction requests go to the transaction coordinator
(:meth:`~ferrymq.spark._route.Router.txn_request`): on a cluster the leader of ``%TXN%state``,
followed through a failover.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from pyspark.sql.datasource import WriterCommitMessage

from ferrymq.errors import (
    BatchAlreadyCommittedError,
    TopicAlreadyExistsError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.spark import _route, _wire

log = logging.getLogger("ferrymq.spark")

SINKS_TOPIC = "__ferrymq_spark_sinks"
"""Where streaming sinks record committed micro-batches (keys ``sinkId#batchId``)."""
PRODUCE_TIMEOUT_MS = 30_000
TXN_TIMEOUT_S = 60.0
"""How long a transaction request looks for the transaction coordinator (a cluster's may be
failing over: seconds)."""
MAX_SINK_CHARS = 200
"""Longest sink id used as is on the broker (names have at most ``MAX_NAME_CHARS`` = 249
characters, and the transactional ids add ``#partition.attempt``); longer ones are shortened
with a digest (:func:`broker_sink_id`)."""

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


def last_committed_batch(wire: _wire.WireConfig, sink: str) -> int:
    """The last batch id the broker committed for ``sink`` (-1: none)."""
    resp = _route.router(wire).txn_request(m.DescribeTxnsRequest("", sink),
                                           m.DescribeTxnsResponse, timeout_s=TXN_TIMEOUT_S)
    return max((b for s, b, _at in resp.sinks if s == sink), default=-1)


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
        _route.router(wire).txn_request(m.CommitStagedRequest(sink, batch_id, handles),
                                        m.CommitStagedResponse, timeout_s=TXN_TIMEOUT_S)
    except BatchAlreadyCommittedError as exc:
        log.info("sink %s: batch %d was committed before (a replay): %d staged rows dropped (%s)",
                 sink, batch_id, sum(msg.rows for msg in done), exc)
        return
    log.info("sink %s: committed batch %d (%d rows from %d tasks)", sink, batch_id,
             sum(msg.rows for msg in done), len(handles))


def abort_staged(wire: _wire.WireConfig, sink: str, batch_id: int) -> int:
    """Abort every staged transaction of (``sink``, ``batch_id``) (never committed data)."""
    resp = _route.router(wire).txn_request(m.AbortStagedRequest(sink, batch_id, []),
                                           m.AbortStagedResponse, timeout_s=TXN_TIMEOUT_S)
    return resp.aborted


def fence_key(sink_id: str, batch_id: int) -> str:
    """The key under which a committed micro-batch is recorded."""
    return f"{sink_id.replace(chr(0), '')}#{batch_id}"


FENCE_TIMEOUT_S = 30.0
"""How long recording or looking up a micro-batch waits for a leader of ``SINKS_TOPIC``."""


def batch_committed(wire: _wire.WireConfig, sink_id: str, batch_id: int) -> bool:
    """Whether the driver recorded ``batch_id`` of ``sink_id`` as committed (asked of the
    leader of ``SINKS_TOPIC``: every replica indexes its copy, but only up to the high
    watermark it knows, and the leader's is the current one)."""
    resp = _route.router(wire).request(
        SINKS_TOPIC, 0, m.FindByKeyRequest(SINKS_TOPIC, fence_key(sink_id, batch_id), 1),
        m.FindByKeyResponse, code=lambda r: 0, timeout_s=FENCE_TIMEOUT_S)
    return bool(resp.messages)


def check_brokers(wire: _wire.WireConfig) -> None:
    """Fail at the start of a ``deliveryMode=transactional`` write when no broker answers or
    the login is refused (a cluster's transaction coordinator is found at the first request).

    Raises:
        ConnectionClosedError: no broker answered.
        BrokerError: the login was refused.
    """
    _wire.connection(wire).request(m.ClusterMetadataRequest([]), m.ClusterMetadataResponse)


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
    resp = _route.router(wire).request(
        SINKS_TOPIC, 0, m.ProduceRequest(PRODUCE_TIMEOUT_MS, [(SINKS_TOPIC, 0, batch)]),
        m.ProduceResponse, code=lambda r: r.results[0][2], timeout_s=FENCE_TIMEOUT_S)
    code = resp.results[0][2]
    if code:
        raise error_for_code(code, f"recording micro-batch {batch_id} of sink {sink_id}")
