"""The ISR compare-and-swap in the metadata store, and settling a lost answer."""

from __future__ import annotations

import pytest

from ferrymq.cluster.isr import change_isr, settle_isr
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import Check, Put
from ferrymq.cluster.model import Keys, QueueRecord
from ferrymq.errors import MetadataUnavailableError
from ferrymq.testing import FakeClock
from tests.cluster.support import memory_store, register, sync

KEYS = Keys("c")


async def _queue(store: MemoryMetadataStore, isr: list[int], leader: int = 1) -> QueueRecord:
    rec = QueueRecord([1, 2, 3], leader, 0, isr)
    rev = await store.commit([Check(KEYS.queue("t", 0), 0)],
                             [Put(KEYS.queue("t", 0), rec.encode())])
    assert rev is not None
    kv = await store.get(KEYS.queue("t", 0))
    assert kv is not None
    return QueueRecord.decode(kv)


@sync
async def test_change_isr_writes_by_cas_and_a_stale_leader_fails() -> None:
    store = memory_store(FakeClock())
    for b in (1, 2, 3):
        await register(store, KEYS, b)
    rec = await _queue(store, [1, 2, 3])
    shrunk = await change_isr(store, KEYS, "t", 0, rec, [1, 2])
    assert shrunk is not None and shrunk.isr == [1, 2] and shrunk.leader_epoch == 0
    kv = await store.get(KEYS.queue("t", 0))
    assert kv is not None and QueueRecord.decode(kv) == shrunk
    # the old record is stale now: a second writer holding it fails and changes nothing
    assert await change_isr(store, KEYS, "t", 0, rec, [1, 3]) is None
    kv = await store.get(KEYS.queue("t", 0))
    assert kv is not None and QueueRecord.decode(kv).isr == [1, 2]
    grown = await change_isr(store, KEYS, "t", 0, shrunk, [1, 2, 3])
    assert grown is not None and grown.isr == [1, 2, 3]
    assert await change_isr(store, KEYS, "t", 0, grown, [1, 2, 3]) is grown  # no change


@sync
async def test_change_isr_leaves_out_a_broker_that_is_not_alive() -> None:
    clock = FakeClock()
    store = memory_store(clock)
    l1 = await register(store, KEYS, 1)
    await register(store, KEYS, 3)
    rec = await _queue(store, [1])
    # broker 2 is not registered: it may not join; 3 may
    grown = await change_isr(store, KEYS, "t", 0, rec, [1, 2, 3])
    assert grown is not None and grown.isr == [1, 3]
    clock.advance(2)
    await store.keep_alive(l1)
    clock.advance(2)  # 3's lease expired, 1's not
    store.expire_leases()
    kv = await store.get(KEYS.queue("t", 0))
    assert kv is not None
    again = await change_isr(store, KEYS, "t", 0, QueueRecord.decode(kv), [1])
    assert again is not None and again.isr == [1]
    assert await change_isr(store, KEYS, "t", 0, again, [1, 3]) is again


@sync
async def test_change_isr_refuses_an_isr_without_its_leader_or_with_strangers() -> None:
    store = memory_store(FakeClock())
    rec = await _queue(store, [1, 2])
    with pytest.raises(ValueError, match="must hold its leader 1"):
        await change_isr(store, KEYS, "t", 0, rec, [2])
    with pytest.raises(ValueError, match="not replicas"):
        await change_isr(store, KEYS, "t", 0, rec, [1, 7])


@sync
async def test_settle_isr_finds_a_write_whose_answer_was_lost() -> None:
    store = memory_store(FakeClock())
    for b in (1, 2, 3):
        await register(store, KEYS, b)
    rec = await _queue(store, [1, 2])
    store.lose_answer_of.add(KEYS.queue("t", 0))  # applied, and the leader hears a timeout
    with pytest.raises(MetadataUnavailableError):
        await change_isr(store, KEYS, "t", 0, rec, [1, 2, 3])
    settled = await settle_isr(store, KEYS, "t", 0, rec, [1, 2, 3])
    assert settled is not None and settled.isr == [1, 2, 3] and settled.version > rec.version
    # a CAS that failed because another writer got there first with the same ISR: committed
    assert await settle_isr(store, KEYS, "t", 0, rec, [1, 2, 3]) == settled
    # ... and one that another writer beat with something else: refused
    assert await settle_isr(store, KEYS, "t", 0, rec, [1, 3]) is None


@sync
async def test_settle_isr_fences_a_write_that_did_not_apply() -> None:
    store = memory_store(FakeClock())
    for b in (1, 2, 3):
        await register(store, KEYS, b)
    rec = await _queue(store, [1, 2])
    store.available = False
    with pytest.raises(MetadataUnavailableError):  # still unknown: the leader asks again
        await settle_isr(store, KEYS, "t", 0, rec, [1, 2, 3])
    store.available = True
    assert await settle_isr(store, KEYS, "t", 0, rec, [1, 2, 3]) is None
    kv = await store.get(KEYS.queue("t", 0))
    assert kv is not None and QueueRecord.decode(kv).isr == [1, 2]
    # the version moved: the write, were it still in flight, can no longer apply
    assert await change_isr(store, KEYS, "t", 0, rec, [1, 2, 3]) is None
