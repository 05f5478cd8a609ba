"""The Scheduler the broker and its handlers call: indexing appends, cancels, maintenance, flushes.

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

The parts, each in its module of this package:

- :mod:`.clock`: the scheduler's clock ``S`` (monotonic from an anchor: a delay is measured in
  monotonic time) and the *skew* that maps an entry's due time to it;
- :mod:`.buckets`: the buckets in memory (near ones loaded, far ones counted) over the bucket
  files: pure transitions, no clock;
- :mod:`.firing`: the timer and the rounds that append the copies of due messages;
- :mod:`.originals`: the originals read back from the log (due time, the copy);
- :mod:`.cancellation`: cancel and the lookup of a message's scheduling state;
- :mod:`.parking`: on a cluster, due entries waiting for their mark (a copy, a cancel record)
  in the queue's committed log;
- :mod:`.recovery`: the index rebuilt at a start from the bucket files and the logs above the
  watermarks (crash safety).

This module holds them together: the watermarks (every scheduled batch below a queue's
watermark is indexed; noted with the clock's reading about once a second by the maintenance
tick and checkpointed by the flusher (:meth:`Scheduler.flush_blocking`) after the bucket files
it covers were fsynced) and the flusher's side.

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

On a cluster every replica indexes a queue's scheduled originals: its leader when producers
append them (:meth:`Scheduler.on_append`), a follower when it copies them
(:meth:`Scheduler.on_replica_append`), so a new leader has them. Only the leader fires, and a
cancel is also stored in the queue as a *cancel record* (:mod:`ferrymq.protocol.schedule`),
answered once committed, so every replica learns it. What a replica's leader did comes back to
it as marks in its log (:mod:`.parking`): the maintenance tick reads the committed tail of every
replicated queue with pending or parked entries; a broker that starts leading a queue
(:meth:`Scheduler.on_lead`) reads the rest up to its log end, settles what is marked and fires
the other due entries at once. ``message cancel`` and ``message status`` of a cluster's
scheduled message are answered by the queue's leader only (NOT_LEADER elsewhere: the client
asks the other brokers).

Everything runs on the event-loop thread except :meth:`Scheduler.flush_blocking` (the flusher
thread: fsync of bucket files, watermark checkpoint).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ferrymq._faults import enospc_point
from ferrymq._time import Clock
from ferrymq.broker.scheduler.buckets import Bucket, BucketIndex
from ferrymq.broker.scheduler.cancellation import (
    CANCELLED_STATE,
    FIRED_STATE,
    NOT_SCHEDULED,
    cancel_entry,
    lookup_state,
)
from ferrymq.broker.scheduler.clock import ClockMeta, SchedulerClock
from ferrymq.broker.scheduler.firing import Firer, replicated
from ferrymq.broker.scheduler.originals import Originals
from ferrymq.broker.scheduler.parking import MARKS_TICK_BYTES, Parking
from ferrymq.broker.scheduler.recovery import recover, reindex_held
from ferrymq.errors import CorruptRecordError, InvalidRequestError, NotScheduledError
from ferrymq.protocol.messages import Acks
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    BatchHeader,
    RecordInput,
    decode_header,
    encode_batch,
    encode_msg_id,
    encode_properties,
)
from ferrymq.protocol.schedule import (
    CANCELLED_MARK,
    Due,
    cancel_properties,
    read_due_times,
)
from ferrymq.storage.schedule import FIRED, ScheduleStore

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.topics import QueueState, TopicRegistry

log = logging.getLogger("ferrymq.broker")

MAINTENANCE_INTERVAL_S = 1.0
"""How often near buckets are loaded, finished ones deleted, watermarks checkpointed and, on a
cluster, the marks of the replicated queues' committed tails read."""
CANCEL_COMMIT_TIMEOUT_MS = 30_000
"""How long a cancel of a cluster's scheduled message waits for its cancel record to be
committed (then NOT_ENOUGH_REPLICAS: the cancel may still stand, as an unanswered send)."""


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
        self.store = ScheduleStore(data_dir / "schedule", handles=topics.handles)
        self.schedule_clock = SchedulerClock(clock)
        self.index = BucketIndex(self.store, config.schedule_bucket_ms,
                                 config.schedule_lookahead_ms)
        self.originals = Originals(topics, config.schedule_cache_bytes)
        self.parking = Parking()
        self.on_cluster = False
        """The broker is part of a cluster (set by its cluster link): the tick reads marks."""
        self.firer = Firer(config, topics, flusher, clock, self.schedule_clock, self.index,
                           self.originals, self.parking)
        self._clock_pending: ClockMeta | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._seq_waiters: deque[tuple[int, Callable[[BaseException | None], None]]] = deque()
        self._hold: dict[tuple[int, int], int] = {}  # queue -> offset whose indexing failed
        self._wm_pending: dict[tuple[int, int], int] | None = None  # to checkpoint next flush
        self._wm_written: dict[tuple[int, int], int] | None = None
        self._wm_durable: dict[tuple[int, int], int] = {}  # last checkpoint that completed
        self.cancelled = 0
        self._closed = False

    def __str__(self) -> str:
        return "scheduler"

    # -- the scheduler's clock -------------------------------------------------------------------

    def now_ms(self) -> float:
        """The scheduler's clock in ms (:meth:`SchedulerClock.now_ms`)."""
        return self.schedule_clock.now_ms()

    def offset_ms(self) -> int:
        """``S - wall``: 0 until the wall clock jumps while the broker runs."""
        return self.schedule_clock.offset_ms()

    def to_wall(self, fire_ms: int) -> int:
        """When (wall-clock ms, as the wall clock runs now) the scheduler's clock reaches
        ``fire_ms``."""
        return self.schedule_clock.to_wall(fire_ms)

    # -- start and stop ----------------------------------------------------------------------------

    def load(self) -> None:
        """Read the bucket files and the watermarks, then index what the logs hold above the
        watermarks (scheduled batches a crash left unindexed). Runs once, before listening."""
        self.schedule_clock.resume(self.store.read_clock())
        recover(self.index, self.schedule_clock, self.store.read_watermarks(),
                self.topics.all_queues(), self._register_found)
        self.store.sync()
        self._checkpoint_now()

    def start(self) -> None:
        """Arm the timer (entries that came due while the broker was down fire at once) and the
        maintenance tick. Call on the event loop after :meth:`load`."""
        self._loop = asyncio.get_running_loop()
        self._tick_handle = self._loop.call_later(MAINTENANCE_INTERVAL_S, self._tick)
        self.firer.start(self._loop)

    def stop(self) -> None:
        """Stop firing (shutdown): cancel the timer and the tick."""
        self._closed = True
        self.firer.stop()
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self._tick_handle = None

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
        meta = self.schedule_clock.meta()
        self.store.write_watermarks(marks, meta)
        self.schedule_clock.saved(meta)
        self._wm_written = self._wm_durable = marks

    # -- the flusher's side (ferrymq.broker.flusher.Flushable) --------------------------------------

    def flush_blocking(self) -> int:
        """fsync the bucket files written so far, then checkpoint the watermarks noted before
        (flusher thread); the write sequence now durable."""
        enospc_point("fsync", "%schedule")
        seq = self.index.write_seq
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
        if not dues:
            return  # only cancel records
        items = [(base_offset + d, due.at(append_time_ms)) for d, due in dues]
        try:
            self._register(qs.topic_id, qs.queue, items,
                           self.schedule_clock.skew(append_time_ms))
        except OSError as exc:
            key = (qs.topic_id, qs.queue)
            self._hold[key] = min(self._hold.get(key, base_offset), base_offset)
            log.error("%s: cannot index scheduled messages at offset %d (%s); they will be "
                      "indexed from the log at the next start", qs, base_offset, exc)

    def on_replica_append(self, qs: QueueState, batch: bytes | memoryview, base_offset: int,
                          append_time_ms: int) -> None:
        """Index a scheduled batch a follower just copied into ``qs`` (the replica manager's
        ``on_scheduled``): its originals, as its leader did (its cancel records are marks,
        read by the maintenance tick)."""
        self.on_append(qs, batch, base_offset, append_time_ms)

    def on_replica_truncated(self, qs: QueueState, end: int) -> None:
        """A follower cut the log of ``qs`` to end at ``end`` (the replica manager's
        ``on_truncated``): marks read above it are gone (its indexed originals there are
        checked against the log when they come due)."""
        self.parking.truncated((qs.topic_id, qs.queue), end)

    def on_lead(self, qs: QueueState) -> None:
        """This broker now leads ``qs`` (a cluster's queue; call once its role is the
        leader's): read the marks its log holds beyond the last tick, settle the parked
        entries they mark and fire the others (they are due)."""
        key = (qs.topic_id, qs.queue)
        floors = [f for f in (self.index.lowest_pending().get(key), self.parking.lowest(key))
                  if f is not None]
        if not floors:
            return
        self.parking.watch(key, min(floors))
        nbytes = self.parking.read(qs, qs.log.end_offset)
        settled = self._settle_marked(key)
        if nbytes or settled:
            log.info("%s: %d due scheduled messages settled by the marks in %d bytes of its "
                     "log", qs, settled, nbytes)
        self.firer.fire_parked(qs)

    def _settle_marked(self, key: tuple[int, int]) -> int:
        n = 0
        for mark, items in self.parking.settle_marked(key):
            self.firer.settle_mark(key[0], key[1], items, mark)
            n += len(items)
        return n

    def _read_marks(self) -> None:
        """The tick's part on a cluster: read the marks of the committed tail of every
        replicated queue with pending or parked entries, settle what they mark."""
        if not self.on_cluster:
            return
        parking = self.parking
        lowest = self.index.lowest_pending()
        keys = set(lowest)
        keys.update(k for k, st in parking.queues.items() if st.parked)
        by_id = self.topics.by_id
        budget = MARKS_TICK_BYTES
        for key in keys:
            topic = by_id.get(key[0])
            if topic is None or key[1] >= len(topic.queues):
                dropped = parking.unpark(key)
                if dropped:  # the topic was deleted: nothing to deliver
                    self.firer.settle(key[0], key[1], dropped, FIRED)
                parking.forget(key)
                continue
            qs = topic.queues[key[1]]
            if not replicated(qs):
                continue
            low = lowest.get(key)
            if low is not None:
                parking.watch(key, low)
            if budget > 0:
                budget -= parking.read(qs, qs.visible_end, budget)
            self._settle_marked(key)
            parking.prune(key, low)

    def _register(self, tid: int, q: int, items: list[tuple[int, int]], skew: int) -> None:
        """Index ``(offset, due ms)`` items of one queue whose entries get ``skew``."""
        self.index.register(tid, q, items, skew, now=self.now_ms())
        self.firer.arm()

    def _register_found(self, tid: int, q: int, items: list[tuple[int, int]]) -> None:
        """Index items a rescan of the log found unindexed."""
        # the best guess: stored while today's offset S - wall held
        self._register(tid, q, items, self.schedule_clock.skew(self.clock.wall_ms()))

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

    def _retry_after_full(self) -> None:
        """Once space is back: index what a full disk left unindexed (from the log), append
        the copies it held back and write the fired entries it kept from being written."""
        if not self.flusher.space_back or self in self.flusher.full:
            return
        self.firer.retry_held()
        reindex_held(self._hold, self.topics, self.index, self._register_found)

    def _maintain(self) -> None:
        if self.firer.refire or self.firer.unsettled or self._hold:
            self._retry_after_full()
        self._read_marks()
        now = self.now_ms()
        self.index.load_near(now)
        self.index.delete_finished(now, self._covered)
        marks = self._watermarks()
        meta = self.schedule_clock.meta()
        clock_moved = self.schedule_clock.moved(meta)
        if clock_moved or marks != self._wm_written or self.store.has_unsynced:
            self._clock_pending = meta
            self._wm_pending = marks  # a new dict: the flusher writes the checkpoint
            self.flusher.mark_dirty(self)
        self.firer.arm()

    def _covered(self, b: Bucket) -> bool:
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

    def cancel(self, msg_id: str) -> tuple[int, QueueState, int | None]:
        """Cancel a scheduled message that is not yet due: the write sequence to wait for
        (:meth:`when_durable`) before answering in sync mode, its queue and, for a cluster's
        queue, the end offset of its cancel record (answer once committed:
        ``qs.replica.wait_acks``; None for a single broker's queue).

        Raises:
            InvalidRequestError: not a message id.
            NotScheduledError: not a pending scheduled message.
            NotLeaderError: a cluster's queue this broker does not lead.
            NotEnoughReplicasError: its queue has fewer in-sync replicas than its min_insync.
        """
        qs, due, end = cancel_entry(self.index, self.originals, self.schedule_clock, msg_id,
                                    self._record_cancel)
        self.cancelled += 1
        log.info("cancelled scheduled message %s (%s, due %d)", msg_id, qs, due)
        return self.index.write_seq, qs, end

    def _record_cancel(self, qs: QueueState, off: int) -> int | None:
        """Append the cancel record of the pending original at ``off`` of a cluster's queue
        ``qs`` (checked first: this broker leads it, enough in-sync replicas, no mark read for
        it); its end offset. A single broker's queue: None, nothing written."""
        if not replicated(qs):
            return None
        msg_id = encode_msg_id(qs.topic_id, qs.queue, off)
        mark = self.parking.mark_of((qs.topic_id, qs.queue), off)
        if mark is not None:
            raise NotScheduledError(f"message {msg_id} is already "
                                    f"{'cancelled' if mark == CANCELLED_MARK else 'due'}")
        qs.check_own_write()
        assert qs.replica is not None  # check_own_write: it leads the queue
        qs.replica.check_produce(Acks.ALL)
        self.flusher.check_writable(qs)
        now = self.clock.wall_ms()
        batch = encode_batch([RecordInput(b"", now, properties=encode_properties(
            cancel_properties(msg_id)))], attributes=ATTR_SCHEDULED)
        res = qs.log.append(batch, now_ms=now)
        self.flusher.mark_dirty(qs)
        if self.config.flush != "sync":
            qs.advance(qs.log.end_offset)
        return res.last_offset + 1

    def lookup(self, topic_id: int, queue: int, offset: int) -> tuple[str, int]:
        """The scheduling state of the message at a position: ``(state, due ms)`` with state
        ``PENDING``, ``FIRED`` (its copy was appended), ``CANCELLED``, ``DONE`` (fired or
        cancelled; its bucket was cleaned up) or ``NOT_SCHEDULED`` (due -1).

        Raises:
            NotLeaderError: a cluster's scheduled message whose queue this broker does not
                lead (its leader knows its state).
        """
        state, due = lookup_state(self.index, self.originals, self.schedule_clock, topic_id,
                                  queue, offset)
        if state == NOT_SCHEDULED:
            return state, due
        qs = self.topics.by_id[topic_id].queues[queue]  # found: lookup_state read it
        if replicated(qs):
            qs.check_own_write()  # NotLeaderError: its leader knows its state
            mark = self.parking.mark_of((topic_id, queue), offset)
            if mark is not None:
                state = CANCELLED_STATE if mark == CANCELLED_MARK else FIRED_STATE
        return state, due

    def topic_stats(self, topic_id: int) -> tuple[int, int]:
        """``(pending scheduled messages, earliest due ms or -1)`` of a topic: when the first of
        them fires, in wall-clock ms as the wall clock runs now."""
        n, fire = self.index.topic_stats(topic_id)
        return n, -1 if fire is None else self.to_wall(fire)

    def retention_floors(self) -> dict[tuple[int, int], int]:
        """``(topic id, queue) -> lowest offset of a pending scheduled original`` (a lower
        bound): retention must keep every segment holding offsets at or above it."""
        return self.index.retention_floors()

    @property
    def pending(self) -> int:
        """Scheduled messages not yet due (all topics)."""
        return self.index.pending

    @property
    def fired(self) -> int:
        """Copies of due messages appended since the start."""
        return self.firer.fired

    @property
    def dropped(self) -> int:
        """Due entries dropped since the start (their original or topic was gone)."""
        return self.firer.dropped
