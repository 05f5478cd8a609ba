"""Scheduled originals read back from their queue's log: their due time, the copy to deliver.

An index entry names its original by position and due time; before a copy is appended (or a
cancel is accepted) the original is read from the log, checked (CRC, ``ATTR_SCHEDULED``, the
same due time) and its record turned into the copy consumers see. Batches read are cached
(:class:`BatchCache`): the originals of one batch usually come due together or close together.
Runs on the event-loop thread.
"""

from __future__ import annotations

import array
import bisect
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from ferrymq.broker.scheduler.buckets import Item
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
    decode_properties,
    encode_msg_id,
    encode_properties,
    iter_batches,
    record_fields,
    record_timestamp_delta,
    walk_records,
)
from ferrymq.protocol.schedule import copy_properties, parse_due

if TYPE_CHECKING:
    from ferrymq.broker.topics import QueueState, TopicRegistry

log = logging.getLogger("ferrymq.broker")


def _position(_ctx: None, _buf: bytes, p: int, _off: int) -> int:
    return p


Cached = tuple[bytes, int, BatchHeader, "array.array[int]"]
"""(bytes read, position of the batch in them, its header, position of each record)."""


class BatchCache:
    """Originals' batches recently read, checked and walked, least recently used out first,
    at most ``max_bytes`` of them: due messages of one batch are copied without reading and
    checking it again each time."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._lru: OrderedDict[tuple[int, int, int], Cached] = OrderedDict()
        self._bases: dict[tuple[int, int], list[int]] = {}  # sorted base offsets per queue
        self.bytes = 0

    def get(self, tid: int, q: int, off: int) -> Cached | None:
        """The cached batch of queue ``(tid, q)`` holding ``off``, if any."""
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

    def put(self, tid: int, q: int, c: Cached) -> None:
        """Cache a batch of queue ``(tid, q)``, dropping the least recently used beyond the
        limit."""
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


def _cost(c: Cached) -> int:
    return len(c[0]) + 4 * len(c[3]) + 200


class Originals:
    """Reads scheduled originals from the queues of ``topics``, through a cache of at most
    ``cache_bytes`` (``schedule_cache_bytes``)."""

    def __init__(self, topics: TopicRegistry, cache_bytes: int) -> None:
        self.topics = topics
        self._cache = BatchCache(cache_bytes)

    def read_batch(self, qs: QueueState, off: int) -> Cached:
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

    def original_due(self, tid: int, q: int, off: int) -> tuple[QueueState, int]:
        """The queue and due time of the scheduled original at a position.

        Raises:
            NotScheduledError: no such message, or not a scheduled one.
        """
        topic = self.topics.by_id.get(tid)
        if topic is None or q >= len(topic.queues):
            raise NotScheduledError(f"no topic with id {tid} and queue {q}: not scheduled")
        qs = topic.queues[q]
        try:
            data, _p, h, positions = self.read_batch(qs, off)
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

    def _original(self, qs: QueueState, item: Item
                  ) -> tuple[bytes, BatchHeader, int, dict[str, str]] | None:
        """The batch, header, record position and properties of the original an entry names;
        None when the entry is stale (the original is gone, or is not the scheduled message the
        entry names: logged)."""
        off, due, _start = item
        try:
            data, _p, h, positions = self.read_batch(qs, off)
            if not h.attributes & ATTR_SCHEDULED:
                raise InvalidRequestError("not a scheduled batch")
            rp = positions[off - h.base_offset]
            k1, p1 = record_fields(data, rp)[3:5]
            props = decode_properties(data[k1:p1]) if p1 > k1 else {}
            if parse_due(props).at(h.append_time_ms) != due:
                raise InvalidRequestError("due time differs")
        except (BrokerError, LogClosedError) as exc:
            log.warning("%s@%d: scheduled entry dropped: %s", qs, off, exc)
            return None
        return data, h, rp, props

    def is_current(self, qs: QueueState, item: Item) -> bool:
        """Whether the entry ``item`` still names a scheduled original of ``qs`` (a follower's
        truncation may have cut it)."""
        return self._original(qs, item) is not None

    def copy_of(self, qs: QueueState, item: Item) -> RecordInput | None:
        """The copy to append for the original at ``item``; None when the entry is stale (the
        original is gone, or is not the scheduled message the entry names)."""
        found = self._original(qs, item)
        if found is None:
            return None
        data, h, rp, props = found
        off, due, _start = item
        t0, t1, s1, k1, p1, rend = record_fields(data, rp)
        return RecordInput(
            data[p1:rend],
            h.first_timestamp + record_timestamp_delta(data, rp),
            data[t0:t1], data[t1:s1], data[s1:k1],
            encode_properties(copy_properties(props, encode_msg_id(qs.topic_id, qs.queue, off),
                                              due)),
        )
