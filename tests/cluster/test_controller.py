"""The controller over a memory store and a fake clock: its decisions, its seat, fencing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from ferrymq.cluster.controller import Controller, decide_leadership
from ferrymq.cluster.isr import change_isr
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import Check, Put
from ferrymq.cluster.model import NO_LEADER, ControllerRecord, Keys, QueueRecord
from ferrymq.cluster.operations import decide_preferred
from ferrymq.cluster.topics import create_topic, load_topics
from ferrymq.errors import MetadataLeaseExpiredError, NotControllerError, UnknownTopicError
from ferrymq.testing import FakeClock
from tests.cluster.support import (
    LEASE_TTL_S,
    YieldingStore,
    memory_store,
    outlive,
    register,
    sync,
)

KEYS = Keys("c")


def rec(replicas: list[int], leader: int, epoch: int, isr: list[int]) -> QueueRecord:
    return QueueRecord(replicas, leader, epoch, isr)


@pytest.mark.parametrize(("before", "live", "unclean", "after"), [
    # nothing to do
    (rec([1, 2, 3], 1, 5, [1, 2, 3]), {1, 2, 3}, False, None),
    # a follower died: it leaves the ISR, same leader and epoch
    (rec([1, 2, 3], 1, 5, [1, 2, 3]), {1, 3}, False, rec([1, 2, 3], 1, 5, [1, 3])),
    # the leader died: the next replica in replica order that is in the ISR and alive
    (rec([1, 2, 3], 1, 5, [1, 3, 2]), {2, 3}, False, rec([1, 2, 3], 2, 6, [3, 2])),
    (rec([1, 2, 3], 1, 5, [1, 3]), {2, 3}, False, rec([1, 2, 3], 3, 6, [3])),
    # no ISR member alive: offline, ISR unchanged, the epoch bumped (fences the last leader)
    (rec([1, 2, 3], 1, 5, [1]), {2, 3}, False, rec([1, 2, 3], NO_LEADER, 6, [1])),
    (rec([1, 2, 3], NO_LEADER, 6, [1]), {2, 3}, False, None),
    # unless the topic allows an unclean election
    (rec([1, 2, 3], 1, 5, [1]), {2, 3}, True, rec([1, 2, 3], 2, 6, [2])),
    (rec([1, 2, 3], 1, 5, [1]), set(), True, rec([1, 2, 3], NO_LEADER, 6, [1])),
    # an ISR member comes back to an offline queue: it leads
    (rec([1, 2, 3], NO_LEADER, 6, [1, 3]), {3}, False, rec([1, 2, 3], 3, 7, [3])),
    (rec([1, 2, 3], NO_LEADER, 6, [1, 3]), {1, 2, 3}, False, rec([1, 2, 3], 1, 7, [1, 3])),
])
def test_decide_leadership(before: QueueRecord, live: set[int], unclean: bool,
                           after: QueueRecord | None) -> None:
    assert decide_leadership(before, live, unclean=unclean) == after


def test_decide_preferred() -> None:
    assert decide_preferred(rec([1, 2], 2, 3, [2, 1]), {1, 2}) == rec([1, 2], 1, 4, [2, 1])
    assert decide_preferred(rec([1, 2], 2, 3, [2]), {1, 2}) is None  # not in sync
    assert decide_preferred(rec([1, 2], 2, 3, [2, 1]), {2}) is None  # not alive
    assert decide_preferred(rec([1, 2], 1, 3, [2, 1]), {1, 2}) is None  # leads already


class Cluster:
    """Brokers 1..n registered on a fake clock, a controller per broker (on its lease)."""

    def __init__(self, store: MemoryMetadataStore | YieldingStore, clock: FakeClock) -> None:
        self.store = store
        self.clock = clock
        self.leases: dict[int, int] = {}
        self.controllers: dict[int, Controller] = {}

    @property
    def memory(self) -> MemoryMetadataStore:
        s = self.store
        return s.inner if isinstance(s, YieldingStore) else s

    async def start(self, *brokers: int) -> None:
        for b in brokers:
            self.leases[b] = await register(self.memory, KEYS, b)
            self.controllers.setdefault(b, Controller(
                self.store, KEYS, b, lease_ttl_s=LEASE_TTL_S, clock=self.clock.monotonic,
                lease_of=lambda b=b: self.leases[b]))

    async def kill(self, *brokers: int) -> None:
        """The brokers stop renewing: their leases expire (the others' are renewed)."""
        keep = [lease for b, lease in self.leases.items() if b not in brokers]
        await outlive(self.memory, self.clock, keep)
        for b in brokers:
            del self.leases[b]

    async def queues(self) -> dict[tuple[str, int], QueueRecord]:
        return (await load_topics(self.memory, KEYS))[1]


async def cluster_with_topic(n: int = 3, queues: int = 3, replicas: int = 3,
                             config: dict[str, str] | None = None) -> Cluster:
    clock = FakeClock()
    c = Cluster(memory_store(clock), clock)
    await c.start(*range(1, n + 1))
    await create_topic(c.memory, KEYS, "t", queues, replicas, 1, config or {}, 0, start=0)
    return c


@sync
async def test_one_campaign_wins_and_the_epoch_grows_with_each_new_controller() -> None:
    c = await cluster_with_topic()
    one, two = c.controllers[1], c.controllers[2]
    assert await one.campaign()
    assert not await two.campaign()
    assert one.active and not two.active and one.epoch == 1
    kv = await c.memory.get(KEYS.controller)
    assert kv is not None and ControllerRecord.decode(kv) == ControllerRecord(1, 1)
    assert kv.lease == c.leases[1]  # the seat goes with broker 1's lease
    await c.kill(1)
    assert await c.memory.get(KEYS.controller) is None
    assert await two.campaign() and two.epoch == 2
    await two.resign()
    assert await c.memory.get(KEYS.controller) is None
    assert await c.controllers[3].campaign() and c.controllers[3].epoch == 3


@sync
async def test_a_dead_leader_is_replaced_from_the_isr_and_a_dead_follower_leaves_it() -> None:
    c = await cluster_with_topic()
    ctl = c.controllers[2]
    assert await ctl.campaign()
    assert await ctl.reconcile() == 0
    before = await c.queues()
    await c.kill(1)
    assert await ctl.reconcile() == 3  # every queue has broker 1 as a replica
    after = await c.queues()
    for tq, old in before.items():
        new = after[tq]
        assert 1 not in new.isr
        if old.leader == 1:
            assert new.leader == next(b for b in old.replicas if b != 1)
            assert new.leader_epoch == old.leader_epoch + 1
        else:
            assert (new.leader, new.leader_epoch) == (old.leader, old.leader_epoch)
    assert await ctl.reconcile() == 0  # level-triggered: nothing more to do


@sync
async def test_the_last_isr_member_takes_the_queue_offline_and_back() -> None:
    c = await cluster_with_topic(queues=1)
    ctl = c.controllers[3]
    assert await ctl.campaign()
    await c.kill(2)
    await ctl.reconcile()
    await c.kill(1)  # the leader: 3, the last one in sync, takes over
    await ctl.reconcile()
    q = (await c.queues())[("t", 0)]
    assert (q.leader, q.isr, q.leader_epoch) == (3, [3], 1)
    await c.start(1, 2)  # back, but not in sync: 3 stays the only ISR member
    assert await ctl.reconcile() == 0
    # now 3 dies: nobody in sync is alive, the queue goes offline, its ISR stays [3]
    await c.kill(3)
    ctl = c.controllers[1]
    assert await ctl.campaign()
    await ctl.reconcile()
    q = (await c.queues())[("t", 0)]
    assert (q.leader, q.isr, q.leader_epoch) == (NO_LEADER, [3], 2)
    await c.start(3)
    await ctl.reconcile()
    q = (await c.queues())[("t", 0)]
    assert (q.leader, q.isr, q.leader_epoch) == (3, [3], 3)


@sync
async def test_an_unclean_topic_elects_a_live_replica_outside_the_isr() -> None:
    c = await cluster_with_topic(queues=1, config={"unclean_leader_election": "true"})
    ctl = c.controllers[3]
    assert await ctl.campaign()
    key = KEYS.queue("t", 0)
    q = (await c.queues())[("t", 0)]
    assert await c.memory.commit([Check(key, q.version)],
                                 [Put(key, QueueRecord([1, 2, 3], 1, 0, [1]).encode())])
    await c.kill(1)
    await ctl.reconcile()
    q = (await c.queues())[("t", 0)]
    assert (q.leader, q.isr, q.leader_epoch) == (2, [2], 1)


@sync
async def test_a_broker_that_restarted_between_two_reconciles_leaves_the_isr() -> None:
    c = await cluster_with_topic(queues=3)
    ctl = c.controllers[3]
    assert await ctl.campaign()
    await ctl.reconcile()
    before = await c.queues()
    await c.kill(1)
    await c.start(1)  # a new incarnation before the controller looked
    await ctl.reconcile()
    after = await c.queues()
    for tq, old in before.items():
        new = after[tq]
        assert 1 not in new.isr and new.leader != 1
        if old.leader == 1:
            assert new.leader_epoch == old.leader_epoch + 1


@pytest.mark.parametrize("back", [False, True])
@sync
async def test_the_controller_reconciles_what_happened_while_there_was_none(back: bool) -> None:
    c = await cluster_with_topic(queues=3)
    await c.kill(1)  # no controller yet
    if back:
        await c.start(1)  # restarted too, before any controller looked
    ctl = c.controllers[2]
    assert await ctl.campaign()
    assert await ctl.reconcile() == 3
    assert all(1 not in q.isr and q.leader in (2, 3) for q in (await c.queues()).values())


@sync
async def test_preferred_leaders_come_back_when_alive_and_in_sync() -> None:
    c = await cluster_with_topic(queues=3)
    ctl = c.controllers[3]
    assert await ctl.campaign()
    await c.kill(1)
    await ctl.reconcile()
    await c.start(1)
    # broker 1 caught up: each leader took it back into its ISR
    for (t, q), r in (await c.queues()).items():
        assert await change_isr(c.memory, KEYS, t, q, r, [*r.isr, 1]) is not None
    assert await ctl.elect_preferred_leaders(["t"]) == 1
    after = await c.queues()
    assert [after[("t", q)].leader for q in range(3)] == [1, 2, 3]
    assert await ctl.elect_preferred_leaders() == 0
    with pytest.raises(UnknownTopicError, match="unknown topic 'nope'"):
        await ctl.elect_preferred_leaders(["nope"])
    with pytest.raises(NotControllerError, match="broker 1 is not the controller"):
        await c.controllers[1].elect_preferred_leaders()


@sync
async def test_a_deposed_controllers_writes_fail_and_change_nothing() -> None:
    c = await cluster_with_topic(queues=1)
    old = c.controllers[1]
    assert await old.campaign()
    # broker 1 pauses past its lease: the seat goes with it; broker 2 takes it
    await c.kill(1)
    new = c.controllers[2]
    assert await new.campaign() and new.epoch == 2
    assert old.active  # the zombie does not know yet
    q = (await c.queues())[("t", 0)]
    rev = c.memory.revision
    with pytest.raises(NotControllerError, match="its write was refused: the seat is another"):
        # the zombie's decision made on a fresh record: only the seat check can stop it
        await old._update("t", 0, q, lambda r: r.with_leader(3))
    assert c.memory.revision == rev and (await c.queues())[("t", 0)] == q
    assert not old.active
    with pytest.raises(NotControllerError):
        await old.reconcile()
    assert await new.reconcile() == 1


@sync
async def test_a_controller_redecides_when_a_leader_changed_the_isr_meanwhile() -> None:
    c = await cluster_with_topic(queues=1)
    ctl = c.controllers[3]
    assert await ctl.campaign()
    q = (await c.queues())[("t", 0)]
    await c.kill(2)

    class Racing(YieldingStore):
        """The leader (1) drops 3 from its ISR just before the controller's first commit."""

        raced = False

        async def commit(self, checks: Sequence[Check], puts: Sequence[Put] = (),
                         deletes: Sequence[str] = ()) -> int | None:
            if not self.raced and puts:
                self.raced = True
                assert await change_isr(self.inner, KEYS, "t", 0, q, [1, 2]) is not None
            return await super().commit(checks, puts, deletes)

    racing = Racing(c.memory)
    ctl.store = racing
    assert await ctl.reconcile() == 1
    assert racing.raced and racing.failed_commits == 1
    got = (await c.queues())[("t", 0)]
    # decided again on the leader's record: 2 is gone, the leader's own change kept
    assert (got.leader, got.isr, got.leader_epoch) == (1, [1], 0)


@sync
async def test_controllers_racing_as_tasks_one_serves_and_the_next_takes_over() -> None:
    clock = FakeClock()
    c = Cluster(YieldingStore(memory_store(clock)), clock)
    await c.start(1, 2, 3)
    await create_topic(c.memory, KEYS, "t", 3, 3, 2, {}, 0, start=0)
    tasks = {b: asyncio.create_task(ctl.run()) for b, ctl in c.controllers.items()}

    async def until(cond: object, what: str) -> None:
        for _ in range(500):
            if callable(cond) and await cond():
                return
            await asyncio.sleep(0.002)
        raise AssertionError(f"timed out waiting for {what}")

    async def one_active() -> bool:
        return sum(ctl.active for ctl in c.controllers.values()) == 1
    await until(one_active, "a controller")
    first = next(b for b, ctl in c.controllers.items() if ctl.active)
    kv = await c.memory.get(KEYS.controller)
    assert kv is not None and ControllerRecord.decode(kv).broker_id == first
    await c.kill(first)  # its seat goes with its lease; the watch deposes it

    async def moved() -> bool:
        qs = await c.queues()
        others = [ctl for b, ctl in c.controllers.items() if b != first and ctl.active]
        return (len(others) == 1 and tasks[first].done()
                and all(first not in q.isr and q.leader != first for q in qs.values()))
    await until(moved, "the next controller to move the queues")
    second = next(b for b, ctl in c.controllers.items() if ctl.active)
    assert c.controllers[second].epoch == 2
    for t in tasks.values():
        t.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)


@sync
async def test_a_controller_with_its_own_lease_resigns_and_frees_the_seat() -> None:
    clock = FakeClock()
    store = memory_store(clock)
    ctl = Controller(store, KEYS, 7, lease_ttl_s=LEASE_TTL_S, clock=clock.monotonic)
    assert await ctl.campaign()
    kv = await store.get(KEYS.controller)
    assert kv is not None and kv.lease != 0
    await ctl.resign()
    assert not ctl.active and await store.get(KEYS.controller) is None
    with pytest.raises(MetadataLeaseExpiredError, match="has expired"):
        await store.keep_alive(kv.lease)  # revoked with the seat
    other = Controller(store, KEYS, 8, lease_ttl_s=LEASE_TTL_S, clock=clock.monotonic)
    assert await other.campaign() and other.epoch == 2


@sync
async def test_no_seat_is_taken_without_a_lease() -> None:
    store = memory_store(FakeClock())
    ctl = Controller(store, KEYS, 1, lease_ttl_s=LEASE_TTL_S, lease_of=lambda: 0)
    assert not await ctl.campaign()
    assert await store.get(KEYS.controller) is None


@sync
async def test_serving_survives_a_lost_watch_and_an_unreachable_store() -> None:
    clock = FakeClock()
    c = Cluster(memory_store(clock), clock)
    await c.start(1, 2, 3)
    await create_topic(c.memory, KEYS, "t", 3, 3, 1, {}, 0, start=0)
    ctl = c.controllers[3]
    task = asyncio.create_task(ctl.run())
    for _ in range(100):
        if ctl.active:
            break
        await asyncio.sleep(0.005)
    assert ctl.active
    c.memory.lose_watches()
    c.memory.available = False
    await asyncio.sleep(0.1)
    c.memory.available = True
    await c.kill(1)  # while the controller waits to read again

    async def moved() -> bool:
        return all(1 not in q.isr for q in (await c.queues()).values())
    for _ in range(300):
        if await moved():
            break
        await asyncio.sleep(0.01)
    assert await moved() and ctl.active
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@sync
async def test_concurrent_campaigns_elect_one_and_a_zombie_racing_the_new_controller_loses() -> None:
    clock = FakeClock()
    c = Cluster(YieldingStore(memory_store(clock)), clock)
    await c.start(1, 2, 3)
    await create_topic(c.memory, KEYS, "t", 3, 3, 1, {}, 0, start=0)
    won = await asyncio.gather(*(ctl.campaign() for ctl in c.controllers.values()))
    assert sorted(won) == [False, False, True]
    zombie = next(ctl for ctl in c.controllers.values() if ctl.active)
    assert zombie.epoch == 1
    # the seat holder pauses past its lease; another takes the seat; a follower of every queue
    # dies too; then the zombie wakes up and acts at the same time as the new controller
    others = [b for b in (1, 2, 3) if b != zombie.broker_id]
    await c.kill(zombie.broker_id)
    new = c.controllers[others[0]]
    assert await new.campaign() and new.epoch == 2
    await c.kill(others[1])
    results = await asyncio.gather(zombie.reconcile(), new.reconcile(), return_exceptions=True)
    assert isinstance(results[0], NotControllerError) and results[1] == 3
    assert not zombie.active and new.active
    for q in (await c.queues()).values():
        assert q.leader == others[0] and q.isr == [others[0]]
