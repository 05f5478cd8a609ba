"""The scheduler's time buckets in memory: near buckets loaded, far ones counted, over the bucket files.

Theory of operation
-------------------
Only buckets whose start lies within ``schedule_lookahead_ms`` of now are loaded: their pending
entries are in a dict and a heap ordered by fire time. Of every other bucket the index keeps a
few counters per (topic, queue): pending count, earliest fire time, lowest offset (for ``topic
describe`` and the retention floor). A bucket is loaded (one sequential read) when it comes near
(:meth:`BucketIndex.load_near`); a bucket in the past with nothing pending, nothing in flight and
nothing above the durable watermarks is deleted (:meth:`BucketIndex.delete_finished`).

An entry goes to the bucket of its fire time ``due + skew`` (:mod:`.clock`), or to the current
bucket when that is past: past buckets stay closed. Taking an entry to fire
(:meth:`BucketIndex.pop_due`) moves it from *pending* to *firing*; :meth:`BucketIndex.settle`
writes its fired (or cancelled) entry once its copy is durable and it leaves the firing count.

The index does no I/O but through its :class:`BucketFiles` (the bucket files of
:mod:`ferrymq.storage.schedule`) and takes the time as an argument: no clock. Runs on the
event-loop thread.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ferrymq.broker.descriptors import is_resource_shortage
from ferrymq.storage.schedule import (
    CANCELLED,
    FIRED,
    SCHEDULED,
    BucketScan,
    Position,
    encode_entries,
    pending_entries,
)

log = logging.getLogger("ferrymq.broker")

PENDING_ENTRY = 0
""":meth:`BucketIndex.find`: the entry is pending."""
FIRED_ENTRY = 1
""":meth:`BucketIndex.find`: the entry fired (or is firing: its fired entry not yet written)."""
CANCELLED_ENTRY = 2
""":meth:`BucketIndex.find`: the entry was cancelled."""
NOT_FOUND = -1
""":meth:`BucketIndex.find`: no bucket holds the entry."""

HeapItem = tuple[int, int, int, int, int, int]
"""(fire ms, topic id, queue, offset, bucket start, due ms) of a loaded pending entry."""
Item = tuple[int, int, int]
"""(offset, due ms, bucket start) of an entry being fired."""
Known = set[tuple[int, int, int, int]]
"""(topic id, queue, offset, due ms) of scheduled entries on disk."""


class BucketFiles(Protocol):
    """What the index needs of the bucket files (:class:`ferrymq.storage.schedule.ScheduleStore`)."""

    def bucket_starts(self) -> list[int]:
        """Start of every bucket file, ascending."""
        ...

    def path(self, start_ms: int) -> Path:
        """The file of a bucket (named in log messages)."""
        ...

    def read(self, start_ms: int) -> BucketScan:
        """Every valid entry of a bucket."""
        ...

    def append(self, start_ms: int, data: bytes) -> None:
        """Append encoded entries to a bucket file (creating it)."""
        ...

    def delete(self, start_ms: int) -> None:
        """Delete a bucket file."""
        ...


@dataclass(eq=False, slots=True)
class Bucket:
    """What the scheduler keeps of one bucket file."""

    start: int
    pending: int = 0
    firing: int = 0  # fired: the copy is not yet fsynced, the fired entry not yet written
    stats: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(topic id, queue) -> [pending, earliest fire time, lowest offset] (the last two are exact
    for unloaded buckets, lower bounds for loaded ones)."""
    maxoff: dict[tuple[int, int], int] = field(default_factory=dict)
    """(topic id, queue) -> largest offset ever indexed here (deletion waits for watermarks)."""
    entries: dict[Position, int] | None = None
    """Loaded: pending position -> fire time (ms on the scheduler's clock). None: not in
    memory."""

    def add(self, tid: int, q: int, off: int, fire: int) -> None:
        """Count a new pending entry."""
        key = (tid, q)
        st = self.stats.get(key)
        if st is None:
            self.stats[key] = [1, fire, off]
        else:
            st[0] += 1
            if fire < st[1]:
                st[1] = fire
            if off < st[2]:
                st[2] = off
        if off > self.maxoff.get(key, -1):
            self.maxoff[key] = off
        self.pending += 1

    def remove(self, tid: int, q: int) -> None:
        """Count a pending entry less (it fired or was cancelled)."""
        key = (tid, q)
        st = self.stats.get(key)
        if st is not None:
            st[0] -= 1
            if st[0] <= 0:
                del self.stats[key]
        self.pending -= 1

    def rebuild(self, pending: dict[Position, tuple[int, int]]) -> None:
        """Exact counters from the pending entries of the file (``maxoff`` is kept)."""
        stats: dict[tuple[int, int], list[int]] = {}
        get = stats.get
        for (tid, q, off), (due, skew) in pending.items():
            fire = due + skew
            st = get((tid, q))
            if st is None:
                stats[(tid, q)] = [1, fire, off]
            else:
                st[0] += 1
                if fire < st[1]:
                    st[1] = fire
                if off < st[2]:
                    st[2] = off
        self.stats = stats
        self.pending = len(pending)


class BucketIndex:
    """The buckets of one broker's schedule, near ones loaded. See the module docstring.

    Args:
        store: the bucket files.
        width_ms: bucket width (``schedule_bucket_ms``).
        lookahead_ms: buckets starting within this of now are loaded
            (``schedule_lookahead_ms``).
    """

    def __init__(self, store: BucketFiles, width_ms: int, lookahead_ms: int) -> None:
        self.store = store
        self.width = width_ms
        self.lookahead = lookahead_ms
        self.buckets: dict[int, Bucket] = {}
        self.far: list[int] = []  # heap of the starts of unloaded buckets (lazy)
        self.heap: list[HeapItem] = []
        self.topic_pending: dict[int, int] = {}
        self.write_seq = 0
        """Appends to bucket files so far (the flusher makes them durable up to a sequence)."""

    def bucket_start(self, due: int) -> int:
        """Start of the bucket holding fire time ``due``."""
        return due - due % self.width

    @property
    def pending(self) -> int:
        """Scheduled messages not yet due (all topics)."""
        return sum(self.topic_pending.values())

    # -- loading -------------------------------------------------------------------------------

    def load(self, marks: dict[tuple[int, int], int], now: float,
             on_skew: Callable[[int], None]) -> tuple[Known, int, int]:
        """Read every bucket file (counters; buckets within the look-ahead of ``now`` into
        memory); ``on_skew`` is told the skew of every skewed scheduled entry. Returns the
        scheduled entries at or above the watermarks ``marks`` (a rescan of the logs skips
        them), the pending count and the number of corrupt entries skipped."""
        horizon = now + self.lookahead
        known: Known = set()  # (tid, q, off, due) above watermarks
        corrupt = 0
        total = 0
        for start in self.store.bucket_starts():
            scan = self.store.read(start)
            if scan.corrupt or scan.torn_bytes:
                log.warning("schedule bucket %s: %d corrupt entries skipped, torn tail of %d bytes",
                            self.store.path(start).name, scan.corrupt, scan.torn_bytes)
                corrupt += scan.corrupt
            b = Bucket(start)
            maxoff = b.maxoff
            for kind, due, tid, q, off, skew in scan.entries:  # one pass per entry: keep it lean
                if kind == SCHEDULED:
                    key = (tid, q)
                    if off > maxoff.get(key, -1):
                        maxoff[key] = off
                    if off >= marks.get(key, 0):
                        known.add((tid, q, off, due))
                    if skew:
                        on_skew(skew)
            pending = pending_entries(scan.entries)
            b.rebuild(pending)
            for (tid, _q), st in b.stats.items():
                self.topic_pending[tid] = self.topic_pending.get(tid, 0) + st[0]
            total += len(pending)
            self.buckets[start] = b
            if start <= horizon:
                self._load_entries(b, pending)
            else:
                heapq.heappush(self.far, start)
        return known, total, corrupt

    def load_near(self, now: float) -> None:
        """Load the buckets on disk whose start came within the look-ahead."""
        horizon = now + self.lookahead
        far = self.far
        while far and far[0] <= horizon:
            start = heapq.heappop(far)
            b = self.buckets.get(start)
            if b is not None and b.entries is None:
                self._load_bucket(b)

    def _load_entries(self, b: Bucket, pending: dict[Position, tuple[int, int]]) -> None:
        entries = b.entries = {}
        heap = self.heap
        start = b.start
        for pos, (due, skew) in pending.items():
            fire = due + skew
            entries[pos] = fire
            heap.append((fire, pos[0], pos[1], pos[2], start, due))
        heapq.heapify(heap)

    def _load_bucket(self, b: Bucket) -> None:
        scan = self.store.read(b.start)
        pending = pending_entries(scan.entries)
        b.rebuild(pending)
        self._load_entries(b, pending)

    def indexed(self, key: tuple[int, int], off: int) -> Known:
        """The scheduled entries of queue ``key`` at or above ``off`` in every bucket file."""
        known: Known = set()
        for start in self.buckets:
            for kind, due, tid, q, o, _skew in self.store.read(start).entries:
                if kind == SCHEDULED and (tid, q) == key and o >= off:
                    known.add((tid, q, o, due))
        return known

    # -- registering ---------------------------------------------------------------------------

    def register(self, tid: int, q: int, items: list[tuple[int, int]], skew: int, *,
                 now: float) -> None:
        """Index ``(offset, due ms)`` items of one queue whose entries get ``skew``.

        Raises:
            OSError: a bucket file could not be written (the items of earlier buckets are
                indexed, the rest not).
        """
        width = self.width
        cur = int(now) - int(now) % width
        by_bucket: dict[int, list[tuple[int, int, int, int, int, int]]] = {}
        for off, due in items:
            fire = due + skew
            start = fire - fire % width
            if start < cur:
                start = cur  # due already: keep the past buckets closed
            ents = by_bucket.get(start)
            if ents is None:
                ents = by_bucket[start] = []
            ents.append((SCHEDULED, due, tid, q, off, skew))
        horizon = now + self.lookahead
        heap = self.heap
        for start, ents in by_bucket.items():
            self.store.append(start, encode_entries(ents))
            self.write_seq += 1
            b = self.buckets.get(start)
            if b is None:
                b = self.buckets[start] = Bucket(start)
                if start <= horizon:
                    b.entries = {}
                else:
                    heapq.heappush(self.far, start)
            entries = b.entries
            for _k, due, _t, _q, off, _s in ents:
                fire = due + skew
                b.add(tid, q, off, fire)
                if entries is not None:
                    entries[(tid, q, off)] = fire
                    heapq.heappush(heap, (fire, tid, q, off, start, due))
        self.topic_pending[tid] = self.topic_pending.get(tid, 0) + len(items)

    # -- firing --------------------------------------------------------------------------------

    def next_wake(self) -> int | None:
        """When (ms on the scheduler's clock) the earliest loaded entry fires or the next
        bucket on disk comes within the look-ahead; None: nothing is scheduled."""
        heap = self.heap
        due = heap[0][0] if heap else None
        if self.far:  # also wake when the next bucket on disk comes within the look-ahead
            load_at = self.far[0] - self.lookahead
            due = load_at if due is None or load_at < due else due
        return due

    def more_due(self, now: float) -> bool:
        """Whether a loaded entry is due at ``now`` (a round left it for the next)."""
        heap = self.heap
        return bool(heap) and heap[0][0] <= now

    def pop_due(self, now: float, limit: int) -> dict[tuple[int, int], list[Item]]:
        """Take at most ``limit`` entries due at ``now`` (fire time at or before it) out of
        pending, into firing, in fire order, grouped by queue."""
        heap = self.heap
        buckets = self.buckets
        groups: dict[tuple[int, int], list[Item]] = {}
        n = 0
        pop = heapq.heappop
        while heap and heap[0][0] <= now and n < limit:
            fire, tid, q, off, start, due = pop(heap)
            b = buckets.get(start)
            if b is None or b.entries is None:
                continue
            pos = (tid, q, off)
            if b.entries.get(pos) != fire:
                continue  # cancelled
            del b.entries[pos]
            b.remove(tid, q)
            b.firing += 1
            self.topic_pending[tid] -= 1
            key = (tid, q)
            g = groups.get(key)
            if g is None:
                g = groups[key] = []
            g.append((off, due, start))
            n += 1
        return groups

    def settle(self, tid: int, q: int, items: Iterable[Item], kind: int) -> list[Item]:
        """Write fired (or cancelled) entries for fired items; they leave the in-flight count.
        Returns the items a full disk (or no descriptor) kept from being written: their
        buckets keep counting them in flight until they are settled again."""
        by_bucket: dict[int, list[tuple[int, int, int, int, int, int]]] = {}
        for off, due, start in items:
            by_bucket.setdefault(start, []).append((kind, due, tid, q, off, 0))
        unsettled: list[Item] = []
        for start, ents in by_bucket.items():
            try:
                self.store.append(start, encode_entries(ents))
                self.write_seq += 1
            except OSError as exc:
                if is_resource_shortage(exc):  # the bucket stays (firing > 0) until written
                    log.warning("schedule bucket %d: cannot write %d fired entries (%s); "
                                "written once space (or a descriptor) is back", start,
                                len(ents), exc)
                    unsettled.extend((off, due, start) for _k, due, _t, _q, off, _s in ents)
                    continue
                log.error("schedule bucket %d: cannot write %d fired entries (%s); they fire "
                          "again after a restart", start, len(ents), exc)
            b = self.buckets.get(start)
            if b is not None:
                b.firing -= len(ents)
        return unsettled

    # -- cancelling and finding ------------------------------------------------------------------

    def find(self, pos: Position, due: int, skew_lo: int, skew_hi: int) -> tuple[Bucket | None, int]:
        """The bucket whose file holds the scheduled entry, and its state there:
        :data:`PENDING_ENTRY`, :data:`FIRED_ENTRY` (or firing), :data:`CANCELLED_ENTRY`, or
        :data:`NOT_FOUND`.

        The entry is in the bucket of its fire time ``due + skew``; the skew is one of those
        written (``skew_lo`` .. ``skew_hi``, a single bucket unless the wall clock jumped) or
        it went to a later bucket, which is loaded (it was due already when indexed; then only
        its pending state is found). That later bucket is the current one, loaded when it came
        within the look-ahead; should the timer that loads it be later than the look-ahead,
        its pending entries are not found until the next round loads it."""
        for b in self.buckets.values():
            if b.entries is not None and pos in b.entries:
                return b, PENDING_ENTRY
        width = self.width
        first = self.bucket_start(due + min(skew_lo, 0))
        last = self.bucket_start(due + max(skew_hi, 0))
        home = self.bucket_start(due)
        starts = sorted((s for s in self.buckets if first <= s <= last),
                        key=lambda s: abs(s - home) // width)
        for s in starts:
            b = self.buckets[s]
            state = NOT_FOUND
            for kind, d, tid, q, off, _skew in self.store.read(s).entries:
                if (tid, q, off) != pos or d != due:
                    continue
                state = (PENDING_ENTRY if kind == SCHEDULED else FIRED_ENTRY if kind == FIRED
                         else CANCELLED_ENTRY)
            if state != NOT_FOUND:
                if state == PENDING_ENTRY and b.entries is not None:
                    state = FIRED_ENTRY  # loaded, not pending: fired, its entry not yet written
                return b, state
        return None, NOT_FOUND

    def cancel(self, b: Bucket, pos: Position, due: int) -> None:
        """Write a cancelled entry for the pending entry at ``pos`` (due ``due``) in ``b``
        (found by :meth:`find`).

        Raises:
            OSError: the entry could not be written (nothing changed).
        """
        tid, q, off = pos
        self.store.append(b.start, encode_entries([(CANCELLED, due, tid, q, off, 0)]))
        self.write_seq += 1
        if b.entries is not None:
            del b.entries[pos]  # its heap item is skipped when popped
            b.remove(tid, q)
        else:
            pending = pending_entries(self.store.read(b.start).entries)
            b.rebuild(pending)
        self.topic_pending[tid] = self.topic_pending.get(tid, 0) - 1

    # -- finishing -------------------------------------------------------------------------------

    def delete_finished(self, now: float, covered: Callable[[Bucket], bool]) -> None:
        """Delete the buckets that ended before ``now`` with nothing pending or in flight and
        that ``covered`` says the durable watermarks are past."""
        width = self.width
        for start, b in list(self.buckets.items()):
            if (b.entries is not None and start + width <= now and b.pending <= 0
                    and b.firing <= 0 and not b.entries and covered(b)):
                del self.buckets[start]
                self.store.delete(start)

    # -- statistics ------------------------------------------------------------------------------

    def topic_stats(self, topic_id: int) -> tuple[int, int | None]:
        """``(pending scheduled messages, earliest fire time or None)`` of a topic (ms on the
        scheduler's clock)."""
        n = self.topic_pending.get(topic_id, 0)
        if n <= 0:
            return 0, None
        for start in sorted(self.buckets):
            b = self.buckets[start]
            if b.entries is not None:
                fires = [f for (t, _q, _o), f in b.entries.items() if t == topic_id]
            else:
                fires = [st[1] for (t, _q), st in b.stats.items() if t == topic_id and st[0] > 0]
            if fires:
                return n, min(fires)
        return n, None

    def lowest_pending(self) -> dict[tuple[int, int], int]:
        """``(topic id, queue) -> lowest offset of a pending entry`` (a lower bound) of every
        queue with pending entries."""
        lowest: dict[tuple[int, int], int] = {}
        for b in self.buckets.values():
            for key, st in b.stats.items():
                if st[0] > 0:
                    f = lowest.get(key)
                    if f is None or st[2] < f:
                        lowest[key] = st[2]
        return lowest

    def retention_floors(self) -> dict[tuple[int, int], int]:
        """``(topic id, queue) -> lowest offset of a pending scheduled original`` (a lower
        bound): retention must keep every segment holding offsets at or above it."""
        floors = self.lowest_pending()
        for b in self.buckets.values():
            if b.firing > 0:  # copies not yet fsynced: a crash fires their originals again
                for key in b.maxoff:
                    floors[key] = 0
        return floors
