"""Moving a failed delivery on: to the group's retry queue, to its dead-letter queue, or, in an
orderly group, retried in place.

Failures are *moves*: the message is copied, with letter properties (see
:mod:`~ferrymq.broker.delivery.letters`), to the group's retry queue ``%RETRY%<group>`` with a
due time from the retry ladder, or to ``%DLQ%<group>`` once it failed more than
``max_reconsume`` times. The original position is marked finished only after the copy is
durable, so a crash in between delivers the message twice, never zero times. An expired lease
or an evicted member's lease is a failure that is due at once (the lease was the wait).

A retry letter with a delay is appended as a scheduled record and indexed by the broker's
scheduler (:mod:`ferrymq.broker.scheduler`), which appends its visible copy to the retry queue
when it is due; a letter due at once is appended visible. An orderly group's failed head stays
the head of its key and is delivered again after ``orderly_retry_ms`` (or the nack's delay).
"""

from __future__ import annotations

import logging

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import DeliveryGroup, FailureOutcome
from ferrymq.broker.delivery.journaling import Journaling
from ferrymq.broker.delivery.letters import make_letter, read_letter
from ferrymq.broker.delivery.orderly import Failure, OrderlyCursor
from ferrymq.broker.delivery.queues import GroupQueues
from ferrymq.broker.delivery.state import Lease
from ferrymq.broker.delivery.store import Callback
from ferrymq.broker.flusher import flush_postponed
from ferrymq.errors import BrokerError, BusyError, CorruptRecordError, NotLeaderError
from ferrymq.protocol.letters import MAX_REASON_CHARS, Letter
from ferrymq.protocol.records import encode_msg_id

log = logging.getLogger("ferrymq.broker")


class Moves:
    """Moves failed deliveries of every group (see the module docstring)."""

    def __init__(self, ctx: DeliveryContext, journaling: Journaling, queues: GroupQueues) -> None:
        self.ctx = ctx
        self.journaling = journaling
        self.queues = queues

    def fail(
        self, g: DeliveryGroup, key: tuple[str, int], offset: int, lease: Lease, *,
        counts: bool, delay_ms: int, reason: str, dead: bool = False,
        on_durable: Callback | None = None,
    ) -> None:
        """A delivery failed (or is handed back): move the message on, then finish it here.

        Where it goes is the group's FailureOutcome: an orderly group keeps the message where it
        is (retried in place) unless it is dead; ``dead`` sends it to the dead-letter queue
        whatever its count. ``on_durable`` (sync
        mode) is told when the message's new state is durable.

        The copy is written before anything changes: when it cannot be (no descriptor to read
        the message or to write the copy, no space), this raises and the message is still
        leased as it was, so no letter is written twice and nobody else gets it meanwhile.

        Raises:
            BrokerError: the journal or the target queue refuses writes (BUSY or STORAGE_FULL
                with a retry-after, STORAGE_ERROR).
            OSError: no descriptor or no space to read the message or write its copy.
        """
        ctx = self.ctx
        reconsume = lease.reconsume + (1 if counts else 0)
        outcome = g.failure_outcome(key, reconsume, dead=dead)
        if outcome is FailureOutcome.IN_PLACE:
            cur = g.sources[key]
            assert isinstance(cur, OrderlyCursor)
            pos = self._fail_in_place(g, cur, offset, reconsume, delay_ms, reason)
            if on_durable is not None:
                self.journaling.when_durable(g.name, pos, on_durable)
            return
        record = self.queues.read_record(g, key, offset)
        if record is None:  # deleted by retention (or the topic was deleted): nothing to move
            pos = self.journaling.journal(g, ["A", key[0], key[1], [[offset, 1]]])
            log.warning("delivery group %s: %s/%d@%d is gone; dropped from the group", g.name,
                        key[0], key[1], offset)
            g.finish(key, offset)
            g.advance_floor(key)
            if on_durable is not None:
                self.journaling.when_durable(g.name, pos, on_durable)
            return
        if key[0] == g.retry_topic:
            try:
                origin = read_letter(record)
            except CorruptRecordError:
                origin = Letter(key[0], key[1], offset, "", 0)
        else:
            t = ctx.topics.get(key[0])
            origin = Letter(key[0], key[1], offset, encode_msg_id(t.topic_id, key[1], offset), 0)
        wall = ctx.clock.wall_ms()
        if outcome is FailureOutcome.DEAD and not dead:  # failed too often
            reason = f"{reason} (failed {reconsume} times, max_reconsume {g.max_reconsume})"
        dead = outcome is FailureOutcome.DEAD
        if dead:
            target = g.dlq_topic
            due_wall = wall
        else:
            if delay_ms < 0:
                delay_ms = g.retry_delay_ms(reconsume)
            target = g.retry_topic
            due_wall = wall + delay_ms
        letter = origin._replace(reconsume=reconsume, due_wall=due_wall, reason=reason,
                                 dead_wall=wall if dead else -1)
        scheduled = not dead and due_wall > wall  # else visible at once
        batch = make_letter(record, letter, deliver_at=due_wall if scheduled else None)
        qs = (self.queues.retry_queue(g) if not dead
              else self.queues.internal_queue(target, create=True))
        assert qs is not None
        flusher = ctx.flusher
        flusher.check_writable(qs)
        try:  # a cluster's queues: only their leader writes (the coordinator, see below)
            qs.check_own_write()
        except NotLeaderError as exc:
            raise BusyError(f"delivery group {g.name}: {target} is led by another broker for "
                            f"now ({exc.message})",
                            retry_after_ms=ctx.config.busy_retry_after_ms) from None
        res = qs.log.append(batch, now_ms=wall)  # OSError: nothing stored, nothing changed
        # the copy is written: the original is finished here (journaled once the copy is
        # durable: a crash in between delivers the message twice, never zero times)
        g.finish(key, offset)
        if scheduled and not res.duplicate:  # the scheduler makes a copy visible when due
            ctx.scheduler.on_append(qs, batch, res.base_offset, res.append_time_ms)
        flusher.mark_dirty(qs)
        if not ctx.sync:
            qs.advance(qs.log.end_offset)
        g.pending_moves += 1
        g.moving[origin.msg_id] = ("DEAD" if dead else "RETRYING", letter)
        end = res.last_offset + 1

        def moved(exc: BaseException | None) -> None:
            if flush_postponed(exc) and qs not in flusher.failed and qs.replica is None:
                qs.wait_durable(end, moved)  # durable once the flusher wrote its tail again
                return
            g.pending_moves -= 1
            g.moving.pop(origin.msg_id, None)
            if exc is not None:
                log.error("delivery group %s: move to %s failed: %s", g.name, target, exc)
                if on_durable is not None:
                    on_durable(exc)
                return
            if ctx.groups.get(g.name) is not g:  # deleted meanwhile
                if on_durable is not None:
                    on_durable(None)
                return
            try:
                self.journaling.journal_or_defer(g, ["A", key[0], key[1], [[offset, 1]]],
                                                 on_durable)
            except BrokerError as e:
                log.error("delivery group %s: %s", g.name, e)
                if on_durable is not None:
                    on_durable(e)
            g.advance_floor(key)

        if qs.replica is not None and dead:
            # a cluster's dead-letter queue is a log of its own: the letter must be replicated
            # before the finish is (the retry queue holds the finish itself, after its letter)
            qs.replica.wait_acks(end, 0, moved)
        elif qs.replica is not None:
            # a cluster's retry queue is also the group's journal: the finish goes right after
            # its letter, in the same event-loop step, so every copy of the log that has the
            # letter has the finish (a failover between the two left the letter and the lease:
            # a nack retried at the new coordinator wrote a second letter, delivered with the
            # first); the finish's high watermark, which the answer waits for, covers both
            moved(None)
        elif ctx.sync:
            qs.wait_durable(end, moved)
        else:
            moved(None)

    def _fail_in_place(
        self, g: DeliveryGroup, cur: OrderlyCursor, offset: int, reconsume: int, delay_ms: int,
        reason: str,
    ) -> int:
        """Orderly: the head stays the head of its key and is delivered again after a short
        fixed backoff (``orderly_retry_ms``, or the nack's own delay)."""
        ctx = self.ctx
        if delay_ms < 0:
            delay_ms = ctx.config.orderly_retry_ms
        now = ctx.now()
        wall = ctx.clock.wall_ms()
        old = cur.failures.get(offset)
        f = Failure(reconsume, now + delay_ms, old.since_wall if old is not None else wall,
                    reason[:MAX_REASON_CHARS])
        pos = self.journaling.journal(g, ["F", cur.topic, cur.queue, offset, reconsume,
                                          wall + delay_ms, f.since_wall, f.reason])
        g.fail_in_place(cur, offset, f, now)
        return pos
