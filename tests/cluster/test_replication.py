"""Replication's data path between real brokers: followers copy exactly, the high watermark
and ``acks="all"`` wait for the in-sync replicas, ISR shrink and expand, truncation by epoch.

Each test starts two or three real :class:`~ferrymq.broker.server.BrokerServer`\\ s in this
process on port 0, each with a real :class:`~ferrymq.cluster.replication.ReplicaManager` wired
in the way the cluster node does it (``server.replicas``); producers and followers talk over
real sockets. What the node would do (the metadata store, the roles) is done by the test
directly: ``on_isr_change`` is a recording stand-in for the node's compare-and-swap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.server import BrokerServer
from ferrymq.client import AsyncProducer, Message
from ferrymq.client._transport import Transport
from ferrymq.cluster.model import QueueRecord
from ferrymq.cluster.replication import ReplicaManager
from ferrymq.errors import MetadataUnavailableError, NotEnoughReplicasError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.messages import Acks, Durability
from ferrymq.protocol.records import RecordInput, encode_batch

pytestmark = pytest.mark.integration

TOPIC = "rep"


class Node:
    """One broker of the test cluster and its replica manager."""

    def __init__(self, broker_id: int, server: BrokerServer, isr_calls: list[tuple[int, list[int]]],
                 addresses: dict[int, tuple[str, int]]) -> None:
        self.id = broker_id
        self.server = server
        self.isr_calls = isr_calls
        self.isr_answer = True

        async def on_isr_change(topic: str, queue: int, isr: list[int]) -> list[int] | None:
            isr_calls.append((broker_id, list(isr)))
            return list(isr) if self.isr_answer else None

        self.mgr = ReplicaManager(broker_id, 1, server.topics, server.config, server.clock,
                                  server.flusher, addresses.get, on_isr_change)
        server.replicas = self.mgr

    @property
    def log(self):  # type: ignore[no-untyped-def]
        return self.server.topics.queue(TOPIC, 0).log

    @property
    def qs(self):  # type: ignore[no-untyped-def]
        return self.server.topics.queue(TOPIC, 0)

    def data(self) -> bytes:
        """The whole log's bytes."""
        return self.log.read(0, 1 << 30)


@asynccontextmanager
async def cluster(tmp_path: Path, n: int, topic_config: dict[str, str] | None = None,
                  **cfg: object) -> AsyncIterator[list[Node]]:
    """``n`` brokers (ids 1..n) with topic ``rep`` (one queue) on each."""
    addresses: dict[int, tuple[str, int]] = {}
    isr_calls: list[tuple[int, list[int]]] = []
    nodes: list[Node] = []
    try:
        for i in range(1, n + 1):
            config = BrokerConfig(data_dir=str(tmp_path / f"b{i}"), port=0, http_port=0, broker_id=i,
                                  **cfg)  # type: ignore[arg-type]
            srv = BrokerServer(config)
            await srv.start()
            addresses[i] = srv.address
            srv.topics.create(TOPIC, 1, topic_config or {}, srv.clock.wall_ms())
            nodes.append(Node(i, srv, isr_calls, addresses))
        yield nodes
    finally:
        for node in nodes:
            await node.mgr.close()
            await node.server.stop()


def record(leader: int, epoch: int, replicas: list[int], isr: list[int] | None = None
           ) -> QueueRecord:
    return QueueRecord(replicas, leader, epoch, list(replicas if isr is None else isr))


def assign(nodes: list[Node], rec: QueueRecord, min_insync: int = 1,
           skip: tuple[int, ...] = ()) -> None:
    """What the node does on a queue record: the leader leads, the other replicas follow."""
    for node in nodes:
        if node.id in skip:
            continue
        if node.id == rec.leader:
            node.mgr.become_leader(TOPIC, 0, rec, min_insync)
        elif node.id in rec.replicas:
            node.mgr.become_follower(TOPIC, 0, rec)


def batch(i: int, n: int = 3) -> bytes:
    return bytes(encode_batch([RecordInput(f"m{i}-{k}".encode() * 10, 1) for k in range(n)]))


@asynccontextmanager
async def connect(node: Node) -> AsyncIterator[Transport]:
    host, port = node.server.address
    t = await Transport.connect(host, port, 5)
    try:
        await t.request(m.HelloRequest("test", "0"), m.HelloResponse, 5)
        yield t
    finally:
        t.close()


async def produce(t: Transport, i: int, acks: int = Acks.ALL,
                  timeout_ms: int = 5000) -> m.ProduceResult:
    resp = await t.request(m.ProduceRequest(timeout_ms, [(TOPIC, 0, batch(i))], acks),
                           m.ProduceResponse, timeout_ms / 1000 + 5)
    return resp.results[0]


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def run(coro_fn: Callable[[], object]) -> None:
    asyncio.run(coro_fn())  # type: ignore[arg-type]


# --- copying -----------------------------------------------------------------------------------


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_followers_copy_the_leaders_log_exactly(tmp_path: Path, flush: str) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3, flush=flush) as nodes:
            assign(nodes, record(1, 1, [1, 2, 3]), min_insync=2)
            async with connect(nodes[0]) as t:
                for i in range(20):
                    res = await produce(t, i)
                    assert res[2] == 0, res
                    assert res[7] == Durability.REPLICATED
                    assert res[4] == 3 * i
            leader = nodes[0]
            end = leader.log.end_offset
            assert end == 60
            # acks=all answered: the HW covered it, so every in-sync follower has it
            assert leader.qs.visible_end == end
            for f in nodes[1:]:
                assert f.log.end_offset == end
                assert f.data() == leader.data()  # same bytes, same offsets
                assert f.log.epochs.entries() == [(1, 0)]
                if flush == "sync":
                    assert f.log.durable_offset == end
    run(main)


def test_a_long_poll_is_woken_by_the_append_not_a_timer(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2, replica_fetch_wait_ms=20_000) as nodes:
            assign(nodes, record(1, 1, [1, 2]), min_insync=2)
            async with connect(nodes[0]) as t:
                await produce(t, 0)  # the follower is connected and long-polling
                await asyncio.sleep(0.2)
                started = time.monotonic()
                for i in range(1, 11):
                    assert (await produce(t, i))[2] == 0
                took = time.monotonic() - started
            assert took < 2.0, f"10 acks=all produces took {took:.2f} s with a 20 s long poll"
    run(main)


def test_a_queue_resting_after_not_leader_joins_the_next_long_poll_when_its_rest_ends(
        tmp_path: Path) -> None:
    """A follower that learns of a new leader before that leader does is answered NOT_LEADER
    and rests the queue; when the rest ends the queue must be fetched at once, not after the
    long poll in flight for the fetcher's other queues (replica_fetch_wait_ms, 0.5 s by
    default: the txn failover bench's first commit after a kill waited that long for the new
    coordinator's follower of %TXN%state)."""
    async def main() -> None:
        async with cluster(tmp_path, 2, replica_fetch_wait_ms=20_000) as nodes:
            leader, follower = nodes
            for node in nodes:
                node.server.topics.create("other", 1, {}, node.server.clock.wall_ms())
            assign(nodes, record(1, 1, [1, 2]), min_insync=2)
            async with connect(leader) as t:
                await produce(t, 0)
                await asyncio.sleep(0.2)  # the follower long-polls rep/0
                rec = record(1, 1, [1, 2])
                follower.mgr.become_follower("other", 0, rec)  # before the leader knows
                fq = follower.mgr.followers[("other", 0)]
                await until(lambda: fq.rest_until > 0)  # NOT_LEADER: the queue rests
                leader.mgr.become_leader("other", 0, rec, 2)
                started = time.monotonic()
                resp = await t.request(
                    m.ProduceRequest(10_000, [("other", 0, batch(1))], Acks.ALL),
                    m.ProduceResponse, 15)
                took = time.monotonic() - started
            assert resp.results[0][2] == 0, resp.results[0]
            assert took < 2.0, f"acks=all took {took:.2f} s with a 20 s long poll on rep/0"
    run(main)


def test_an_append_woken_by_a_fetch_that_moved_the_hw_wakes_that_fetch_s_long_poll(
        tmp_path: Path) -> None:
    """The follower's long poll moves the HW when it arrives, which wakes whoever waited for
    acks (a transaction coordinator, which then appends at once: a marker after its decision);
    that append must wake the long poll the same request goes on to wait in, not be missed
    until the poll times out (it was: ~replica_fetch_wait_ms per transaction commit)."""
    async def main() -> None:
        async with cluster(tmp_path, 2, flush="async", replica_fetch_wait_ms=20_000) as nodes:
            leader = nodes[0]
            assign(nodes, record(1, 1, [1, 2]), min_insync=2)
            async with connect(leader) as t:
                await produce(t, 0)
                await asyncio.sleep(0.2)  # the follower is long-polling
                qs = leader.qs
                loop = asyncio.get_running_loop()

                def append(i: int) -> asyncio.Future[BaseException | None]:
                    res = qs.log.append(batch(i), now_ms=int(time.time() * 1000))
                    leader.server.flusher.mark_dirty(qs)
                    qs.advance(qs.log.end_offset)
                    acked: asyncio.Future[BaseException | None] = loop.create_future()
                    qs.replica.wait_acks(res.last_offset + 1, 30_000,
                                         lambda e: acked.done() or acked.set_result(e))
                    return acked

                assert await append(1) is None  # resumed by the HW move itself (no wait_for:
                # that would resume this a loop step later, after the poll's task started)
                started = time.monotonic()
                assert await asyncio.wait_for(append(2), 10) is None
                took = time.monotonic() - started
            assert took < 2.0, f"the append right after the HW moved was acked in {took:.2f} s"
    run(main)


def test_a_caught_up_follower_reports_its_fsync_with_its_next_long_poll(tmp_path: Path) -> None:
    """Sync mode: a follower that copied up to the leader's end sends its next long poll once
    its flush made the copy durable, so the long poll carries the durable offset: one answer per
    acks=all produce, not one more for a separate position report."""
    async def main() -> None:
        async with cluster(tmp_path, 2, flush="sync") as nodes:
            leader, follower = nodes
            assign(nodes, record(1, 1, [1, 2]), min_insync=2)
            async with connect(leader) as t:
                await produce(t, 0)
                await asyncio.sleep(0.2)
                fetcher = follower.mgr.fetchers[1]
                rounds = fetcher.rounds
                for i in range(1, 21):
                    assert (await produce(t, i))[2] == 0
                    # acknowledged: the follower has it fsynced (the promise is unchanged)
                    assert follower.log.durable_offset >= leader.log.end_offset
                answers = fetcher.rounds - rounds
            assert answers <= 22, f"{answers} answers for 20 produces: position reports"
    run(main)


# --- the high watermark and acks=all -----------------------------------------------------------


def test_hw_and_acks_all_wait_for_the_follower(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2) as nodes:
            leader, follower = nodes
            rec = record(1, 1, [1, 2])
            assign(nodes, rec, min_insync=2, skip=(2,))  # the follower does not fetch yet
            async with connect(leader) as t:
                pending = asyncio.ensure_future(produce(t, 0, timeout_ms=10_000))
                await asyncio.sleep(0.5)
                assert not pending.done()  # stored and fsynced on the leader, not acked
                assert leader.log.end_offset == 3 and leader.log.durable_offset == 3
                assert leader.qs.visible_end == 0  # consumers see nothing above the HW
                fetched = await t.request(m.FetchRequest(0, 0, 1 << 20, [(TOPIC, 0, 0, 1 << 20,
                                                                          "")]),
                                          m.FetchResponse, 5)
                assert fetched.results[0][7] == b"" and fetched.results[0][4] == 0
                follower.mgr.become_follower(TOPIC, 0, rec)
                res = await asyncio.wait_for(pending, 5)
                assert res[2] == 0 and res[4:6] == (0, 2)
                assert leader.qs.visible_end == 3
                assert follower.data() == leader.data()
    run(main)


def test_acks_all_times_out_and_acks_leader_does_not_wait(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2) as nodes:
            assign(nodes, record(1, 1, [1, 2]), min_insync=2, skip=(2,))
            async with connect(nodes[0]) as t:
                res = await produce(t, 0, timeout_ms=300)
                assert res[2] == ErrorCode.NOT_ENOUGH_REPLICAS
                assert "within 300 ms" in res[3]
                res = await produce(t, 1, acks=Acks.LEADER)
                assert res[2] == 0 and res[7] == Durability.FSYNCED
            assert nodes[0].qs.visible_end == 0
    run(main)


def test_acks_all_is_refused_before_the_append_below_min_insync(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2) as nodes:
            leader, follower = nodes
            rec = record(1, 1, [1, 2], isr=[1])
            assign(nodes, rec, min_insync=2, skip=(2,))
            async with connect(leader) as t:
                res = await produce(t, 0)
                assert res[2] == ErrorCode.NOT_ENOUGH_REPLICAS
                assert "min_insync 2" in res[3]
                assert leader.log.end_offset == 0  # nothing stored
                assert (await produce(t, 1, acks=Acks.LEADER))[2] == 0
                with pytest.raises(NotEnoughReplicasError, match="min_insync"):
                    leader.mgr.check_acks_all(TOPIC, 0)
                # the follower catches up and is taken back: acks=all works again
                follower.mgr.become_follower(TOPIC, 0, rec)
                await until(lambda: (1, [1, 2]) in leader.isr_calls)
                assert (await produce(t, 2))[2] == 0
                assert follower.data() == leader.data()
    run(main)


def test_fence_fails_waits_and_refuses_acks_all(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2) as nodes:
            leader, follower = nodes
            assign(nodes, record(1, 1, [1, 2]), min_insync=2, skip=(2,))
            async with connect(leader) as t:
                pending = asyncio.ensure_future(produce(t, 0, timeout_ms=10_000))
                await until(lambda: leader.log.end_offset == 3)
                leader.mgr.fence()
                res = await asyncio.wait_for(pending, 5)
                assert res[2] == ErrorCode.NOT_LEADER and "metadata store" in res[3]
                assert (await produce(t, 1))[2] == ErrorCode.NOT_LEADER
                assert leader.log.end_offset == 3
                leader.mgr.unfence()
                follower.mgr.become_follower(TOPIC, 0, record(1, 1, [1, 2]))
                assert (await produce(t, 2))[2] == 0
    run(main)


def test_a_follower_refuses_produce_and_stale_fetches_are_fenced(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2) as nodes:
            assign(nodes, record(1, 3, [1, 2]))
            async with connect(nodes[1]) as t:
                res = await produce(t, 0)
                assert res[2] == ErrorCode.NOT_LEADER and "broker 1 leads it" in res[3]
            async with connect(nodes[0]) as t:
                stale = m.ReplicaFetchRequest(2, 1, 0, 1 << 20, [(TOPIC, 0, 2, 0, 0)])
                r = (await t.request(stale, m.ReplicaFetchResponse, 5)).results[0]
                assert r[2] == ErrorCode.FENCED_LEADER_EPOCH
                stranger = m.ReplicaFetchRequest(7, 1, 0, 1 << 20, [(TOPIC, 0, 3, 0, 0)])
                r = (await t.request(stranger, m.ReplicaFetchResponse, 5)).results[0]
                assert r[2] == ErrorCode.NOT_LEADER
            async with connect(nodes[1]) as t:  # not the leader
                req = m.OffsetForEpochRequest(1, [(TOPIC, 0, 3, 3)])
                r2 = (await t.request(req, m.OffsetForEpochResponse, 5)).results[0]
                assert r2[2] == ErrorCode.NOT_LEADER
    run(main)


# --- the ISR ------------------------------------------------------------------------------------


def test_isr_shrinks_after_the_lag_and_expands_after_catching_up(tmp_path: Path) -> None:
    async def main() -> None:
        # 1 s of lag: a loaded CI machine can stall the fetching broker 2 for 400 ms, which
        # dropped it too and refused the acks=all produce with NOT_ENOUGH_REPLICAS
        async with cluster(tmp_path, 3, replica_lag_ms=1000) as nodes:
            leader = nodes[0]
            rec = record(1, 1, [1, 2, 3])
            assign(nodes, rec, min_insync=2)
            async with connect(leader) as t:
                assert (await produce(t, 0))[2] == 0
                nodes[2].mgr.stop_replica(TOPIC, 0)  # broker 3 stops fetching
                started = time.monotonic()
                res = await produce(t, 1, timeout_ms=10_000)  # waits until 3 is dropped
                waited = time.monotonic() - started
                assert res[2] == 0
                assert (1, [1, 2]) in leader.isr_calls
                assert 0.8 < waited < 8, waited
                assert leader.mgr.leaders[(TOPIC, 0)].isr.isr == [1, 2]
                for i in range(2, 6):  # broker 3 no longer holds acks=all back
                    assert (await produce(t, i))[2] == 0
                assert nodes[2].log.end_offset == 3
                # broker 3 comes back, catches up and is taken back
                nodes[2].mgr.become_follower(TOPIC, 0, replace(rec, isr=[1, 2]))
                await until(lambda: (1, [1, 2, 3]) in leader.isr_calls)
                assert leader.mgr.leaders[(TOPIC, 0)].isr.isr == [1, 2, 3]
                assert nodes[2].data() == leader.data()
            assert [c for c in leader.isr_calls if c[0] != 1] == []
    run(main)


def test_a_refused_isr_change_keeps_the_old_isr(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2, replica_lag_ms=200) as nodes:
            leader = nodes[0]
            leader.isr_answer = False  # the node's compare-and-swap fails (stale view)
            assign(nodes, record(1, 1, [1, 2]), min_insync=1, skip=(2,))
            await until(lambda: len(leader.isr_calls) >= 2)  # proposed again later
            assert leader.mgr.leaders[(TOPIC, 0)].isr.isr == [1, 2]
            assert all(c == (1, [1]) for c in leader.isr_calls)
    run(main)


def test_an_isr_write_of_unknown_outcome_keeps_counting_its_added_member(tmp_path: Path) -> None:
    # the store applied the expansion and the answer was lost: the controller may elect broker
    # 3 from now on, so until the outcome is known the leader must wait for 3 as for a member
    async def main() -> None:
        async with cluster(tmp_path, 3, replica_lag_ms=400) as nodes:
            leader = nodes[0]
            outcomes: list[bool | Exception] = [MetadataUnavailableError("answer lost"), True]
            seen: list[list[int]] = []
            calls = 0

            async def on_isr_change(topic: str, queue: int, isr: list[int]) -> list[int] | None:
                nonlocal calls
                calls += 1
                lq = leader.mgr.leaders[(TOPIC, 0)]
                # what the leader counts once this answer is taken in
                asyncio.get_running_loop().call_soon(lambda: seen.append(lq.isr.maximal()))
                out = outcomes.pop(0) if outcomes else True
                if isinstance(out, Exception):
                    raise out
                return list(isr) if out else None

            leader.mgr._on_isr_change = on_isr_change
            assign(nodes, record(1, 1, [1, 2, 3], isr=[1, 2]), min_insync=1)
            await until(lambda: leader.mgr.leaders[(TOPIC, 0)].isr.isr == [1, 2, 3])
            assert calls == 2
            assert seen[0] == [1, 2, 3], seen  # not [1, 2] while the outcome is unknown
    run(main)


def test_a_new_leader_lets_consumers_wait_between_its_high_watermark_and_its_end(
        tmp_path: Path) -> None:
    # a new leader learns the high watermark from its followers' next fetches, so for a moment
    # it is below offsets consumers already read from the old leader: Kafka answers such a fetch
    # empty; OFFSET_OUT_OF_RANGE would send the consumer to its reset policy (seen in a
    # failover bench as "resetting to EARLIEST")
    async def fetch_at(t: Transport, offset: int) -> m.FetchResult:
        req = m.FetchRequest(0, 0, 1 << 20, [(TOPIC, 0, offset, 1 << 20, "")])
        return (await t.request(req, m.FetchResponse, 5)).results[0]

    async def main() -> None:
        async with cluster(tmp_path, 3, replica_lag_ms=60_000) as nodes:
            assign(nodes, record(1, 1, [1, 2, 3]), min_insync=1)
            async with connect(nodes[0]) as t:
                assert (await produce(t, 0))[2] == 0  # offsets 0..2 on every replica
                await until(lambda: nodes[1].qs.visible_end == 3)
                nodes[2].mgr.stop_replica(TOPIC, 0)  # broker 3 holds the watermark at 3
                assert (await produce(t, 1, acks=Acks.LEADER))[2] == 0  # offsets 3..5
            await until(lambda: nodes[1].log.end_offset == 6)
            assert nodes[1].qs.visible_end == 3
            nodes[0].mgr.stop_replica(TOPIC, 0)
            nodes[1].mgr.become_leader(TOPIC, 0, record(2, 2, [1, 2, 3], isr=[2, 3]), 2)
            async with connect(nodes[1]) as t:
                assert nodes[1].qs.visible_end == 3
                for offset in (4, 6):  # between the watermark and the end: nothing yet
                    res = await fetch_at(t, offset)
                    assert (res[2], res[4], res[7]) == (0, 3, b"")
                res = await fetch_at(t, 7)  # beyond the end: out of range
                assert res[2] == ErrorCode.OFFSET_OUT_OF_RANGE
    run(main)


# --- truncation by epoch -------------------------------------------------------------------------


def test_a_follower_truncates_a_divergent_tail_after_a_leader_change(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2) as nodes:
            a, b = nodes
            assign(nodes, record(1, 1, [1, 2]), min_insync=2)
            async with connect(a) as t:
                for i in range(3):
                    assert (await produce(t, i))[2] == 0  # on both: offsets 0..8
                b.mgr.stop_replica(TOPIC, 0)  # b is cut off
                for i in range(3, 5):  # a's tail in epoch 1, never on b: offsets 9..14
                    assert (await produce(t, i, acks=Acks.LEADER))[2] == 0
            assert a.log.end_offset == 15 and b.log.end_offset == 9
            # b becomes leader at epoch 2 (the controller's choice) and writes its own tail
            a.mgr.stop_replica(TOPIC, 0)
            b.mgr.become_leader(TOPIC, 0, record(2, 2, [1, 2], isr=[2]), 1)
            async with connect(b) as t:
                for i in range(100, 104):
                    assert (await produce(t, i))[2] == 0  # offsets 9..20 in epoch 2
            assert b.log.epochs.entries() == [(1, 0), (2, 9)]
            # a follows b: asks where epoch 1 ends on b (9), truncates its tail, copies b's
            a.mgr.become_follower(TOPIC, 0, record(2, 2, [1, 2], isr=[2]))
            await until(lambda: a.log.end_offset == b.log.end_offset)
            assert a.data() == b.data()
            assert a.log.epochs.entries() == [(1, 0), (2, 9)]
            assert b"m3-0" not in a.data()  # the divergent tail is gone
    run(main)


def test_a_new_leader_keeps_the_followers_tail_and_commits_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3) as nodes:
            assign(nodes, record(1, 1, [1, 2, 3]), min_insync=2)
            async with connect(nodes[0]) as t:
                for i in range(4):
                    assert (await produce(t, i))[2] == 0
            end = nodes[0].log.end_offset
            # broker 1 dies; 2 leads at epoch 2, 3 follows it: nothing acknowledged is lost
            nodes[0].mgr.stop_replica(TOPIC, 0)
            rec = record(2, 2, [1, 2, 3], isr=[2, 3])
            assign(nodes, rec, min_insync=2, skip=(1,))
            async with connect(nodes[1]) as t:
                res = await produce(t, 50)
                assert res[2] == 0 and res[4] == end
            assert nodes[2].data() == nodes[1].data()
            assert nodes[1].data().startswith(nodes[0].data())
    run(main)


def test_a_follower_behind_the_leaders_start_starts_again_there(tmp_path: Path) -> None:
    async def main() -> None:
        config = {"segment_bytes": "2000", "retention_ms": "1"}
        async with cluster(tmp_path, 2, config) as nodes:
            leader, follower = nodes
            rec = record(1, 1, [1, 2], isr=[1])
            assign(nodes, rec, skip=(2,))  # the follower is away
            async with connect(leader) as t:
                for i in range(30):
                    assert (await produce(t, i))[2] == 0
            leader.log.delete_old_segments(leader.server.clock.wall_ms() + 60_000)
            start = leader.log.start_offset
            assert start > 0  # retention on the leader took what the follower lacks
            follower.mgr.become_follower(TOPIC, 0, rec)
            await until(lambda: follower.log.end_offset == leader.log.end_offset)
            assert follower.log.start_offset == start
            assert follower.log.read(start, 1 << 30) == leader.log.read(start, 1 << 30)
            assert follower.log.epochs.entries() == leader.log.epochs.entries()
    run(main)


def test_the_real_producer_gets_replicated_acks_and_a_follower_the_same_bytes(
        tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3) as nodes:
            assign(nodes, record(1, 1, [1, 2, 3]), min_insync=2)
            host, port = nodes[0].server.address
            async with AsyncProducer(f"{host}:{port}", acks="all") as producer:
                results = await asyncio.gather(*(
                    producer.send(Message(TOPIC, f"body-{i}")) for i in range(50)))
            assert {r.durability.name for r in results} == {"REPLICATED"}
            assert sorted(r.offset for r in results) == list(range(50))
            for f in nodes[1:]:  # idempotent batches: producer state copied with them
                assert f.data() == nodes[0].data()
                assert (dict(f.log.producer_state.entries)
                        == dict(nodes[0].log.producer_state.entries))
    run(main)


def test_a_restarted_follower_takes_the_leaders_hw_not_its_log_end(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3) as nodes:
            a, b, _c = nodes
            rec = record(1, 1, [1, 2, 3])
            assign(nodes, rec, min_insync=2, skip=(3,))  # 3 is in the ISR but away: HW stays
            async with connect(a) as t:
                for i in range(2):
                    assert (await produce(t, i, acks=Acks.LEADER))[2] == 0
            await until(lambda: b.log.end_offset == 6 and b.log.durable_offset == 6)
            assert a.qs.visible_end == 0
            # b restarts: recovery shows its whole log, 6, above the leader's HW
            await b.mgr.close()
            await b.server.stop()
            srv = BrokerServer(b.server.config)
            await srv.start()
            b.server = srv
            b.mgr = ReplicaManager(2, 2, srv.topics, srv.config, srv.clock, srv.flusher,
                                   {1: a.server.address}.get, b.mgr._on_isr_change)
            srv.replicas = b.mgr
            assert b.qs.visible_end == 6
            b.mgr.become_follower(TOPIC, 0, rec)
            await until(lambda: b.qs.visible_end == 0)
            # so as leader (broker 1 gone) it starts from the HW it knows, not from 6
            a.mgr.stop_replica(TOPIC, 0)
            b.mgr.become_leader(TOPIC, 0, record(2, 2, [1, 2, 3], isr=[2, 3]), 2)
            assert b.mgr.high_watermark(TOPIC, 0) == 0
    run(main)
