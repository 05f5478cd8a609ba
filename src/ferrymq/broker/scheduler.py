"""Delayed and scheduled messages: the broker's scheduler.

Theory of operation
-------------------
A scheduled message is appended to its target queue like any message, in a batch with
``ATTR_SCHEDULED`` set whose records name their due time (:mod:`ferrymq.protocol.schedule`).
Readers skip such batches. Right after the append (same event-loop callback) the produce handler
calls :meth:`Scheduler.on_append`, which writes one 32-byte entry per record to the time bucket
of its due time (:mod:`ferrymq.storage.schedule`). When a message is due the scheduler reads the
original, appends a *copy* (a normal batch: consumers see it as a new message) to the same queue
and, once that copy is fsynced, writes a *fired* entry for the original. ``cancel`` writes a
*cancelled* entry.

Memory: only buckets whose start lies within ``schedule_lookahead_ms`` of now are loaded: their
pending entries are in a dict and a heap ordered by due time. Of every other bucket the
scheduler keeps a few counters per (topic, queue): pending count, earliest due, lowest offset
(for ``topic describe`` and the retention floor). A bucket is loaded (one sequential read) by the
maintenance tick when it comes near; a bucket in the past with nothing pending, nothing in flight
and nothing above the durable watermarks is deleted.

Timer: one ``call_later`` on the earliest due entry, re-armed when an earlier one arrives; due
entries are fired in rounds (all due entries of a queue in one appended batch, at most
:data:`MAX_FIRE_PER_ROUND` per round, rounds at least :data:`ROUND_INTERVAL_S` apart while
messages keep coming due). Never early: an entry fires only when the scheduler's clock is at or
past its fire time.

The scheduler's clock: ``S = anchor + monotonic time elapsed``: it never follows a wall-clock
jump while the broker runs, so a delay is measured in monotonic time. An entry stores the
message's *due* time (append time + delay, or the ``deliver_at`` time: wall-clock ms that the
log record determines, so entries are checked against their originals) and a *skew*: the
scheduler's clock minus the wall clock when it was indexed (see ``_skew``). It fires when ``S`` reaches
``due + skew`` (its *fire* time; buckets group entries by it). Without a clock jump ``S`` equals
the wall clock and the skew is 0. After a jump of J, ``S`` differs from the wall clock by J for
good and new entries carry skew J: every wait is still counted from the moment the message was
stored. The anchor is checkpointed with the watermarks as ``(S, wall)``; a start resumes
``S = S_saved + max(0, wall - wall_saved)`` (time while the broker was down counts as elapsed;
a backward jump while down counts as none).

Crash safety: the bucket files are derived data. Entries are written with ``write(2)`` right
after the original's append (they survive ``kill -9``) and fsynced by the flusher. Each queue has
a watermark (checkpointed about once a second, after the bucket files it covers were fsynced):
every scheduled batch below it is indexed. On start the scheduler reads every bucket file
(counters; near buckets into memory), then rescans each queue's log from its watermark and
indexes the scheduled batches a crash left unindexed (deduplicated by position and due time).
A fired entry is written only after the copy is fsynced, so a crash can deliver a message twice,
never zero times. Entries due while the broker was down fire right after start.

A full disk (ENOSPC/EDQUOT) needs no restart, and neither does running out of file descriptors
(EMFILE/ENFILE), which is handled the same way (without telling the disk watermark). An fsync of
the bucket files (or the watermark checkpoint) that fails for lack of space puts the scheduler
in the flusher's ``full`` set: no watermark is checkpointed past entries whose fsync failed,
cancels are answered STORAGE_FULL, and once space is back :meth:`Scheduler.rewrite_undurable`
reads every bucket file back (CRC-checked), writes it again in place and fsyncs it through a new
descriptor before the next checkpoint. Entries that could not be written are indexed again from
the log (the queue's watermark is held at the first of them) by the maintenance tick once space
is back; due messages whose copy could not be appended, or whose fired entries could not be
written, are tried again then too; a copy whose fsync failed for lack of space is settled once
the queue's tail was written again.

Everything runs on the event-loop thread except :meth:`Scheduler.flush_blocking` (the flusher
thread: fsync of bucket files, watermark checkpoint).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import heapq
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ferrymq._faults import enospc_point
from ferrymq._time import Clock
from ferrymq.broker.descriptors import is_resource_shortage
from ferrymq.broker.flusher import flush_postponed
from ferrymq.broker.watermarks import is_disk_full
from ferrymq.errors import (
    BrokerError,
    CorruptRecordError,
    InvalidRequestError,
    LogClosedError,
    NotScheduledError,
    OffsetOutOfRangeError,
)
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    BatchHeader,
    RecordInput,
    check_stored_batch,
    decode_header,
    decode_msg_id,
    decode_properties,
    encode_batch,
    encode_msg_id,
    encode_properties,
    iter_batches,
    record_fields,
    record_timestamp_delta,
    walk_records,
)
from ferrymq.protocol.schedule import Due, copy_properties, parse_due, read_due_times
from ferrymq.storage.schedule import (
    CANCELLED,
    FIRED,
    SCHEDULED,
    Position,
    ScheduleStore,
    encode_entries,
    pending_entries,
)

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.topics import QueueState, TopicRegistry

log = logging.getLogger("ferrymq.broker")

MAX_FIRE_PER_ROUND = 20_000
"""Most messages one firing round copies (one event-loop callback); the rest go next round."""
ROUND_INTERVAL_S = 0.002
"""While messages keep coming due, firing rounds start at least this far apart, so that a
stream of due messages is copied in batches rather than one callback per millisecond."""
COPY_BATCH_BYTES = 1 << 20
"""A round's copies for one queue are appended in batches of at most about this many bytes."""
MAINTENANCE_INTERVAL_S = 1.0
"""How often near buckets are loaded, finished ones deleted and watermarks checkpointed."""
RESCAN_READ_BYTES = 1 << 20
"""Log bytes read per step when rescanning a queue for unindexed scheduled batches."""

PENDING = "PENDING"
FIRED_STATE = "FIRED"
CANCELLED_STATE = "CANCELLED"
DONE = "DONE"
NOT_SCHEDULED = "NOT_SCHEDULED"

HeapItem = tuple[int, int, int, int, int, int]
"""(fire ms, topic id, queue, offset, bucket start, due ms) of a loaded pending entry."""
SKEW_SNAP_MS = 2
"""A skew this small (rounding between the clocks) is written as 0."""
CLOCK_SAVE_MS = 50
"""The clock anchor is checkpointed again when ``S - wall`` moved by more than this."""
JUMP_LOG_MS = 1000
"""A change of ``S - wall`` by more than this is logged as a wall-clock jump."""
Item = tuple[int, int, int]
"""(offset, due ms, bucket start) of an entry being fired."""


@dataclass(eq=False, slots=True)
class _Bucket:
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


class Scheduler:
    """Indexes scheduled messages by due time and fires them. See the module docstring."""

    def __init__(
        self, config: BrokerConfig, topics: TopicRegistry, flusher: Flusher, clock: Clock,
        data_dir: Path,
    ) -> None:
        self.config = config
        self.topics = topics
        self.flusher = flusher
        self.clock = clock
        self.sync = config.flush == "sync"
        self.store = ScheduleStore(data_dir / "schedule")
        self._width = config.schedule_bucket_ms
        self._lookahead = config.schedule_lookahead_ms
        self._buckets: dict[int, _Bucket] = {}
        self._far: list[int] = []  # heap of the starts of unloaded buckets (lazy)
        self._heap: list[HeapItem] = []
        self._topic_pending: dict[int, int] = {}
        self._anchor_ms = float(clock.wall_ms())
        self._anchor_mono = clock.monotonic()
        self._offset_saved = 0  # S - wall when the anchor was last checkpointed
        self._skew_lo = 0  # the range of skews written (bounds where _find looks)
        self._skew_hi = 0
        self._skew_saved: tuple[int, ...] = (0, 0)
        self._clock_pending: tuple[int, int, int, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0
        self._tick_handle: asyncio.TimerHandle | None = None
        self._round_queued = False
        self._last_round = 0.0
        self._write_seq = 0
        self._seq_waiters: deque[tuple[int, Callable[[BaseException | None], None]]] = deque()
        self._hold: dict[tuple[int, int], int] = {}  # queue -> offset whose indexing failed
        self._refire: list[tuple[QueueState, list[RecordInput], list[Item]]] = []
        """Due copies a full disk kept from being appended (tried again by the tick)."""
        self._unsettled: list[tuple[int, int, list[Item], int]] = []
        """Fired/cancelled entries a full disk kept from being written (tid, q, items, kind)."""
        self._wm_pending: dict[tuple[int, int], int] | None = None  # to checkpoint next flush
        self._wm_written: dict[tuple[int, int], int] | None = None
        self._wm_durable: dict[tuple[int, int], int] = {}  # last checkpoint that completed
        self._cache = _BatchCache(config.schedule_cache_bytes)
        self.fired = 0
        self.cancelled = 0
        self.dropped = 0
        self._closed = False

    def __str__(self) -> str:
        return "scheduler"

    # -- the scheduler's clock -------------------------------------------------------------------

    def now_ms(self) -> float:
        """The scheduler's clock in ms: ``anchor + monotonic time elapsed`` (module docstring)."""
        return self._anchor_ms + (self.clock.monotonic() - self._anchor_mono) * 1000.0

    def offset_ms(self) -> int:
        """``S - wall``: 0 until the wall clock jumps while the broker runs."""
        return round(self.now_ms()) - self.clock.wall_ms()

    def to_wall(self, fire_ms: int) -> int:
        """When (wall-clock ms, as the wall clock runs now) the scheduler's clock reaches
        ``fire_ms``."""
        offset = self.offset_ms()
        return fire_ms if -SKEW_SNAP_MS <= offset <= SKEW_SNAP_MS else fire_ms - offset

    def _skew(self, append_time_ms: int) -> int:
        """The skew of an entry indexed now for a message stored at ``append_time_ms``: ``S -
        wall`` now (rounded up: never early), less how far the append time is ahead of the wall
        clock (a queue's append times do not go back after a backward jump). Not ``S - append
        time``: the wall clock has moved on while the request was handled, and that must not
        make the message late. Small skews are snapped to 0."""
        wall = self.clock.wall_ms()
        skew = math.ceil(self.now_ms()) - wall
        if append_time_ms > wall:
            skew -= append_time_ms - wall
        if -SKEW_SNAP_MS <= skew <= SKEW_SNAP_MS:
            return 0
        if skew < self._skew_lo:
            self._skew_lo = skew
        elif skew > self._skew_hi:
            self._skew_hi = skew
        return skew

    def _clock_meta(self) -> tuple[int, int, int, int]:
        wall = self.clock.wall_ms()
        return round(self.now_ms()), wall, self._skew_lo, self._skew_hi

    def _resume_clock(self) -> None:
        """Continue the clock of the last run from the checkpoint (module docstring)."""
        saved = self.store.read_clock()
        if saved is None:
            return
        s_ms, w_ms, lo, hi = saved
        wall = self.clock.wall_ms()
        self._anchor_ms = float(s_ms + max(0, wall - w_ms))
        self._anchor_mono = self.clock.monotonic()
        self._offset_saved = round(self._anchor_ms) - wall
        self._skew_lo = min(self._skew_lo, lo)
        self._skew_hi = max(self._skew_hi, hi)
        self._skew_saved = (lo, hi)
        if abs(self._offset_saved) > JUMP_LOG_MS:
            log.warning("scheduler: its clock runs %+d ms from the wall clock (wall-clock jumps "
                        "while the broker ran); delays keep counting in monotonic time",
                        self._offset_saved)

    def _bucket_start(self, due: int) -> int:
        return due - due % self._width

    # -- start and stop ----------------------------------------------------------------------------

    def load(self) -> None:
        """Read the bucket files and the watermarks, then index what the logs hold above the
        watermarks (scheduled batches a crash left unindexed). Runs once, before listening."""
        self._resume_clock()
        now = self.now_ms()
        watermarks = self.store.read_watermarks()
        marks = watermarks or {}
        horizon = now + self._lookahead
        known: set[tuple[int, int, int, int]] = set()  # (tid, q, off, due) above watermarks
        corrupt = 0
        total = 0
        for start in self.store.bucket_starts():
            scan = self.store.read(start)
            if scan.corrupt or scan.torn_bytes:
                log.warning("schedule bucket %s: %d corrupt entries skipped, torn tail of %d bytes",
                            self.store.path(start).name, scan.corrupt, scan.torn_bytes)
                corrupt += scan.corrupt
            b = _Bucket(start)
            maxoff = b.maxoff
            for kind, due, tid, q, off, skew in scan.entries:  # one pass per entry: keep it lean
                if kind == SCHEDULED:
                    key = (tid, q)
                    if off > maxoff.get(key, -1):
                        maxoff[key] = off
                    if off >= marks.get(key, 0):
                        known.add((tid, q, off, due))
                    if skew:
                        if skew < self._skew_lo:
                            self._skew_lo = skew
                        elif skew > self._skew_hi:
                            self._skew_hi = skew
            pending = pending_entries(scan.entries)
            b.rebuild(pending)
            for (tid, _q), st in b.stats.items():
                self._topic_pending[tid] = self._topic_pending.get(tid, 0) + st[0]
            total += len(pending)
            self._buckets[start] = b
            if start <= horizon:
                self._load_entries(b, pending)
            else:
                heapq.heappush(self._far, start)
        rescanned = 0
        scanned_bytes = 0
        for qs in self.topics.all_queues():
            lg = qs.log
            key = (qs.topic_id, qs.queue)
            pos = max(marks.get(key, lg.start_offset), lg.start_offset)
            if pos >= lg.end_offset:
                continue
            n, nbytes = self._rescan(qs, pos, known)
            rescanned += n
            scanned_bytes += nbytes
        if total or rescanned or corrupt:
            log.info("scheduler: %d scheduled messages pending in %d buckets (%d indexed again "
                     "from %.1f MB of log%s)", total + rescanned, len(self._buckets), rescanned,
                     scanned_bytes / 1e6, f", {corrupt} corrupt entries" if corrupt else "")
        self.store.sync()
        self._checkpoint_now()

    def _rescan(self, qs: QueueState, pos: int, known: set[tuple[int, int, int, int]]) -> tuple[int, int]:
        lg = qs.log
        end = lg.end_offset
        tid, q = qs.topic_id, qs.queue
        found = 0
        nbytes = 0
        while pos < end:
            try:
                data = lg.read(pos, RESCAN_READ_BYTES)
            except OffsetOutOfRangeError:
                break
            if not data:
                break
            nbytes += len(data)
            mv = memoryview(data)
            before = pos
            for p, h in iter_batches(mv):
                if h.attributes & ATTR_SCHEDULED and h.last_offset >= pos:
                    try:
                        check_stored_batch(mv, p)
                        dues = read_due_times(mv, p, h, max_delay_ms=None, now_ms=0)
                    except (CorruptRecordError, InvalidRequestError) as exc:
                        log.error("%s: scheduled batch at offset %d cannot be indexed: %s", qs,
                                  h.base_offset, exc)
                        dues = []
                    items = []
                    for delta, due in dues:
                        off = h.base_offset + delta
                        at = due.at(h.append_time_ms)
                        if off >= pos and (tid, q, off, at) not in known:
                            items.append((off, at))
                    if items:
                        # the best guess: stored while today's offset S - wall held
                        self._register(tid, q, items, self._skew(self.clock.wall_ms()))
                        found += len(items)
                pos = max(pos, h.last_offset + 1)
            if pos == before:
                break
        return found, nbytes

    def start(self) -> None:
        """Arm the timer (entries that came due while the broker was down fire at once) and the
        maintenance tick. Call on the event loop after :meth:`load`."""
        self._loop = asyncio.get_running_loop()
        self._tick_handle = self._loop.call_later(MAINTENANCE_INTERVAL_S, self._tick)
        self._queue_round()

    def stop(self) -> None:
        """Stop firing (shutdown): cancel the timer and the tick."""
        self._closed = True
        for h in (self._timer, self._tick_handle):
            if h is not None:
                h.cancel()
        self._timer = self._tick_handle = None

    def close(self) -> None:
        """Write the final watermarks (every log's end) and close the bucket files. The flusher
        must have stopped and the logs must still be open."""
        self.stop()
        self.store.sync()
        self._checkpoint_now()
        self.store.close()

    def _watermarks(self) -> dict[tuple[int, int], int]:
        marks = {}
        hold = self._hold
        for qs in self.topics.all_queues():
            key = (qs.topic_id, qs.queue)
            end = qs.log.end_offset
            h = hold.get(key)
            marks[key] = end if h is None else min(h, end)
        return marks

    def _checkpoint_now(self) -> None:
        marks = self._watermarks()
        meta = self._clock_meta()
        self.store.write_watermarks(marks, meta)
        self._offset_saved = meta[0] - meta[1]
        self._skew_saved = meta[2:]
        self._wm_written = self._wm_durable = marks

    # -- the flusher's side (ferrymq.broker.flusher.Flushable) --------------------------------------

    def flush_blocking(self) -> int:
        """fsync the bucket files written so far, then checkpoint the watermarks noted before
        (flusher thread); the write sequence now durable."""
        enospc_point("fsync", "%schedule")
        seq = self._write_seq
        marks = self._wm_pending
        meta = self._clock_pending
        self.store.sync()
        if marks is not None and marks is not self._wm_written:
            self.store.write_watermarks(marks, meta)
            self._wm_written = marks
            self._wm_durable = marks
        return seq

    def rewrite_undurable(self) -> int:
        """After an fsync failed with ENOSPC (loop thread, the flusher does not touch the
        scheduler then): write every bucket file again through a new descriptor and fsync it
        (:meth:`ScheduleStore.rewrite_all`), then checkpoint as a flush does; the write
        sequence now durable.

        Raises:
            OSError: still no space.
            CorruptRecordError: a bucket file does not read back intact (restart needed: the
                logs are rescanned from the last watermarks).
        """
        enospc_point("rewrite", "%schedule")
        self.store.rewrite_all()
        return self.flush_blocking()

    def on_flushed(self, durable: int, sync: bool) -> None:
        """Answer cancels whose entries are now durable."""
        w = self._seq_waiters
        while w and w[0][0] <= durable:
            w.popleft()[1](None)

    def on_flush_failed(self, exc: BaseException) -> None:
        """The fsync failed: fail the cancels waiting for it."""
        w = list(self._seq_waiters)
        self._seq_waiters.clear()
        for _seq, cb in w:
            cb(exc)

    def when_durable(self, seq: int, cb: Callable[[BaseException | None], None]) -> None:
        """Call ``cb`` once the entries written up to ``seq`` are fsynced."""
        self._seq_waiters.append((seq, cb))
        self.flusher.mark_dirty(self)

    # -- indexing -----------------------------------------------------------------------------------

    def check(self, batch: bytes | bytearray | memoryview, h: BatchHeader,
              now_ms: int) -> list[tuple[int, Due]]:
        """The due times of a scheduled batch from a producer, before it is appended.

        Raises:
            InvalidRequestError: a record without a valid due time, or one beyond
                ``max_delay_ms``: the batch must not be stored.
        """
        return read_due_times(batch, 0, h, max_delay_ms=self.config.max_delay_ms, now_ms=now_ms)

    def on_append(
        self, qs: QueueState, batch: bytes | bytearray | memoryview, base_offset: int,
        append_time_ms: int, dues: list[tuple[int, Due]] | None = None,
    ) -> None:
        """Index a batch with ``ATTR_SCHEDULED`` just appended to ``qs`` (not a duplicate):
        call it right after ``qs.log.append`` returned, in the same event-loop callback.

        Args:
            qs: the queue appended to.
            batch: the batch as given to ``append``.
            base_offset: ``AppendResult.base_offset``.
            append_time_ms: ``AppendResult.append_time_ms``.
            dues: what :meth:`check` returned for it, if called (saves parsing twice).
        """
        if dues is None:
            try:
                dues = read_due_times(batch, 0, decode_header(batch), max_delay_ms=None,
                                      now_ms=append_time_ms)
            except (InvalidRequestError, CorruptRecordError) as exc:
                log.error("%s: scheduled batch at offset %d cannot be indexed: %s", qs,
                          base_offset, exc)
                return
        items = [(base_offset + d, due.at(append_time_ms)) for d, due in dues]
        try:
            self._register(qs.topic_id, qs.queue, items, self._skew(append_time_ms))
        except OSError as exc:
            key = (qs.topic_id, qs.queue)
            self._hold[key] = min(self._hold.get(key, base_offset), base_offset)
            log.error("%s: cannot index scheduled messages at offset %d (%s); they will be "
                      "indexed from the log at the next start", qs, base_offset, exc)

    def _register(self, tid: int, q: int, items: list[tuple[int, int]], skew: int) -> None:
        """Index ``(offset, due ms)`` items of one queue whose entries get ``skew``."""
        now = self.now_ms()
        width = self._width
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
        horizon = now + self._lookahead
        heap = self._heap
        for start, ents in by_bucket.items():
            self.store.append(start, encode_entries(ents))
            self._write_seq += 1
            b = self._buckets.get(start)
            if b is None:
                b = self._buckets[start] = _Bucket(start)
                if start <= horizon:
                    b.entries = {}
                else:
                    heapq.heappush(self._far, start)
            entries = b.entries
            for _k, due, _t, _q, off, _s in ents:
                fire = due + skew
                b.add(tid, q, off, fire)
                if entries is not None:
                    entries[(tid, q, off)] = fire
                    heapq.heappush(heap, (fire, tid, q, off, start, due))
        self._topic_pending[tid] = self._topic_pending.get(tid, 0) + len(items)
        self._arm()

    def _load_entries(self, b: _Bucket, pending: dict[Position, tuple[int, int]]) -> None:
        entries = b.entries = {}
        heap = self._heap
        start = b.start
        for pos, (due, skew) in pending.items():
            fire = due + skew
            entries[pos] = fire
            heap.append((fire, pos[0], pos[1], pos[2], start, due))
        heapq.heapify(heap)

    def _load_bucket(self, b: _Bucket) -> None:
        scan = self.store.read(b.start)
        pending = pending_entries(scan.entries)
        b.rebuild(pending)
        self._load_entries(b, pending)

    # -- firing ---------------------------------------------------------------------------------

    def _arm(self) -> None:
        loop = self._loop
        if loop is None or self._closed or self._round_queued:
            return
        heap = self._heap
        due = heap[0][0] if heap else None
        if self._far:  # also wake when the next bucket on disk comes within the look-ahead
            load_at = self._far[0] - self._lookahead
            due = load_at if due is None or load_at < due else due
        if due is None:
            return
        if self._timer is not None:
            if self._timer_due <= due:
                return
            self._timer.cancel()
        wait_s = max((due - self.now_ms()) / 1000.0, 0.0)
        since = loop.time() - self._last_round
        if since < ROUND_INTERVAL_S:
            wait_s = max(wait_s, ROUND_INTERVAL_S - since)
        self._timer_due = due
        self._timer = loop.call_later(wait_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._fire()

    def _queue_round(self) -> None:
        if self._loop is None or self._round_queued or self._closed:
            return
        self._round_queued = True
        self._loop.call_soon(self._run_queued)

    def _run_queued(self) -> None:
        self._round_queued = False
        self._fire()

    def _fire(self) -> None:
        """Copy every entry that is due (at most MAX_FIRE_PER_ROUND), queue by queue."""
        if self._closed:
            return
        assert self._loop is not None
        now = self.now_ms()
        self._load_near(now)
        heap = self._heap
        buckets = self._buckets
        groups: dict[tuple[int, int], list[Item]] = {}
        n = 0
        pop = heapq.heappop
        while heap and heap[0][0] <= now and n < MAX_FIRE_PER_ROUND:
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
            self._topic_pending[tid] -= 1
            key = (tid, q)
            g = groups.get(key)
            if g is None:
                g = groups[key] = []
            g.append((off, due, start))
            n += 1
        self._last_round = self._loop.time()
        for (tid, q), items in groups.items():
            self._fire_queue(tid, q, items)
        if heap and heap[0][0] <= now:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._queue_round()
        else:
            self._arm()

    def _fire_queue(self, tid: int, q: int, items: list[Item]) -> None:
        topic = self.topics.by_id.get(tid)
        if topic is None or q >= len(topic.queues):
            self._settle(tid, q, items, FIRED)  # the topic was deleted: nothing to deliver
            self.dropped += len(items)
            return
        qs = topic.queues[q]
        items.sort()
        records: list[RecordInput] = []
        fired: list[Item] = []
        stale: list[Item] = []
        size = 0
        for item in items:
            rec = self._copy_of(qs, item)
            if rec is None:
                stale.append(item)
                continue
            records.append(rec)
            fired.append(item)
            size += len(rec.body) + len(rec.properties) + 64
            if size >= COPY_BATCH_BYTES or len(records) >= self.config.max_batch_records:
                self._append_copies(qs, records, fired)
                records, fired, size = [], [], 0
        if records:
            self._append_copies(qs, records, fired)
        if stale:
            self._settle(tid, q, stale, FIRED)
            self.dropped += len(stale)

    def _read_batch(self, qs: QueueState, off: int) -> _Cached:
        """The batch of ``qs`` holding ``off``, checked, with its record positions (cached:
        the originals of one batch usually come due together or close together).

        Raises:
            OffsetOutOfRangeError, CorruptRecordError, LogClosedError.
        """
        c = self._cache.get(qs.topic_id, qs.queue, off)
        if c is not None:
            return c
        data = qs.log.read(off, 1)
        for p, h in iter_batches(data):
            if h.base_offset <= off <= h.last_offset:
                check_stored_batch(data, p)
                positions = walk_records(data, p, h, h.base_offset, _position, None)
                if positions is None or len(positions) != h.record_count:
                    raise CorruptRecordError(f"batch at offset {h.base_offset} is malformed")
                c = (data, p, h, array.array("I", positions))
                self._cache.put(qs.topic_id, qs.queue, c)
                return c
        raise OffsetOutOfRangeError(f"no batch holds offset {off}")

    def _copy_of(self, qs: QueueState, item: Item) -> RecordInput | None:
        """The copy to append for the original at ``item``; None when the entry is stale (the
        original is gone, or is not the scheduled message the entry names)."""
        off, due, _start = item
        try:
            data, _p, h, positions = self._read_batch(qs, off)
            if not h.attributes & ATTR_SCHEDULED:
                raise InvalidRequestError("not a scheduled batch")
            rp = positions[off - h.base_offset]
            t0, t1, s1, k1, p1, rend = record_fields(data, rp)
            props = decode_properties(data[k1:p1]) if p1 > k1 else {}
            if parse_due(props).at(h.append_time_ms) != due:
                raise InvalidRequestError("due time differs")
        except (BrokerError, LogClosedError) as exc:
            log.warning("%s@%d: scheduled entry dropped: %s", qs, off, exc)
            return None
        return RecordInput(
            data[p1:rend],
            h.first_timestamp + record_timestamp_delta(data, rp),
            data[t0:t1], data[t1:s1], data[s1:k1],
            encode_properties(copy_properties(props, encode_msg_id(qs.topic_id, qs.queue, off),
                                              due)),
        )

    def _append_copies(self, qs: QueueState, records: list[RecordInput], items: list[Item]) -> None:
        tid, q = qs.topic_id, qs.queue
        try:
            batch = encode_batch(records)
        except BrokerError as exc:  # born times more than 24 days apart: one batch per message
            if len(records) == 1:
                log.error("%s@%d: cannot copy a due scheduled message: %s", qs, items[0][0], exc)
                self._settle(tid, q, items, FIRED)
                return
            for rec, item in zip(records, items, strict=True):
                self._append_copies(qs, [rec], [item])
            return
        if qs in self.flusher.full:  # its tail waits for the rewrite: try again after it
            self._refire.append((qs, records, items))
            return
        try:
            res = qs.log.append(batch, now_ms=self.clock.wall_ms())
        except OSError as exc:
            if not is_resource_shortage(exc):
                log.error("%s: cannot append %d due scheduled messages: %s; they will be "
                          "delivered after a restart", qs, len(records), exc)
                return
            if is_disk_full(exc) and self.flusher.on_disk_full is not None:
                self.flusher.on_disk_full(exc)
            log.warning("%s: cannot append %d due scheduled messages (%s); they are delivered "
                        "once space (or a descriptor) is back", qs, len(records), exc)
            self._refire.append((qs, records, items))
            return
        except (BrokerError, LogClosedError) as exc:
            # the fired entries are never written: the messages fire again after a restart
            log.error("%s: cannot append %d due scheduled messages: %s; they will be delivered "
                      "after a restart", qs, len(records), exc)
            return
        self.flusher.mark_dirty(qs)
        if not self.sync:
            qs.advance(qs.log.end_offset)
        self.fired += len(items)

        def copied(exc: BaseException | None) -> None:
            if flush_postponed(exc) and qs not in self.flusher.failed:
                qs.wait_durable(res.last_offset + 1, copied)  # durable after the rewrite
                return
            if exc is not None:
                log.error("%s: copies of %d scheduled messages not fsynced (%s); they will be "
                          "delivered again after a restart", qs, len(items), exc)
                return
            self._settle(tid, q, items, FIRED)

        qs.wait_durable(res.last_offset + 1, copied)

    def _settle(self, tid: int, q: int, items: Iterable[Item], kind: int) -> None:
        """Write fired (or cancelled) entries for fired items; they leave the in-flight count."""
        by_bucket: dict[int, list[tuple[int, int, int, int, int, int]]] = {}
        for off, due, start in items:
            by_bucket.setdefault(start, []).append((kind, due, tid, q, off, 0))
        for start, ents in by_bucket.items():
            try:
                self.store.append(start, encode_entries(ents))
                self._write_seq += 1
            except OSError as exc:
                if is_resource_shortage(exc):  # the bucket stays (firing > 0) until written
                    log.warning("schedule bucket %d: cannot write %d fired entries (%s); "
                                "written once space (or a descriptor) is back", start,
                                len(ents), exc)
                    self._unsettled.append(
                        (tid, q, [(off, due, start) for _k, due, _t, _q, off, _s in ents], kind))
                    continue
                log.error("schedule bucket %d: cannot write %d fired entries (%s); they fire "
                          "again after a restart", start, len(ents), exc)
            b = self._buckets.get(start)
            if b is not None:
                b.firing -= len(ents)

    # -- maintenance -----------------------------------------------------------------------------

    def _tick(self) -> None:
        if self._closed:
            return
        assert self._loop is not None
        try:
            self._maintain()
        except Exception:
            log.exception("scheduler maintenance failed")
        self._tick_handle = self._loop.call_later(MAINTENANCE_INTERVAL_S, self._tick)

    def _load_near(self, now: float) -> None:
        """Load the buckets on disk whose start came within the look-ahead."""
        horizon = now + self._lookahead
        far = self._far
        while far and far[0] <= horizon:
            start = heapq.heappop(far)
            b = self._buckets.get(start)
            if b is not None and b.entries is None:
                self._load_bucket(b)

    def _retry_after_full(self) -> None:
        """Once space is back: index what a full disk left unindexed (from the log), append
        the copies it held back and write the fired entries it kept from being written."""
        if not self.flusher.space_back or self in self.flusher.full:
            return
        refire, self._refire = self._refire, []
        for i, (qs, records, items) in enumerate(refire):
            if qs.log.closed:
                continue
            if qs in self.flusher.full:
                self._refire.append((qs, records, items))
                continue
            self._append_copies(qs, records, items)
            if self._refire and self._refire[-1][2] is items:  # still full: keep the rest
                self._refire.extend(refire[i + 1:])
                break
        unsettled, self._unsettled = self._unsettled, []
        for tid, q, items, kind in unsettled:
            self._settle(tid, q, items, kind)
        for key, off in list(self._hold.items()):
            topic = self.topics.by_id.get(key[0])
            if topic is None or key[1] >= len(topic.queues):
                del self._hold[key]
                continue
            qs = topic.queues[key[1]]
            known: set[tuple[int, int, int, int]] = set()
            for start in self._buckets:
                for kind, due, tid, q, o, _skew in self.store.read(start).entries:
                    if kind == SCHEDULED and (tid, q) == key and o >= off:
                        known.add((tid, q, o, due))
            try:
                n, _nbytes = self._rescan(qs, max(off, qs.log.start_offset), known)
            except OSError as exc:
                log.warning("%s: still cannot index its scheduled messages: %s", qs, exc)
                return
            del self._hold[key]
            log.warning("%s: %d scheduled messages indexed after the disk was full", qs, n)

    def _maintain(self) -> None:
        if self._refire or self._unsettled or self._hold:
            self._retry_after_full()
        now = self.now_ms()
        self._load_near(now)
        width = self._width
        for start, b in list(self._buckets.items()):
            if (b.entries is not None and start + width <= now and b.pending <= 0
                    and b.firing <= 0 and not b.entries and self._covered(b)):
                del self._buckets[start]
                self.store.delete(start)
        marks = self._watermarks()
        meta = self._clock_meta()
        offset = meta[0] - meta[1]
        clock_moved = (abs(offset - self._offset_saved) > CLOCK_SAVE_MS
                       or meta[2:] != self._skew_saved)
        if clock_moved:
            if abs(offset - self._offset_saved) > JUMP_LOG_MS:
                log.warning("scheduler: the wall clock jumped by %+d ms; delays keep counting in "
                            "monotonic time", self._offset_saved - offset)
            self._offset_saved = offset
            self._skew_saved = meta[2:]
        if clock_moved or marks != self._wm_written or self.store.has_unsynced:
            self._clock_pending = meta
            self._wm_pending = marks  # a new dict: the flusher writes the checkpoint
            self.flusher.mark_dirty(self)
        self._arm()

    def _covered(self, b: _Bucket) -> bool:
        """Whether the durable watermarks are past every original indexed in ``b`` (else a
        crash after deleting it would index them again from the log and fire them twice)."""
        durable = self._wm_durable
        by_id = self.topics.by_id
        for key, off in b.maxoff.items():
            mark = durable.get(key)
            if mark is None:
                if key[0] in by_id:
                    return False  # a topic newer than the last checkpoint
                continue  # the topic was deleted
            if off >= mark:
                return False
        return True

    # -- cancel, lookups, statistics ----------------------------------------------------------------

    def _original_due(self, tid: int, q: int, off: int) -> tuple[QueueState, int]:
        """The queue and due time of the scheduled original at a position.

        Raises:
            NotScheduledError: no such message, or not a scheduled one.
        """
        topic = self.topics.by_id.get(tid)
        if topic is None or q >= len(topic.queues):
            raise NotScheduledError(f"no topic with id {tid} and queue {q}: not scheduled")
        qs = topic.queues[q]
        try:
            data, _p, h, positions = self._read_batch(qs, off)
            if not h.attributes & ATTR_SCHEDULED:
                raise NotScheduledError(f"{qs}@{off} is not a scheduled message")
            rp = positions[off - h.base_offset]
            k1, p1 = record_fields(data, rp)[3:5]
            due = parse_due(decode_properties(data[k1:p1]) if p1 > k1 else {})
        except NotScheduledError:
            raise
        except (BrokerError, LogClosedError) as exc:
            raise NotScheduledError(f"{qs}@{off}: {exc}") from None
        return qs, due.at(h.append_time_ms)

    def _find(self, pos: Position, due: int) -> tuple[_Bucket | None, int]:
        """The bucket whose file holds the scheduled entry, and its state there: 0 pending, 1
        fired (or firing), 2 cancelled, -1 not found.

        The entry is in the bucket of its fire time ``due + skew``; the skew is one of those
        written (``_skew_lo`` .. ``_skew_hi``, a single bucket unless the wall clock jumped) or
        it went to a later bucket, which is loaded (it was due already when indexed; then only
        its pending state is found)."""
        for b in self._buckets.values():
            if b.entries is not None and pos in b.entries:
                return b, 0
        width = self._width
        first = self._bucket_start(due + min(self._skew_lo, 0))
        last = self._bucket_start(due + max(self._skew_hi, 0))
        home = self._bucket_start(due)
        starts = sorted((s for s in self._buckets if first <= s <= last),
                        key=lambda s: abs(s - home) // width)
        for s in starts:
            b = self._buckets[s]
            state = -1
            for kind, d, tid, q, off, _skew in self.store.read(s).entries:
                if (tid, q, off) != pos or d != due:
                    continue
                state = 0 if kind == SCHEDULED else 1 if kind == FIRED else 2
            if state >= 0:
                if state == 0 and b.entries is not None:
                    state = 1  # loaded, not pending: fired, its entry not yet written
                return b, state
        return None, -1

    def cancel(self, msg_id: str) -> int:
        """Cancel a scheduled message that is not yet due; returns the write sequence to wait
        for (:meth:`when_durable`) before answering in sync mode.

        Raises:
            InvalidRequestError: not a message id.
            NotScheduledError: not a pending scheduled message.
        """
        try:
            tid, q, off = decode_msg_id(msg_id)
        except ValueError:
            raise InvalidRequestError(f"not a message id: {msg_id[:64]!r}") from None
        qs, due = self._original_due(tid, q, off)
        pos = (tid, q, off)
        b, state = self._find(pos, due)
        if b is None or state != 0:
            what = {1: "already due (delivered or being delivered)",
                    2: "already cancelled"}.get(state, "not scheduled")
            raise NotScheduledError(f"message {msg_id} is {what}")
        self.store.append(b.start, encode_entries([(CANCELLED, due, tid, q, off, 0)]))
        self._write_seq += 1
        if b.entries is not None:
            del b.entries[pos]  # its heap item is skipped when popped
            b.remove(tid, q)
        else:
            pending = pending_entries(self.store.read(b.start).entries)
            b.rebuild(pending)
        self._topic_pending[tid] = self._topic_pending.get(tid, 0) - 1
        self.cancelled += 1
        log.info("cancelled scheduled message %s (%s, due %d)", msg_id, qs, due)
        return self._write_seq

    def lookup(self, topic_id: int, queue: int, offset: int) -> tuple[str, int]:
        """The scheduling state of the message at a position: ``(state, due ms)`` with state
        ``PENDING``, ``FIRED`` (its copy was appended), ``CANCELLED``, ``DONE`` (fired or
        cancelled; its bucket was cleaned up) or ``NOT_SCHEDULED`` (due -1)."""
        try:
            _qs, due = self._original_due(topic_id, queue, offset)
        except NotScheduledError:
            return NOT_SCHEDULED, -1
        b, state = self._find((topic_id, queue, offset), due)
        if b is None:
            return DONE, due
        return (PENDING, FIRED_STATE, CANCELLED_STATE)[state], due

    def topic_stats(self, topic_id: int) -> tuple[int, int]:
        """``(pending scheduled messages, earliest due ms or -1)`` of a topic: when the first of
        them fires, in wall-clock ms as the wall clock runs now."""
        n = self._topic_pending.get(topic_id, 0)
        if n <= 0:
            return 0, -1
        for start in sorted(self._buckets):
            b = self._buckets[start]
            if b.entries is not None:
                fires = [f for (t, _q, _o), f in b.entries.items() if t == topic_id]
            else:
                fires = [st[1] for (t, _q), st in b.stats.items() if t == topic_id and st[0] > 0]
            if fires:
                return n, self.to_wall(min(fires))
        return n, -1

    def retention_floors(self) -> dict[tuple[int, int], int]:
        """``(topic id, queue) -> lowest offset of a pending scheduled original`` (a lower
        bound): retention must keep every segment holding offsets at or above it."""
        floors: dict[tuple[int, int], int] = {}
        for b in self._buckets.values():
            for key, st in b.stats.items():
                if st[0] > 0:
                    f = floors.get(key)
                    if f is None or st[2] < f:
                        floors[key] = st[2]
            if b.firing > 0:  # copies not yet fsynced: a crash fires their originals again
                for key in b.maxoff:
                    floors[key] = 0
        return floors

    @property
    def pending(self) -> int:
        """Scheduled messages not yet due (all topics)."""
        return sum(self._topic_pending.values())


def _position(_ctx: None, _buf: bytes, p: int, _off: int) -> int:
    return p


_Cached = tuple[bytes, int, BatchHeader, "array.array[int]"]
"""(bytes read, position of the batch in them, its header, position of each record)."""


class _BatchCache:
    """Originals' batches recently read, checked and walked, least recently used out first,
    at most ``max_bytes`` of them: due messages of one batch are copied without reading and
    checking it again each time."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._lru: OrderedDict[tuple[int, int, int], _Cached] = OrderedDict()
        self._bases: dict[tuple[int, int], list[int]] = {}  # sorted base offsets per queue
        self.bytes = 0

    def get(self, tid: int, q: int, off: int) -> _Cached | None:
        bases = self._bases.get((tid, q))
        if not bases:
            return None
        i = bisect.bisect_right(bases, off) - 1
        if i < 0:
            return None
        key = (tid, q, bases[i])
        c = self._lru[key]
        if c[2].last_offset < off:
            return None
        self._lru.move_to_end(key)
        return c

    def put(self, tid: int, q: int, c: _Cached) -> None:
        key = (tid, q, c[2].base_offset)
        if key in self._lru:
            return
        self._lru[key] = c
        bisect.insort(self._bases.setdefault((tid, q), []), key[2])
        self.bytes += _cost(c)
        while self.bytes > self._max and len(self._lru) > 1:
            (t, qq, base), old = self._lru.popitem(last=False)
            self._bases[(t, qq)].remove(base)
            self.bytes -= _cost(old)


def _cost(c: _Cached) -> int:
    return len(c[0]) + 4 * len(c[3]) + 200

