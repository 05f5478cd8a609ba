"""CANCEL_SCHEDULED: cancel a scheduled message that is not yet due.

The scheduler writes a *cancelled* entry to the message's time bucket
(:mod:`ferrymq.broker.scheduler`). In sync flush mode the answer waits until that entry is
fsynced, like a send; in async mode it comes at once. While the scheduler's files wait for
disk space (an fsync failed with ENOSPC, or the entry cannot be written) the cancel is refused
with STORAGE_FULL (retriable, nothing changed); after any other fsync failure with
STORAGE_ERROR until a restart.

On a cluster only the queue's leader cancels (NOT_LEADER elsewhere): it also appends a cancel
record to the queue, refused first like an ``acks="all"`` send (NOT_ENOUGH_REPLICAS), and
answers once the record is committed (every in-sync replica has it: a new leader knows the
cancel), NOT_ENOUGH_REPLICAS after ``CANCEL_COMMIT_TIMEOUT_MS``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ferrymq.broker.scheduler.facade import CANCEL_COMMIT_TIMEOUT_MS
from ferrymq.broker.watermarks import is_disk_full
from ferrymq.errors import (
    BrokerError,
    BrokerShuttingDownError,
    StorageFailureError,
)
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection


def cancel_scheduled(
    conn: ClientConnection, req: m.CancelScheduledRequest
) -> m.Empty | asyncio.Future[m.Empty]:
    """Cancel ``req.msg_id``; NOT_SCHEDULED when it is not a pending scheduled message."""
    srv = conn.server
    if srv.shutting_down:
        raise BrokerShuttingDownError("broker is shutting down")
    srv.flusher.check_writable(srv.scheduler)
    try:
        seq, qs, end = srv.scheduler.cancel(req.msg_id)
    except OSError as exc:  # the cancelled entry was not written: nothing changed
        if is_disk_full(exc):
            raise srv.watermarks.full_error(exc) from None
        raise srv.flusher.write_error(exc, "the cancelled entry") from None
    if not srv.sync_flush and end is None:
        return m.Empty()
    fut: asyncio.Future[m.Empty] = asyncio.get_running_loop().create_future()

    def durable(exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(m.Empty())
        else:
            fut.set_exception(exc if isinstance(exc, BrokerError)
                              else StorageFailureError(f"fsync failed: {exc}"))

    if end is not None and qs.replica is not None:  # a cluster's: once the record is committed
        qs.replica.wait_acks(end, CANCEL_COMMIT_TIMEOUT_MS, durable)
    else:
        srv.scheduler.when_durable(seq, durable)
    return fut
