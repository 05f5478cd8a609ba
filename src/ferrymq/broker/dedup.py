"""Per-topic dedup windows (NATS JetStream's ``duplicate_window`` and ``Nats-Msg-Id``).

Theory of operation
-------------------
A topic with ``dedup_window_ms`` > 0 has a :class:`DedupTable`: dedup key -> (queue, offset,
append time) of the message stored with that key, for every key stored within the last window,
over all queues of the topic (a key names one message of the topic, whichever queue the producer
picked for it). PRODUCE consults it only for batches with ``ATTR_DEDUP``
(:meth:`Deduplicator.check`), so plain batches keep their zero-per-record path. A record whose
key is in the table and younger than the window is answered as a duplicate of the stored message
and left out; so is a record whose key an earlier record of the same batch carries. The other
records are appended as one batch (re-encoded without the duplicates when there were some, see
:func:`~ferrymq.protocol.records.select_records`) and then remembered
(:meth:`Deduplicator.on_append`), in the same event-loop callback, so no other produce can slip
in between the lookup and the insert.

Dedup batches carry no producer id or sequence: the keys are what makes a retried batch harmless
(a retry finds its own records in the table), and a batch stored with fewer records than were
sent could not keep an idempotent producer's per-queue sequence numbers in line. A dedup batch
that does carry a producer id is refused (INVALID_REQUEST) in a topic with a window; in a topic
without one it is an ordinary batch whose keys are just stored.

Expiry: a key is a duplicate while ``now - append time < window`` (the original's append time,
as in NATS: a duplicate does not extend the window). Keys leave the table in insertion order,
lazily before each dedup lookup and on every housekeeping tick.

Bound: a table holds at most ``dedup_max_keys`` keys. A batch whose new keys would go past that
is refused with BUSY (retriable) before anything is allocated or stored. Keys are never evicted
early: a forgotten key would let a duplicate in without anyone noticing.

On a cluster a message with a dedup key and no sharding key goes to the queue its dedup key
hashes to (the client's partitioner), so a key always meets the window of the same queue's
leader; a broker that starts leading a queue reads that queue's keys again from its copy
(:meth:`Deduplicator.rebuild_queue`), so the window holds across a failover.

Durability: nothing is persisted; the records are the source of truth. At start
(:meth:`Deduplicator.load`) every queue of a dedup topic is read from the first batch appended
within the window (found with the time index) to its end, and the keys of its dedup batches are
remembered again, so a window survives a restart and kill -9 (only acknowledged records are in
the log after recovery). The cost is one sequential read of what the dedup topics stored within
their windows; the window is at most ``MAX_DEDUP_WINDOW_MS`` and at most the topic's
``retention_ms``. A key whose message was already deleted by ``retention_bytes`` is not rebuilt.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ferrymq.errors import BrokerError, BusyError, InvalidRequestError
from ferrymq.protocol.dedup import read_dedup_keys
from ferrymq.protocol.messages import Duplicate
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    BatchHeader,
    RawRecord,
    decode_header,
    iter_batches,
    select_records,
)

if TYPE_CHECKING:
    from ferrymq.broker.topics import QueueState, Topic, TopicRegistry

log = logging.getLogger("ferrymq.broker")

DEFAULT_DEDUP_MAX_KEYS = 1_000_000
"""Most keys one topic's window holds (``dedup_max_keys``): about 280 bytes each measured with
18-byte keys (bench/dedup.py), so ~300 MB for a full table. 1M keys in NATS' default 2-min window
is 8,300 dedup-keyed messages per second."""

SCAN_READ_BYTES = 1 << 20
"""The start-up rebuild reads the log this much at a time (bounded memory)."""


@dataclass(slots=True)
class DedupTable:
    """The dedup keys one topic stored within its window, and where."""

    window_ms: int
    max_keys: int
    seen: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """key -> (queue, offset, append time ms)."""
    order: deque[tuple[int, str]] = field(default_factory=deque)
    """(append time ms, key) in insertion order: what :meth:`expire` drops first."""

    def __len__(self) -> int:
        return len(self.seen)

    def lookup(self, key: str, now_ms: int) -> tuple[int, int] | None:
        """``(queue, offset)`` of the message stored with ``key`` within the window, else None."""
        e = self.seen.get(key)
        if e is None or now_ms - e[2] >= self.window_ms:
            return None
        return e[0], e[1]

    def remember(self, key: str, queue: int, offset: int, append_time_ms: int) -> None:
        """Note that ``key`` was stored at ``queue``/``offset`` (replaces an expired entry)."""
        self.seen[key] = (queue, offset, append_time_ms)
        self.order.append((append_time_ms, key))

    def expire(self, now_ms: int) -> int:
        """Forget keys whose window ended; return how many."""
        limit = now_ms - self.window_ms
        order, seen = self.order, self.seen
        n = 0
        while order and order[0][0] <= limit:
            t, key = order.popleft()
            e = seen.get(key)
            if e is not None and e[2] == t:  # not stored again since
                del seen[key]
                n += 1
        return n


class DedupPlan(NamedTuple):
    """What to do with one dedup batch (see :meth:`Deduplicator.check`)."""

    batch: bytes | bytearray | memoryview | None
    """The batch to append: the one sent, or its new records re-encoded; None: nothing new."""
    header: BatchHeader | None
    """Its header."""
    keys: list[str]
    """The keys of the records to append, in order."""
    duplicates: list[Duplicate]
    """Records that duplicate messages stored earlier: (index, queue, offset)."""
    inner: list[tuple[int, int]]
    """Records that repeat the key of an earlier record of the batch: (index, position of that
    record among the appended ones)."""


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What :meth:`Deduplicator.load` did."""

    topics: int
    keys: int
    bytes_read: int
    elapsed_s: float
    dropped: int
    """Keys beyond ``dedup_max_keys`` (the oldest) that were not loaded."""


class Deduplicator:
    """Every topic's dedup table; the produce handler's and the start-up rebuild's entry point.

    Runs on the event-loop thread only (like the produce path it serves)."""

    def __init__(self, topics: TopicRegistry, *, max_keys: int = DEFAULT_DEDUP_MAX_KEYS) -> None:
        self._topics = topics
        self.max_keys = max_keys
        self._tables: dict[int, DedupTable] = {}

    def _table(self, topic: Topic) -> DedupTable | None:
        if topic.dedup_window_ms <= 0:
            return None
        t = self._tables.get(topic.topic_id)
        if t is None:
            t = self._tables[topic.topic_id] = DedupTable(topic.dedup_window_ms, self.max_keys)
        return t

    # --- produce ---------------------------------------------------------------------------

    def check(self, qs: QueueState, batch: bytes | bytearray | memoryview, h: BatchHeader,
              now_ms: int) -> DedupPlan | None:
        """Sort the records of a dedup batch (``ATTR_DEDUP``) for ``qs`` into new ones and
        duplicates, before anything is stored.

        Returns:
            None when the topic has no dedup window (store the batch as it is), else the plan.

        Raises:
            InvalidRequestError: a producer id on the batch, or a record without a valid key.
            BusyError: the new keys would take the topic past ``dedup_max_keys``.
        """
        topic = self._topics.by_id.get(qs.topic_id)
        table = self._table(topic) if topic is not None else None
        if table is None:
            return None
        if h.producer_id >= 0:
            raise InvalidRequestError(
                "a dedup batch must not carry a producer id: its dedup keys make retries safe")
        records = read_dedup_keys(batch, 0, h)
        table.expire(now_ms)
        keep: list[RawRecord] = []
        keys: list[str] = []
        dups: list[Duplicate] = []
        inner: list[tuple[int, int]] = []
        first: dict[str, int] = {}
        for i, (rec, key) in enumerate(records):
            hit = table.lookup(key, now_ms)
            if hit is not None:
                dups.append((i, hit[0], hit[1]))
                continue
            j = first.get(key)
            if j is not None:
                inner.append((i, j))
                continue
            first[key] = len(keep)
            keep.append(rec)
            keys.append(key)
        if keys and len(table) + len(keys) > table.max_keys:
            raise BusyError(
                f"topic {qs.topic!r} remembers {len(table)} dedup keys, max {table.max_keys} "
                f"(dedup_max_keys): retry when older keys leave its {table.window_ms} ms window")
        if not keep:
            return DedupPlan(None, None, keys, dups, inner)
        if not dups and not inner:
            return DedupPlan(batch, h, keys, dups, inner)
        out = select_records(batch, 0, h, keep)
        return DedupPlan(out, decode_header(out), keys, dups, inner)

    def on_append(self, plan: DedupPlan, qs: QueueState, base_offset: int,
                  append_time_ms: int) -> list[Duplicate]:
        """Remember the keys of ``plan``'s batch, just appended to ``qs`` at ``base_offset``;
        return every duplicate of the batch as sent, by index."""
        table = self._tables.get(qs.topic_id)
        if table is not None:
            for k, key in enumerate(plan.keys):
                table.remember(key, qs.queue, base_offset + k, append_time_ms)
        if not plan.inner:
            return plan.duplicates
        return sorted([*plan.duplicates,
                       *((i, qs.queue, base_offset + j) for i, j in plan.inner)])

    # --- housekeeping ----------------------------------------------------------------------

    def expire(self, now_ms: int) -> int:
        """Drop expired keys of every table, and the tables of deleted topics."""
        n = 0
        by_id = self._topics.by_id
        for tid in list(self._tables):
            if tid not in by_id:
                del self._tables[tid]
            else:
                n += self._tables[tid].expire(now_ms)
        return n

    def rebuild_queue(self, qs: QueueState, now_ms: int) -> int:
        """Forget what the table holds of ``qs`` and read its keys again from its log: a
        cluster broker that starts leading ``qs`` copied its records as a follower, without
        remembering their keys. Call before the first produce the new leader serves (in the same
        event-loop callback); returns the keys loaded. A topic without a window: nothing."""
        topic = self._topics.topics.get(qs.topic)
        table = None if topic is None else self._table(topic)
        if table is None:
            return 0
        q = qs.queue
        if any(e[0] == q for e in table.seen.values()):
            table.seen = {k: e for k, e in table.seen.items() if e[0] != q}
            table.order = deque((t, k) for t, k in table.order if k in table.seen)
        found: list[tuple[int, str, int, int]] = []
        nbytes = _scan(qs, now_ms - table.window_ms + 1, found)
        loaded = 0
        for t, key, queue, off in sorted(found, key=lambda e: e[0]):
            if key not in table.seen and len(table.seen) < table.max_keys:
                table.remember(key, queue, off, t)
                loaded += 1
        if found:
            log.info("%s: the dedup window holds its %d keys again (%d bytes read)", qs, loaded,
                     nbytes)
        return loaded

    def forget(self, topic_id: int) -> None:
        """Drop a deleted topic's table."""
        self._tables.pop(topic_id, None)

    def keys(self, topic_id: int) -> int:
        """How many keys the topic's table holds now (expired ones not yet dropped included)."""
        t = self._tables.get(topic_id)
        return 0 if t is None else len(t)

    # --- start-up --------------------------------------------------------------------------

    def load(self, now_ms: int) -> RebuildReport:
        """Rebuild every dedup topic's table from its queues' logs (see the module docstring).

        Call after the logs were opened (recovered), before serving produce requests.
        """
        started = time.monotonic()
        self._tables.clear()
        nbytes = topics = loaded = dropped = 0
        for topic in self._topics.topics.values():
            table = self._table(topic)
            if table is None:
                continue
            topics += 1
            since = now_ms - table.window_ms + 1  # still a duplicate: now - t < window
            found: list[tuple[int, str, int, int]] = []
            for qs in topic.queues:
                nbytes += _scan(qs, since, found)
            found.sort(key=lambda e: e[0])  # stable: queue order among equal times
            if len(found) > table.max_keys:
                dropped += len(found) - table.max_keys
                log.warning("%s: %d dedup keys within the window, max %d (dedup_max_keys): the "
                            "oldest %d are forgotten", topic.name, len(found), table.max_keys,
                            len(found) - table.max_keys)
                del found[: len(found) - table.max_keys]
            seen = table.seen
            for t, key, q, off in found:
                if key not in seen:  # a key is stored once per window: keep the original
                    table.remember(key, q, off, t)
            loaded += len(table)
        report = RebuildReport(topics, loaded, nbytes, time.monotonic() - started, dropped)
        if topics:
            log.info("rebuilt the dedup windows of %d topics: %d keys from %d bytes in %.3f s",
                     topics, loaded, nbytes, report.elapsed_s)
        return report


def _scan(qs: QueueState, since_ms: int, out: list[tuple[int, str, int, int]]) -> int:
    """Append ``(append time, key, queue, offset)`` for every record of the dedup batches of
    ``qs`` appended at or after ``since_ms``; return the bytes read."""
    lg = qs.log
    pos = max(lg.offset_for_time(since_ms), lg.start_offset)
    end = lg.end_offset
    nbytes = 0
    while pos < end:
        try:
            data = lg.read(pos, SCAN_READ_BYTES, stored=True)  # envelopes: never theirs
        except BrokerError as exc:  # the log changed under us: cannot happen before serving
            log.warning("%s: dedup rebuild stopped at offset %d: %s", qs, pos, exc)
            break
        if not data:
            break
        nbytes += len(data)
        before = pos
        mv = memoryview(data)
        for p0, h in iter_batches(mv):
            if h.last_offset < pos:
                continue
            if h.attributes & ATTR_DEDUP and h.append_time_ms >= since_ms:
                try:
                    records = read_dedup_keys(mv, p0, h)
                except InvalidRequestError as exc:  # stored by a topic without a window?
                    log.warning("%s: dedup batch at offset %d skipped: %s", qs, h.base_offset,
                                exc)
                    records = []
                for rec, key in records:
                    out.append((h.append_time_ms, key, qs.queue, rec[0]))
            pos = h.last_offset + 1
        if pos == before:
            break
    return nbytes
