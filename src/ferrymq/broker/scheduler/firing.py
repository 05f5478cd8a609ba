"""Firing: the timer and the rounds that append the copies of due messages to their queues.

Theory of operation
-------------------
Timer: one ``call_later`` on the earliest due entry, re-armed when an earlier one arrives; due
entries are fired in rounds (all due entries of a queue in one appended batch, at most
:data:`MAX_FIRE_PER_ROUND` per round, rounds at least :data:`ROUND_INTERVAL_S` apart while
messages keep coming due). Never early: an entry fires only when the scheduler's clock is at or
past its fire time.

When a message is due the original is read (:mod:`.originals`), a *copy* (a normal batch:
consumers see it as a new message) is appended to the same queue and, once that copy is
fsynced, a *fired* entry is written for the original (:meth:`Firer.settle`). A crash before
that fires the message again at the next start: twice, never zero times.

A full disk (or no descriptor) keeps a copy from being appended or a fired entry from being
written: both are kept (``refire``, ``unsettled``) and tried again by :meth:`Firer.retry_held`
once space is back; a copy whose fsync failed for lack of space is settled once the queue's
tail was written again.

On a cluster only the queue's leader fires, and a copy counts once it is committed: due entries
of a queue this broker does not lead, and entries whose copy it appended, are *parked*
(:mod:`.parking`) until the queue's committed log holds their mark; an entry whose mark was read
already (the leader fired or cancelled it while it was pending here) is settled when it comes
due. Runs on the event-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ferrymq.broker.descriptors import is_resource_shortage
from ferrymq.broker.flusher import flush_postponed
from ferrymq.broker.scheduler.buckets import BucketIndex, Item
from ferrymq.broker.scheduler.clock import SchedulerClock
from ferrymq.broker.scheduler.originals import Originals
from ferrymq.broker.scheduler.parking import Parking
from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE
from ferrymq.broker.watermarks import is_disk_full
from ferrymq.errors import BrokerError, LogClosedError, NotLeaderError
from ferrymq.protocol.records import RecordInput, encode_batch
from ferrymq.protocol.schedule import CANCELLED_MARK
from ferrymq.storage.schedule import CANCELLED, FIRED

if TYPE_CHECKING:
    from ferrymq._time import Clock
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


class Firer:
    """Fires the due entries of ``index``: the timer, the rounds, the copies. See the module
    docstring."""

    def __init__(
        self, config: BrokerConfig, topics: TopicRegistry, flusher: Flusher, clock: Clock,
        schedule_clock: SchedulerClock, index: BucketIndex, originals: Originals,
        parking: Parking,
    ) -> None:
        self.config = config
        self.topics = topics
        self.flusher = flusher
        self.clock = clock
        self.schedule_clock = schedule_clock
        self.index = index
        self.originals = originals
        self.parking = parking
        self.sync = config.flush == "sync"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0
        self._round_queued = False
        self._last_round = 0.0
        self._closed = False
        self.refire: list[tuple[QueueState, list[RecordInput], list[Item]]] = []
        """Due copies a full disk kept from being appended (tried again by the tick)."""
        self.unsettled: list[tuple[int, int, list[Item], int]] = []
        """Fired/cancelled entries a full disk kept from being written (tid, q, items, kind)."""
        self.fired = 0
        self.dropped = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fire on ``loop`` from now on: entries that came due while the broker was down fire
        at once."""
        self._loop = loop
        self._queue_round()

    def stop(self) -> None:
        """Stop firing (shutdown): cancel the timer."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    # -- the timer -----------------------------------------------------------------------------

    def arm(self) -> None:
        """(Re)arm the timer on the index's next wake-up, if earlier than the one armed."""
        loop = self._loop
        if loop is None or self._closed or self._round_queued:
            return
        due = self.index.next_wake()
        if due is None:
            return
        if self._timer is not None:
            if self._timer_due <= due:
                return
            self._timer.cancel()
        wait_s = max((due - self.schedule_clock.now_ms()) / 1000.0, 0.0)
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

    # -- a round -------------------------------------------------------------------------------

    def _fire(self) -> None:
        """Copy every entry that is due (at most MAX_FIRE_PER_ROUND), queue by queue."""
        if self._closed:
            return
        assert self._loop is not None
        now = self.schedule_clock.now_ms()
        index = self.index
        index.load_near(now)
        groups = index.pop_due(now, MAX_FIRE_PER_ROUND)
        self._last_round = self._loop.time()
        for (tid, q), items in groups.items():
            self._fire_queue(tid, q, items)
        if index.more_due(now):
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._queue_round()
        else:
            self.arm()

    def _fire_queue(self, tid: int, q: int, items: list[Item]) -> None:
        topic = self.topics.by_id.get(tid)
        if topic is None or q >= len(topic.queues):
            self.settle(tid, q, items, FIRED)  # the topic was deleted: nothing to deliver
            self.dropped += len(items)
            return
        qs = topic.queues[q]
        if replicated(qs):
            marked, items = self.parking.split_marked((tid, q), items)
            for kind, done in marked:  # its leader fired or cancelled it already
                self.settle_mark(tid, q, done, kind)
            try:
                qs.check_own_write()
            except NotLeaderError:  # its leader fires it; the copy's mark settles it here
                current: list[Item] = []
                cut: list[Item] = []  # cut from the log by a truncation: no mark will come
                for it in items:
                    (current if self.originals.is_current(qs, it) else cut).append(it)
                if cut:
                    self.settle(tid, q, cut, FIRED)
                    self.dropped += len(cut)
                if current:
                    self.parking.park((tid, q), current)
                return
            if not items:
                return
        items.sort()
        records: list[RecordInput] = []
        fired: list[Item] = []
        stale: list[Item] = []
        size = 0
        for item in items:
            rec = self.originals.copy_of(qs, item)
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
            self.settle(tid, q, stale, FIRED)
            self.dropped += len(stale)

    def _append_copies(self, qs: QueueState, records: list[RecordInput], items: list[Item]) -> None:
        tid, q = qs.topic_id, qs.queue
        try:
            batch = encode_batch(records)
        except BrokerError as exc:  # born times more than 24 days apart: one batch per message
            if len(records) == 1:
                log.error("%s@%d: cannot copy a due scheduled message: %s", qs, items[0][0], exc)
                self.settle(tid, q, items, FIRED)
                return
            for rec, item in zip(records, items, strict=True):
                self._append_copies(qs, [rec], [item])
            return
        try:
            qs.check_own_write()
        except NotLeaderError:  # a cluster's queue led elsewhere: its leader fires its copy
            log.debug("%s: not the leader; %d due scheduled messages left to the leader", qs,
                      len(records))
            self.parking.park((tid, q), items)
            return
        if qs in self.flusher.full:  # its tail waits for the rewrite: try again after it
            self.refire.append((qs, records, items))
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
            self.refire.append((qs, records, items))
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
        if replicated(qs):  # settled once committed: a deposed leader's copy is truncated
            self.parking.park((tid, q), items)
            return

        def copied(exc: BaseException | None) -> None:
            if flush_postponed(exc) and qs not in self.flusher.failed:
                qs.wait_durable(res.last_offset + 1, copied)  # durable after the rewrite
                return
            if exc is not None:
                log.error("%s: copies of %d scheduled messages not fsynced (%s); they will be "
                          "delivered again after a restart", qs, len(items), exc)
                return
            self.settle(tid, q, items, FIRED)

        qs.wait_durable(res.last_offset + 1, copied)

    def settle(self, tid: int, q: int, items: list[Item], kind: int) -> None:
        """Write fired (or cancelled) entries for fired items (:meth:`BucketIndex.settle`);
        those a full disk kept from being written are kept for :meth:`retry_held`."""
        unsettled = self.index.settle(tid, q, items, kind)
        if unsettled:
            self.unsettled.append((tid, q, unsettled, kind))

    def settle_mark(self, tid: int, q: int, items: list[Item], mark: int) -> None:
        """Settle entries whose mark (:data:`~ferrymq.protocol.schedule.FIRED_MARK` or
        :data:`~ferrymq.protocol.schedule.CANCELLED_MARK`) the queue's log holds."""
        self.settle(tid, q, items, CANCELLED if mark == CANCELLED_MARK else FIRED)

    def fire_parked(self, qs: QueueState) -> None:
        """This broker now leads ``qs``: fire its parked entries whose mark its log does not
        hold (call after :meth:`Parking.read` to the log end and settling the marked ones)."""
        items = self.parking.unpark((qs.topic_id, qs.queue))
        if items:
            log.info("%s: firing %d due scheduled messages its former leader did not deliver",
                     qs, len(items))
            self._fire_queue(qs.topic_id, qs.queue, items)

    def retry_held(self) -> None:
        """Once space is back: append the copies a full disk held back and write the fired
        entries it kept from being written."""
        refire, self.refire = self.refire, []
        for i, (qs, records, items) in enumerate(refire):
            if qs.log.closed:
                continue
            if qs in self.flusher.full:
                self.refire.append((qs, records, items))
                continue
            self._append_copies(qs, records, items)
            if self.refire and self.refire[-1][2] is items:  # still full: keep the rest
                self.refire.extend(refire[i + 1:])
                break
        unsettled, self.unsettled = self.unsettled, []
        for tid, q, items, kind in unsettled:
            self.settle(tid, q, items, kind)


def replicated(qs: QueueState) -> bool:
    """Whether ``qs`` is a cluster's queue (replicated: only its leader fires, copies settle
    by their mark)."""
    return qs.replica is not None or qs.topic_id >= CLUSTER_TOPIC_ID_BASE
