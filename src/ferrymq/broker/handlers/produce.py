"""PRODUCE: check each batch, append it, acknowledge at the configured durability.

The batch bytes are appended as they came (after the CRC check and stamping): no per-message
work, except for two kinds of batches that say so in their attributes. Scheduled batches
(``ATTR_SCHEDULED``): their records' due times are checked before the append and indexed by the
scheduler right after it (:mod:`ferrymq.broker.scheduler`). Dedup batches (``ATTR_DEDUP``) into a
topic with a dedup window: records whose key the topic stored within the window are answered as
duplicates and left out, the others appended and their keys remembered
(:mod:`ferrymq.broker.dedup`). Transactional batches (``ATTR_TRANSACTIONAL``) are admitted by
the transaction coordinator, which registers the queue with the producer's open transaction
first (:mod:`ferrymq.broker.txn`); in a cluster, where the coordinator may be another broker, a
request with a transactional batch whose transaction is not open on its queue here waits until
the coordinator registered the queue (:mod:`ferrymq.broker.txn.cluster`), then goes on as any
other. In sync flush mode the response waits until
every entry's offsets are fsynced (group commit, see :mod:`ferrymq.broker.flusher`), and for a
duplicate until the message it duplicates is.

In a cluster, a queue this broker leads carries a replica role (:class:`~ferrymq.broker.topics.
ReplicaRole`): it refuses the entry before the append when it must (not the leader; ``acks="all"``
with fewer in-sync replicas than ``min_insync``), and with ``acks="all"`` the entry is answered
when the high watermark covers it (:mod:`ferrymq.cluster.replication`), with ``acks="leader"``
when the leader's own flush does (sync mode) or at once (async mode).

Back-pressure (:mod:`ferrymq.broker.watermarks`): while memory or free disk is past its
watermark the whole request is refused (BUSY / STORAGE_FULL with a retry-after) before anything
is looked at. A write that fails with ENOSPC/EDQUOT leaves nothing behind (the segment cuts the
file back) and answers that entry with STORAGE_FULL; the watermarks then refuse produce until
space is back.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, cast

from ferrymq.broker.watermarks import is_disk_full
from ferrymq.errors import (
    BrokerError,
    BrokerShuttingDownError,
    InvalidRequestError,
    StorageFailureError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.kafka.envelope import envelope_header
from ferrymq.protocol.messages import Acks, Durability
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_DEDUP,
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    validate_batch,
)

if TYPE_CHECKING:
    from ferrymq.broker.context import BrokerContext, ClientConnection
    from ferrymq.broker.topics import QueueState
    from ferrymq.broker.txn.cluster import Verified


def produce(
    conn: ClientConnection, req: m.ProduceRequest, *, envelopes: bool = False,
) -> m.ProduceResponse | asyncio.Future[m.ProduceResponse]:
    """Append every entry; answer now (async mode) or once all are durable (sync mode).

    The queues written to are marked dirty together at the end (also when a later entry
    raised), so one flush round fsyncs them all: the answer waits for every one of them.

    ``envelopes``: the entries are envelopes the Kafka port built and checked
    (:func:`~ferrymq.protocol.kafka.envelope.wrap`), not batches from a FerryMQ client (whose
    check refuses an envelope: a client cannot store one unchecked).
    """
    cluster = conn.server.cluster
    if cluster is not None:
        need = cluster.txn.unverified(req)
        if need:
            return asyncio.ensure_future(_produce_verified(conn, req, need, envelopes))
    dirty: list[QueueState] = []
    try:
        return _produce(conn, req, dirty, envelopes=envelopes)
    finally:
        conn.server.flusher.mark_all_dirty(dirty)


async def _produce_verified(conn: ClientConnection, req: m.ProduceRequest,
                            need: list[tuple[QueueState, int, int]],
                            envelopes: bool) -> m.ProduceResponse:
    """A cluster's produce with transactional batches not yet part of an open transaction
    here: the coordinator registers their queues first (refusals answer those entries)."""
    cluster = conn.server.cluster
    assert cluster is not None
    verified, refused = await cluster.txn.verify(need)
    dirty: list[QueueState] = []
    try:
        out = _produce(conn, req, dirty, verified, refused, envelopes=envelopes)
    finally:
        conn.server.flusher.mark_all_dirty(dirty)
    return out if isinstance(out, m.ProduceResponse) else await out


def _produce(
    conn: ClientConnection, req: m.ProduceRequest, dirty: list[QueueState],
    verified: Verified | None = None, refused: dict[tuple[str, int], BrokerError] | None = None,
    *, envelopes: bool = False,
) -> m.ProduceResponse | asyncio.Future[m.ProduceResponse]:
    """:func:`produce`, noting in ``dirty`` the queues it wrote to."""
    srv = conn.server
    cfg = srv.config
    sync = srv.sync_flush
    now_ms = srv.clock.wall_ms()
    results: list[m.ProduceResult] = []
    waits: list[tuple[QueueState, int, int]] = []  # (queue, end offset, result index)
    durability = Durability.FSYNCED if sync else Durability.WRITTEN
    srv.watermarks.check_produce()  # memory / disk watermark: the whole request, nothing stored
    entries = cast("list[tuple[str, int, bytes | bytearray | memoryview]]", req.entries)  # decoded
    for topic, queue, batch in entries:
        try:
            if srv.shutting_down:
                raise BrokerShuttingDownError("broker is shutting down")
            qs = srv.topics.queue(topic, queue)
            rep = qs.replica
            if rep is not None:  # a cluster's queue: not the leader, or too few in-sync
                rep.check_produce(req.acks)
            elif srv.cluster is not None:  # a cluster's queue this broker does not replicate
                srv.cluster.check_serves(qs)
            srv.flusher.check_writable(qs)
            h = (envelope_header(batch) if envelopes
                 else validate_batch(batch, max_message_bytes=cfg.max_message_bytes,
                                     max_records=cfg.max_batch_records))
            txn_end = -1
            if h.attributes & (ATTR_TRANSACTIONAL | ATTR_CONTROL):
                if h.attributes & (ATTR_CONTROL | ATTR_DEDUP | ATTR_SCHEDULED):
                    raise InvalidRequestError("a transactional batch cannot be a control, dedup "
                                              "or scheduled batch (only the broker writes "
                                              "markers)")
                if srv.cluster is None:
                    txn_end = srv.txn.check_produce(qs, h)
                elif refused and (topic, queue) in refused:
                    raise refused[(topic, queue)]
                else:
                    srv.txn.admit(qs, h, verified)
            plan = srv.dedup.check(qs, batch, h, now_ms) if h.attributes & ATTR_DEDUP else None
            if plan is not None:
                if plan.batch is None or plan.header is None:  # all duplicates: nothing to store
                    results.append((topic, queue, 0, "", -1, -1, -1,
                                    durability if rep is None or req.acks != Acks.ALL
                                    else Durability.REPLICATED, qs.topic_id, plan.duplicates))
                    if sync or (rep is not None and req.acks == Acks.ALL):
                        _wait_for_originals(srv, qs, plan.duplicates, results, waits)
                    continue
                batch, h = plan.batch, plan.header
            dues = srv.scheduler.check(batch, h, now_ms) if h.attributes & ATTR_SCHEDULED else None
            res = qs.log.append(batch, now_ms=now_ms)
        except BrokerError as exc:
            results.append((topic, queue, exc.code, str(exc)[:1024], -1, -1, -1, 0, -1, []))
            continue
        except OSError as exc:  # the segment cut the file back: nothing of it was stored
            err = (srv.watermarks.full_error(exc) if is_disk_full(exc)
                   else srv.flusher.write_error(exc, f"to {topic}/{queue}"))
            results.append((topic, queue, err.code, str(err)[:1024], -1, -1, -1, 0, -1, []))
            continue
        dups = [] if plan is None else srv.dedup.on_append(plan, qs, res.base_offset,
                                                            res.append_time_ms)
        results.append((topic, queue, 0, "", res.base_offset, res.last_offset,
                        res.append_time_ms,
                        durability if rep is None or req.acks != Acks.ALL
                        else Durability.REPLICATED, qs.topic_id, dups))
        if h.attributes & ATTR_TRANSACTIONAL:
            if not res.duplicate:
                srv.txn.on_append(qs, h.producer_id, res.base_offset)
            if sync and txn_end >= 0:  # the queue's registration must be durable too
                waits.append((srv.txn.state_queue, txn_end, len(results) - 1))
        if dups and (sync or (rep is not None and req.acks == Acks.ALL)):
            _wait_for_originals(srv, qs, dups, results, waits)
        if not res.duplicate:
            if dues is not None:
                srv.scheduler.on_append(qs, batch, res.base_offset, res.append_time_ms, dues)
            dirty.append(qs)
            if not sync or rep is not None:  # a replica role wakes its followers at once
                qs.advance(qs.log.end_offset)
        if ((sync or (rep is not None and req.acks == Acks.ALL))
                and res.last_offset + 1 > qs.visible_end):
            waits.append((qs, res.last_offset + 1, len(results) - 1))
    if not waits:
        return m.ProduceResponse(results)
    fut: asyncio.Future[m.ProduceResponse] = asyncio.get_running_loop().create_future()
    remaining = [len(waits)]

    def done(idx: int, exc: BaseException | None) -> None:
        if exc is not None:
            t, q = results[idx][0], results[idx][1]
            code = exc.code if isinstance(exc, BrokerError) else StorageFailureError.code
            results[idx] = (t, q, code, str(exc)[:1024], -1, -1, -1, 0, -1, [])
        remaining[0] -= 1
        if remaining[0] == 0 and not fut.done():
            fut.set_result(m.ProduceResponse(results))

    for qs, end, idx in waits:  # (a retried duplicate may wait for an earlier end)
        rep = qs.replica
        if rep is None:
            qs.wait_durable(end, functools.partial(done, idx))
        elif req.acks == Acks.ALL:
            rep.wait_acks(end, req.timeout_ms, functools.partial(done, idx))
        else:  # acks="leader" in sync mode: the leader's own fsync
            qs.when_durable(end, functools.partial(done, idx))
    return fut


def _wait_for_originals(srv: BrokerContext, qs: QueueState, dups: list[m.Duplicate],
                        results: list[m.ProduceResult],
                        waits: list[tuple[QueueState, int, int]]) -> None:
    """Sync flush mode or ``acks="all"`` on a replicated queue: answer the last result only once
    the messages its duplicates point at are fsynced (replicated) too (an original may still
    wait for it, sent by another request)."""
    topic = srv.topics.by_id.get(qs.topic_id)
    if topic is None:
        return
    idx = len(results) - 1
    ends: dict[int, int] = {}
    for _i, q, off in dups:
        if off + 1 > ends.get(q, 0):
            ends[q] = off + 1
    for q, end in ends.items():
        if not 0 <= q < len(topic.queues):
            continue
        oq = topic.queues[q]
        if end <= oq.visible_end:
            continue
        if oq in srv.flusher.failed:  # the original will never be fsynced
            t, tq = results[idx][0], results[idx][1]
            results[idx] = (t, tq, StorageFailureError.code,
                            f"the original in {oq} had an fsync failure", -1, -1, -1, 0, -1, [])
            return
        waits.append((oq, end, idx))
