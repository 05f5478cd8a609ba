"""RECEIVE: leasing messages to a member, due retry letters first, then new messages of its
subscribed queues (FIFO per queue, or the heads of sharding keys in an orderly group).

A lease hands messages to one member until its deadline; they are invisible to the rest of the
group meanwhile. First deliveries come from each queue's cursor
(:class:`~ferrymq.broker.delivery.state.SourceCursor`, or
:class:`~ferrymq.broker.delivery.orderly.OrderlyCursor`), read in steps that grow from
RECEIVE_FIRST_READ_BYTES until the lease is full, whole batches where no tag filter applies.
Retry letters come from the group's
:class:`~ferrymq.broker.delivery.state.RetryCursor`, which scans the *visible* letters of its
retry queue in offset order and keeps at most ``max_retry_loaded`` of them ahead of receivers.

Each lease is journaled before it is applied. A step that meets no descriptor or space ends the
receive: what was leased before it is returned, and nothing of that step changed (an orderly
scan is rewound).
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from typing import TYPE_CHECKING

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import DeliveryGroup
from ferrymq.broker.delivery.journaling import Journaling
from ferrymq.broker.delivery.letters import read_letter, stored_record
from ferrymq.broker.delivery.orderly import OrderlyCursor
from ferrymq.broker.delivery.queues import SKIP_BITS, GroupQueues, skipped, txn_filter
from ferrymq.broker.delivery.replay import runs, set_tag_filter
from ferrymq.broker.delivery.shortage import Shortage
from ferrymq.broker.delivery.state import Lease, SourceCursor
from ferrymq.errors import BrokerError, CorruptRecordError
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import STATE_PRODUCER_ID
from ferrymq.protocol.records import ATTR_SCHEDULED, filter_batch, iter_batches, iter_raw_records
from ferrymq.protocol.tags import parse_tag_expression

if TYPE_CHECKING:
    import asyncio

    from ferrymq.broker.delivery.sources import SourceLog, SourceQueue
    from ferrymq.broker.topics import QueueState

log = logging.getLogger("ferrymq.broker")

RECEIVE_FIRST_READ_BYTES = 64 * 1024
"""RECEIVE reads a queue in steps starting at this size (growing 4x) until the lease is full."""
RETRY_READ_BYTES = 256 * 1024
"""The retry cursor reads its queue in steps of this size."""


class Receiving:
    """RECEIVE for every group (see the module docstring)."""

    def __init__(self, ctx: DeliveryContext, journaling: Journaling, shortage: Shortage,
                 queues: GroupQueues) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.topics = ctx.topics
        self.journaling = journaling
        self.shortage = shortage
        self.queues = queues

    def receive(
        self, g: DeliveryGroup, member_id: str, subscriptions: list[tuple[str, str]],
        max_messages: int, max_bytes: int, invisible_ms: int,
    ) -> tuple[list[m.Delivery], int]:
        """Lease what is available now: due retries first, then new messages.

        Returns the deliveries and the journal position to wait for (-1: none). When a step
        meets no descriptor or space, what was leased before it is returned; nothing was.

        Raises:
            BusyError, StorageFullError: no descriptor or space, and nothing was leased (with
                a retry-after; nothing changed).
            StorageFailureError: the group's journal failed (restart needed).
        """
        out: list[m.Delivery] = []
        try:
            with self.journaling.writing(g):
                return self._receive(g, member_id, subscriptions, max_messages, max_bytes,
                                     invisible_ms, out)
        except (OSError, BrokerError) as exc:
            err = self.shortage.classify(exc, f"receive for delivery group {g.name}")
            if err is None:
                raise
            if not out:
                raise err from exc
            return out, self.ctx.stores[g.name].position()  # all of it journaled

    def _receive(
        self, g: DeliveryGroup, member_id: str, subscriptions: list[tuple[str, str]],
        max_messages: int, max_bytes: int, invisible_ms: int, out: list[m.Delivery],
    ) -> tuple[list[m.Delivery], int]:
        cfg = self.config
        now = self.ctx.now()
        deadline = now + invisible_ms
        deadline_wall = self.ctx.clock.wall_ms() + invisible_ms
        room = min(max_messages, cfg.max_receive_messages,
                   cfg.max_in_flight_per_member - g.in_flight.get(member_id, 0))
        budget = min(max_bytes, cfg.max_fetch_bytes)
        pos = -1
        if room <= 0 or budget <= 0:
            return out, pos
        filters = {t: parse_tag_expression(e) for t, e in subscriptions}
        pos = self._note_tag_filters(g, subscriptions, filters)
        room, budget, p = self._receive_letters(g, member_id, filters, room, budget, deadline,
                                                deadline_wall, out)
        pos = max(pos, p)
        for topic, tags in filters.items():
            if room <= 0 or budget <= 0:
                break
            t = self.topics.topics.get(topic)
            if t is None:  # subscribed before it exists (see heartbeat)
                continue
            n = len(t.queues)
            if topic in g.awaited and all((topic, q) in g.sources for q in range(n)):
                g.awaited.discard(topic)  # every queue has its cursor now
            for i in range(n):
                if room <= 0 or budget <= 0:
                    break
                qs = self.queues.source(g, t.queues[(g.rr + i) % n])
                if qs is None:  # read from its leader, not listed yet
                    continue
                receive_queue = self._receive_orderly if g.orderly else self._receive_queue
                taken, used, p = receive_queue(g, member_id, qs, tags, room, budget,
                                               deadline, deadline_wall, out)
                room -= taken
                budget -= used
                pos = max(pos, p)
        g.rr += 1
        return out, pos

    def _note_tag_filters(
        self, g: DeliveryGroup, subscriptions: list[tuple[str, str]],
        filters: dict[str, frozenset[str] | None],
    ) -> int:
        """Remember the tag expression this receive filters each topic with, when it is not the
        one the group used last (``message status`` tells a filtered-out message from an acked
        one by it). Returns the journal position of the change, or -1 (the usual case: a dict
        lookup per subscribed topic)."""
        pos = -1
        for topic, tags in filters.items():
            f = g.tag_filters.get(topic)
            if f is not None and f.tags == tags:
                continue
            expression = dict(subscriptions)[topic]  # as ``filters``: the last of a topic wins
            since = {q: cur.next for (t, q), cur in g.sources.items() if t == topic}
            pos = self.journaling.journal(
                g, ["T", topic, expression, [[q, o] for q, o in since.items()]])
            set_tag_filter(g, topic, expression, since)
        return pos

    def _receive_letters(
        self, g: DeliveryGroup, member_id: str, filters: dict[str, frozenset[str] | None],
        room: int, budget: int, deadline: int, deadline_wall: int, out: list[m.Delivery],
    ) -> tuple[int, int, int]:
        """Lease visible retry letters of the subscribed topics, oldest first (each in its own
        delivery: letters of one batch may differ in topic and attempt count)."""
        rc = g.retry
        qs = self.queues.internal_queue(g.retry_topic, create=False)
        pos = -1
        if qs is None or (not rc.ready and rc.next >= qs.visible_end):
            return room, budget, pos
        held = rc.held
        cands: list[int] = []
        for off, letter in rc.ready.items():
            if len(cands) >= room:
                break
            if letter.topic in filters and off not in held:
                cands.append(off)
        if len(cands) < room:
            cands.extend(self._scan_retry(g, qs, filters, room - len(cands)))
        if not cands:
            return room, budget, pos
        ctx = self.ctx
        lg = qs.log
        taken: set[int] = set()
        for offs, batch in self.queues.read_offsets(lg, cands, budget, set(cands)):
            off = offs[0]
            if off not in rc.ready:
                continue
            letter = rc.ready[off]
            lease = Lease(ctx.next_lease, member_id, (g.retry_topic, 0), deadline,
                          letter.reconsume)
            pos = self.journaling.journal(g, ["L", g.retry_topic, 0, lease.lease_id, member_id,
                                              deadline_wall, letter.reconsume, [[off, 1]]])
            ctx.next_lease += 1
            g.grant_letter(off, lease)
            taken.add(off)
            out.append((g.retry_topic, 0, qs.topic_id, lease.lease_id, letter.reconsume, off, off,
                        batch))
            room -= 1
            budget -= len(batch)
        gone = [o for o in cands if o not in taken and o < lg.start_offset]
        if gone:  # deleted by retention before anyone got them
            pos = self.journaling.journal(g, ["A", g.retry_topic, 0, runs(gone)])
            for o in gone:
                rc.finish(o)
            rc.advance_floor()
        return room, budget, pos

    def _scan_retry(
        self, g: DeliveryGroup, qs: QueueState, filters: Container[str], want: int,
    ) -> list[int]:
        """Read visible letters from the retry cursor's scan position into ``ready`` until
        ``want`` of them belong to a topic in ``filters`` or ``max_retry_loaded`` are ready;
        return the offsets of those ``want``. Scheduled letters (not due yet) are skipped: the
        scheduler appends their copies when they are due."""
        rc = g.retry
        lg = qs.log
        if rc.next < lg.start_offset:  # retention deleted letters nobody got
            rc.skip_to(lg.start_offset)
        end = qs.visible_end
        limit = self.config.max_retry_loaded
        wall = self.ctx.clock.wall_ms()
        found: list[int] = []
        while rc.next < end and len(rc.ready) < limit and len(found) < want:
            try:
                data = lg.read(rc.next, RETRY_READ_BYTES, upto_offset=end)
            except BrokerError as exc:
                log.error("retry queue of %s: cannot read offset %d: %s", g.name, rc.next, exc)
                break
            if not data:
                break
            before = rc.next
            mv = memoryview(data)
            for p0, h in iter_batches(mv):
                if h.last_offset < rc.next:
                    continue
                if h.attributes & ATTR_SCHEDULED or h.producer_id == STATE_PRODUCER_ID:
                    # a letter not due yet (the scheduler's), or the group's own state record
                    rc.passed(rc.next, h.last_offset, plain=False)
                    continue
                if len(rc.ready) >= limit or len(found) >= want:
                    break
                try:
                    recs = list(iter_raw_records(mv, p0, h))
                except CorruptRecordError as exc:
                    log.error("retry queue of %s: %s; skipped", g.name, exc)
                    rc.passed(rc.next, h.last_offset, plain=True)
                    continue
                for rec in recs:
                    o = rec[0]
                    if o < rc.next:
                        continue
                    if len(rc.ready) >= limit or len(found) >= want:
                        break
                    rc.passed(o, o, plain=True)
                    if o in rc.done:  # finished before a restart
                        rc.done.discard(o)
                        continue
                    if o in rc.leased:  # leased before a restart
                        rc.track(o)
                        continue
                    r = stored_record(mv, rec)
                    try:
                        letter = read_letter(r)
                    except CorruptRecordError as exc:
                        log.error("retry queue of %s: %s; skipped", g.name, exc)
                        continue
                    until = self.queues.held_until(r, letter, wall)
                    rc.add(o, letter, until)
                    if letter.topic in filters and until is None:
                        found.append(o)
            if rc.next == before:
                break
        rc.advance_floor()
        return found

    def wakeups(
        self, g: DeliveryGroup, subscriptions: Iterable[tuple[str, str]]
    ) -> list[set[asyncio.Future[None]]]:
        """What a long-polling RECEIVE of ``g`` waits on: the group itself (leases handed
        back, orderly keys ready), its retry queue (a letter, or the copy of a due scheduled
        letter, became visible) and the subscribed queues."""
        sets = [g.waiters]
        rt = self.topics.topics.get(g.retry_topic)
        if rt is not None:
            sets.append(rt.queues[0].waiters)
        for topic, _ in subscriptions:
            t = self.topics.topics.get(topic)
            if t is not None:
                for qs in t.queues:
                    src = self.queues.source(g, qs)
                    if src is not None:  # (else the group is woken when it is)
                        sets.append(src.waiters)
        return sets

    def _receive_queue(
        self, g: DeliveryGroup, member_id: str, qs: SourceQueue, tags: frozenset[str] | None,
        room: int, budget: int, deadline: int, deadline_wall: int, out: list[m.Delivery],
    ) -> tuple[int, int, int]:
        key = (qs.topic, qs.queue)
        lg = qs.log
        journal = self.journaling.journal
        cur = g.sources.get(key)
        if cur is None:  # journaled, so a restart does not move a "latest" start
            start = self._start(g, qs)
            journal(g, ["N", qs.topic, qs.queue, start])
            cur = g.sources[key] = SourceCursor(qs.topic, qs.queue, start)
        if cur.next < lg.start_offset:  # retention deleted what this group never got
            cur.skip_to(lg.start_offset)
        end = qs.lso  # transactions: nothing past the first open one (read_committed)
        if cur.next >= end:
            return 0, 0, -1
        start = cur.next
        txf = txn_filter(lg, start, end)
        parts: list[bytes | memoryview] = []
        offsets: list[int] = []
        new_next = start
        used = 0
        chunk = min(budget, RECEIVE_FIRST_READ_BYTES)
        gaps = tags is not None  # leased offsets are not contiguous
        while new_next < end and len(offsets) < room and used < budget:
            # read what the lease can use: small first, growing, not the whole byte budget
            data = lg.read(new_next, chunk, upto_offset=end)
            if not data:
                break
            before = new_next
            mv = memoryview(data)
            for p0, h in iter_batches(mv):
                if room - len(offsets) <= 0 or used >= budget:
                    break
                first = max(h.base_offset, new_next)
                last = h.last_offset
                # the scheduler appends a copy when due; markers and aborted data are skipped
                if h.attributes & SKIP_BITS and skipped(h, txf):
                    new_next = max(new_next, last + 1)
                    gaps = True
                    continue
                if tags is None:
                    take = min(last - first + 1, room - len(offsets))
                    offsets.extend(range(first, first + take))
                    parts.append(mv[p0 : p0 + h.size])
                    used += h.size
                    new_next = first + take
                else:
                    keep: list[tuple[int, int, int, int, int, int, int, int]] = []
                    stop = last + 1
                    for rec in iter_raw_records(mv, p0, h):
                        if rec[0] < first:
                            continue
                        t0, t1 = rec[2], rec[3]
                        if t1 > t0 and str(mv[t0:t1], "utf-8", "replace") in tags:
                            if len(offsets) + len(keep) >= room:
                                stop = rec[0]
                                break
                            keep.append(rec)
                    if keep:
                        offsets.extend(r[0] for r in keep)
                        fb = filter_batch(mv, p0, h, keep)
                        parts.append(fb)
                        used += len(fb)
                    new_next = stop
            if new_next == before:
                break
            chunk = min(max(budget - used, 1), chunk * 4)
        if not offsets:
            pos = journal(g, ["N", qs.topic, qs.queue, new_next])
            cur.skip_to(new_next)
            return 0, 0, pos
        ctx = self.ctx
        lease = Lease(ctx.next_lease, member_id, key, deadline, 0)
        rs = [[offsets[0], len(offsets)]] if not gaps else runs(offsets)
        pos = journal(g, ["L", qs.topic, qs.queue, lease.lease_id, member_id, deadline_wall, 0,
                          rs])
        ctx.next_lease += 1
        g.grant(cur, offsets, lease)
        batches = b"".join(parts)
        out.append((qs.topic, qs.queue, qs.topic_id, lease.lease_id, 0, offsets[0], offsets[-1],
                    batches))
        if new_next > offsets[-1] + 1:  # (when this cannot be journaled, it is scanned again)
            pos = journal(g, ["N", qs.topic, qs.queue, new_next])
        cur.skip_to(new_next)
        return len(offsets), len(batches), pos

    def _receive_orderly(
        self, g: DeliveryGroup, member_id: str, qs: SourceQueue, tags: frozenset[str] | None,
        room: int, budget: int, deadline: int, deadline_wall: int, out: list[m.Delivery],
    ) -> tuple[int, int, int]:
        """Lease heads of sharding keys from one queue of an orderly group (see orderly.py):
        ready ones first (failed ones whose backoff ended, next messages of finished keys), then
        new ones from the scan position. A read or a journal write that fails (no descriptor,
        no space) puts back what the call took: the scan position and the ready heads."""
        ctx = self.ctx
        journal = self.journaling.journal
        key = (qs.topic, qs.queue)
        lg = qs.log
        pos = -1
        cur = g.sources.get(key)
        if cur is None:
            first = self._start(g, qs)
            pos = journal(g, ["N", qs.topic, qs.queue, first])
            cur = g.sources[key] = OrderlyCursor(qs.topic, qs.queue, first)
        assert isinstance(cur, OrderlyCursor)
        if cur.next < lg.start_offset:
            cur.skip_to(lg.start_offset)
        taken: dict[int, list[tuple[list[int], bytes]]] = {}  # reconsume -> (offsets, batch)
        gone: list[int] = []
        examined: list[int] = []  # what the scan made pending (undone if it is not journaled)
        start = cur.next
        ready = cur.take_ready(ctx.now())
        try:
            n = self._orderly_scan(cur, lg, qs.lso, tags, ready, room, budget, taken, gone,
                                   examined)
            if cur.next > start:
                pos = journal(g, ["N", qs.topic, qs.queue, cur.next])
        except BaseException:
            cur.rewind(start, examined)
            cur.unready(ready)
            raise
        if gone:  # filtered out or deleted: finished for the group, without an ack time
            pos = max(pos, self.journaling.journal_or_defer(
                g, ["A", qs.topic, qs.queue, runs(gone)]))
        total = 0
        groups = [(r, parts) for r, parts in taken.items() if parts]
        for i, (reconsume, parts) in enumerate(groups):
            lease = Lease(ctx.next_lease, member_id, key, deadline, reconsume)
            offsets = [o for offs, _ in parts for o in offs]
            try:
                pos = journal(g, ["L", qs.topic, qs.queue, lease.lease_id, member_id,
                                  deadline_wall, reconsume, runs(offsets)])
            except BaseException:  # these and the rest stay pending, ready again
                cur.unready(o for _, rest in groups[i:] for offs, _ in rest for o in offs)
                raise
            ctx.next_lease += 1
            g.grant(cur, offsets, lease)
            batches = b"".join(part for _, part in parts)
            out.append((qs.topic, qs.queue, qs.topic_id, lease.lease_id, reconsume, min(offsets),
                        max(offsets), batches))
            total += len(batches)
        cur.advance_floor()
        return n, total, pos

    def _orderly_scan(
        self, cur: OrderlyCursor, lg: SourceLog, end: int, tags: frozenset[str] | None,
        ready: list[int], room: int, budget: int,
        taken: dict[int, list[tuple[list[int], bytes]]], gone: list[int], examined: list[int],
    ) -> int:
        """The reading part of :meth:`_receive_orderly`: the ready heads' records (into
        ``taken`` by attempt count; those past the byte budget back to ready), then new
        messages from the scan position up to ``end`` (every one examined is added to
        ``examined``; the deliverable ones to ``taken[0]``, filtered ones to ``gone``).
        Returns how many messages it took.

        Raises:
            OSError: a read met no descriptor (the caller undoes the scan).
        """
        n = used = 0
        if ready:
            if len(ready) > room:
                cur.unready(ready[room:])
                del ready[room:]
            failures = cur.failures
            got: set[int] = set()
            for offs, part in self.queues.read_offsets(lg, ready, budget, failures):
                f = failures.get(offs[0])  # a redelivery gets its own lease (its own count)
                taken.setdefault(f.reconsume if f is not None else 0, []).append((offs, part))
                got.update(offs)
                used += len(part)
            n = len(got)
            for off in ready:
                if off not in got:
                    if off < lg.start_offset:  # deleted by retention
                        cur.finish(off)
                        gone.append(off)
                    else:  # past the byte budget
                        cur.unready([off])
            ready[:] = [o for o in ready if o in got]  # the rest were dealt with here
        limit = self.config.max_orderly_held
        txf = txn_filter(lg, cur.next, end)
        chunk = min(budget, RECEIVE_FIRST_READ_BYTES)
        fresh = taken.setdefault(0, [])
        stop = False
        while not stop and cur.next < end and n < room and used < budget \
                and cur.held_count < limit:
            data = lg.read(cur.next, chunk, upto_offset=end)
            if not data:
                break
            before = cur.next
            mv = memoryview(data)
            for p0, h in iter_batches(mv):
                if h.attributes & SKIP_BITS and skipped(h, txf):  # scheduled, marker, aborted
                    if h.last_offset >= cur.next:
                        gone.extend(range(max(h.base_offset, cur.next), h.last_offset + 1))
                        cur.next = h.last_offset + 1
                    continue
                keep: list[tuple[int, int, int, int, int, int, int, int]] = []
                for rec in iter_raw_records(mv, p0, h):
                    o = rec[0]
                    if o < cur.next:
                        continue
                    if n >= room or used >= budget or cur.held_count >= limit:
                        stop = True
                        break
                    t0, t1, s1 = rec[2], rec[3], rec[4]
                    if tags is not None and not (
                            t1 > t0 and str(mv[t0:t1], "utf-8", "replace") in tags):
                        cur.next = o + 1
                        gone.append(o)
                        continue
                    examined.append(o)
                    if cur.examine(o, str(mv[t1:s1], "utf-8", "replace") if s1 > t1 else ""):
                        keep.append(rec)
                        n += 1
                if keep:
                    fb = filter_batch(mv, p0, h, keep)
                    fresh.append(([r[0] for r in keep], fb))
                    used += len(fb)
                if stop:
                    break
            if cur.next == before:
                break
            chunk = min(max(budget - used, 1), chunk * 4)
        return n

    def _start(self, g: DeliveryGroup, qs: SourceQueue) -> int:
        """Where a new cursor of ``g`` starts on ``qs``."""
        if g.start_from == m.OffsetSpec.EARLIEST:
            return qs.log.start_offset
        if g.start_from == m.OffsetSpec.LATEST:
            # a topic created after the group subscribed to it: all of it is news
            return qs.log.start_offset if qs.topic in g.awaited else qs.lso
        return min(qs.log.offset_for_time(g.start_from), qs.lso)
