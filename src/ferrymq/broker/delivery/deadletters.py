"""A delivery group's dead letters: finding one, redriving and purging them (DLQ_ADMIN), and
sending an orderly group's stuck head there on purpose (SKIP_MESSAGE).

Dead letters are records of ``%DLQ%<group>`` (one queue). The group's ``dlq_floor`` says where
its dead letters start: those below were redriven (copied to the retry queue as letters due at
once, with their attempt count reset) or purged. The floor is journaled: before a purge takes
effect, and in sync flush mode once a redrive's copies are durable.

One chosen letter above the floor can be redriven or purged on its own (DLQ_ADMIN with an
``offset``): its offset joins the group's ``dlq_done`` set, journaled as ``["DX", offset]`` the
same way, and every reader of dead letters (:meth:`GroupQueues.dlq_records`, the DLQ depth,
browsing through the answer's ``done`` list) skips it; the floor folds the set away as it
reaches it (:func:`~ferrymq.broker.delivery.replay.move_dlq_floor`). The set is bounded by
``max_dlq_done_letters``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import DeliveryGroup
from ferrymq.broker.delivery.journaling import Journaling
from ferrymq.broker.delivery.letters import StoredRecord, make_letter, read_letter
from ferrymq.broker.delivery.moves import Moves
from ferrymq.broker.delivery.orderly import OrderlyCursor
from ferrymq.broker.delivery.queues import GroupQueues
from ferrymq.broker.delivery.replay import mark_dlq_done, move_dlq_floor
from ferrymq.broker.delivery.shortage import Shortage
from ferrymq.broker.delivery.state import Lease
from ferrymq.broker.flusher import flush_postponed
from ferrymq.errors import (
    BrokerError,
    CorruptRecordError,
    InvalidOffsetError,
    InvalidRequestError,
    PolicyViolationError,
)
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
        self, g: DeliveryGroup, action: int, max_messages: int, dry_run: bool, offset: int = -1
    ) -> tuple[m.DlqAdminResponse, int]:
        """Redrive or purge dead letters, the oldest ``max_messages`` (0: all) or, with
        ``offset`` >= 0, the one at that offset; returns the answer and a journal position.

        Raises:
            InvalidRequestError: an unknown action.
            InvalidOffsetError: ``offset`` is not a live dead letter (nothing changed).
            PolicyViolationError: ``max_dlq_done_letters`` letters are done one by one above
                the oldest dead letter already.
        """
        if action not in (m.DlqAction.REDRIVE, m.DlqAction.PURGE):
            raise InvalidRequestError(f"unknown DLQ action {action}")
        if offset >= 0:
            return self.admin_one(g, action, offset, dry_run)
        queues = self.queues
        if action == m.DlqAction.PURGE:
            if max_messages > 0:
                first, end, recs = queues.dlq_records(g, max_messages)
                stop = recs[-1].offset + 1 if recs else first
                count = len(recs)
            else:  # everything: no need to read it
                first, end, _ = queues.dlq_records(g, 0)
                stop = end
                count = queues.dlq_size(g)
            if dry_run or stop <= g.dlq_floor:
                return self._answer(g, first, stop, count), -1
            pos = self.journaling.journal(g, ["D", stop])
            move_dlq_floor(g, stop)
            self.on_floor_moved(g)
            return self._answer(g, first, stop, count), pos
        first, end, recs = queues.dlq_records(
            g, min(max_messages, MAX_REDRIVE_BATCH) if max_messages > 0 else MAX_REDRIVE_BATCH)
        stop = recs[-1].offset + 1 if recs else first
        if dry_run or not recs:
            return self._answer(g, first, stop, len(recs)), -1
        stop, count, pos = self._redrive(g, recs, stop)
        return self._answer(g, first, stop, count), pos

    def admin_one(
        self, g: DeliveryGroup, action: int, offset: int, dry_run: bool
    ) -> tuple[m.DlqAdminResponse, int]:
        """Redrive or purge the one dead letter at ``offset``, wherever it is in the queue
        (see :meth:`admin`). The answer covers ``[offset, offset + 1)``."""
        r = self.queues.dlq_record(g, offset)
        if action == m.DlqAction.REDRIVE:
            try:
                read_letter(r)
            except CorruptRecordError as exc:
                raise InvalidOffsetError(
                    f"the dead letter at offset {offset} of delivery group {g.name!r} cannot be "
                    f"redriven: {exc}; purge it instead") from None
        limit = self.ctx.config.max_dlq_done_letters
        first = self.queues.dlq_records(g, 0)[0]  # (letters done below it: deleted by retention)
        done = sum(1 for o in g.dlq_done if o >= first) if len(g.dlq_done) >= limit else 0
        if offset > first and done >= limit:
            raise PolicyViolationError(
                f"delivery group {g.name!r} has {done} dead letters redriven or "
                f"purged one by one above its oldest dead letter (max_dlq_done_letters = "
                f"{limit}): redrive or purge the oldest ones first")
        if dry_run:
            return self._answer(g, offset, offset + 1, 1), -1
        if action == m.DlqAction.PURGE:
            pos = self.journaling.journal(g, ["DX", offset])
            self._apply(g, ["DX", offset])
            return self._answer(g, offset, offset + 1, 1), pos
        _stop, count, pos = self._redrive(g, [r], offset + 1, one=True)
        return self._answer(g, offset, offset + 1, count), pos

    def _answer(self, g: DeliveryGroup, first: int, stop: int,
                count: int) -> m.DlqAdminResponse:
        return m.DlqAdminResponse(first, stop, count, sorted(g.dlq_done))

    def _apply(self, g: DeliveryGroup, record: list[Any]) -> None:
        """Apply a ``D`` or ``DX`` record (journaled, or about to be) in memory."""
        if record[0] == "D":
            move_dlq_floor(g, record[1])
        else:
            mark_dlq_done(g, record[1])
        self.on_floor_moved(g)

    def _redrive(self, g: DeliveryGroup, recs: list[StoredRecord], stop: int, *,
                 one: bool = False) -> tuple[int, int, int]:
        """Copy dead letters to the retry queue, due now with a fresh attempt count, and mark
        them done: the floor moves to ``stop`` (``one``: the one letter of ``recs`` is done on
        its own). Returns the floor reached (short of ``stop`` when the disk filled up
        half-way), how many were copied and the journal position to wait for.

        In sync flush mode the record saying they are done is journaled once the copies are
        durable (a crash before leaves them dead: redriven again, never lost)."""
        ctx = self.ctx
        flusher = ctx.flusher
        with self.journaling.writing(g):
            qs = self.queues.retry_queue(g)
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
            record: list[Any] = ["DX", recs[0].offset] if one else ["D", stop]
            pos = self.journaling.journal(g, record) if not ctx.sync else -1
            self._apply(g, record)
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
                    self.journaling.journal_or_defer(g, record)
                except BrokerError as e:
                    log.error("delivery group %s: %s", g.name, e)
            g.wake()

        if ctx.sync and last_end:
            qs.wait_durable(last_end, moved)
        else:
            moved(None)
        return stop, count, pos

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
