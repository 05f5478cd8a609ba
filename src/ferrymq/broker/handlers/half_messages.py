"""PREPARE_HALF, END_HALF, HALF_CHECK_POLL: the wire side of
:mod:`ferrymq.broker.half_messages`; and MESSAGE_STATUS for half ids,
which it answers itself before handing other ids to the delivery handler. In a cluster only
the owner of half messages (the leader of the half topic) answers the first three
(:mod:`ferrymq.broker.half_messages.cluster`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ferrymq.broker.handlers import delivery
from ferrymq.errors import BrokerShuttingDownError, StorageFullError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection


def prepare_half(
    conn: ClientConnection, req: m.PrepareHalfRequest
) -> m.PrepareHalfResponse | asyncio.Future[m.PrepareHalfResponse]:
    """Store a half message (invisible until committed); refused like a produce while memory
    or disk is past its watermark."""
    srv = conn.server
    _open(conn, req.group)
    srv.watermarks.check_produce()
    try:
        return srv.half_messages.prepare(req)
    except StorageFullError as exc:
        srv.watermarks.on_disk_full(exc)
        raise


def end_half(
    conn: ClientConnection, req: m.EndHalfRequest
) -> m.EndHalfResponse | asyncio.Future[m.EndHalfResponse]:
    """Commit or roll back a half message (or report UNKNOWN)."""
    _open(conn, req.group)
    return conn.server.half_messages.end(req)


def half_check_poll(
    conn: ClientConnection, req: m.HalfCheckPollRequest
) -> m.HalfCheckPollResponse | asyncio.Future[m.HalfCheckPollResponse]:
    """Long poll for check-backs of a producer group."""
    _check_owner(conn, req.group)
    return conn.server.half_messages.poll(req)


def _open(conn: ClientConnection, group: str) -> None:
    """Refuse while shutting down, and (in a cluster) unless this broker owns half messages."""
    if conn.server.shutting_down:
        raise BrokerShuttingDownError("broker is shutting down")
    _check_owner(conn, group)


def _check_owner(conn: ClientConnection, group: str) -> None:
    """In a cluster: NOT_COORDINATOR unless this broker owns half messages."""
    cluster = conn.server.cluster
    if cluster is not None:
        cluster.halves.check_owner(f"the half messages of producer group {group[:249]!r}")


def message_status(conn: ClientConnection, req: m.MessageStatusRequest) -> m.MessageStatusResponse:
    """A half id: its half message's state; any other id: the delivery status."""
    halves = conn.server.half_messages
    if halves.is_half(req.msg_id):
        return halves.status(req.msg_id)
    return delivery.message_status(conn, req)
