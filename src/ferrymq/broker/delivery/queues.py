"""A delivery group's queues (its source queues, retry queue and dead-letter queue) and reading
records from them by offset.

A group's retry queue ``%RETRY%<group>`` and dead-letter queue ``%DLQ%<group>`` are internal
topics of one queue each, created on first use. Reads here are for the few records a group
needs by offset (heads of orderly keys, retry letters, a message whose status is asked, one to
move); RECEIVE's sequential scans are in :mod:`.receiving`. Batches that delivery leaves out
(scheduled originals, transaction markers, aborted data) are told by :func:`skipped`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from typing import TYPE_CHECKING

from ferrymq.broker.delivery.context import DeliveryContext
from ferrymq.broker.delivery.group import DeliveryGroup
from ferrymq.broker.delivery.letters import StoredRecord, iter_stored, stored_record
from ferrymq.broker.delivery.orderly import OrderlyCursor
from ferrymq.errors import (
    BrokerError,
    BusyError,
    InvalidOffsetError,
    InvalidRequestError,
    UnknownTopicError,
)
from ferrymq.protocol.letters import Letter
from ferrymq.protocol.markers import ReadCommittedFilter
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    BatchHeader,
    RawRecord,
    decode_msg_id,
    filter_batch,
    iter_batches,
    iter_raw_records,
)
from ferrymq.protocol.schedule import SCHEDULED_ID

if TYPE_CHECKING:
    from ferrymq.broker.delivery.sources import SourceLog, SourceQueue
    from ferrymq.broker.topics import QueueState

ORDERLY_READ_GAP = 4096
"""Orderly RECEIVE reads ready heads closer than this many offsets in one sequential pass."""

REMOTE_PENDING_KEY = "\x00pending"
"""The key an orderly group's pending offsets of a queue read from its leader get after a
load (their own keys cannot be read then); a NUL-prefixed name no producer is expected to use."""
SKIP_BITS = ATTR_SCHEDULED | ATTR_TRANSACTIONAL | ATTR_CONTROL
"""Batch attributes of which one must be set for :func:`skipped` to leave a batch out."""


def txn_filter(lg: SourceLog, start: int, end: int) -> ReadCommittedFilter | None:
    """The read_committed filter for a read of ``[start, end)`` (None: no aborted data)."""
    aborted = lg.aborted_txns(start, end)
    return ReadCommittedFilter(aborted) if aborted else None


def skipped(h: BatchHeader, txf: ReadCommittedFilter | None) -> bool:
    """Whether delivery leaves this batch out: a scheduled original (its copy comes when due),
    a transaction marker, or data of an aborted transaction. Call in offset order."""
    if h.attributes & ATTR_SCHEDULED:
        return True
    if txf is not None:
        return not txf.keep(h.producer_id, h.base_offset, h.attributes)
    return bool(h.attributes & ATTR_CONTROL)


def batches_between(
    lg: SourceLog, first: int, last: int, chunk_filter: Callable[[bytes], bool] | None = None,
) -> Iterator[tuple[memoryview, int, BatchHeader, list[RawRecord]]]:
    """Each stored batch holding offsets ``first..last`` with its records in that range, read
    sequentially (1 MiB at a time; stops early at a gap it cannot read past). With
    ``chunk_filter``, the batches of a chunk read are skipped unless it returns True for it.

    Raises:
        CorruptRecordError: a batch's records do not add up.
    """
    pos = max(first, lg.start_offset)
    while pos <= last:
        try:
            data = lg.read(pos, 1 << 20)
        except BrokerError:
            return
        if not data:
            return
        before = pos
        wanted = chunk_filter is None or chunk_filter(data)
        mv = memoryview(data)
        for p0, h in iter_batches(mv):
            if wanted and h.last_offset >= pos:
                yield mv, p0, h, [r for r in iter_raw_records(mv, p0, h) if pos <= r[0] <= last]
            pos = max(pos, h.last_offset + 1)
            if pos > last:
                return
        if pos == before:
            return


class GroupQueues:
    """The queues of the broker's delivery groups (see the module docstring)."""

    def __init__(self, ctx: DeliveryContext) -> None:
        self.ctx = ctx
        self.topics = ctx.topics

    def internal_queue(self, name: str, *, create: bool) -> QueueState | None:
        """The one queue of internal topic ``name`` (created with ``create``), or None."""
        t = self.topics.topics.get(name)
        if t is None:
            if not create:
                return None
            t = self.ctx.create_internal(name)
        return t.queues[0]

    def source(self, g: DeliveryGroup, qs: QueueState) -> SourceQueue | None:
        """What ``g`` reads of its source queue ``qs``: ``qs`` itself, or on a cluster, when
        this broker holds no replica of it, the queue read from its leader (None: not readable
        yet; see :mod:`.sources`)."""
        hook = self.ctx.remote_source
        return qs if hook is None else hook(g, qs)

    def retry_queue(self, g: DeliveryGroup) -> QueueState:
        """The group's retry queue, created on first use."""
        qs = self.internal_queue(g.retry_topic, create=False)
        if qs is None:
            qs = self.internal_queue(g.retry_topic, create=True)
            assert qs is not None
            g.wake()  # long polls that started before it existed wait on it from now on
        return qs

    def read_record(
        self, g: DeliveryGroup, key: tuple[str, int], offset: int
    ) -> StoredRecord | None:
        """The record at ``offset`` of the group's queue ``key`` (None: not stored).

        Raises:
            BusyError: a queue read from its leader has not fetched it yet (retry).
        """
        try:
            qs: SourceQueue | None
            if key[0] == g.retry_topic:
                qs = self.internal_queue(key[0], create=False)
            else:
                qs = self.source(g, self.topics.queue(*key))
                if qs is None:
                    raise BusyError(f"{key[0]}/{key[1]} is not read from its leader yet",
                                    retry_after_ms=self.ctx.config.busy_retry_after_ms)
            if qs is None:
                return None
            data = qs.log.read(offset, 1)
        except BusyError:
            raise
        except BrokerError:
            return None
        for r in iter_stored(data, offset):
            return r if r.offset == offset else None
        return None

    def read_records(self, lg: SourceLog, offsets: list[int]) -> dict[int, StoredRecord]:
        """The records at ``offsets`` (rising), near ones read in one pass."""
        out: dict[int, StoredRecord] = {}
        want = set(offsets)
        i = 0
        while i < len(offsets):
            j = i
            while j + 1 < len(offsets) and offsets[j + 1] - offsets[j] <= ORDERLY_READ_GAP:
                j += 1
            for mv, _p0, _h, recs in batches_between(lg, offsets[i], offsets[j]):
                for rec in recs:
                    if rec[0] in want:
                        out[rec[0]] = stored_record(mv, rec)
            i = j + 1
        return out

    def read_offsets(
        self, lg: SourceLog, offsets: list[int], budget: int, alone: Container[int],
    ) -> list[tuple[list[int], bytes]]:
        """The records at ``offsets`` (rising) as batches, up to ``budget`` bytes: the wanted
        records of one stored batch share one filtered batch, except those in ``alone``, which
        get one each. Near offsets are read in one pass (clusters split at gaps of
        ORDERLY_READ_GAP offsets), so a thousand heads cost a few reads, not a thousand."""
        out: list[tuple[list[int], bytes]] = []
        want = set(offsets)
        used = 0
        i = 0
        while i < len(offsets) and used < budget:
            j = i
            while j + 1 < len(offsets) and offsets[j + 1] - offsets[j] <= ORDERLY_READ_GAP:
                j += 1
            first, last = offsets[i], offsets[j]
            i = j + 1
            for mv, p0, h, recs in batches_between(lg, first, last):
                keep = [r for r in recs if r[0] in want]
                shared = [r for r in keep if r[0] not in alone]
                if shared:
                    b = filter_batch(mv, p0, h, shared)
                    out.append(([r[0] for r in shared], b))
                    used += len(b)
                for r in keep:
                    if r[0] in alone:
                        b = filter_batch(mv, p0, h, [r])
                        out.append(([r[0]], b))
                        used += len(b)
                if used >= budget:
                    break
        return out

    def pending_keys(self, g: DeliveryGroup, cur: OrderlyCursor) -> dict[int, str | None]:
        """After a restart: the sharding key of each pending offset of ``cur`` (missing: gone).

        A queue read from its leader has nothing buffered yet: its pending offsets keep their
        order behind one key, REMOTE_PENDING_KEY (nothing is dropped; see docs/delivery.md)."""
        out: dict[int, str | None] = {}
        t = self.topics.topics.get(cur.topic)
        if t is None or cur.queue >= len(t.queues) or not cur.pending:
            return out
        want = cur.pending
        qs = t.queues[cur.queue]
        if self.source(g, qs) is not qs:
            return dict.fromkeys(want, REMOTE_PENDING_KEY)
        for mv, _p0, _h, recs in batches_between(qs.log, min(want), max(want)):
            for rec in recs:
                if rec[0] in want:
                    t1, s1 = rec[3], rec[4]
                    out[rec[0]] = str(mv[t1:s1], "utf-8", "replace") if s1 > t1 else ""
        return out

    def held_until(self, record: StoredRecord, letter: Letter, wall: int) -> int | None:
        """A visible letter written by an older broker (before retries were scheduled) with a
        due time still ahead: the monotonic time it may go. None for anything else (copies of
        scheduled letters carry ``%SCHEDULED_ID`` and are due by definition)."""
        if SCHEDULED_ID in record.properties or letter.due_wall <= wall:
            return None
        return self.ctx.to_mono(letter.due_wall)

    def locate(self, msg_id: str) -> tuple[str, int, int]:
        """(topic, queue, offset) of a message id.

        Raises:
            InvalidRequestError: not a message id.
            UnknownTopicError: no topic has its topic id.
        """
        try:
            topic_id, queue, offset = decode_msg_id(msg_id)
        except ValueError:
            raise InvalidRequestError(f"not a message id: {msg_id[:64]!r}") from None
        t = self.topics.by_id.get(topic_id)
        if t is None:
            raise UnknownTopicError(f"no topic has id {topic_id} (message {msg_id})")
        return t.name, queue, offset

    def dlq_size(self, g: DeliveryGroup) -> int:
        """Dead letters not redriven or purged (one per offset of the dead-letter queue, less
        the letters above the floor redriven or purged one by one)."""
        dlq = self.internal_queue(g.dlq_topic, create=False)
        if dlq is None:
            return 0
        first = max(g.dlq_floor, dlq.log.start_offset)
        done = sum(1 for o in g.dlq_done if o >= first) if g.dlq_done else 0
        return max(0, dlq.log.end_offset - first - done)

    def dlq_records(
        self, g: DeliveryGroup, limit: int
    ) -> tuple[int, int, list[StoredRecord]]:
        """Dead letters from the DLQ floor: ``(first, end, up to limit records)``; letters
        redriven or purged one by one (``g.dlq_done``) are left out."""
        qs = self.internal_queue(g.dlq_topic, create=False)
        if qs is None:
            return g.dlq_floor, g.dlq_floor, []
        lg = qs.log
        first = max(g.dlq_floor, lg.start_offset)
        end = lg.end_offset
        out: list[StoredRecord] = []
        pos = first
        while pos < end and len(out) < limit:
            data = lg.read(pos, 1 << 20)
            if not data:
                break
            before = pos
            for r in iter_stored(data, pos):
                if len(out) >= limit:
                    break
                pos = r.offset + 1
                if r.offset not in g.dlq_done:
                    out.append(r)
            if pos == before:  # nothing readable in this chunk
                break
        return first, end, out

    def dlq_record(self, g: DeliveryGroup, offset: int) -> StoredRecord:
        """The live dead letter at ``offset`` of the group's dead-letter queue.

        Raises:
            InvalidOffsetError: no dead letter is there now: below the floor (redriven, purged
                or deleted by retention), redriven or purged one by one, beyond the end, or
                not a record.
        """
        qs = self.internal_queue(g.dlq_topic, create=False)
        start, end = (qs.log.start_offset, qs.log.end_offset) if qs is not None else (0, 0)
        first = max(g.dlq_floor, start)
        what = ""
        if offset < first:
            what = (f"below the oldest dead letter ({first}): redriven or purged already"
                    if offset >= start else f"deleted by retention (the queue starts at {start})")
        elif offset >= end:
            what = f"beyond the end of the dead-letter queue ({end})"
        elif offset in g.dlq_done:
            what = "redriven or purged already"
        if not what and qs is not None:
            for r in iter_stored(qs.log.read(offset, 1 << 20), offset):
                if r.offset == offset:
                    return r
                break
            what = "not a readable record"
        raise InvalidOffsetError(
            f"no dead letter of delivery group {g.name!r} at offset {offset}: {what}; nothing "
            "was changed")
