"""Shared set-up of the cluster logic tests: a memory store on a fake clock, brokers registered
as ClusterNode registers them (a leased key, created only if absent)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import Check, KeyValue, Put, WatchEvent
from ferrymq.cluster.model import BrokerRecord, Keys
from ferrymq.testing import FakeClock

LEASE_TTL_S = 3


def memory_store(clock: FakeClock) -> MemoryMetadataStore:
    """A memory store whose leases expire on ``clock``."""
    return MemoryMetadataStore(clock=clock.monotonic)


async def register(store: MemoryMetadataStore, keys: Keys, broker_id: int,
                   ttl_s: int = LEASE_TTL_S) -> int:
    """Register broker ``broker_id`` under a new lease; the lease."""
    lease = await store.grant_lease(ttl_s)
    key = keys.broker(broker_id)
    rev = await store.commit([Check(key, 0)], [
        Put(key, BrokerRecord(broker_id, "127.0.0.1", 9000 + broker_id, 0).encode(), lease)])
    assert rev is not None, f"broker {broker_id} is registered already"
    return lease


def sync(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))
    return run


class YieldingStore:
    """A store that yields to the event loop before each call, so that coroutines sharing it
    interleave at every store call (the memory store itself never yields); counts the commits
    whose checks failed."""

    def __init__(self, inner: MemoryMetadataStore) -> None:
        self.inner = inner
        self.failed_commits = 0

    async def get(self, key: str) -> KeyValue | None:
        await asyncio.sleep(0)
        return await self.inner.get(key)

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        await asyncio.sleep(0)
        return await self.inner.range(prefix)

    async def commit(self, checks: Sequence[Check], puts: Sequence[Put] = (),
                     deletes: Sequence[str] = ()) -> int | None:
        await asyncio.sleep(0)
        rev = await self.inner.commit(checks, puts, deletes)
        if rev is None:
            self.failed_commits += 1
        return rev

    async def grant_lease(self, ttl_s: int) -> int:
        await asyncio.sleep(0)
        return await self.inner.grant_lease(ttl_s)

    async def keep_alive(self, lease: int) -> int:
        await asyncio.sleep(0)
        return await self.inner.keep_alive(lease)

    async def revoke_lease(self, lease: int) -> None:
        await asyncio.sleep(0)
        await self.inner.revoke_lease(lease)

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        return self.inner.watch(prefix, start_revision)

    async def close(self) -> None:
        await self.inner.close()


async def outlive(store: MemoryMetadataStore, clock: FakeClock, keep: list[int]) -> list[int]:
    """Let every lease but those in ``keep`` expire (the clock moves past their TTL while the
    ``keep`` ones are renewed); the leases that ended."""
    for lease in keep:
        await store.keep_alive(lease)
    clock.advance(LEASE_TTL_S - 1)
    for lease in keep:
        await store.keep_alive(lease)
    clock.advance(2)
    return store.expire_leases()
