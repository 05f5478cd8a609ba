"""The background key indexer and find-by-key lookups (RocketMQ's query by key).

Theory of operation
-------------------
Producing does no per-message work for keys. Instead, every housekeeping tick
(:meth:`KeyIndexer.tick`) reads the batches appended past each queue's indexed offset and
appends their keys to the queue's :class:`~ferrymq.storage.keyindex.KeyIndex`, at most
``key_index_bytes_per_tick`` bytes of log per tick over all queues (each queue with work gets
an equal share, the first queue served rotates), and only up to the queue's ``visible_end``
(what consumers may see). It yields to the event loop every ``SLICE_BYTES``, so requests are
served in between. Indexes are opened lazily, a few per tick, so a broker with many
queues does not stall its first tick; opening repairs or drops a damaged index, which is then
rebuilt the same way, in the background. Retention is applied to the index files in the same
pass; indexes of deleted topics are forgotten (their files went with the topic's directory).

:meth:`KeyIndexer.find` answers FIND_BY_KEY: per queue it first searches the log the indexer
has not reached yet (newest data), then walks index candidates newest first and reads each
candidate's record to check that it really carries the key (the index stores hashes). Both
are bounded by ``find_scan_bytes`` per request (each queue gets an equal share for its
unindexed part), yielding to the event loop like the indexer; the offsets left unsearched
(unindexed data, unchecked candidates) are reported as ``unindexed``. Results of all queues
are merged newest first by stored time.

Everything here runs on the event-loop thread (the log is single-threaded for reads).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferrymq.broker.descriptors import is_resource_shortage
from ferrymq.errors import BrokerError, CorruptRecordError, OffsetOutOfRangeError
from ferrymq.protocol import messages as m
from ferrymq.protocol.kafka.envelope import ENVELOPE_MAGIC, native_batch
from ferrymq.protocol.records import (
    ATTR_HAS_KEYS,
    decode_header,
    encode_msg_id,
    iter_batches,
    iter_raw_records,
)
from ferrymq.storage.keyindex import KeyIndex

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig
    from ferrymq.broker.topics import QueueState, Topic, TopicRegistry

log = logging.getLogger("ferrymq.broker")

MAX_OPENS_PER_TICK = 16
"""Indexes opened (checked, repaired) per tick: opening reads the newest index file."""
MIN_SHARE_BYTES = 64 * 1024
"""Smallest per-queue share of a tick's budget (a share always reads at least one batch)."""
SLICE_BYTES = 256 * 1024
"""Log bytes indexed between two yields to the event loop (a few milliseconds of parsing), so
indexing never holds up produce and fetch requests for long."""


@dataclass(slots=True)
class _Budget:
    left: int


class KeyIndexer:
    """Owns the key index of every queue (see the module docstring).

    Args:
        topics: the broker's topic registry.
        config: ``key_index_*`` and ``find_scan_bytes`` settings.
    """

    def __init__(self, topics: TopicRegistry, config: BrokerConfig) -> None:
        self.topics = topics
        self.config = config
        self.indexes: dict[tuple[int, int], KeyIndex] = {}
        self._rr = 0
        self._paused = False

    def _open(self, qs: QueueState) -> KeyIndex:
        key = (qs.topic_id, qs.queue)
        idx = self.indexes.get(key)
        if idx is None:
            idx, report = KeyIndex.open(qs.log.directory, qs.log,
                                        file_bytes=self.config.key_index_file_bytes)
            if report.rebuilt:
                log.warning("key index of %s/%d is rebuilt from the log", qs.topic, qs.queue)
            self.indexes[key] = idx
        return idx

    def forget_deleted(self) -> None:
        """Drop the indexes of topics that no longer exist."""
        ids = set(self.topics.by_id)
        for key in [k for k in self.indexes if k[0] not in ids]:
            del self.indexes[key]

    def _gone(self, qs: QueueState) -> bool:
        t = self.topics.by_id.get(qs.topic_id)
        return t is None or qs.log.closed

    async def tick(self) -> None:
        """Index newly visible data of every queue, within the per-tick budget, in slices of
        SLICE_BYTES with the event loop free to serve requests between them. Out of disk
        space or file descriptors, it pauses (one warning) and goes on at a later tick."""
        if not self.config.key_index_enabled:
            return
        try:
            await self._tick()
        except OSError as exc:
            if not is_resource_shortage(exc):
                raise
            if not self._paused:
                log.warning("key indexing paused: %s; it goes on once there is room", exc)
            self._paused = True
            return
        if self._paused:
            log.info("key indexing goes on")
            self._paused = False

    async def _tick(self) -> None:
        self.forget_deleted()
        queues = list(self.topics.all_queues())
        if not queues:
            return
        n = len(queues)
        self._rr = (self._rr + 1) % n
        order = queues[self._rr:] + queues[: self._rr]
        opens = 0
        work: list[tuple[QueueState, KeyIndex]] = []
        for qs in order:
            idx = self.indexes.get((qs.topic_id, qs.queue))
            if idx is None:
                if opens >= MAX_OPENS_PER_TICK:
                    continue
                opens += 1
                idx = self._open(qs)
            idx.delete_below(qs.log.start_offset)
            if idx.next_offset < qs.visible_end:
                work.append((qs, idx))
        budget = self.config.key_index_bytes_per_tick
        for i, (qs, idx) in enumerate(work):
            if budget <= 0:
                break
            share = max(budget // (len(work) - i), MIN_SHARE_BYTES)
            used = 0
            while used < share and not self._gone(qs) and idx.next_offset < qs.visible_end:
                before = idx.next_offset
                used += idx.index(qs.log, qs.visible_end, min(SLICE_BYTES, share - used))
                await asyncio.sleep(0)
                if idx.next_offset == before:
                    break  # nothing readable there now: try again next tick
            budget -= used

    # -- lookups -------------------------------------------------------------------------------

    async def find(self, topic: Topic, key: str, limit: int) -> tuple[list[m.KeyMatch], int]:
        """Messages of ``topic`` carrying ``key``, newest first, at most ``limit``; and the
        number of offsets left unsearched (see the module docstring). Yields to the event loop
        every SLICE_BYTES of log read."""
        raw = key.encode()
        budget = _Budget(self.config.find_scan_bytes)
        found: list[m.KeyMatch] = []
        unindexed = 0
        queues = list(topic.queues)
        for i, qs in enumerate(queues):
            if self._gone(qs):
                break
            share = budget.left // (len(queues) - i)
            matches, left = await self._find_in_queue(qs, key, raw, limit, budget, share)
            found.extend(matches)
            unindexed += left
        found.sort(key=lambda r: (r[3], r[1]), reverse=True)
        return found[:limit], unindexed

    async def _find_in_queue(
        self, qs: QueueState, key: str, raw: bytes, limit: int, budget: _Budget, share: int
    ) -> tuple[list[m.KeyMatch], int]:
        lg = qs.log
        start, end = lg.start_offset, qs.visible_end
        idx = self._open(qs) if self.config.key_index_enabled else None
        indexed = min(max(idx.next_offset, start), end) if idx is not None else start
        # 1. the newest data, not indexed yet: read it directly (this queue's share of the budget)
        tail: list[m.KeyMatch] = []
        pos = indexed
        tail_budget = _Budget(share)
        while pos < end and tail_budget.left > 0 and not self._gone(qs):
            try:
                data = lg.read(pos, min(tail_budget.left, SLICE_BYTES), upto_offset=end,
                               stored=True)
            except OffsetOutOfRangeError:
                break
            if not data:
                break
            tail_budget.left -= len(data)
            budget.left -= len(data)
            nxt = self._matches(qs, data, pos, None, key, tail)
            await asyncio.sleep(0)
            if nxt <= pos:
                break
            pos = nxt
        unindexed = max(0, end - pos)
        out = sorted(tail, key=lambda r: r[1], reverse=True)[:limit]
        if idx is None or len(out) >= limit:
            return out, unindexed
        # 2. index candidates, newest first; each is read to check its keys
        since_yield = 0
        for candidates in idx.lookup(raw, start):
            wanted = [o for o in candidates if o < indexed]
            i = 0
            while i < len(wanted) and len(out) < limit and budget.left > 0:
                if self._gone(qs):
                    return out, unindexed
                off = wanted[i]
                try:
                    data = lg.read(off, 1, upto_offset=end, stored=True)
                except OffsetOutOfRangeError:
                    i += 1
                    continue
                first = next(iter_batches(data), None)
                if first is None:
                    i += 1
                    continue
                budget.left -= len(data)
                since_yield += len(data)
                base, last = first[1].base_offset, first[1].last_offset
                group: set[int] = set()
                while i < len(wanted) and base <= wanted[i] <= last:
                    group.add(wanted[i])
                    i += 1
                if not group:  # the batch does not hold it (should not happen): move on
                    i += 1
                    continue
                hits: list[m.KeyMatch] = []
                self._matches(qs, data[: first[1].size], base, group, key, hits)
                hits.sort(key=lambda r: r[1], reverse=True)
                out.extend(hits[: limit - len(out)])
                if since_yield >= SLICE_BYTES:
                    since_yield = 0
                    await asyncio.sleep(0)
            if len(out) >= limit:
                break
            if budget.left <= 0:
                unindexed += len(wanted) - i  # candidates left unchecked
                break
        return out, unindexed

    @staticmethod
    def _matches(qs: QueueState, data: bytes, start: int, only: set[int] | None, key: str,
                 out: list[m.KeyMatch]) -> int:
        """Append the records of ``data`` (at or above ``start``, in ``only`` if given) whose
        keys include ``key``; return the offset after the last whole batch. ``data`` is read as
        stored: like the index, only Kafka batches marked as keyed are converted and searched."""
        nxt = start
        max_converted = qs.log.config.max_converted_batch_bytes
        mv = memoryview(data)
        for at, bh in iter_batches(mv):
            nxt = max(nxt, bh.last_offset + 1)
            try:
                if bh.magic == ENVELOPE_MAGIC:  # as the index: only those marked with keys
                    if not bh.attributes & ATTR_HAS_KEYS:
                        continue
                    rmv = memoryview(native_batch(mv, at, bh, max_batch_bytes=max_converted))
                    pos, h = 0, decode_header(rmv)
                else:
                    rmv, pos, h = mv, at, bh
                for off, _ts, _t0, _t1, s1, k1, _p1, _rend in iter_raw_records(rmv, pos, h):
                    if off < start or k1 <= s1 or (only is not None and off not in only):
                        continue
                    keys = str(rmv[s1:k1], "utf-8", "replace").split("\x00")
                    if key in keys:
                        out.append((qs.queue, off, encode_msg_id(qs.topic_id, qs.queue, off),
                                    h.append_time_ms, keys))
            except CorruptRecordError:
                continue  # malformed inside: consumers skip it too
            except BrokerError:  # an envelope that cannot be converted: not searchable
                continue
        return nxt
