"""Recovery: the scheduler's index rebuilt from the bucket files and the logs above the watermarks.

Theory of operation
-------------------
The bucket files are derived data. Entries are written with ``write(2)`` right after the
original's append (they survive ``kill -9``) and fsynced by the flusher. Each queue has a
watermark (checkpointed about once a second, after the bucket files it covers were fsynced):
every scheduled batch below it is indexed. On start the scheduler reads every bucket file
(counters; near buckets into memory, :meth:`~ferrymq.broker.scheduler.buckets.BucketIndex.load`),
then rescans each queue's log from its watermark and indexes the scheduled batches a crash left
unindexed (deduplicated by position and due time). Entries due while the broker was down fire
right after start.

A queue whose entries could not be written (a full disk) has its watermark held at the first of
them; once space is back :func:`reindex_held` indexes them from the log the same way. Runs on the
event-loop thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ferrymq.broker.scheduler.buckets import BucketIndex, Known
from ferrymq.broker.scheduler.clock import SchedulerClock
from ferrymq.errors import CorruptRecordError, InvalidRequestError, OffsetOutOfRangeError
from ferrymq.protocol.records import ATTR_SCHEDULED, check_stored_batch, iter_batches
from ferrymq.protocol.schedule import read_due_times

if TYPE_CHECKING:
    from ferrymq.broker.topics import QueueState, TopicRegistry

log = logging.getLogger("ferrymq.broker")

RESCAN_READ_BYTES = 1 << 20
"""Log bytes read per step when rescanning a queue for unindexed scheduled batches."""

Register = Callable[[int, int, list[tuple[int, int]]], None]
"""Index ``(offset, due ms)`` items found in queue ``(topic id, queue)`` (entries written now)."""


def recover(index: BucketIndex, clock: SchedulerClock,
            watermarks: dict[tuple[int, int], int] | None, queues: Iterable[QueueState],
            register: Register) -> None:
    """Load the bucket files into ``index``, then index what the logs of ``queues`` hold above
    the ``watermarks`` (None: the checkpoint is missing, every log is rescanned)."""
    now = clock.now_ms()
    marks = watermarks or {}
    known, total, corrupt = index.load(marks, now, clock.note_skew)
    rescanned = 0
    scanned_bytes = 0
    for qs in queues:
        lg = qs.log
        key = (qs.topic_id, qs.queue)
        pos = max(marks.get(key, lg.start_offset), lg.start_offset)
        if pos >= lg.end_offset:
            continue
        n, nbytes = rescan(qs, pos, known, register)
        rescanned += n
        scanned_bytes += nbytes
    if total or rescanned or corrupt:
        log.info("scheduler: %d scheduled messages pending in %d buckets (%d indexed again "
                 "from %.1f MB of log%s)", total + rescanned, len(index.buckets), rescanned,
                 scanned_bytes / 1e6, f", {corrupt} corrupt entries" if corrupt else "")


def rescan(qs: QueueState, pos: int, known: Known, register: Register) -> tuple[int, int]:
    """Index the scheduled batches of ``qs`` from offset ``pos`` whose entries are not in
    ``known``: ``(messages indexed, log bytes read)``.

    Raises:
        OSError: an entry could not be written.
    """
    lg = qs.log
    end = lg.end_offset
    tid, q = qs.topic_id, qs.queue
    found = 0
    nbytes = 0
    while pos < end:
        try:
            data = lg.read(pos, RESCAN_READ_BYTES, stored=True)  # envelopes: never theirs
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
                    register(tid, q, items)
                    found += len(items)
            pos = max(pos, h.last_offset + 1)
        if pos == before:
            break
    return found, nbytes


def reindex_held(hold: dict[tuple[int, int], int], topics: TopicRegistry, index: BucketIndex,
                 register: Register) -> None:
    """Index from the log what a full disk left unindexed: ``hold`` maps a queue to the
    first offset whose entries could not be written; a queue done (or gone) leaves it."""
    for key, off in list(hold.items()):
        topic = topics.by_id.get(key[0])
        if topic is None or key[1] >= len(topic.queues):
            del hold[key]
            continue
        qs = topic.queues[key[1]]
        known = index.indexed(key, off)
        try:
            n, _nbytes = rescan(qs, max(off, qs.log.start_offset), known, register)
        except OSError as exc:
            log.warning("%s: still cannot index its scheduled messages: %s", qs, exc)
            return
        del hold[key]
        log.warning("%s: %d scheduled messages indexed after the disk was full", qs, n)
