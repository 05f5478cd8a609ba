"""PRODUCE: check each batch, append it, acknowledge at the configured durability.

The batch bytes are appended as they came (after the CRC check and stamping): no per-message
work, except for scheduled batches (``ATTR_SCHEDULED``): their records' due times are checked
before the append and indexed by the scheduler right after it
(:mod:`ferrymq.broker.scheduler`). In sync flush mode the response waits until every entry's
offsets are fsynced (group commit, see :mod:`ferrymq.broker.flusher`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ferrymq.errors import BrokerError, BrokerShuttingDownError, StorageFailureError
from ferrymq.protocol import messages as m
from ferrymq.protocol.messages import Durability
from ferrymq.protocol.records import ATTR_SCHEDULED, validate_batch

if TYPE_CHECKING:
    from ferrymq.broker.connection import BrokerConnection
    from ferrymq.broker.topics import QueueState


def produce(
    conn: BrokerConnection, req: m.ProduceRequest
) -> m.ProduceResponse | asyncio.Future[m.ProduceResponse]:
    """Append every entry; answer now (async mode) or once all are durable (sync mode)."""
    srv = conn.server
    cfg = srv.config
    sync = srv.sync_flush
    now_ms = srv.clock.wall_ms()
    results: list[m.ProduceResult] = []
    waits: list[tuple[QueueState, int, int]] = []  # (queue, end offset, result index)
    durability = Durability.FSYNCED if sync else Durability.WRITTEN
    for topic, queue, batch in req.entries:
        try:
            if srv.shutting_down:
                raise BrokerShuttingDownError("broker is shutting down")
            qs = srv.topics.queue(topic, queue)
            if qs in srv.flusher.failed:
                raise StorageFailureError(f"{topic}/{queue} had an fsync failure; restart needed")
            h = validate_batch(batch, max_message_bytes=cfg.max_message_bytes,
                               max_records=cfg.max_batch_records)
            dues = srv.scheduler.check(batch, h, now_ms) if h.attributes & ATTR_SCHEDULED else None
            res = qs.log.append(batch, now_ms=now_ms)
        except BrokerError as exc:
            results.append((topic, queue, exc.code, str(exc)[:1024], -1, -1, -1, 0, -1))
            continue
        except OSError as exc:
            results.append((topic, queue, StorageFailureError.code, f"write failed: {exc}",
                            -1, -1, -1, 0, -1))
            continue
        results.append((topic, queue, 0, "", res.base_offset, res.last_offset,
                        res.append_time_ms, durability, qs.topic_id))
        if not res.duplicate:
            if dues is not None:
                srv.scheduler.on_append(qs, batch, res.base_offset, res.append_time_ms, dues)
            srv.flusher.mark_dirty(qs)
            if not sync:
                qs.advance(qs.log.end_offset)
        if sync and res.last_offset + 1 > qs.visible_end:
            waits.append((qs, res.last_offset + 1, len(results) - 1))
    if not waits:
        return m.ProduceResponse(results)
    fut: asyncio.Future[m.ProduceResponse] = asyncio.get_running_loop().create_future()
    remaining = [len(waits)]

    def done(idx: int, exc: BaseException | None) -> None:
        if exc is not None:
            t, q = results[idx][0], results[idx][1]
            code = exc.code if isinstance(exc, BrokerError) else StorageFailureError.code
            results[idx] = (t, q, code, str(exc)[:1024], -1, -1, -1, 0, -1)
        remaining[0] -= 1
        if remaining[0] == 0 and not fut.done():
            fut.set_result(m.ProduceResponse(results))

    for qs, end, idx in waits:
        fw = qs.flush_waiters
        cb = (end, lambda exc, i=idx: done(i, exc))
        if fw and fw[-1][0] > end:  # a retried duplicate still waiting: keep the deque sorted
            items = sorted([*fw, cb], key=lambda e: e[0])
            fw.clear()
            fw.extend(items)
        else:
            fw.append(cb)
    return fut
