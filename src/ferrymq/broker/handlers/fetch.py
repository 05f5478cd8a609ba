"""FETCH: read record batches, filter by tag on the broker, long-poll when there is nothing.

Theory of operation
-------------------
A fetch reads each requested queue from its offset up to the queue's ``visible_end`` (durable end
in sync mode), at most the entry's and the request's byte budgets. If the response holds fewer
than ``min_bytes``, the fetch waits: it registers a future on every queue it reads, and a queue
that advances wakes it (liftbridge's NotifyLEO). It then reads again, until enough data arrived
or ``max_wait_ms`` passed. No busy loop: an idle long poll costs one timer.

Tag filtering keeps the matching records of each batch and rebuilds the batch around them (same
header, fresh CRCs, original offsets). Runs of batches with no match shrink to one header-only
batch that covers their offsets, so the consumer still advances past them.

Scheduled originals (batches with ``ATTR_SCHEDULED``) are left out of filtered reads (a run of
them becomes part of such a header-only batch). An unfiltered read is sent as it was read, with
no walk over its batches: the protocol says readers skip scheduled batches (every client does;
consumers get the scheduler's copy when the message is due).

Transactions (:mod:`ferrymq.broker.txn`): a READ_COMMITTED fetch reads only up to
the queue's last stable offset (LSO) and its answer lists the aborted transactions in the range
read, which the client skips (:class:`~ferrymq.protocol.markers.ReadCommittedFilter`); the
unfiltered read stays one ``Log.read``. The broker filters transactional data itself only where
it already walks batches: tag-filtered reads (control and aborted batches join the skip runs),
and LEGACY fetches (clients that do not send an isolation and do not know control batches),
which get control batches stripped, and only from segments that ever held one.

Kafka batches stored as they came (envelopes, :mod:`ferrymq.protocol.kafka.envelope`) reach
FerryMQ readers converted by the log read; the Kafka port asks for them as ``stored``.

Out of range means below the log start or beyond the log's end, not beyond ``visible_end``
(Kafka's rule). A consumer may hold an offset between the two: a new cluster leader learns the
high watermark its predecessor had advanced only from its followers' next fetches, so for a
moment its ``visible_end`` is below offsets consumers already read. Such a fetch waits (and
answers empty) instead of sending the consumer to its ``auto_offset_reset``, which would read
everything again (``earliest``) or skip messages (``latest``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ferrymq.broker.topics import wait_for_wakeup
from ferrymq.errors import BrokerError, OffsetOutOfRangeError
from ferrymq.protocol import messages as m
from ferrymq.protocol.markers import ReadCommittedFilter
from ferrymq.protocol.messages import Isolation
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_SCHEDULED,
    HEADER_SIZE,
    RawRecord,
    encode_skip_batch,
    filter_batch,
    iter_batches,
    iter_raw_records,
)
from ferrymq.protocol.tags import parse_tag_expression

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection
    from ferrymq.broker.topics import QueueState

MAX_FILTER_SCAN_BYTES = 16 * 1024 * 1024
"""Most log bytes one filtered fetch entry scans looking for matches."""


def fetch(
    conn: ClientConnection, req: m.FetchRequest, *, stored: bool = False,
) -> m.FetchResponse | asyncio.Future[m.FetchResponse]:
    """Answer at once when data is there (or no wait was asked), else long-poll.

    ``stored``: unfiltered reads return the batches as stored, envelopes (Kafka batches as
    they came) unconverted: the Kafka port's fetch, which sends them on as they are.
    """
    srv = conn.server
    max_wait_ms = min(max(req.max_wait_ms, 0), srv.config.max_fetch_wait_ms)
    filters = [parse_tag_expression(e[4]) for e in req.entries]
    results, total, queues, txn = _read_all(conn, req, filters, stored)
    if total >= max(req.min_bytes, 1) or max_wait_ms == 0 or not queues:
        return m.FetchResponse(results, txn)
    return asyncio.ensure_future(_long_poll(conn, req, filters, queues, max_wait_ms / 1000.0,
                                            stored))


async def _long_poll(
    conn: ClientConnection,
    req: m.FetchRequest,
    filters: list[frozenset[str] | None],
    queues: list[QueueState],
    wait_s: float,
    stored: bool,
) -> m.FetchResponse:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0 or conn.server.shutting_down:
            break
        if not await wait_for_wakeup([qs.waiters for qs in queues], remaining):
            break
        results, total, queues, txn = _read_all(conn, req, filters, stored)
        if total >= max(req.min_bytes, 1):
            return m.FetchResponse(results, txn)
    results, _, _, txn = _read_all(conn, req, filters, stored)
    return m.FetchResponse(results, txn)


def _read_all(
    conn: ClientConnection, req: m.FetchRequest, filters: list[frozenset[str] | None],
    stored: bool,
) -> tuple[list[m.FetchResult], int, list[QueueState], list[m.FetchTxnInfo]]:
    srv = conn.server
    budget = min(req.max_bytes, srv.config.max_fetch_bytes)
    results: list[m.FetchResult] = []
    waitable: list[QueueState] = []
    txn: list[m.FetchTxnInfo] = []
    committed = req.isolation == Isolation.READ_COMMITTED
    legacy = req.isolation == Isolation.LEGACY
    total = 0
    for (topic, queue, offset, max_bytes, _expr), tags in zip(req.entries, filters, strict=True):
        try:
            qs = srv.topics.queue(topic, queue)
            if srv.cluster is not None:  # consumers read from the leader
                srv.cluster.check_serves(qs)
            lg = qs.log
            visible = qs.visible_end
            if offset < lg.start_offset or offset > max(visible, lg.end_offset):
                raise OffsetOutOfRangeError(
                    f"offset {offset} is outside {lg.start_offset}..{lg.end_offset} of "
                    f"{topic}/{queue}"
                )
            end = qs.lso if committed and qs.open_txns else visible
            data: bytes | memoryview = b""
            aborted: list[tuple[int, int]] = []
            if budget > 0 and offset < end:
                limit = max(1, min(max_bytes, budget))
                if tags is None and not (legacy and lg.has_control(offset, end)):
                    data = lg.read_view(offset, limit, upto_offset=end, stored=stored)
                    if committed:
                        aborted = lg.aborted_txns(offset, end)
                else:
                    aborted_here = lg.aborted_txns(offset, end) if committed else []
                    rc = ReadCommittedFilter(aborted_here) if aborted_here else None
                    data = _read_filtered(qs, offset, limit, end, tags, rc)
            elif offset >= end:
                waitable.append(qs)
        except BrokerError as exc:
            results.append((topic, queue, exc.code, str(exc)[:1024], -1, -1, -1, b""))
            continue
        budget -= len(data)
        total += len(data)
        results.append((topic, queue, 0, "", end if committed else visible, lg.start_offset,
                        qs.topic_id, data))
        if aborted or end < visible:
            txn.append((topic, queue, end, aborted))
    return results, total, waitable, txn


def _read_filtered(
    qs: QueueState, offset: int, limit: int, end: int, tags: frozenset[str] | None,
    rc: ReadCommittedFilter | None = None,
) -> bytes:
    """Read from ``offset`` keeping only records whose tag is in ``tags`` (None: every
    record), and leaving out control batches and, with ``rc``, aborted transactional ones."""
    out: list[bytes] = []
    out_bytes = 0
    scanned = 0
    skip_start = -1  # first offset of a run of batches with no match
    skip_end = -1
    skip_header: bytes = b""
    wanted = None if tags is None else {t.encode() for t in tags}
    pos_offset = offset
    while pos_offset < end and out_bytes < limit and scanned < MAX_FILTER_SCAN_BYTES:
        chunk = qs.log.read(pos_offset, min(limit, 1024 * 1024), upto_offset=end)
        if not chunk:
            break
        scanned += len(chunk)
        mv = memoryview(chunk)
        advanced = False
        for pos, h in iter_batches(mv):
            advanced = True
            keep: list[RawRecord] = []
            whole = False
            if rc is not None:
                skip = not rc.keep(h.producer_id, h.base_offset, h.attributes)
            else:
                skip = bool(h.attributes & ATTR_CONTROL)
            if skip or h.attributes & ATTR_SCHEDULED:
                pass
            elif wanted is None:
                whole = True
            else:
                for rec in iter_raw_records(mv, pos, h):
                    t0, t1 = rec[2], rec[3]
                    if t1 > t0 and rec[0] >= offset and bytes(mv[t0:t1]) in wanted:
                        keep.append(rec)
            if whole or keep:
                if skip_start >= 0:
                    out.append(encode_skip_batch(skip_header, skip_start, skip_end))
                    skip_start = -1
                fb = (filter_batch(mv, pos, h, keep) if keep and len(keep) < h.record_count
                      else bytes(mv[pos : pos + h.size]))
                out.append(fb)
                out_bytes += len(fb)
            else:
                if skip_start < 0:
                    skip_start = h.base_offset
                    skip_header = bytes(mv[pos : pos + HEADER_SIZE])
                skip_end = h.last_offset
            pos_offset = h.last_offset + 1
        if not advanced:
            break
    if skip_start >= 0:
        out.append(encode_skip_batch(skip_header, skip_start, skip_end))
    return b"".join(out)

