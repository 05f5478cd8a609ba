"""Parking: due entries of a cluster's queues waiting for their mark in the queue's committed log.

Theory of operation
-------------------
On a cluster every replica of a queue indexes its scheduled originals (the leader when producers
append them, a follower when it copies them: ``Scheduler.on_replica_append``), but only the
leader fires them. A due entry of a replicated queue is *parked* (it stays in flight in its
bucket: neither pending nor settled) when

- this broker does not lead the queue (a follower, or a deposed leader): the leader fires it;
- this broker appended its copy: it is settled once the copy is committed (below the high
  watermark); a leader deposed before that has its copy truncated when it rejoins, and the new
  leader fires the message again (its log has no copy), so the final log holds one copy.

An entry is settled by its *mark* in the queue's log (:func:`ferrymq.protocol.schedule.read_marks`):
a copy naming it settles it as fired, a cancel record as cancelled. :meth:`Parking.read` reads
the marks of one queue from a cursor up to a bound: the visible end (the high watermark: what no
failover truncates) for the maintenance tick, which reads every replicated queue holding pending
or parked entries (at most :data:`MARKS_TICK_BYTES` a tick), so a new leader has only the tail
since the last tick to read; the log end
for a broker that starts leading the queue (its log is the queue's truth from then on). A mark
whose entry is still pending here (this broker's clock is behind the leader's, or the message
was cancelled before it was due) is kept until the entry comes due (:meth:`Parking.split_marked`
when it is taken to fire); marks below the lowest entry of the queue still pending or parked are
dropped. A log cut below the cursor (a follower's truncation: :meth:`Parking.truncated`) drops
the marks read above the cut and reads from there again.

A broker that starts leading a queue settles what its log marks and fires the rest of its parked
entries at once: they are due. Parked entries live in memory: after a restart they are pending in
the bucket files and come due again at once. A single broker's queues (and a broker's own
internal topics) never park. Runs on the event-loop thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ferrymq.broker.scheduler.buckets import Item
from ferrymq.errors import CorruptRecordError, LogClosedError, OffsetOutOfRangeError
from ferrymq.protocol.records import decode_msg_id, iter_batches
from ferrymq.protocol.schedule import read_marks

if TYPE_CHECKING:
    from ferrymq.broker.topics import QueueState

log = logging.getLogger("ferrymq.broker")

MARKS_READ_BYTES = 1 << 20
"""Log bytes read per step when reading a queue's marks."""
MARKS_TICK_BYTES = 16 << 20
"""Most log bytes the maintenance tick reads for marks (all queues together), so that a long
backlog (the first tick after a start reads from each queue's lowest pending message) is read
over several ticks instead of stalling the event loop; a broker that starts leading a queue
reads the rest of its log at once."""

Key = tuple[int, int]
"""(topic id, queue)."""


@dataclass(eq=False, slots=True)
class QueueMarks:
    """What parking keeps of one queue."""

    start: int
    """Marks are read for originals at or above this offset."""
    cursor: int
    """The log was read for marks up to here."""
    marks: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Original offset -> (FIRED_MARK or CANCELLED_MARK, offset of the batch holding it)."""
    parked: dict[int, Item] = field(default_factory=dict)
    """Original offset -> its parked entry."""


class Parking:
    """Parked entries and the marks read for them, per queue. See the module docstring."""

    def __init__(self) -> None:
        self.queues: dict[Key, QueueMarks] = {}

    @property
    def parked(self) -> int:
        """Entries parked (all queues)."""
        return sum(len(s.parked) for s in self.queues.values())

    def _state(self, key: Key, start: int) -> QueueMarks:
        """The queue's state, reading from ``start`` on (at the latest)."""
        s = self.queues.get(key)
        if s is None:
            s = self.queues[key] = QueueMarks(start, start)
        elif start < s.start:
            s.start = start
            s.cursor = min(s.cursor, start)  # its marks lie above it, perhaps below the cursor
        return s

    def park(self, key: Key, items: list[Item]) -> None:
        """Park due entries of a queue until their mark is read."""
        s = self._state(key, min(off for off, _due, _start in items))
        for item in items:
            s.parked[item[0]] = item

    def watch(self, key: Key, lowest: int) -> None:
        """Read the queue's marks from now on, for originals from ``lowest`` up (its lowest
        pending entry)."""
        self._state(key, lowest)

    def lowest(self, key: Key) -> int | None:
        """The lowest parked original of a queue."""
        s = self.queues.get(key)
        return min(s.parked) if s is not None and s.parked else None

    def read(self, qs: QueueState, upto: int, max_bytes: int | None = None) -> int:
        """Read the marks of ``qs`` from its cursor up to offset ``upto`` (stopping after about
        ``max_bytes`` of log, if given: the cursor stays where it stopped); the log bytes read.
        A log that ends below the cursor (truncated) is read again from the cut."""
        key = (qs.topic_id, qs.queue)
        s = self.queues.get(key)
        if s is None:
            return 0
        lg = qs.log
        if lg.end_offset < s.cursor:  # cut without being told (a restart's recovery)
            self.truncated(key, lg.end_offset)
        pos = max(s.cursor, lg.start_offset)
        nbytes = 0
        while pos < upto and (max_bytes is None or nbytes < max_bytes):
            try:
                data = lg.read(pos, MARKS_READ_BYTES)
            except (OffsetOutOfRangeError, LogClosedError):
                break
            if not data:
                break
            nbytes += len(data)
            before = pos
            for p, h in iter_batches(data):
                if h.base_offset >= upto:
                    pos = upto
                    break
                if h.last_offset >= pos:
                    try:
                        found = read_marks(data, p, h)
                    except CorruptRecordError as exc:
                        log.error("%s: batch at offset %d: marks of scheduled messages not "
                                  "read: %s", qs, h.base_offset, exc)
                        found = []
                    for kind, original in found:
                        try:
                            t, qq, off = decode_msg_id(original)
                        except ValueError:
                            continue
                        if (t, qq) == key and off >= s.start:
                            s.marks[off] = (kind, h.base_offset)
                pos = max(pos, h.last_offset + 1)
            if pos == before:
                break
        s.cursor = max(s.cursor, min(pos, upto))
        return nbytes

    def settle_marked(self, key: Key) -> list[tuple[int, list[Item]]]:
        """Take the parked entries of a queue whose mark was read: ``(mark kind, items)``."""
        s = self.queues.get(key)
        if s is None or not s.parked or not s.marks:
            return []
        by_kind: dict[int, list[Item]] = {}
        for off in [o for o in s.parked if o in s.marks]:
            by_kind.setdefault(s.marks.pop(off)[0], []).append(s.parked.pop(off))
        return list(by_kind.items())

    def split_marked(self, key: Key, items: list[Item]
                     ) -> tuple[list[tuple[int, list[Item]]], list[Item]]:
        """Entries just taken to fire: ``(marked ones by mark kind, the others)``."""
        s = self.queues.get(key)
        if s is None or not s.marks:
            return [], items
        by_kind: dict[int, list[Item]] = {}
        rest: list[Item] = []
        for item in items:
            mark = s.marks.pop(item[0], None)
            if mark is None:
                rest.append(item)
            else:
                by_kind.setdefault(mark[0], []).append(item)
        return list(by_kind.items()), rest

    def mark_of(self, key: Key, off: int) -> int | None:
        """The mark read for the original at ``off``, if any."""
        s = self.queues.get(key)
        mark = None if s is None else s.marks.get(off)
        return None if mark is None else mark[0]

    def unpark(self, key: Key) -> list[Item]:
        """Take every parked entry of a queue (its new leader fires them)."""
        s = self.queues.get(key)
        if s is None or not s.parked:
            return []
        items = list(s.parked.values())
        s.parked.clear()
        return items

    def prune(self, key: Key, lowest_pending: int | None) -> None:
        """Drop the marks below the queue's lowest pending or parked entry (nothing will ask
        for them)."""
        s = self.queues.get(key)
        if s is None:
            return
        floors = [f for f in (lowest_pending, min(s.parked, default=None)) if f is not None]
        if not floors:
            s.marks.clear()
            s.start = s.cursor
            return
        floor = min(floors)
        if floor > s.start:
            s.start = floor
            if s.marks:
                s.marks = {o: k for o, k in s.marks.items() if o >= floor}

    def truncated(self, key: Key, end: int) -> None:
        """The queue's log was cut to end at ``end`` (a follower's truncation): forget the
        marks read at or above it and read from there again."""
        s = self.queues.get(key)
        if s is None:
            return
        s.cursor = min(s.cursor, max(end, s.start))
        if s.marks:
            s.marks = {o: mk for o, mk in s.marks.items() if mk[1] < end}

    def forget(self, key: Key) -> None:
        """The queue is gone (its topic was deleted)."""
        self.queues.pop(key, None)
