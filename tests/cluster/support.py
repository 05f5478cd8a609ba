"""Shared set-up of the cluster logic tests: a memory store on a fake clock, brokers registered
as ClusterNode registers them (a leased key, created only if absent)."""

from __future__ import annotations

from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import Check, Put
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
