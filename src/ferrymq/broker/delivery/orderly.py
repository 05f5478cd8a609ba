"""Orderly delivery: per queue, one message per sharding key at a time, in send order.

An orderly delivery group reads each queue through an :class:`OrderlyCursor` instead of a
:class:`~ferrymq.broker.delivery.state.SourceCursor`. The cursor scans the queue in offset order.
The first pending message of a sharding key is its *head*: only heads are delivered, and a key's
next message becomes its head when the head is finished (acked, or moved to the dead-letter
queue). Messages behind a busy head are *held*; other keys keep flowing past them, so a failing
message blocks only its own key (RocketMQ and Kafka block the whole queue). Messages without a
sharding key have no order to keep and are delivered as they come.

A failed head is retried in place: it stays the head, with its attempt count and a "not before"
time (:class:`Failure`), until it is acked or dead-lettered.

What is persisted (by the manager's journal and snapshot): ``next`` (the scan position), the set
of *pending* offsets below it (leased, failed, ready or held: everything examined but not
finished), leases and failures. Heads and held messages are not: after a restart the pending
offsets are read again to learn their keys (:meth:`OrderlyCursor.rebuild`). Memory is bounded:
the scan stops while ``max_orderly_held`` messages are held in a queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ferrymq.broker.delivery.state import Lease


@dataclass(slots=True)
class Failure:
    """A head that failed: how often, not before when, since when, and why."""

    reconsume: int
    until: int  # monotonic ms: not redelivered before
    since_wall: int  # wall ms of its first failure
    reason: str


class OrderlyCursor:
    """First (and in-place repeated) deliveries of one queue for an orderly group."""

    __slots__ = ("_order", "due", "failures", "floor", "heads", "held", "held_count", "key_of",
                 "leased", "next", "pending", "queue", "ready", "topic")

    def __init__(self, topic: str, queue: int, start: int) -> None:
        self.topic = topic
        self.queue = queue
        self.floor = start
        self.next = start  # scan position: every offset below was examined
        self.leased: dict[int, Lease] = {}
        self.pending: set[int] = set()  # examined, not finished
        self._order: deque[int] = deque()  # pending offsets, rising; finished ones pruned lazily
        self.heads: dict[str, int] = {}  # sharding key -> its head (oldest pending) offset
        self.key_of: dict[int, str] = {}  # pending offset -> sharding key ("" none)
        self.held: dict[str, deque[int]] = {}  # key -> offsets waiting behind its head
        self.held_count = 0
        self.ready: list[int] = []  # heap: deliverable offsets (heads, unkeyed), not leased
        self.failures: dict[int, Failure] = {}
        self.due: list[tuple[int, int]] = []  # heap: (until, offset) of failures backing off

    # -- scanning ---------------------------------------------------------------------------

    def examine(self, offset: int, key: str) -> bool:
        """The scan reached ``offset`` (key ``key``): it is pending now. True if it may be
        delivered now (a new head, or unkeyed), False if held behind its key's head."""
        self.pending.add(offset)
        self._order.append(offset)
        self.next = offset + 1
        return self._place(offset, key)

    def _place(self, offset: int, key: str) -> bool:
        self.key_of[offset] = key
        if not key:
            return True
        if key in self.heads:
            q = self.held.get(key)
            if q is None:
                q = self.held[key] = deque()
            q.append(offset)
            self.held_count += 1
            return False
        self.heads[key] = offset
        return True

    def rewind(self, start: int, examined: list[int]) -> None:
        """Undo a scan whose new position could not be journaled: ``examined`` are the
        offsets :meth:`examine` took since the position was ``start`` (rising, none leased or
        finished since); they are not pending any more and the scan goes back to ``start``."""
        for o in reversed(examined):
            self.pending.discard(o)
            key = self.key_of.pop(o, "")
            if key:
                if self.heads.get(key) == o:
                    del self.heads[key]
                else:  # held behind its key's head, last in line
                    q = self.held[key]
                    q.pop()
                    self.held_count -= 1
                    if not q:
                        del self.held[key]
            if self._order and self._order[-1] == o:
                self._order.pop()
        self.next = start

    def lease(self, offsets: Iterable[int], lease: Lease) -> None:
        """Hand ``offsets`` (pending, deliverable, popped from ``ready`` or just examined)."""
        for o in offsets:
            self.leased[o] = lease
            lease.offsets.add(o)

    def take_ready(self, now: int) -> list[int]:
        """Deliverable offsets now, rising (failures whose backoff ended included); the caller
        leases them or gives them back with :meth:`unready`."""
        due = self.due
        while due and due[0][0] <= now:
            until, off = heapq.heappop(due)
            f = self.failures.get(off)
            if f is not None and f.until == until and off not in self.leased:
                heapq.heappush(self.ready, off)
        out: list[int] = []
        ready = self.ready
        while ready:
            off = heapq.heappop(ready)
            if off in self.pending and off not in self.leased and (not out or out[-1] != off):
                out.append(off)
        return out

    def unready(self, offsets: Iterable[int]) -> None:
        """Give back offsets from :meth:`take_ready` that were not leased."""
        for o in offsets:
            heapq.heappush(self.ready, o)

    def next_due(self) -> int | None:
        """Monotonic ms when a backing-off failure becomes deliverable, or None."""
        return self.due[0][0] if self.due else None

    # -- outcomes -----------------------------------------------------------------------------

    def finish(self, offset: int) -> Lease | None:
        """``offset`` is done (acked or dead-lettered): its key's next message becomes the
        head. Returns the lease it had."""
        lease = self.leased.pop(offset, None)
        if lease is not None:
            lease.offsets.discard(offset)
        if offset not in self.pending:
            return lease
        self.pending.discard(offset)
        self.failures.pop(offset, None)
        key = self.key_of.pop(offset, "")
        if key and self.heads.get(key) == offset:
            q = self.held.get(key)
            if q:
                nxt = q.popleft()
                self.held_count -= 1
                if not q:
                    del self.held[key]
                self.heads[key] = nxt
                heapq.heappush(self.ready, nxt)
            else:
                del self.heads[key]
        return lease

    def fail(self, offset: int, failure: Failure, now: int) -> Lease | None:
        """The delivery of ``offset`` failed (or was handed back): it stays pending and is
        delivered again at ``failure.until``. Returns the lease it had."""
        lease = self.leased.pop(offset, None)
        if lease is not None:
            lease.offsets.discard(offset)
        if offset not in self.pending:
            return lease
        self.failures[offset] = failure
        if failure.until <= now:
            heapq.heappush(self.ready, offset)
        else:
            heapq.heappush(self.due, (failure.until, offset))
        return lease

    def skip_to(self, offset: int) -> None:
        """Nothing below ``offset`` can be delivered (retention deleted it)."""
        for o in [o for o in self.pending if o < offset]:
            self.finish(o)
        if offset > self.next:
            self.next = offset
        self.advance_floor()

    def advance_floor(self) -> None:
        """Move ``floor`` to the lowest pending offset (or ``next``)."""
        order = self._order
        pending = self.pending
        while order and order[0] not in pending:
            order.popleft()
        self.floor = order[0] if order else self.next

    @property
    def in_flight(self) -> int:
        """Messages leased now."""
        return len(self.leased)

    @property
    def unfinished(self) -> int:
        """Messages below ``next`` not finished: every pending one (leased, retried in place,
        ready, or held behind its key's head)."""
        return len(self.pending)

    # -- restart ------------------------------------------------------------------------------

    def restore(self, offsets: Iterable[int], lease: Lease) -> None:
        """Replay: a lease read back from disk (its offsets are pending)."""
        for o in offsets:
            self.leased[o] = lease
            lease.offsets.add(o)
            self.pending.add(o)

    def advance_to(self, offset: int) -> None:
        """Replay: the scan examined everything below ``offset``; what is not finished later
        in the journal is pending."""
        if offset > self.next:
            self.pending.update(range(self.next, offset))
            self.next = offset

    def rebuild(self, keys: Mapping[int, str | None], now: int) -> None:
        """After loading: place the pending offsets behind their keys again (``keys``: each
        pending offset's sharding key, None if it could not be read: finished)."""
        self._order = deque()
        self.heads.clear()
        self.held.clear()
        self.held_count = 0
        self.key_of.clear()
        self.ready = []
        self.due = []
        for o in sorted(self.pending):
            key = keys.get(o)
            if key is None:
                self.pending.discard(o)
                self.failures.pop(o, None)
                lease = self.leased.pop(o, None)
                if lease is not None:
                    lease.offsets.discard(o)
                continue
            self._order.append(o)
            if self._place(o, key) and o not in self.leased:
                f = self.failures.get(o)
                if f is not None and f.until > now:
                    heapq.heappush(self.due, (f.until, o))
                else:
                    heapq.heappush(self.ready, o)
        self.advance_floor()

    def blocked(self) -> list[tuple[str, int, Failure]]:
        """Heads that failed at least once: (key, offset, failure), oldest first."""
        return sorted(((self.key_of.get(o, ""), o, f) for o, f in self.failures.items()),
                      key=lambda t: t[1])
