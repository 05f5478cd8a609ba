"""What delivery reads a source queue through, and a source queue held in memory: the part of
a queue read from another broker.

Theory of operation
-------------------
RECEIVE and the moves read a group's source queues through :class:`SourceQueue` (the end
consumers may read, the long-poll waiters) and :class:`SourceLog` (whole batches by offset,
the aborted transactions of a range, an offset by time). A queue this broker holds is its own
:class:`~ferrymq.broker.topics.QueueState` and :class:`~ferrymq.storage.log.Log`: both fit
these protocols as they are, so local reads are the reads they always were.

On a cluster a group's coordinator may hold no replica of a subscribed queue (a topic with
fewer replicas than brokers). It reads such a queue from the queue's leader, as a consumer
would (:mod:`ferrymq.broker.cluster_reads`), into a :class:`BufferedQueue`: the batches from
the group's oldest unfinished offset of the queue (the cursor's ``floor``: every lease and
pending orderly head is at or above it) up to what was fetched, at most ``limit_bytes`` (one
batch may exceed it, as a fetch answers at least one). When the cursor's floor moves up,
the batches wholly below it are dropped, which makes room for the next fetch; the buffer is
*positioned* by the cursor on every use (:meth:`BufferedQueue.sync`), so a floor outside the
buffer (a new coordinator's first look at a queue, the leader's retention) starts it again
there. Reading an offset the buffer does not hold yet is ``BUSY`` (retriable: a move of a
leased message is retried, nothing is dropped), never "not stored": only the leader's log
start says that a message is gone.

Transactions: the fetches are read_committed (nothing past the leader's last stable offset);
the aborted transactions each answer lists are kept with the position of their ABORT marker
once the buffer holds it, so :meth:`BufferedQueue.aborted_txns` answers like
:meth:`ferrymq.storage.log.Log.aborted_txns` for the buffered range.

Everything runs on the event-loop thread; this module does no I/O.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_right
from collections.abc import Callable
from typing import Protocol

from ferrymq.errors import BusyError
from ferrymq.protocol.records import ATTR_CONTROL, iter_batches

NOT_FETCHED_RETRY_MS = 100
"""The retry-after of BUSY for an offset not fetched yet (a fetch round at the leader is about
this long when the leader has data)."""


class SourceLog(Protocol):
    """The reads delivery makes of a source queue's log (:class:`~ferrymq.storage.log.Log`
    has them)."""

    @property
    def start_offset(self) -> int:
        """First offset still stored (retention deleted what is below)."""
        ...

    @property
    def end_offset(self) -> int:
        """One past the last offset that can be read."""
        ...

    def read(self, offset: int, max_bytes: int, *, upto_offset: int | None = None,
             stored: bool = False) -> bytes:
        """Whole batches from the one holding ``offset`` (at least one), none whose last
        offset is at or above ``upto_offset``; ``stored``: as stored (a Kafka batch stored as
        it came is not converted)."""
        ...

    def aborted_txns(self, start: int, upto: int) -> list[tuple[int, int]]:
        """Aborted transactions overlapping ``[start, upto)``: ``(producer id, first offset)``."""
        ...

    def offset_for_time(self, ts_ms: int) -> int:
        """First offset appended at or after ``ts_ms``."""
        ...


class SourceQueue(Protocol):
    """A source queue as delivery reads it (:class:`~ferrymq.broker.topics.QueueState` is
    one)."""

    @property
    def topic(self) -> str:
        """The topic's name."""
        ...

    @property
    def topic_id(self) -> int:
        """The topic's id (in message ids)."""
        ...

    @property
    def queue(self) -> int:
        """The queue's number."""
        ...

    @property
    def log(self) -> SourceLog:
        """Its records."""
        ...

    @property
    def visible_end(self) -> int:
        """One past the last offset consumers may read."""
        ...

    @property
    def lso(self) -> int:
        """The last stable offset: read_committed readers stop here."""
        ...

    @property
    def waiters(self) -> set[asyncio.Future[None]]:
        """Long polls to wake when more can be read."""
        ...


class RemoteBudget:
    """The bytes all of a broker's remote-read buffers hold together, against one limit
    (``delivery_remote_buffers_total_bytes``): each :class:`BufferedQueue` fetches only into
    the room both its own limit and this one leave."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @property
    def room(self) -> int:
        """Bytes the buffers may still take together."""
        return max(0, self.limit - self.used)


class BufferedQueue:
    """A source queue read from its leader into memory, for one delivery group (see the
    module docstring).

    Args:
        topic, topic_id, queue: the queue.
        limit_bytes: most bytes buffered (``delivery_remote_buffer_bytes``).
        floor: the group's cursor floor on the queue (None: no cursor yet).
        on_moved: told when the buffer was started again elsewhere or made room (the fetcher
            goes on).
        budget: the broker-wide limit shared with every other buffer (None: none).
    """

    def __init__(self, topic: str, topic_id: int, queue: int, limit_bytes: int,
                 floor: Callable[[], int | None], on_moved: Callable[[], None],
                 budget: RemoteBudget | None = None) -> None:
        self.topic = topic
        self.topic_id = topic_id
        self.queue = queue
        self.limit_bytes = limit_bytes
        self.budget = budget
        self._floor = floor
        self._on_moved = on_moved
        self.waiters: set[asyncio.Future[None]] = set()
        self.leader_start = -1
        """The leader's log start offset (-1: not known yet)."""
        self.listed_end = -1
        """The leader's last stable offset when listed, where a new cursor may start."""
        self.listed_times: dict[int, int] = {}
        """Offsets by time looked up for a new cursor (timestamp -> offset)."""
        self.first = -1
        """Where the buffer starts (-1: not positioned: no cursor yet)."""
        self.end = -1
        """One past the buffered offsets: where the next fetch reads."""
        self.generation = 0
        """Bumped when the buffer starts again: an answer to an older fetch is dropped."""
        self.size = 0
        self._bases: list[int] = []
        self._lasts: list[int] = []
        self._data: list[bytes] = []
        self._aborted: list[list[int]] = []
        """[producer id, first offset, ABORT marker offset (-1: not buffered yet)]."""

    def __str__(self) -> str:
        return f"{self.topic}/{self.queue} (read from its leader)"

    # --- what delivery reads -------------------------------------------------------------------

    @property
    def listed(self) -> bool:
        """Whether the leader's offsets are known (a cursor can start)."""
        return self.leader_start >= 0

    @property
    def log(self) -> BufferedQueue:
        """The buffer is its own log."""
        return self

    @property
    def start_offset(self) -> int:
        """The leader's log start: below it, messages are gone (retention)."""
        return self.leader_start

    @property
    def end_offset(self) -> int:
        """One past the buffered offsets (before a cursor: the leader's, when listed)."""
        self.sync()
        return self.end if self.first >= 0 else self.listed_end

    @property
    def visible_end(self) -> int:
        """Same as :attr:`end_offset`: only committed data is fetched."""
        return self.end_offset

    @property
    def lso(self) -> int:
        """Same as :attr:`end_offset` (fetches stop at the leader's last stable offset)."""
        return self.end_offset

    def read(self, offset: int, max_bytes: int, *, upto_offset: int | None = None,
             stored: bool = False) -> bytes:
        """Whole buffered batches from the one holding ``offset``: at least one, then as many
        as fit ``max_bytes``; none whose last offset is at or above ``upto_offset``. They are
        FerryMQ batches whatever ``stored`` says (the leader's FETCH answer converted Kafka
        batches already).

        Raises:
            BusyError: ``offset`` is not buffered (yet): retry later.
        """
        self.sync()
        limit = self.end if upto_offset is None else min(self.end, upto_offset)
        if self.first < 0 or offset < self.first or offset >= self.end:
            raise BusyError(f"{self}: offset {offset} is not fetched yet",
                            retry_after_ms=NOT_FETCHED_RETRY_MS)
        i = bisect_right(self._bases, offset) - 1
        out: list[bytes] = []
        used = 0
        while i < len(self._data) and self._lasts[i] < limit:
            b = self._data[i]
            if out and used + len(b) > max_bytes:
                break
            out.append(b)
            used += len(b)
            i += 1
        return b"".join(out)

    def aborted_txns(self, start: int, upto: int) -> list[tuple[int, int]]:
        """Aborted transactions overlapping ``[start, upto)`` (their marker not before
        ``start``)."""
        return [(pid, first) for pid, first, marker in self._aborted
                if first < upto and (marker < 0 or marker >= start)]

    def offset_for_time(self, ts_ms: int) -> int:
        """The offset looked up for ``ts_ms`` when the queue was listed (the leader's end if
        it was not)."""
        return self.listed_times.get(ts_ms, self.listed_end)

    # --- what the fetcher does -----------------------------------------------------------------

    def sync(self) -> None:
        """Follow the group's cursor: drop batches wholly below its floor, or start the buffer
        again at the floor when the buffer does not reach it."""
        floor = self._floor()
        if floor is None or floor == self.first:
            return
        if 0 <= self.first < floor <= self.end:
            n = bisect_right(self._lasts, floor - 1)
            if n:
                self._resize(-sum(len(b) for b in self._data[:n]))
                del self._bases[:n], self._lasts[:n], self._data[:n]
                self._aborted = [a for a in self._aborted if a[2] < 0 or a[2] >= floor]
            self.first = floor
            self._on_moved()
            return
        self.start_at(floor)

    def start_at(self, offset: int) -> None:
        """Empty the buffer and start it at ``offset`` (answers in flight are dropped)."""
        self.first = self.end = offset
        self._resize(-self.size)
        self._bases, self._lasts, self._data, self._aborted = [], [], [], []
        self.generation += 1
        self._on_moved()

    def release(self) -> None:
        """Drop what is buffered and give its bytes back to the budget (the reader stopped)."""
        self._resize(-self.size)
        self._bases, self._lasts, self._data, self._aborted = [], [], [], []

    def _resize(self, delta: int) -> None:
        self.size += delta
        if self.budget is not None:
            self.budget.used += delta

    @property
    def room(self) -> int:
        """Bytes a fetch may ask for now (0: full, or not positioned, or the broker's buffers
        together are full)."""
        if self.first < 0:
            return 0
        room = self.limit_bytes - self.size
        if self.budget is not None:
            room = min(room, self.budget.room)
        return max(0, room)

    def add(self, data: bytes | memoryview, leader_start: int,
            aborted: list[tuple[int, int]]) -> None:
        """Buffer a fetch answer read at :attr:`end` (its complete batches not held yet) with
        the leader's log start and the answer's aborted transactions; wake the long polls.
        Not positioned (no cursor): nothing is kept."""
        if self.first < 0:
            return
        if leader_start >= 0:
            self.leader_start = leader_start
        known = {(a[0], a[1]) for a in self._aborted}
        self._aborted.extend([pid, first, -1] for pid, first in aborted
                             if (pid, first) not in known)
        grew = False
        for pos, h in iter_batches(data):
            last = h.last_offset
            if last < self.end:
                continue
            if h.attributes & ATTR_CONTROL:
                for a in self._aborted:
                    if a[0] == h.producer_id and a[2] < 0 and a[1] <= h.base_offset:
                        a[2] = h.base_offset
            b = bytes(data[pos:pos + h.size])
            self._bases.append(h.base_offset)
            self._lasts.append(last)
            self._data.append(b)
            self._resize(len(b))
            self.end = last + 1
            grew = True
        if grew:
            self.wake()

    def wake(self) -> None:
        """Wake the long-polling receivers."""
        if self.waiters:
            for w in self.waiters:
                if not w.done():
                    w.set_result(None)
            self.waiters.clear()
