"""A delivery group's journal and snapshots as records of its replicated retry queue (a cluster).

Theory of operation
-------------------
On a single broker a group keeps its state in files (:class:`~.store.GroupStore`). In a
cluster that state must outlive the broker, so it lives where the group's retry letters already
are: the group's retry queue ``%RETRY%<group>``, a cluster topic of one queue replicated like
any other. The group's coordinator is that queue's leader (:mod:`ferrymq.broker.cluster_delivery`),
so letters and state are one log with one writer, fenced by the queue's leader epoch, and a
failover truncates both at the same point: the state a new coordinator rebuilds never refers to
a letter it does not have.

Each change is one batch of one record, producer id
:data:`~ferrymq.protocol.letters.STATE_PRODUCER_ID` (readers of letters skip such batches by
their header), tag :data:`~ferrymq.protocol.letters.STATE_TAG`, body msgpack::

    {"j": gen, "r": record}      a journal record (the same records as the file journal)
    {"s": gen, "snap": {...}}     a snapshot: the records before it are folded into it
    {"x": 1}                      the group was deleted

A position is an offset of the queue, and a position is *durable* once the queue's high
watermark covers it: every in-sync replica has it (the ``acks="all"`` rule), so an answer that
waited for it survives the loss of the coordinator. :func:`read_state` replays the queue for a
new coordinator: the last snapshot and the records after it. A snapshot is written when the
records since the last one pass ``delivery_journal_bytes`` and at least every
:data:`SNAPSHOT_EVERY_MS`, so time retention of the retry queue never deletes the newest one
while it matters.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack

from ferrymq.errors import BrokerError, CorruptRecordError, NotCoordinatorError, NotLeaderError
from ferrymq.protocol.letters import STATE_PRODUCER_ID, STATE_TAG
from ferrymq.protocol.records import (
    RecordInput,
    encode_batch,
    iter_batches,
    iter_raw_records,
)

if TYPE_CHECKING:
    from ferrymq._time import Clock
    from ferrymq.broker.delivery.store import Callback
    from ferrymq.broker.flusher import Flusher
    from ferrymq.broker.topics import QueueState

log = logging.getLogger("ferrymq.broker")

READ_BYTES = 1 << 20
"""Bytes read at a time when a new coordinator replays a retry queue."""
SNAPSHOT_EVERY_MS = 3_600_000
"""Longest time between two snapshots of a group that changes (one hour: far below any
retention a retry queue may have, so the newest snapshot is never deleted by it)."""


def state_batch(body: dict[str, Any], now_ms: int) -> bytearray:
    """One state record as a batch of the retry queue."""
    return encode_batch([RecordInput(bytes(msgpack.packb(body, use_bin_type=True)), now_ms,
                                     STATE_TAG)], producer_id=STATE_PRODUCER_ID)


class GroupLog(NamedTuple):
    """What the state records of a retry queue add up to (:func:`read_state`)."""

    snapshot: dict[str, Any] | None
    records: list[Any]
    """The journal records after the snapshot."""
    gen: int
    size: int
    """Bytes of state records since the snapshot."""
    found: bool
    """Whether a group lives there (a state record after the last delete)."""
    deleted: bool
    """Whether the last state record is a delete."""


def read_state(qs: QueueState) -> GroupLog:
    """Replay the state records of retry queue ``qs`` up to its end. A delete resets
    everything before it."""
    snap: dict[str, Any] | None = None
    records: list[Any] = []
    gen = 0
    size = 0
    found = deleted = False
    lg = qs.log
    pos = lg.start_offset
    while pos < lg.end_offset:
        try:
            data = lg.read(pos, READ_BYTES)
        except BrokerError as exc:
            log.error("%s: cannot read offset %d: %s", qs, pos, exc)
            break
        if not data:
            break
        mv = memoryview(data)
        before = pos
        for p0, h in iter_batches(mv):
            if h.last_offset < pos:
                continue
            pos = h.last_offset + 1
            if h.producer_id != STATE_PRODUCER_ID:
                continue
            try:
                for rec in iter_raw_records(mv, p0, h):
                    d = msgpack.unpackb(mv[rec[6]:rec[7]], raw=False, strict_map_key=False)
                    size += h.batch_length
                    if "x" in d:
                        snap, records, size, found, deleted = None, [], 0, False, True
                        continue
                    if "r" in d:
                        records.append(d["r"])
                    elif "snap" in d:
                        snap, records, gen, size = d["snap"], [], int(d["s"]), 0
                    found, deleted = True, False
            except (CorruptRecordError, ValueError, TypeError, KeyError) as exc:
                log.error("%s: unreadable state record at %d: %s; skipped", qs, h.base_offset,
                          exc)
        if pos == before:
            break
    return GroupLog(snap, records, gen, size, found, deleted)


class LogGroupStore:
    """A group's journal in its replicated retry queue (see the module docstring)."""

    snapshot_on_close = False  # every record is already in the replicated log

    def __init__(self, group: str, qs: QueueState, flusher: Flusher, clock: Clock, *,
                 gen: int = 0, size: int = 0) -> None:
        self.group = group
        self.qs = qs
        self.flusher = flusher
        self.clock = clock
        self.gen = gen
        self._size = size
        self._end = qs.log.end_offset
        self._last_snapshot_ms = clock.monotonic() * 1000
        self._waiting = 0
        self.failed: BaseException | None = None
        self.deferred: list[tuple[list[Any], Callback | None]] = []

    @property
    def flushable(self) -> QueueState:
        """The retry queue: the flusher fsyncs its log."""
        return self.qs

    @property
    def size(self) -> int:
        """Record bytes since the last snapshot; reported as huge, so that compaction writes a
        new snapshot, once the last one is older than :data:`SNAPSHOT_EVERY_MS` and anything
        came after it in the queue (a record, a letter, a scheduled letter's copy: what may
        roll the snapshot's segment towards retention)."""
        if (self._size or self.qs.log.end_offset > self._end) \
                and self.clock.monotonic() * 1000 - self._last_snapshot_ms > SNAPSHOT_EVERY_MS:
            return 1 << 62
        return self._size

    def position(self) -> int:
        """The end of the last record written."""
        return self._end

    def busy(self) -> bool:
        """Whether an answer waits for replication."""
        return self._waiting > 0

    def hold(self) -> None:
        """Nothing to hold: the queue's log keeps its own descriptor."""

    def release(self) -> None:
        """See :meth:`hold`."""

    def append(self, record: list[Any]) -> int:
        """Append one journal record to the retry queue; the offset after it.

        Raises:
            NotCoordinatorError: this broker no longer leads the queue.
            OSError: the log cannot take it (nothing written).
        """
        return self._write({"j": self.gen, "r": record})

    def _write(self, body: dict[str, Any]) -> int:
        qs = self.qs
        try:
            qs.check_own_write()
        except NotLeaderError as exc:
            raise NotCoordinatorError(f"delivery group {self.group!r}: {exc.message}") from None
        now = self.clock.wall_ms()
        batch = state_batch(body, now)
        res = qs.log.append(batch, now_ms=now)
        self.flusher.mark_dirty(qs)
        qs.advance(qs.log.end_offset)
        self._size += len(batch)
        self._end = res.last_offset + 1
        return self._end

    def when_durable(self, pos: int, cb: Callback, *, sync: bool) -> None:
        """Run ``cb`` once the queue's high watermark covers ``pos`` (whatever the flush mode:
        see the module docstring); NOT_COORDINATOR when the queue's leadership moved first."""
        rep = self.qs.replica
        if rep is None:
            cb(NotCoordinatorError(f"{self.qs} has no replica role here"))
            return
        self._waiting += 1

        def done(exc: BaseException | None) -> None:
            self._waiting -= 1
            if isinstance(exc, NotLeaderError):
                exc = NotCoordinatorError(f"delivery group {self.group!r}: {exc.message}")
            cb(exc)

        rep.wait_acks(pos, 0, done)

    def rotate(self, snapshot: dict[str, Any]) -> None:
        """Append ``snapshot`` as a new generation: what a new coordinator replays starts there.

        Raises:
            NotCoordinatorError, OSError: see :meth:`append`.
        """
        self._write({"s": self.gen + 1, "snap": snapshot})
        self.gen += 1
        self._size = 0
        self._last_snapshot_ms = self.clock.monotonic() * 1000

    def tombstone(self) -> None:
        """Record that the group was deleted (a new coordinator then does not load it). Best
        effort: when it cannot be written the cluster's delete of the retry topic still ends
        the group."""
        try:
            self._write({"x": 1})
        except (BrokerError, OSError) as exc:
            log.warning("delivery group %s: delete not recorded in %s: %s", self.group, self.qs,
                        exc)

    def close(self) -> None:
        """Nothing to close (the queue's log is the topic registry's)."""

    def __str__(self) -> str:
        return f"state of delivery group {self.group} in {self.qs}"
