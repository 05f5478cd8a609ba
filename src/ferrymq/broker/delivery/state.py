"""The in-memory state of a delivery group: cursors over queues, leases, members.

Pure data and transitions: no I/O, no clock (times are passed in as monotonic milliseconds).
:mod:`ferrymq.broker.delivery.manager` drives it and journals every change.

A **source cursor** covers one queue of a subscribed topic for one group. First deliveries are
FIFO: ``next`` is the first offset never delivered; offsets in ``[floor, next)`` are either
leased (in ``leased``) or finished (acked, or moved to the retry or dead-letter queue).
``floor`` is the lowest unfinished offset: everything below it is done for this group.

The **retry cursor** covers the group's retry queue ``%RETRY%<group>``. A retry letter with a
delay is stored there as a *scheduled* record: the broker's scheduler holds it (on disk, only the
near future in memory) and appends a visible copy to the same queue when it is due. So the
cursor only ever sees letters that are due, and scans them in offset order like a source
cursor: ``next`` is the scan position, ``ready`` the letters read but not yet leased (at most
``max_retry_loaded``: a group never holds more, however many retries are pending), ``leased``
and ``letters`` the leased ones. Offsets in ``[floor, next)`` that are neither ready nor leased
are finished (or scheduled originals, which the cursor skips). ``done`` holds finished offsets
at or above ``next``: they only come from the journal after a restart (the scan skips them).
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ferrymq.protocol.letters import Letter

if TYPE_CHECKING:
    from ferrymq.broker.delivery.orderly import OrderlyCursor

DEFAULT_RETRY_DELAYS_MS = [
    s * 1000 for s in (10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800,
                       3600, 7200)
]
"""RocketMQ's retry ladder: 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h."""
DEFAULT_MAX_RECONSUME = 16
MAX_RETRY_DELAY_MS = 24 * 3600 * 1000
MAX_RECONSUME_LIMIT = 1000
MAX_RETRY_LADDER = 64


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

    @property
    def unfinished(self) -> int:
        """Messages below ``next`` not finished: the leased ones."""
        return len(self.leased)


class RetryCursor:
    """The group's retry queue: a scan over its visible letters (see the module docstring)."""

    __slots__ = ("_order", "ahead", "counted", "done", "floor", "held", "leased", "letters",
                 "next", "ready", "reload")

    def __init__(self, start: int) -> None:
        self.floor = start
        self.next = start  # scan position: records below were read (or skipped)
        self.ready: dict[int, Letter] = {}  # read, not leased; rising offsets
        self.leased: dict[int, Lease] = {}
        self.letters: dict[int, Letter] = {}  # the letters of leased offsets
        self.done: set[int] = set()  # finished offsets at or above ``next`` (after a restart)
        self.held: dict[int, int] = {}  # ready letters not due yet -> due (monotonic ms)
        self.reload: set[int] = set()  # ready offsets of a snapshot, read again after loading
        self.counted = start  # plain records in [next, counted) are counted in ``ahead``
        self.ahead = 0
        self._order: deque[int] = deque()  # read or leased offsets below next, rising

    def add(self, offset: int, letter: Letter, held_until: int | None = None) -> None:
        """The scan read the letter at ``offset`` (at ``next``); it waits for a receiver (and,
        with ``held_until``, for that monotonic time: a letter of an older broker)."""
        self.ready[offset] = letter
        if held_until is not None:
            self.held[offset] = held_until
        self._order.append(offset)

    def passed(self, first: int, last: int, *, plain: bool) -> None:
        """The scan moved past offsets ``first..last`` (at ``next``; ``plain``: records of a
        non-scheduled batch, which ``ahead`` counted if they were below ``counted``)."""
        self.next = last + 1
        if last < self.counted:
            if plain:
                self.ahead -= last - first + 1
        else:
            self.counted = self.next
            self.ahead = 0

    def skip_to(self, offset: int) -> None:
        """Nothing below ``offset`` is readable any more (retention)."""
        if offset <= self.next:
            return
        self.next = offset
        self.done = {o for o in self.done if o >= offset}
        self.counted = offset  # counted again from there
        self.ahead = 0

    def track(self, offset: int) -> None:
        """A leased offset the scan reached (restored from the journal before it was read)."""
        self._order.append(offset)

    def lease(self, offset: int, lease: Lease) -> Letter:
        """Hand the ready letter at ``offset`` to ``lease``."""
        letter = self.ready.pop(offset)
        self.held.pop(offset, None)
        self.letters[offset] = letter
        self.leased[offset] = lease
        lease.offsets.add(offset)
        return letter

    def finish(self, offset: int) -> Lease | None:
        """The letter at ``offset`` is done; return the lease it had."""
        lease = self.leased.pop(offset, None)
        if lease is not None:
            lease.offsets.discard(offset)
        self.letters.pop(offset, None)
        self.ready.pop(offset, None)
        self.held.pop(offset, None)
        if offset >= self.next:
            self.done.add(offset)
        return lease

    def restore(self, ready: Iterable[tuple[int, Letter, int | None]],
                leased: dict[int, Letter]) -> None:
        """After loading: the ready letters ``(offset, letter, held until)`` read again (rising)
        and the letters of restored leases."""
        for off, letter, until in ready:
            self.ready[off] = letter
            if until is not None:
                self.held[off] = until
        self.letters.update(leased)
        self._order = deque(sorted(o for o in (*self.ready, *self.leased) if o < self.next))
        self.reload.clear()

    def is_finished(self, offset: int) -> bool:
        """Whether the visible letter at ``offset`` is done (acked or moved on)."""
        if offset in self.ready or offset in self.leased:
            return False
        return offset < self.next or offset in self.done

    def advance_floor(self) -> None:
        """Move ``floor`` past finished offsets."""
        order = self._order
        ready = self.ready
        leased = self.leased
        while order and order[0] not in ready and order[0] not in leased:
            order.popleft()
        self.floor = order[0] if order else self.next

    @property
    def in_flight(self) -> int:
        """Letters leased now."""
        return len(self.leased)


class MemberLink(Protocol):
    """The connection a member last heartbeated on (the broker's connection object)."""

    @property
    def closed(self) -> bool:
        """True once the connection is gone."""


@dataclass(eq=False)
class DeliveryMember:
    """A live member of a delivery group (a push or simple consumer).

    ``exclusive``: the member must be its group's only live member (a broadcasting consumer).
    ``link``: the connection of its last heartbeat (None: not known), used to tell whether an
    exclusive member is still there when another one asks to join (see
    :meth:`is_live`)."""

    member_id: str
    client_id: str
    host: str
    last_heartbeat: int
    session_timeout_ms: int
    subscriptions: list[tuple[str, str]]
    exclusive: bool = False
    link: MemberLink | None = None

    def is_live(self, now: int) -> bool:
        """Heartbeated within its session timeout, on a connection that is still open (a
        member whose process died closed its connection: the kernel closes it even after
        kill -9, so a restarted consumer need not wait for the session to expire)."""
        if now - self.last_heartbeat > self.session_timeout_ms:
            return False
        return self.link is None or not self.link.closed


@dataclass(slots=True)
class TagFilter:
    """The tag expression a group's receives last used on one topic, and from where it is sure
    to have applied: per queue, the group's ``next`` when it came into use (a queue without an
    entry was first read under it). ``message status`` says a message whose tag it does not
    match, at or past that position, was filtered out (never delivered)."""

    expression: str
    tags: frozenset[str] | None  # parsed; None: every message
    since: dict[int, int]  # queue -> first offset judged by this expression


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
    ephemeral: bool = False  # removed by the broker once it has no members (see the manager)
    sources: dict[tuple[str, int], SourceCursor | OrderlyCursor] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)  # member -> leased messages
    expiry: list[tuple[int, int]] = field(default_factory=list)  # (deadline, lease id)
    waiters: set[asyncio.Future[None]] = field(default_factory=set)
    rr: int = 0
    pending_moves: int = 0
    moving: dict[str, tuple[str, Letter]] = field(default_factory=dict)  # msg id -> (state, letter)
    acked: deque[AckRun] = field(default_factory=deque)  # newest last; bounded by the manager
    tag_filters: dict[str, TagFilter] = field(default_factory=dict)  # topic -> last expression
    # topics a member subscribed to before they existed: their cursors start at the topic's
    # beginning whatever ``start_from`` says (everything in them is newer than the subscription)
    awaited: set[str] = field(default_factory=set)
    # leases of members that left or were evicted, handed back to the group by the tick (at
    # once, unless no descriptor or space lets it move them): (lease, counts as an attempt,
    # reason)
    returning: deque[tuple[Lease, bool, str]] = field(default_factory=deque)

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

    def expired(self, now: int) -> Iterator[Lease]:
        """The leases whose deadline passed by ``now``, soonest first. Each one's entry leaves
        the expiry heap only once the caller is done with it (asked for the next one): when the
        caller stops half-way (an exception), the lease is expired again the next time."""
        exp = self.expiry
        while exp and exp[0][0] <= now:
            deadline, lease_id = exp[0]
            lease = self.leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                yield lease
            heapq.heappop(exp)

    def wake(self) -> None:
        """Wake long-polling receivers (something became available)."""
        for w in self.waiters:
            if not w.done():
                w.set_result(None)
        self.waiters.clear()
