"""INIT_TXN, END_TXN, TXN_OFFSET_COMMIT, COMMIT_STAGED, ABORT_STAGED, DESCRIBE_TXNS: exactly-once
transactions, all delegated to :class:`ferrymq.broker.txn.TxnCoordinator`."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

from ferrymq.errors import BrokerShuttingDownError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection


def _open(conn: ClientConnection) -> None:
    if conn.server.shutting_down:
        raise BrokerShuttingDownError("broker is shutting down")


def init_txn(conn: ClientConnection, req: m.InitTxnRequest) -> Awaitable[m.InitTxnResponse]:
    """Give a transactional id its producer id and a new epoch (fencing older instances)."""
    _open(conn)
    return conn.server.txn.init(req)


def end_txn(conn: ClientConnection, req: m.EndTxnRequest) -> Awaitable[m.EndTxnResponse]:
    """Commit, abort or stage the open transaction."""
    _open(conn)
    return conn.server.txn.end(req)


def txn_offset_commit(
    conn: ClientConnection, req: m.TxnOffsetCommitRequest
) -> Awaitable[m.CommitOffsetsResponse]:
    """Consumer offsets that commit with the transaction."""
    _open(conn)
    return conn.server.txn.add_offsets(req)


def commit_staged(
    conn: ClientConnection, req: m.CommitStagedRequest
) -> Awaitable[m.CommitStagedResponse]:
    """Commit one sink batch's staged transactions at once."""
    _open(conn)
    return conn.server.txn.commit_staged(req)


def abort_staged(
    conn: ClientConnection, req: m.AbortStagedRequest
) -> Awaitable[m.AbortStagedResponse]:
    """Abort one sink batch's staged transactions."""
    _open(conn)
    return conn.server.txn.abort_staged(req)


def describe_txns(conn: ClientConnection, req: m.DescribeTxnsRequest) -> m.DescribeTxnsResponse:
    """Transactional ids and sink fences."""
    return conn.server.txn.describe(req)
