"""CANCEL_SCHEDULED: cancel a scheduled message that is not yet due.

The scheduler writes a *cancelled* entry to the message's time bucket
(:mod:`ferrymq.broker.scheduler`). In sync flush mode the answer waits until that entry is
fsynced, like a send; in async mode it comes at once.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ferrymq.errors import BrokerError, BrokerShuttingDownError, StorageFailureError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from ferrymq.broker.connection import BrokerConnection


def cancel_scheduled(
    conn: BrokerConnection, req: m.CancelScheduledRequest
) -> m.Empty | asyncio.Future[m.Empty]:
    """Cancel ``req.msg_id``; NOT_SCHEDULED when it is not a pending scheduled message."""
    srv = conn.server
    if srv.shutting_down:
        raise BrokerShuttingDownError("broker is shutting down")
    if srv.scheduler in srv.flusher.failed:
        raise StorageFailureError("the scheduler's files had an fsync failure; restart needed")
    seq = srv.scheduler.cancel(req.msg_id)
    if not srv.sync_flush:
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

    srv.scheduler.when_durable(seq, durable)
    return fut
