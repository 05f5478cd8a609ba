"""The cursors of a delivery group over its queues, and the leases that hand their messages
to members.

Pure data and transitions: no I/O, no clock (times are passed in as monotonic milliseconds).
:class:`~ferrymq.broker.delivery.group.DeliveryGroup` holds them; the manager's collaborators
journal every change before they make it.

A **source cursor** covers one queue of a subscribed topic for one group. First deliveries are
FIFO: ``next`` is the first offset never delivered; offsets in ``[floor, next)`` are either
leased (in ``leased``) or finished (acked, or moved to the retry or dead-letter queue).
``floor`` is the lowest unfinished offset: everything below it is done for this group. (An
orderly group reads its queues through :class:`~ferrymq.broker.delivery.orderly.OrderlyCursor`
instead.)

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

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ferrymq.protocol.letters import Letter


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
