"""A delivery group's dead letters: finding one, redriving and purging them (DLQ_ADMIN), and
sending an orderly group's stuck head there on purpose (SKIP_MESSAGE).

Dead letters are records of ``%DLQ%<group>`` (one queue). The group's ``dlq_floor`` says where
its dead letters start: those below were redriven (copied to the retry queue as letters due at
once, with their attempt count reset) or purged. The floor is journaled: before a purge takes
effect, and in sync flush mode once a redrive's copies are durable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import DeliveryGroup
from ferrymq.broker.delivery.journaling import Journaling
from ferrymq.broker.delivery.letters import make_letter, read_letter
from ferrymq.broker.delivery.moves import Moves
from ferrymq.broker.delivery.orderly import OrderlyCursor
from ferrymq.broker.delivery.queues import GroupQueues
from ferrymq.broker.delivery.shortage import Shortage
from ferrymq.broker.delivery.state import Lease
from ferrymq.broker.flusher import flush_postponed
from ferrymq.errors import BrokerError, CorruptRecordError, InvalidRequestError
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import Letter

log = logging.getLogger("ferrymq.broker")

MAX_DLQ_SCAN = 100_000
"""Most dead letters MESSAGE_STATUS reads looking for a message (older ones: CONSUMED)."""
MAX_REDRIVE_BATCH = 10_000
"""Most dead letters one DLQ_ADMIN redrive moves (the CLI loops for more)."""


class DeadLetters:
    """The dead letters of every group (see the module docstring).

    Args:
        on_floor_moved: told when a group's DLQ floor moved (an ephemeral group kept for its
            dead letters may be removable now).
    """

    def __init__(self, ctx: DeliveryContext, journaling: Journaling, shortage: Shortage,
                 queues: GroupQueues, moves: Moves,
                 on_floor_moved: Callable[[DeliveryGroup], None]) -> None:
        self.ctx = ctx
        self.journaling = journaling
        self.shortage = shortage
        self.queues = queues
        self.moves = moves
        self.on_floor_moved = on_floor_moved

    def find(self, g: DeliveryGroup, msg_id: str) -> Letter | None:
        """The dead letter of ``msg_id`` (among the first MAX_DLQ_SCAN), or None."""
        _, _, recs = self.queues.dlq_records(g, MAX_DLQ_SCAN)
        for r in recs:
            if r.properties.get("%MSGID") == msg_id:
                try:
                    return read_letter(r)
                except CorruptRecordError:
                    return None
        return None

    def admin(
        self, g: DeliveryGroup, action: int, max_messages: int, dry_run: bool
    ) -> tuple[m.DlqAdminResponse, int]:
        """Redrive or purge dead letters; returns the answer and a journal position."""
        ctx = self.ctx
        queues = self.queues
        if action == m.DlqAction.PURGE:
            if max_messages > 0:
                first, end, recs = queues.dlq_records(g, max_messages)
                stop = recs[-1].offset + 1 if recs else first
                count = len(recs)
            else:  # everything: no need to read it
                first, end, _ = queues.dlq_records(g, 0)
                stop = end
                count = max(0, end - first)
            if dry_run or stop <= g.dlq_floor:
                return m.DlqAdminResponse(first, stop, count), -1
            pos = self.journaling.journal(g, ["D", stop])
            g.dlq_floor = stop
            self.on_floor_moved(g)
            return m.DlqAdminResponse(first, stop, count), pos
        if action != m.DlqAction.REDRIVE:
            raise InvalidRequestError(f"unknown DLQ action {action}")
        first, end, recs = queues.dlq_records(
            g, min(max_messages, MAX_REDRIVE_BATCH) if max_messages > 0 else MAX_REDRIVE_BATCH)
        stop = recs[-1].offset + 1 if recs else first
        if dry_run or not recs:
            return m.DlqAdminResponse(first, stop, len(recs)), -1
        flusher = ctx.flusher
        with self.journaling.writing(g):
            qs = queues.retry_queue(g)
            flusher.check_writable(qs)
            wall = ctx.clock.wall_ms()
            count = 0
            last_end = 0
            for r in recs:
                try:
                    origin = read_letter(r)
                except CorruptRecordError:
                    continue
                letter = origin._replace(reconsume=0, due_wall=wall,
                                         reason="redriven from DLQ", dead_wall=-1)
                try:
                    res = qs.log.append(make_letter(r, letter), now_ms=wall)  # visible: due now
                except OSError as exc:  # stop here: what was copied is redriven, no more
                    err = self.shortage.classify(exc, f"redrive dead letters of {g.name}")
                    if err is None or not count:
                        raise
                    stop = r.offset
                    break
                last_end = res.last_offset + 1
                count += 1
            flusher.mark_dirty(qs)
            if not ctx.sync:
                qs.advance(qs.log.end_offset)
            pos = self.journaling.journal(g, ["D", stop]) if not ctx.sync else -1
            g.dlq_floor = stop
        self.on_floor_moved(g)
        g.pending_moves += 1

        def moved(exc: BaseException | None) -> None:
            if flush_postponed(exc) and qs not in flusher.failed:
                qs.wait_durable(last_end, moved)  # durable once the flusher wrote it again
                return
            g.pending_moves -= 1
            if exc is not None:
                log.error("delivery group %s: redrive failed: %s", g.name, exc)
                return
            if ctx.sync:
                try:
                    self.journaling.journal_or_defer(g, ["D", stop])
                except BrokerError as e:
                    log.error("delivery group %s: %s", g.name, e)
            g.wake()

        if ctx.sync and last_end:
            qs.wait_durable(last_end, moved)
        else:
            moved(None)
        return m.DlqAdminResponse(first, stop, count), pos

    def skip(self, g: DeliveryGroup, msg_id: str) -> None:
        """Send a pending message of an orderly group to its dead-letter queue on purpose, so
        that its sharding key moves on (``ferrymq group skip``).

        Raises:
            InvalidRequestError: not a message id, or not a pending head of the group.
            UnknownTopicError.
        """
        topic, queue, offset = self.queues.locate(msg_id)
        cur = g.sources.get((topic, queue))
        if not isinstance(cur, OrderlyCursor) or offset not in cur.pending:
            raise InvalidRequestError(
                f"message {msg_id} is not pending in orderly group {g.name!r} (skip works on "
                "messages an orderly group has reached and not finished)")
        k = cur.key_of.get(offset, "")
        if k and cur.heads.get(k) != offset:
            raise InvalidRequestError(
                f"message {msg_id} waits behind message {cur.heads[k]} of its key {k!r}; "
                "skip the first one")
        f = cur.failures.get(offset)
        lease = cur.leased.get(offset) or Lease(0, "", (topic, queue), 0,
                                                f.reconsume if f is not None else 0)
        with self.journaling.writing(g):
            self.moves.fail(g, (topic, queue), offset, lease, counts=False, delay_ms=0,
                            reason="skipped on purpose (ferrymq group skip)"
                            + (f"; last failure: {f.reason}" if f is not None else ""),
                            dead=True)
