"""Settling leased messages: ACK, NACK and CHANGE_INVISIBLE, each accepted only for a message's
current lease (its receipt).

An ack finishes the message for its group; a nack moves it on (:mod:`.moves`); a lease change
gives it a new lease (a new receipt). Each is journaled before it is applied. When a step meets
no descriptor or space the request is refused if nothing changed yet; else the entries from the
failed one on are answered with the retriable code and the earlier ones stand.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import MAX_RETRY_DELAY_MS, DeliveryGroup, split_receipts
from ferrymq.broker.delivery.journaling import Journaling
from ferrymq.broker.delivery.moves import Moves
from ferrymq.broker.delivery.replay import remember_acks, runs
from ferrymq.broker.delivery.shortage import Shortage
from ferrymq.broker.delivery.state import Lease
from ferrymq.errors import BrokerError, InvalidRequestError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode

_OK = int(ErrorCode.NONE)
_BAD_RECEIPT = int(ErrorCode.INVALID_RECEIPT)


class Settling:
    """ACK, NACK and CHANGE_INVISIBLE for every group (see the module docstring)."""

    def __init__(self, ctx: DeliveryContext, journaling: Journaling, shortage: Shortage,
                 moves: Moves) -> None:
        self.ctx = ctx
        self.journaling = journaling
        self.shortage = shortage
        self.moves = moves

    def ack(
        self, g: DeliveryGroup, entries: list[m.AckEntry]
    ) -> tuple[list[tuple[str, int, int, int]], int]:
        """Finish leased messages; returns the refused ones and the journal position to wait
        for. Each entry is journaled, then applied. When one meets no descriptor or space, the
        request is refused if nothing was acked yet (nothing changed); else that entry's and
        the later entries' offsets come back with the retriable code, the earlier ones are
        acked.

        Raises:
            BusyError, StorageFullError: no descriptor or space (nothing changed).
            StorageFailureError: the group's journal failed.
        """
        failed: list[tuple[str, int, int, int]] = []
        pos = -1
        clock = self.ctx.clock
        history = self.ctx.config.delivery_ack_history
        with self.journaling.writing(g):
            for i, (topic, queue, lease_id, offsets) in enumerate(entries):
                cursor = g.cursor((topic, queue))
                if cursor is None:
                    failed.extend((topic, queue, o, _BAD_RECEIPT) for o in offsets)
                    continue
                done, refused, held = split_receipts(cursor, offsets, lease_id)
                if refused:
                    failed.extend((topic, queue, o, _BAD_RECEIPT) for o in refused)
                if held is None:
                    continue
                rec: list[Any] = ["A", topic, queue, runs(done), clock.wall_ms()]
                if cursor is g.retry:  # a retry letter's ack names its original message
                    letters = g.retry.letters
                    rec.append([[lt.topic, lt.queue, lt.offset] for o in done
                                if (lt := letters.get(o)) is not None])
                try:
                    p = self.journaling.journal(g, rec)
                except BrokerError as exc:
                    if pos < 0 or self.shortage.classify(exc, "") is None:
                        raise
                    code = int(exc.code)
                    failed.extend((topic, queue, o, code) for o in done)
                    failed.extend((t, q, o, code) for t, q, _l, offs in entries[i + 1:]
                                  for o in offs)
                    break
                pos = p
                g.settle(cursor, done, held)
                remember_acks(g, rec, history)
        return failed, pos

    def nack(self, g: DeliveryGroup, entries: list[m.NackEntry]
             ) -> tuple[list[tuple[int, int]], list[asyncio.Future[None]]]:
        """Give messages back for a later attempt (or the dead-letter queue). Returns the
        results and, in sync mode, what to wait for before answering: each nacked message's
        new state (its retry copy and the journal record that finishes the original) durable,
        so that a nack answered survives a crash as an ack does.

        When a message cannot be moved (no descriptor, no space) it stays leased: the request
        is refused if nothing was nacked yet, else that entry and the later ones get the
        retriable code.

        Raises:
            InvalidRequestError: a delay above MAX_RETRY_DELAY_MS (nothing done).
            BusyError, StorageFullError: no descriptor or space (nothing changed).
        """
        if any(e[4] > MAX_RETRY_DELAY_MS for e in entries):
            raise InvalidRequestError(f"nack delay must be at most {MAX_RETRY_DELAY_MS} ms")
        results: list[tuple[int, int]] = []
        waits: list[asyncio.Future[None]] = []
        with self.journaling.writing(g):
            for i, (topic, queue, offset, lease_id, delay_ms, reason, counts) in \
                    enumerate(entries):
                lease = g.lease_of((topic, queue), offset, lease_id)
                if lease is None:
                    results.append((_BAD_RECEIPT, -1))
                    continue
                fut: asyncio.Future[None] | None = None
                if self.ctx.answers_wait:
                    fut = asyncio.get_running_loop().create_future()
                try:
                    self.moves.fail(g, lease.key, offset, lease, counts=counts,
                                    delay_ms=delay_ms,
                                    reason=reason or "consumer asked to retry later",
                                    on_durable=None if fut is None
                                    else functools.partial(_settle_future, fut))
                except (OSError, BrokerError) as exc:
                    err = self.shortage.classify(exc, f"nack in delivery group {g.name}")
                    if err is None:
                        raise
                    if all(code != _OK for code, _ in results):
                        raise err from exc
                    results.extend((int(err.code), -1) for _ in entries[i:])
                    break
                if fut is not None:
                    waits.append(fut)
                results.append((_OK, -1))
        return results, waits

    def change_invisible(
        self, g: DeliveryGroup, member_id: str, entries: list[tuple[str, int, int, int, int]]
    ) -> tuple[list[tuple[int, int]], int]:
        """New leases (new receipts) ending ``invisible_ms`` from now: one per old lease and
        time, each journaled before it replaces the old one. When one meets no descriptor or
        space, the request is refused if nothing changed yet; else its entries and the later
        ones get the retriable code (they keep their old leases).

        Raises:
            InvalidRequestError: an invisible time out of range (nothing done).
            BusyError, StorageFullError: no descriptor or space (nothing changed).
        """
        ctx = self.ctx
        for entry in entries:
            self.check_invisible(entry[4])
        results: list[tuple[int, int]] = [(_BAD_RECEIPT, -1)] * len(entries)
        now = ctx.now()
        wall = ctx.clock.wall_ms()
        pos = -1
        plan: dict[tuple[tuple[str, int], int, int], list[tuple[int, Lease, int]]] = {}
        for i, (topic, queue, offset, lease_id, invisible_ms) in enumerate(entries):
            old = g.lease_of((topic, queue), offset, lease_id)
            if old is not None:
                plan.setdefault((old.key, lease_id, invisible_ms), []).append((i, old, offset))
        with self.journaling.writing(g):
            steps = list(plan.items())
            for j, ((key, _, inv), items) in enumerate(steps):
                lease = Lease(ctx.next_lease, member_id, key, now + inv, items[0][1].reconsume)
                try:
                    p = self.journaling.journal(g, ["C", key[0], key[1], lease.lease_id,
                                                    lease.member, wall + inv, lease.reconsume,
                                                    runs(o for _, _, o in items)])
                except BrokerError as exc:
                    if pos < 0 or self.shortage.classify(exc, "") is None:
                        raise
                    for _k, rest in steps[j:]:
                        for i, _old, _o in rest:
                            results[i] = (int(exc.code), -1)
                    break
                pos = p
                ctx.next_lease += 1
                g.renew(key, ((old, offset) for _, old, offset in items), lease)
                for i, _old, _o in items:
                    results[i] = (_OK, lease.lease_id)
        return results, pos

    def check_invisible(self, invisible_ms: int) -> None:
        """Raise InvalidRequestError unless ``invisible_ms`` is an acceptable lease."""
        if not 0 < invisible_ms <= self.ctx.config.max_invisible_ms:
            raise InvalidRequestError(
                f"invisible time must be 1..{self.ctx.config.max_invisible_ms} ms, "
                f"not {invisible_ms}"
            )


def _settle_future(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
