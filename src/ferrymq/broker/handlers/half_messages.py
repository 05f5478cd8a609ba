"""PREPARE_TRANSACTION, END_TRANSACTION, TXN_CHECK_POLL: the wire side of
:mod:`ferrymq.broker.half_messages`; and MESSAGE_STATUS for transaction ids (half messages),
which it answers itself before handing other ids to the delivery handler."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ferrymq.broker.handlers import delivery
from ferrymq.errors import BrokerShuttingDownError, StorageFullError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection


def prepare_transaction(
    conn: ClientConnection, req: m.PrepareTransactionRequest
) -> m.PrepareTransactionResponse | asyncio.Future[m.PrepareTransactionResponse]:
    """Store a half message (invisible until committed); refused like a produce while memory
    or disk is past its watermark."""
    srv = conn.server
    if srv.shutting_down:
        raise BrokerShuttingDownError("broker is shutting down")
    srv.watermarks.check_produce()
    try:
        return srv.transactions.prepare(req)
    except StorageFullError as exc:
        srv.watermarks.on_disk_full(exc)
        raise


def end_transaction(
    conn: ClientConnection, req: m.EndTransactionRequest
) -> m.EndTransactionResponse | asyncio.Future[m.EndTransactionResponse]:
    """Commit or roll back a half message (or report UNKNOWN)."""
    if conn.server.shutting_down:
        raise BrokerShuttingDownError("broker is shutting down")
    return conn.server.transactions.end(req)


def txn_check_poll(
    conn: ClientConnection, req: m.TxnCheckPollRequest
) -> m.TxnCheckPollResponse | asyncio.Future[m.TxnCheckPollResponse]:
    """Long poll for check-backs of a producer group."""
    return conn.server.transactions.poll(req)


def message_status(conn: ClientConnection, req: m.MessageStatusRequest) -> m.MessageStatusResponse:
    """A transaction id: its transaction's state; any other id: the delivery status."""
    txns = conn.server.transactions
    if txns.is_transaction(req.msg_id):
        return txns.status(req.msg_id)
    return delivery.message_status(conn, req)
