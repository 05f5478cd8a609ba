"""The in-memory state of a delivery group: cursors over queues, leases, members.

Pure data and transitions: no I/O, no clock (times are passed in as monotonic milliseconds).
:mod:`ferrymq.broker.delivery.manager` drives it and journals every change.

A **source cursor** covers one queue of a subscribed topic for one group. First deliveries are
FIFO: ``next`` is the first offset never delivered; offsets in ``[floor, next)`` are either
leased (in ``leased``) or finished (acked, or moved to the retry or dead-letter queue).
``floor`` is the lowest unfinished offset: everything below it is done for this group.

The **retry cursor** covers the group's retry queue ``%RETRY%<group>``. Its records are due at
different times, so it keeps the pending ones in a heap by due time, and ``done`` holds the
finished offsets above ``floor``.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ferrymq.protocol.letters import Letter

if TYPE_CHECKING:
    from ferrymq.broker.delivery.orderly import OrderlyCursor


@dataclass(eq=False, slots=True)
class Lease:
    """Messages of one cursor handed to one member until ``deadline`` (monotonic ms)."""

    lease_id: int
    member: str
    key: tuple[str, int]
    deadline: int
    reconsume: int
    offsets: set[int] = field(default_factory=set)


class SourceCursor:
    """First deliveries of one queue, for one group (see the module docstring)."""

    __slots__ = ("_order", "floor", "leased", "next", "queue", "topic")

    def __init__(self, topic: str, queue: int, start: int) -> None:
        self.topic = topic
        self.queue = queue
        self.floor = start
        self.next = start
        self.leased: dict[int, Lease] = {}
        self._order: deque[int] = deque()  # leased offsets, rising; finished ones pruned lazily

    def lease(self, offsets: Iterable[int], lease: Lease) -> None:
        """Hand ``offsets`` (rising, at or above ``next``) to ``lease``."""
        offs = list(offsets)
        self.leased.update(dict.fromkeys(offs, lease))
        self._order.extend(offs)
        lease.offsets.update(offs)
        if offs and offs[-1] >= self.next:
            self.next = offs[-1] + 1

    def restore(self, offsets: Iterable[int], lease: Lease) -> None:
        """Re-establish a lease read back from disk (any order)."""
        for o in offsets:
            self.leased[o] = lease
            lease.offsets.add(o)
        self._order = deque(sorted(self.leased))

    def finish(self, offset: int) -> Lease | None:
        """The message at ``offset`` is done (acked or moved); return the lease it had."""
        lease = self.leased.pop(offset, None)
        if lease is not None:
            lease.offsets.discard(offset)
        return lease

    def skip_to(self, offset: int) -> None:
        """Nothing below ``offset`` will be delivered (filtered out, or deleted by retention)."""
        if offset > self.next:
            self.next = offset
        self.advance_floor()

    def advance_floor(self) -> None:
        """Move ``floor`` past finished offsets."""
        order = self._order
        leased = self.leased
        while order and order[0] not in leased:
            order.popleft()
        self.floor = order[0] if order else self.next

    @property
    def in_flight(self) -> int:
        """Messages leased now."""
        return len(self.leased)


class RetryCursor:
    """The group's retry queue: pending records by due time, leases, finished offsets."""

    __slots__ = ("by_msg_id", "done", "due", "floor", "leased", "letters", "next")

    def __init__(self, start: int) -> None:
        self.floor = start
        self.next = start  # records below this were loaded into ``letters`` or are done
        self.leased: dict[int, Lease] = {}
        self.done: set[int] = set()
        self.due: list[tuple[int, int]] = []  # (due monotonic ms, offset) of pending letters
        self.letters: dict[int, Letter] = {}  # pending and leased letters
        self.by_msg_id: dict[str, int] = {}

    def add(self, offset: int, letter: Letter, due_mono: int) -> None:
        """A new pending letter at ``offset``."""
        self.letters[offset] = letter
        self.by_msg_id[letter.msg_id] = offset
        heapq.heappush(self.due, (due_mono, offset))
        if offset >= self.next:
            self.next = offset + 1

    def pending(self, offset: int) -> bool:
        """Whether ``offset`` is a letter waiting to be delivered."""
        return offset in self.letters and offset not in self.leased

    def finish(self, offset: int) -> Lease | None:
        """The letter at ``offset`` is done; return the lease it had."""
        lease = self.leased.pop(offset, None)
        if lease is not None:
            lease.offsets.discard(offset)
        letter = self.letters.pop(offset, None)
        if letter is not None and self.by_msg_id.get(letter.msg_id) == offset:
            del self.by_msg_id[letter.msg_id]
        if offset >= self.floor:
            self.done.add(offset)
        return lease

    def advance_floor(self) -> None:
        """Move ``floor`` past finished offsets."""
        done = self.done
        f = self.floor
        while f < self.next and f in done:
            done.remove(f)
            f += 1
        self.floor = f

    @property
    def in_flight(self) -> int:
        """Letters leased now."""
        return len(self.leased)

    @property
    def waiting(self) -> int:
        """Letters waiting for their due time or a receiver."""
        return len(self.letters) - len(self.leased)


@dataclass(eq=False)
class DeliveryMember:
    """A live member of a delivery group (a push or simple consumer)."""

    member_id: str
    client_id: str
    host: str
    last_heartbeat: int
    session_timeout_ms: int
    subscriptions: list[tuple[str, str]]


class AckRun(NamedTuple):
    """Offsets ``first .. first+length-1`` of ``topic``/``queue`` were acknowledged at
    ``wall_ms`` (for retry letters: the original message's position)."""

    topic: str
    queue: int
    first: int
    length: int
    wall_ms: int


@dataclass(eq=False)
class DeliveryGroup:
    """Everything the broker keeps for one delivery group."""

    name: str
    retry_delays_ms: list[int]
    max_reconsume: int
    start_from: int = -2  # OffsetSpec.EARLIEST: where new cursors start
    retry: RetryCursor = field(default_factory=lambda: RetryCursor(0))
    dlq_floor: int = 0
    members: dict[str, DeliveryMember] = field(default_factory=dict)
    orderly: bool = False  # fixed when the group is created
    sources: dict[tuple[str, int], SourceCursor | OrderlyCursor] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)  # member -> leased messages
    expiry: list[tuple[int, int]] = field(default_factory=list)  # (deadline, lease id)
    waiters: set[asyncio.Future[None]] = field(default_factory=set)
    rr: int = 0
    pending_moves: int = 0
    moving: dict[str, tuple[str, Letter]] = field(default_factory=dict)  # msg id -> (state, letter)
    acked: deque[AckRun] = field(default_factory=deque)  # newest last; bounded by the manager

    def record_acks(self, topic: str, queue: int, runs: list[list[int]], wall_ms: int,
                    limit: int) -> None:
        """Remember when these offsets of ``topic``/``queue`` were acknowledged (``message
        status`` shows it); the oldest runs are forgotten past ``limit``."""
        acked = self.acked
        for first, count in runs:
            acked.append(AckRun(topic, queue, first, count, wall_ms))
        while len(acked) > limit:
            acked.popleft()

    def acked_at(self, topic: str, queue: int, offset: int) -> int:
        """Wall ms when ``offset`` was acknowledged, or -1 if no longer remembered."""
        for run in reversed(self.acked):
            if run.queue == queue and run.first <= offset < run.first + run.length \
                    and run.topic == topic:
                return run.wall_ms
        return -1

    def new_cursor(self, topic: str, queue: int, start: int) -> SourceCursor | OrderlyCursor:
        """A cursor for a queue this group starts reading (orderly or not, as the group)."""
        from ferrymq.broker.delivery.orderly import OrderlyCursor  # it imports Lease from here

        if self.orderly:
            return OrderlyCursor(topic, queue, start)
        return SourceCursor(topic, queue, start)

    @property
    def retry_topic(self) -> str:
        """Name of this group's retry queue topic."""
        return f"%RETRY%{self.name}"

    @property
    def dlq_topic(self) -> str:
        """Name of this group's dead-letter topic."""
        return f"%DLQ%{self.name}"

    def add_lease(self, lease: Lease, count: int) -> None:
        """Index a new lease of ``count`` messages."""
        self.leases[lease.lease_id] = lease
        self.in_flight[lease.member] = self.in_flight.get(lease.member, 0) + count
        heapq.heappush(self.expiry, (lease.deadline, lease.lease_id))

    def drop_from_lease(self, lease: Lease, count: int = 1) -> None:
        """``count`` messages left ``lease`` (already removed from its offsets)."""
        n = self.in_flight.get(lease.member, 0) - count
        if n > 0:
            self.in_flight[lease.member] = n
        else:
            self.in_flight.pop(lease.member, None)
        if not lease.offsets:
            self.leases.pop(lease.lease_id, None)

    def wake(self) -> None:
        """Wake long-polling receivers (something became available)."""
        for w in self.waiters:
            if not w.done():
                w.set_result(None)
        self.waiters.clear()
