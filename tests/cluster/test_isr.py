"""The leader's ISR bookkeeping (pure) and the ISR compare-and-swap."""

from __future__ import annotations

import pytest

from ferrymq.cluster.isr import IsrState, change_isr, settle_isr
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import Check, Put
from ferrymq.cluster.model import Keys, QueueRecord
from ferrymq.errors import MetadataUnavailableError
from ferrymq.testing import FakeClock
from tests.cluster.support import memory_store, register, sync

KEYS = Keys("c")


def state(isr: list[int] | None = None, epoch_start: int = 0) -> IsrState:
    rec = QueueRecord([1, 2, 3], 1, 4, [1, 2, 3] if isr is None else isr, version=7)
    return IsrState(1, rec, epoch_start, now_ms=1_000)


def test_the_high_watermark_is_the_lowest_durable_offset_over_the_isr() -> None:
    s = state()
    s.update_follower(2, log_end=10, durable=8, leader_end=12, now_ms=1_010)
    s.update_follower(3, log_end=12, durable=12, leader_end=12, now_ms=1_010)
    assert s.high_watermark(12, 11, sync_mode=True) == 8
    assert s.high_watermark(12, 11, sync_mode=False) == 10  # flush async: log ends
    s.apply(QueueRecord([1, 2, 3], 1, 4, [1, 3], version=8))  # 2 left the ISR
    assert s.high_watermark(12, 11, sync_mode=True) == 11  # the leader's own durable offset


def test_the_high_watermark_never_goes_back_nor_passes_the_leaders_end() -> None:
    s = state(isr=[1, 2])
    s.update_follower(2, log_end=20, durable=20, leader_end=20, now_ms=1_001)
    assert s.high_watermark(20, 20, sync_mode=True) == 20
    s.update_follower(2, log_end=5, durable=5, leader_end=20, now_ms=1_002)  # truncated
    assert s.high_watermark(20, 20, sync_mode=True) == 20
    fresh = state(isr=[1])
    assert fresh.high_watermark(3, 9, sync_mode=True) == 3


def test_a_follower_leaves_after_lagging_longer_than_replica_lag_ms() -> None:
    s = state()
    # 2 keeps up with every fetch; 3 fetches but stays far behind
    for t in range(1_100, 12_000, 100):
        end = t  # the leader keeps appending
        s.update_follower(2, log_end=end - 100, durable=end - 100, leader_end=end, now_ms=t)
        s.update_follower(3, log_end=50, durable=50, leader_end=end, now_ms=t)
    # 2 is one fetch behind each time (Kafka's rule): caught up at its previous fetch
    assert s.shrink_candidates(11_900, 10_000) == [3]
    assert s.shrink_candidates(10_900, 10_000) == []  # 3's lag (9.9 s) within the limit
    assert s.followers[3].caught_up_ms == 1_000  # since the election
    s.update_follower(3, log_end=11_900, durable=11_900, leader_end=11_900, now_ms=11_950)
    assert s.shrink_candidates(11_950, 10_000) == []


def test_a_follower_that_stops_fetching_leaves_too() -> None:
    s = state()
    s.update_follower(2, log_end=10, durable=10, leader_end=10, now_ms=2_000)
    s.update_follower(3, log_end=10, durable=10, leader_end=10, now_ms=2_000)
    assert s.shrink_candidates(12_000, 10_000) == []
    assert s.shrink_candidates(12_001, 10_000) == [2, 3]


def test_a_follower_rejoins_once_at_the_high_watermark_and_past_the_epoch_start() -> None:
    s = state(isr=[1, 2], epoch_start=30)
    s.update_follower(2, log_end=40, durable=40, leader_end=40, now_ms=1_001)
    assert s.high_watermark(40, 40, sync_mode=True) == 40
    s.update_follower(3, log_end=25, durable=25, leader_end=40, now_ms=1_002)
    assert s.expand_candidates() == []
    s.update_follower(3, log_end=40, durable=35, leader_end=40, now_ms=1_003)
    assert s.expand_candidates() == [3]
    assert s.expand_candidates(sync_mode=True) == []  # not durable up to the HW yet
    s.update_follower(3, log_end=40, durable=40, leader_end=40, now_ms=1_004)
    assert s.expand_candidates(sync_mode=True) == [3]


def test_the_epoch_start_holds_back_a_follower_even_below_the_high_watermark() -> None:
    s = state(isr=[1], epoch_start=50)
    assert s.high_watermark(50, 50, sync_mode=True) == 50
    s.update_follower(2, log_end=49, durable=49, leader_end=50, now_ms=1_001)
    assert s.expand_candidates() == []


def test_acks_all_needs_min_insync_members() -> None:
    assert state().acks_all_ok(3)
    assert not state(isr=[1, 2]).acks_all_ok(3)
    assert state(isr=[1, 2]).acks_all_ok(2)


def test_misuse_is_refused() -> None:
    rec = QueueRecord([1, 2], 2, 0, [2, 1])
    with pytest.raises(ValueError, match="broker 1 does not lead"):
        IsrState(1, rec, 0, 0)
    s = state()
    with pytest.raises(ValueError, match="broker 9 is not a follower"):
        s.update_follower(9, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="not of broker 1's epoch 4"):
        s.apply(QueueRecord([1, 2, 3], 2, 5, [2]))


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
