"""INIT_TXN, END_TXN, TXN_OFFSET_COMMIT, COMMIT_STAGED, ABORT_STAGED, DESCRIBE_TXNS: exactly-once
transactions, all delegated to :class:`ferrymq.broker.txn.TxnCoordinator`; in a cluster only
its coordinator answers them (others: NOT_COORDINATOR). TXN_ADD_QUEUE and TXN_MARKERS are the
cluster's requests between brokers (:mod:`ferrymq.broker.txn.cluster`)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

from ferrymq.errors import BrokerShuttingDownError, InvalidRequestError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection


def _open(conn: ClientConnection, what: str = "transactions") -> None:
    if conn.server.shutting_down:
        raise BrokerShuttingDownError("broker is shutting down")
    cluster = conn.server.cluster
    if cluster is not None:
        cluster.txn.check_owner(what)


def init_txn(conn: ClientConnection, req: m.InitTxnRequest) -> Awaitable[m.InitTxnResponse]:
    """Give a transactional id its producer id and a new epoch (fencing older instances)."""
    _open(conn, f"transactional id {req.transactional_id[:249]!r}")
    return conn.server.txn.init(req)


def end_txn(conn: ClientConnection, req: m.EndTxnRequest) -> Awaitable[m.EndTxnResponse]:
    """Commit, abort or stage the open transaction."""
    _open(conn, f"transactional id {req.transactional_id[:249]!r}")
    return conn.server.txn.end(req)


def txn_offset_commit(
    conn: ClientConnection, req: m.TxnOffsetCommitRequest
) -> Awaitable[m.CommitOffsetsResponse]:
    """Consumer offsets that commit with the transaction."""
    _open(conn, f"transactional id {req.transactional_id[:249]!r}")
    return conn.server.txn.add_offsets(req)


def commit_staged(
    conn: ClientConnection, req: m.CommitStagedRequest
) -> Awaitable[m.CommitStagedResponse]:
    """Commit one sink batch's staged transactions at once."""
    _open(conn, f"sink {req.sink_id[:249]!r}")
    return conn.server.txn.commit_staged(req)


def abort_staged(
    conn: ClientConnection, req: m.AbortStagedRequest
) -> Awaitable[m.AbortStagedResponse]:
    """Abort one sink batch's staged transactions."""
    _open(conn, f"sink {req.sink_id[:249]!r}")
    return conn.server.txn.abort_staged(req)


def describe_txns(conn: ClientConnection, req: m.DescribeTxnsRequest) -> m.DescribeTxnsResponse:
    """Transactional ids and sink fences."""
    _open(conn)
    return conn.server.txn.describe(req)


async def txn_add_queue(conn: ClientConnection,
                        req: m.TxnAddQueueRequest) -> m.TxnAddQueueResponse:
    """A queue's leader asks the coordinator to register the queue with a transaction."""
    _open(conn, f"producer {req.producer_id}")
    await conn.server.txn.add_queue(req.producer_id, req.producer_epoch, req.topic, req.queue)
    return m.TxnAddQueueResponse()


async def txn_markers(conn: ClientConnection, req: m.TxnMarkersRequest) -> m.TxnMarkersResponse:
    """The coordinator asks this queue leader to write a transaction's markers."""
    if conn.server.shutting_down:
        raise BrokerShuttingDownError("broker is shutting down")
    if conn.server.cluster is None:
        raise InvalidRequestError("TXN_MARKERS is a request between brokers of a cluster")
    return m.TxnMarkersResponse(await conn.server.txn.write_markers_here(
        req.producer_id, req.producer_epoch, req.commit, req.transactional_id,
        req.coordinator_offset, req.queues))
