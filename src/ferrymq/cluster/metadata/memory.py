"""The ``memory`` metadata store: etcd's semantics in one process, with a clock you can drive.

For the tests of the controller and the ISR (hypothesis state machines with a fake clock) and
for brokers of one test process. Leases expire when the clock passes their deadline: lazily at
every call, or at once through :meth:`MemoryMetadataStore.expire_leases`.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from ferrymq.cluster.metadata.store import COMMIT_MAX_OPS, Check, KeyValue, Put, WatchEvent
from ferrymq.errors import MetadataError, MetadataLeaseExpiredError, MetadataUnavailableError


@dataclass(slots=True)
class _Lease:
    ttl_s: int
    deadline: float
    keys: set[str] = field(default_factory=set)


class MemoryMetadataStore:
    """A :class:`~ferrymq.cluster.metadata.MetadataStore` in memory.

    ``clock`` is a monotonic time in seconds (``time.monotonic`` unless given). ``available``
    set to False makes every call raise ``MetadataUnavailableError`` (an unreachable store).
    A key added to ``lose_answer_of`` makes the next commit that puts it apply and then raise
    ``MetadataUnavailableError`` (the answer lost on the way back, as a timed-out etcd request
    whose transaction went through); the key is then taken out.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.available = True
        self.lose_answer_of: set[str] = set()
        self.revision = 1
        self._kvs: dict[str, KeyValue] = {}
        self._keys: list[str] = []  # sorted
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x1000)
        self._history: list[tuple[int, WatchEvent]] = []
        self._watchers: list[tuple[str, asyncio.Queue[list[WatchEvent] | None]]] = []

    # --- the interface ---------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        self._enter()
        return self._kvs.get(key)

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        self._enter()
        i = bisect.bisect_left(self._keys, prefix)
        out = []
        while i < len(self._keys) and self._keys[i].startswith(prefix):
            out.append(self._kvs[self._keys[i]])
            i += 1
        return out, self.revision

    async def commit(self, checks: Sequence[Check], puts: Sequence[Put] = (),
                     deletes: Sequence[str] = ()) -> int | None:
        self._enter()
        if len(checks) > COMMIT_MAX_OPS or len(puts) + len(deletes) > COMMIT_MAX_OPS:
            raise MetadataError(f"a commit of {len(checks)} checks and {len(puts) + len(deletes)} "
                                f"puts and deletes passes the limit of {COMMIT_MAX_OPS} of each "
                                "(COMMIT_MAX_OPS)")
        for c in checks:
            kv = self._kvs.get(c.key)
            if (kv.mod_revision if kv else 0) != c.mod_revision:
                return None
        for p in puts:
            if p.lease and p.lease not in self._leases:
                raise MetadataLeaseExpiredError(f"lease {p.lease:x} has expired")
        if not puts and not any(d in self._kvs for d in deletes):
            return self.revision
        self.revision += 1
        events: list[WatchEvent] = []
        for d in deletes:
            gone = self._remove(d)
            if gone is not None:
                events.append(WatchEvent(True, KeyValue(d, b"", self.revision, gone.create_revision)))
        for p in puts:
            old = self._kvs.get(p.key)
            if old is not None and old.lease and old.lease in self._leases:
                self._leases[old.lease].keys.discard(p.key)
            kv = KeyValue(p.key, p.value, self.revision,
                          old.create_revision if old else self.revision, p.lease)
            if old is None:
                bisect.insort(self._keys, p.key)
            self._kvs[p.key] = kv
            if p.lease:
                self._leases[p.lease].keys.add(p.key)
            events.append(WatchEvent(False, kv))
        self._publish(events)
        lost = self.lose_answer_of.intersection(p.key for p in puts)
        if lost:
            self.lose_answer_of -= lost
            raise MetadataUnavailableError("the commit's answer was lost (it was applied)")
        return self.revision

    async def grant_lease(self, ttl_s: int) -> int:
        self._enter()
        lease = next(self._lease_ids)
        self._leases[lease] = _Lease(ttl_s, self.clock() + ttl_s)
        return lease

    async def keep_alive(self, lease: int) -> int:
        self._enter()
        held = self._leases.get(lease)
        if held is None:
            raise MetadataLeaseExpiredError(f"lease {lease:x} has expired")
        held.deadline = self.clock() + held.ttl_s
        return held.ttl_s

    async def revoke_lease(self, lease: int) -> None:
        self._enter()
        self._end_lease(lease)

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        self._enter()
        q: asyncio.Queue[list[WatchEvent] | None] = asyncio.Queue()
        past = [e for rev, e in self._history
                if rev >= start_revision and e.kv.key.startswith(prefix)]
        if past:
            q.put_nowait(past)
        entry = (prefix, q)
        self._watchers.append(entry)
        try:
            while True:
                batch = await q.get()
                if batch is None:
                    raise MetadataUnavailableError("the metadata store went away")
                yield batch
        finally:
            if entry in self._watchers:
                self._watchers.remove(entry)

    async def close(self) -> None:
        for _, q in self._watchers:
            q.put_nowait(None)
        self._watchers.clear()

    # --- for tests -------------------------------------------------------------------------

    def expire_leases(self) -> list[int]:
        """End every lease whose deadline the clock has passed; their ids."""
        now = self.clock()
        gone = [lid for lid, held in self._leases.items() if held.deadline <= now]
        for lid in gone:
            self._end_lease(lid)
        return gone

    def lose_watches(self) -> None:
        """End every open watch as a lost connection would."""
        for _, q in self._watchers:
            q.put_nowait(None)
        self._watchers.clear()

    # --- inside ----------------------------------------------------------------------------

    def _enter(self) -> None:
        if not self.available:
            raise MetadataUnavailableError("the metadata store is unreachable")
        self.expire_leases()

    def _end_lease(self, lease: int) -> None:
        held = self._leases.pop(lease, None)
        if held is None or not held.keys:
            return
        self.revision += 1
        events = []
        for key in sorted(held.keys):
            gone = self._remove(key)
            if gone is not None:
                events.append(WatchEvent(True, KeyValue(key, b"", self.revision,
                                                        gone.create_revision)))
        self._publish(events)

    def _remove(self, key: str) -> KeyValue | None:
        kv = self._kvs.pop(key, None)
        if kv is not None:
            self._keys.pop(bisect.bisect_left(self._keys, key))
            if kv.lease and kv.lease in self._leases:
                self._leases[kv.lease].keys.discard(key)
        return kv

    def _publish(self, events: list[WatchEvent]) -> None:
        if not events:
            return
        self._history.extend((self.revision, e) for e in events)
        for prefix, q in self._watchers:
            mine = [e for e in events if e.kv.key.startswith(prefix)]
            if mine:
                q.put_nowait(mine)
