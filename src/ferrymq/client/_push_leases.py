"""A push consumer's leases: the messages it holds, their renewals, and the acks and nacks
that settle them.

Theory of operation
-------------------
Every message a push consumer received and has not settled is *held* (``held``: message ->
local lease deadline; ``held_since``: when it arrived), whether it waits in the prefetch buffer
or a handler has it (:mod:`ferrymq.client._push_runner`). Two tasks serve them:

* the **flusher** sends what the workers decided (:meth:`Leases.settle_one`): acks are
  collected for ``ACK_LINGER_S`` (or until ``ACK_BATCH`` are waiting) and sent as one ACK
  request, nacks likewise as NACK requests, with at most ``MAX_ACKS_IN_FLIGHT`` requests in
  flight;
* the **renewer** extends the lease of every held message once a third of
  ``invisible_duration`` has passed since it was leased, so a long handler never loses its
  message, until the message was held for ``consume_timeout`` (then its lease is left to
  expire). A renewal changes the message's receipt, so acks and nacks of messages whose
  renewal is in flight wait for it (``_renewing``).

A refused ack or nack (the lease had expired: the message was redelivered) is counted in
``stats["rejected"]`` and logged; a failed request is logged, its messages are redelivered when
their leases expire.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterable
from typing import Any

from ferrymq.client._delivery import DeliveryCore, LeasedMessage
from ferrymq.client._push_results import decision
from ferrymq.errors import BrokerError, FerryMQError

log = logging.getLogger("ferrymq.client")

ACK_LINGER_S = 0.005
"""How long acks and nacks are collected before they are sent (unless ACK_BATCH are waiting)."""
ACK_BATCH = 1024
"""Acks (or nacks) waiting that make the flusher send at once, without lingering."""
MAX_ACK_ENTRIES = 4096
"""Most receipts in one ACK, NACK or CHANGE_INVISIBLE request (keeps frames far below the cap)."""
MAX_ACKS_IN_FLIGHT = 4
"""ACK/NACK requests in flight at once; more acks wait and go out in bigger requests."""


class Leases:
    """The held messages of one push consumer, and the flusher and renewer tasks.

    Args:
        core: the member's delivery core (ACK, NACK, CHANGE_INVISIBLE).
        delivery_group: the member's delivery group (for the logs).
        stats: the consumer's counters (``acked``, ``nacked``, ``returned``, ``renewed``,
            ``rejected``).
        invisible_duration: seconds a lease lasts (and each renewal extends it by).
        consume_timeout: seconds a message may be held before its lease is no longer renewed.
    """

    def __init__(self, core: DeliveryCore, delivery_group: str,
                 stats: collections.Counter[str], *, invisible_duration: float,
                 consume_timeout: float) -> None:
        self._core = core
        self.delivery_group = delivery_group
        self.stats = stats
        self.invisible_duration = invisible_duration
        self.consume_timeout = consume_timeout
        # every leased message this member holds and has not settled -> local lease deadline
        self.held: dict[LeasedMessage, float] = {}
        self.held_since: dict[LeasedMessage, float] = {}  # when each held message arrived
        self._renewing: set[LeasedMessage] = set()
        self.acks: list[LeasedMessage] = []  # replaced by each flush: never keep a reference
        self._nacks: list[tuple[LeasedMessage, float | None, str, bool]] = []
        self._sends: set[asyncio.Task[None]] = set()
        # asyncio primitives bind to the loop on first use (the loop of start())
        self._send_slots = asyncio.Semaphore(MAX_ACKS_IN_FLIGHT)
        self.flush_wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._renew_busy = False  # a renewal is in flight: let it finish, do not cancel it
        self._draining = False  # close(): the flusher sends everything, then returns
        self.stopping = False  # close() began: acks go out without lingering

    def start(self, loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Task[None], ...]:
        """Start the flusher and the renewer; returns their tasks."""
        self._flusher = loop.create_task(self._flush_loop(), name="ferrymq-push-flush")
        self._renewer = loop.create_task(self._renew_loop(), name="ferrymq-push-renew")
        return (self._flusher, self._renewer)

    def hold(self, msgs: list[LeasedMessage], leased_at: float) -> None:
        """``msgs`` were leased at ``leased_at`` (loop time): renew them until settled."""
        self.held.update(dict.fromkeys(msgs, leased_at + self.invisible_duration))
        self.held_since.update(dict.fromkeys(msgs, leased_at))

    def hand_back(self, msgs: Iterable[LeasedMessage], reason: str) -> None:
        """Return ``msgs`` to the group at once without counting an attempt (never handled)."""
        for x in msgs:
            self.held.pop(x, None)
            self.held_since.pop(x, None)
            self._nacks.append((x, 0.0, reason, False))

    def forget(self) -> None:
        """Drop every held message (the member left: its leases went back)."""
        self.held.clear()
        self.held_since.clear()

    def keep(self, task: asyncio.Task[None]) -> None:
        """Hold ``task`` until it is done; :meth:`finish` waits for it."""
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def finish(self) -> None:
        """After the handlers stopped: end the renewals (a renewal in flight completes: the
        new receipts matter for the last acks), then send the last acks and nacks."""
        self._draining = True
        renewer = self._renewer
        if renewer is not None:
            if not self._renew_busy:
                renewer.cancel()
            await asyncio.wait({renewer})  # (a crash was logged by the runner)
        self.wake_flusher()
        if self._flusher is not None:
            await asyncio.wait({self._flusher})
        if self._sends:
            await asyncio.wait(set(self._sends))

    # -- settling ------------------------------------------------------------------------------

    def settle_one(self, msg: LeasedMessage, outcome: tuple[float, str, bool] | None) -> None:
        """Ack (``outcome`` None) or nack with (delay, reason, counts); delay -1: the ladder."""
        self.held.pop(msg, None)
        self.held_since.pop(msg, None)
        if outcome is None:
            self.acks.append(msg)
            self.wake_flusher()
            return
        delay, reason, counts = outcome
        self._nacks.append((msg, None if delay < 0 else delay, reason, counts))
        self.wake_flusher()

    def settle_batch(self, batch: list[LeasedMessage], res: object) -> None:
        """Settle a batch handler's messages by its result (an ``int``: that many acked)."""
        if type(res) is int:
            n = min(max(res, 0), len(batch))
            for x in batch[:n]:
                self.settle_one(x, None)
            reason = f"batch handler acknowledged {n} of {len(batch)} messages"
            for x in batch[n:]:
                self.settle_one(x, (-1.0, reason, True))
            return
        outcome = decision(res, len(batch))
        for x in batch:
            self.settle_one(x, outcome)

    # -- acks and nacks -----------------------------------------------------------------

    def wake_flusher(self) -> None:
        """Have the flusher send what is pending."""
        if not self.flush_wake.is_set():
            self.flush_wake.set()

    async def _flush_loop(self) -> None:
        wake = self.flush_wake
        while True:
            await wake.wait()
            if len(self.acks) < ACK_BATCH and not self.stopping:
                await asyncio.sleep(ACK_LINGER_S)
            wake.clear()
            await self._flush()  # never cancelled: it holds acks it has taken from the list
            if self._draining and not self.acks and not self._nacks:
                return

    async def _flush(self) -> None:
        """Send every pending ack and nack (those waiting for a renewal stay pending)."""
        while True:
            acks, self.acks = self.acks, []
            nacks, self._nacks = self._nacks, []
            if self._renewing:
                renewing = self._renewing
                self.acks = [x for x in acks if x in renewing]
                acks = [x for x in acks if x not in renewing]
                self._nacks = [e for e in nacks if e[0] in renewing]
                nacks = [e for e in nacks if e[0] not in renewing]
            if not acks and not nacks:
                return
            for i in range(0, len(acks), MAX_ACK_ENTRIES):
                await self._send_slots.acquire()
                self._spawn_send(self._send_acks(acks[i : i + MAX_ACK_ENTRIES]))
            if nacks:
                await self._send_slots.acquire()
                self._spawn_send(self._send_nacks(nacks))

    def _spawn_send(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._sends.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sends.discard(task)
        self._send_slots.release()

    async def _send_acks(self, msgs: list[LeasedMessage]) -> None:
        try:
            results = await self._core.ack(msgs)
        except FerryMQError as exc:
            log.error("push consumer %s: ack of %d messages failed (they will be redelivered "
                      "when their leases expire): %s", self.delivery_group, len(msgs), exc)
            return
        self.stats["acked"] += len(msgs) - self._count_rejected(msgs, results, "ack")

    async def _send_nacks(self, entries: list[tuple[LeasedMessage, float | None, str, bool]]
                          ) -> None:
        groups: dict[tuple[float | None, str, bool], list[LeasedMessage]] = {}
        for msg, delay, reason, counts in entries:
            groups.setdefault((delay, reason, counts), []).append(msg)
        for (delay, reason, counts), msgs in groups.items():
            for i in range(0, len(msgs), MAX_ACK_ENTRIES):
                part = msgs[i : i + MAX_ACK_ENTRIES]
                try:
                    results = await self._core.nack(part, delay_s=delay, reason=reason,
                                                    counts=counts)
                except FerryMQError as exc:
                    log.error("push consumer %s: nack of %d messages failed (they will be "
                              "redelivered when their leases expire): %s", self.delivery_group,
                              len(part), exc)
                    continue
                bad = self._count_rejected(part, results, "nack")
                self.stats["nacked" if counts else "returned"] += len(part) - bad

    def _count_rejected(self, msgs: list[LeasedMessage], results: list[BrokerError | None],
                        what: str) -> int:
        bad = [(x, e) for x, e in zip(msgs, results, strict=True) if e is not None]
        if bad:
            self.stats["rejected"] += len(bad)
            x, e = bad[0]
            log.warning("push consumer %s: %d %s(s) rejected, e.g. %s: %s (the lease had "
                        "expired: the message was redelivered)", self.delivery_group, len(bad),
                        what, x.msg_id, e)
        return len(bad)

    # -- renewals ------------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        loop = asyncio.get_running_loop()
        inv = self.invisible_duration
        interval = max(0.01, inv / 6)
        while not self._draining:
            await asyncio.sleep(interval)  # close() cancels the renewer only here
            now = loop.time()
            limit = now + inv * 2 / 3  # renew what was leased a third of a lease ago
            due = [x for x, dl in self.held.items() if dl <= limit]
            if due:
                due = self._drop_timed_out(due, now)
            if due:
                self._renew_busy = True
                try:
                    await self._renew(due, loop)
                finally:
                    self._renew_busy = False

    def _drop_timed_out(self, due: list[LeasedMessage], now: float) -> list[LeasedMessage]:
        """Stop renewing messages held past ``consume_timeout`` (their leases then expire)."""
        cutoff = now - self.consume_timeout
        since = self.held_since
        late = [x for x in due if since.get(x, now) < cutoff]
        if not late:
            return due
        for x in late:
            self.held.pop(x, None)
            since.pop(x, None)
        log.warning("push consumer %s: %d message(s) held longer than consume_timeout=%.0f s; "
                    "their leases are left to expire (redelivered as failures)",
                    self.delivery_group, len(late), self.consume_timeout)
        lateset = set(late)
        return [x for x in due if x not in lateset]

    async def _renew(self, due: list[LeasedMessage], loop: asyncio.AbstractEventLoop) -> None:
        inv = self.invisible_duration
        self._renewing.update(due)
        try:
            for i in range(0, len(due), MAX_ACK_ENTRIES):
                part = due[i : i + MAX_ACK_ENTRIES]
                sent = loop.time()
                try:
                    results = await self._core.change_invisible(part, inv)
                except FerryMQError as exc:
                    log.warning("push consumer %s: lease renewal of %d messages failed: %s",
                                self.delivery_group, len(part), exc)
                    continue
                held = self.held
                lost = 0
                for x, err in zip(part, results, strict=True):
                    if err is None:
                        if x in held:
                            held[x] = sent + inv
                    elif held.pop(x, None) is not None:
                        self.held_since.pop(x, None)
                        lost += 1
                self.stats["renewed"] += len(part) - lost
                if lost:
                    log.warning("push consumer %s: %d leases had expired before renewal (the "
                                "messages went back to the group)", self.delivery_group, lost)
        finally:
            self._renewing.difference_update(due)
            if self.acks or self._nacks:
                self.wake_flusher()
