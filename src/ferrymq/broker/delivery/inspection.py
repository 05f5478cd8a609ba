"""Looking at delivery groups without changing them: DESCRIBE_DELIVERY (members, progress, lag,
retry and dead-letter sizes, blocked keys) and MESSAGE_STATUS (one message in every group).

Nothing here is kept per message. A message's status is derived from the group's cursors and
leases, its tag filters (FILTERED: see ``docs/delivery.md``), its ack history, and by reading
the newest MAX_RETRY_SCAN records of its retry queue and the first MAX_DLQ_SCAN dead letters.
"""

from __future__ import annotations

import contextlib
import logging

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.deadletters import DeadLetters
from ferrymq.broker.delivery.group import DeliveryGroup
from ferrymq.broker.delivery.letters import read_letter, stored_record
from ferrymq.broker.delivery.orderly import OrderlyCursor
from ferrymq.broker.delivery.queues import GroupQueues, batches_between
from ferrymq.broker.scheduler import CANCELLED_STATE, NOT_SCHEDULED
from ferrymq.errors import BrokerError, BusyError, CorruptRecordError, InvalidRequestError
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import STATE_PRODUCER_ID, Letter
from ferrymq.protocol.records import ATTR_SCHEDULED, encode_msg_id, iter_batches

log = logging.getLogger("ferrymq.broker")

MAX_RETRY_SCAN = 100_000
"""MESSAGE_STATUS looks for a message's retry letter among the newest this many records of the
group's retry queue (an older letter that is still pending is not found: see delivery.md)."""
RETRY_COUNT_BYTES = 64 * 1024 * 1024
"""DESCRIBE_DELIVERY counts visible letters the retry cursor has not read yet, reading at most
this many bytes of the retry queue per call (it goes on where it stopped next time)."""


class Inspection:
    """DESCRIBE_DELIVERY and MESSAGE_STATUS (see the module docstring)."""

    def __init__(self, ctx: DeliveryContext, queues: GroupQueues,
                 deadletters: DeadLetters) -> None:
        self.ctx = ctx
        self.topics = ctx.topics
        self.queues = queues
        self.deadletters = deadletters

    def describe(self, g: DeliveryGroup) -> m.DescribeDeliveryResponse:
        """Members, per-queue progress and lag, retry and DLQ sizes."""
        ctx = self.ctx
        now = ctx.now()
        wall = ctx.clock.wall_ms()
        members = [
            (mem.member_id, mem.client_id, mem.host, now - mem.last_heartbeat,
             g.in_flight.get(mem.member_id, 0))
            for mem in g.members.values()
        ]
        topics = {t for mem in g.members.values() for t, _ in mem.subscriptions}
        topics |= {t for t, _ in g.sources}
        queues: list[m.DeliveryQueue] = []
        lags: list[int] = []
        for topic in sorted(topics):
            t = self.topics.topics.get(topic)
            if t is None:
                continue
            for local in t.queues:
                qs = self.queues.source(g, local) or local  # (None: read remotely, not yet)
                cur = g.sources.get((topic, qs.queue))
                floor = cur.floor if cur is not None else qs.log.start_offset
                nxt = cur.next if cur is not None else floor
                end = qs.visible_end
                age = -1
                if floor < end:
                    try:
                        data = qs.log.read(max(floor, qs.log.start_offset), 1,
                                           stored=True)  # the header: either format
                        b = next(iter_batches(data), None)
                        if b is not None:
                            age = max(0, wall - b[1].append_time_ms)
                    except BrokerError:
                        pass
                queues.append((topic, qs.queue, floor, nxt, end,
                               cur.in_flight if cur is not None else 0, age))
                never = end - max(nxt, qs.log.start_offset)  # retention: gone, not owed
                lags.append(max(0, never) + (cur.unfinished if cur is not None else 0))
        dlq_size = self.queues.dlq_size(g)
        blocked: list[m.BlockedKey] = []
        for cur in g.sources.values():
            if not isinstance(cur, OrderlyCursor):
                continue
            t = self.topics.topics.get(cur.topic)
            if t is None:
                continue
            for k, off, f in cur.blocked():
                nxt = -1 if off in cur.leased else ctx.to_wall(f.until)
                blocked.append((cur.topic, cur.queue, k, encode_msg_id(t.topic_id, cur.queue, off),
                                f.reconsume, f.since_wall, nxt, f.reason))
        return m.DescribeDeliveryResponse(
            g.name, members, queues, self.retry_waiting(g), g.retry.in_flight, dlq_size,
            list(g.retry_delays_ms), g.max_reconsume, g.orderly, blocked, lags,
        )

    def retry_waiting(self, g: DeliveryGroup) -> int:
        """Retry letters waiting: pending in the scheduler, read by the cursor and not leased,
        and visible ones the cursor has not read yet (counted incrementally, see
        RETRY_COUNT_BYTES)."""
        rc = g.retry
        qs = self.queues.internal_queue(g.retry_topic, create=False)
        if qs is None:
            return len(rc.ready)
        lg = qs.log
        if rc.next < lg.start_offset:
            rc.skip_to(lg.start_offset)
        if rc.counted < rc.next:
            rc.counted, rc.ahead = rc.next, 0
        pos = rc.counted
        end = lg.end_offset
        budget = RETRY_COUNT_BYTES
        while pos < end and budget > 0:
            try:
                data = lg.read(pos, 1 << 20)
            except BrokerError:
                break
            if not data:
                break
            budget -= len(data)
            before = pos
            for _p0, h in iter_batches(data):  # headers only
                if h.last_offset < pos:
                    continue
                if not h.attributes & ATTR_SCHEDULED and h.producer_id != STATE_PRODUCER_ID:
                    rc.ahead += h.last_offset - max(h.base_offset, pos) + 1
                pos = h.last_offset + 1
            if pos == before:
                break
        rc.counted = pos
        unread = rc.ahead - len(rc.done) - sum(1 for o in rc.leased if o >= rc.next)
        scheduled, _ = self.ctx.scheduler.topic_stats(qs.topic_id)
        return scheduled + len(rc.ready) + max(0, unread)

    def message_status(self, msg_id: str) -> m.MessageStatusResponse:
        """The state of one message in every delivery group that knows its topic."""
        topic, queue, offset = self.queues.locate(msg_id)
        qs = self.topics.queue(topic, queue)
        # (a queue this broker reads from its leader: the leader's answer says whether it is)
        if self.ctx.holds(qs) and not qs.log.start_offset <= offset < qs.log.end_offset:
            raise InvalidRequestError(f"message {msg_id} is not stored (deleted or never written)")
        to_wall = self.ctx.to_wall
        out: list[m.MessageGroupStatus] = []
        for g in self.ctx.groups.values():
            cur = g.sources.get((topic, queue))
            subscribed = any(tp == topic for mem in g.members.values() for tp, _ in mem.subscriptions)
            if cur is None and not subscribed:
                continue
            mv = g.moving.get(msg_id)
            if mv is not None:
                state, letter = mv
                out.append((g.name, state, "", -1, letter.reconsume,
                            letter.due_wall if state == "RETRYING" else -1, letter.reason, -1))
                continue
            if cur is not None and offset in cur.leased:
                lease = cur.leased[offset]
                out.append((g.name, "DELIVERED", lease.member, to_wall(lease.deadline), 0,
                            -1, "", -1))
                continue
            if isinstance(cur, OrderlyCursor) and offset in cur.pending:
                f = cur.failures.get(offset)
                if f is not None:  # retried in place
                    out.append((g.name, "RETRYING", "", -1, f.reconsume, to_wall(f.until),
                                f.reason, -1))
                else:  # behind its key's head
                    out.append((g.name, "WAITING", "", -1, 0, -1, "", -1))
                continue
            if cur is None or offset >= cur.next:
                out.append((g.name, "WAITING", "", -1, 0, -1, "", -1))
                continue
            judged, filtered = self._filtered(g, topic, queue, offset)
            if filtered:  # never delivered: nothing to look for in the retry queue or the DLQ
                out.append((g.name, "FILTERED", "", -1, 0, -1, filtered, -1))
                continue
            retrying, searched_all = self._retry_status(g, msg_id)
            if retrying is not None:
                out.append((g.name, *retrying))
                continue
            dead = self.deadletters.find(g, msg_id)
            if dead is not None:
                out.append((g.name, "DEAD", "", -1, dead.reconsume, -1, dead.reason,
                            dead.dead_wall))
                continue
            at = g.acked_at(topic, queue, offset)
            note = ""
            if at < 0 and not judged:
                note = ("acknowledged, or filtered out by a tag expression the group no longer "
                        "uses (no time kept)")
            if at < 0 and not searched_all:
                note = (f"{note or 'acknowledged'}; or still retrying: only the newest "
                        f"{MAX_RETRY_SCAN} records of the retry queue were searched")
            out.append((g.name, "CONSUMED", "", -1, 0, -1, note, at))
        return m.MessageStatusResponse(topic, queue, offset, out)

    def _retry_status(
        self, g: DeliveryGroup, msg_id: str
    ) -> tuple[tuple[str, str, int, int, int, str, int] | None, bool]:
        """The status of ``msg_id`` from its newest letter in the group's retry queue: RETRYING
        (a scheduled letter pending in the scheduler, or a visible one not yet leased) or
        DELIVERED (leased), or None when it has no unfinished letter; and whether the whole
        retry queue was searched (only its newest MAX_RETRY_SCAN records are).

        Nothing is kept in memory per pending retry: the letters are found by reading the retry
        queue (a substring test of each chunk read skips the chunks without the id)."""
        qs = self.queues.internal_queue(g.retry_topic, create=False)
        if qs is None:
            return None, True
        lg = qs.log
        end = lg.end_offset
        first = max(lg.start_offset, end - MAX_RETRY_SCAN)
        needle = msg_id.encode()
        found: tuple[int, bool, Letter] | None = None
        try:
            for mv, _p0, h, recs in batches_between(lg, first, end - 1,
                                                    lambda data: needle in data):
                for rec in recs:
                    if needle in mv[rec[5]:rec[6]].tobytes():
                        r = stored_record(mv, rec)
                        if r.properties.get("%MSGID") == msg_id:
                            with contextlib.suppress(CorruptRecordError):  # not a letter
                                found = (r.offset, bool(h.attributes & ATTR_SCHEDULED),
                                         read_letter(r))
        except CorruptRecordError as exc:
            log.error("retry queue of %s: %s; status search stopped there", g.name, exc)
        searched_all = first <= lg.start_offset
        if found is None:
            return None, searched_all
        off, scheduled, letter = found
        if scheduled:  # not visible yet: the scheduler has it
            state, due = self.ctx.scheduler.lookup(qs.topic_id, 0, off)
            if state in (CANCELLED_STATE, NOT_SCHEDULED):
                return None, searched_all
            # PENDING; or FIRED/DONE without a copy after it (the copy could not be written:
            # it fires again after a restart)
            return ("RETRYING", "", -1, letter.reconsume, due, letter.reason, -1), searched_all
        rc = g.retry
        lease = rc.leased.get(off)
        if lease is not None:
            return ("DELIVERED", lease.member, self.ctx.to_wall(lease.deadline),
                    letter.reconsume, -1, letter.reason, -1), searched_all
        if rc.is_finished(off):
            return None, searched_all
        return ("RETRYING", "", -1, letter.reconsume, letter.due_wall, letter.reason, -1), \
            searched_all

    def _filtered(self, g: DeliveryGroup, topic: str, queue: int, offset: int) -> tuple[bool, str]:
        """Whether the group's current tag expression of ``topic`` judged the message at
        ``offset`` (a finished one, below the cursor), and if it filtered it out, why ("" when
        not). A message before the position where that expression came into use was judged by
        an earlier one, which the group does not keep."""
        f = g.tag_filters.get(topic)
        if f is None or offset < f.since.get(queue, 0):
            return False, ""
        if f.tags is None:
            return True, ""
        try:
            rec = self.queues.read_record(g, (topic, queue), offset)
        except BusyError:  # read from its leader, and not buffered now
            return False, ""
        if rec is None:
            return True, ""
        tag = rec.tag.decode("utf-8", "replace")
        if tag in f.tags:
            return True, ""
        what = f"its tag is {tag!r}" if tag else "it has no tag"
        return True, (f"filtered out by the group's tag expression {f.expression!r} ({what}): "
                      "never delivered")
