"""A whole cluster in one process: three real brokers (``BrokerServer`` on port 0, real sockets,
real logs) joined through one memory metadata store, driven by the real clients. The node, the
controller and replication run as they do under etcd; only the store is the in-process backend
(the same tests against etcd and broker processes are in ``test_cluster_etcd.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.server import BrokerServer
from ferrymq.client import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from ferrymq.client.message import Durability
from ferrymq.client.retry import Backoff
from ferrymq.cluster.model import QueueRecord
from ferrymq.errors import ClusterStartError, InvalidReplicationFactorError
from tests.cluster.inprocess import cluster, leader_of, run

pytestmark = pytest.mark.integration


def test_replicated_topic_survives_its_leaders_loss(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, replica_lag_ms=2000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
                with pytest.raises(InvalidReplicationFactorError):
                    await admin.create_topic("too-many", 1, replicas=4)
                d = await admin.cluster_describe()
                assert sorted(b.broker_id for b in d.brokers) == [1, 2, 3]
            sent: list[bytes] = []
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                for i in range(200):
                    body = f"m{i}".encode()
                    r = await p.send(Message("orders", body, sharding_key=str(i % 7)))
                    assert r.durability == Durability.REPLICATED
                    sent.append(body)
                # every in-sync replica holds what was acknowledged
                for q in (0, 1):
                    ends = {bid: s.topics.queue("orders", q).log.end_offset
                            for bid, s in c.brokers.items()}
                    assert len(set(ends.values())) == 1, ends
                victim = leader_of(c, "orders", 0)
                await c.stop(victim)  # graceful: the lease is revoked, the controller moves it
                await c.wait(lambda: leader_of(c, "orders", 0) not in (victim, -1),
                             "a new leader of orders/0")
                for i in range(200, 300):
                    body = f"m{i}".encode()
                    r = await p.send(Message("orders", body, sharding_key=str(i % 7)))
                    assert r.durability == Durability.REPLICATED  # min_insync 2 of 2 live
                    sent.append(body)
            got: list[bytes] = []
            async with AsyncPullConsumer(c.bootstrap, group="g", auto_offset_reset="earliest",
                                         ) as consumer:
                await consumer.subscribe("orders")
                deadline = time.monotonic() + 30
                while len(got) < len(sent) and time.monotonic() < deadline:
                    for msg in await consumer.poll(timeout=1.0):
                        got.append(msg.body)
            assert sorted(got) == sorted(sent)
            assert len(got) == len(set(got)), "no duplicates"

    run(body)


def test_a_second_broker_with_the_same_id_refuses_to_start(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, n=1) as c:
            config = BrokerConfig(data_dir=str(tmp_path / "again"), port=0, http_port=0, broker_id=1,
                                  metadata="memory://", cluster="t").validate()
            srv = BrokerServer(config, metadata_store=c.store)
            with pytest.raises(ClusterStartError, match="broker id 1 is held by a live broker"):
                await srv.start()

    run(body)



def test_an_isr_expansion_whose_answer_was_lost_is_settled_from_the_store(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, replica_lag_ms=500) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            leader = leader_of(c, "orders", 0)
            follower = next(b for b in c.brokers if b != leader)

            def isr() -> list[int]:
                srv = c.brokers[leader]
                assert srv.replicas is not None
                return srv.replicas.leaders[("orders", 0)].isr.isr

            await c.stop(follower)
            await c.wait(lambda: follower not in isr(), "the stopped follower out of the ISR")
            node = c.brokers[leader].cluster.node  # type: ignore[union-attr]
            key = node.keys.queue("orders", 0)
            c.store.lose_answer_of.add(key)  # the expansion is applied; the leader hears a timeout
            await c.start(follower)
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                await p.send(Message("orders", b"x"))
            await c.wait(lambda: follower in isr(), "the follower back in the ISR")
            assert not c.store.lose_answer_of  # the fault did happen
            kv = await c.store.get(key)
            assert kv is not None and follower in QueueRecord.decode(kv).isr

    with caplog.at_level(logging.WARNING, logger="ferrymq.broker.cluster_link"):
        run(body)
    assert "was lost" in caplog.text


def test_a_follower_lost_while_its_queue_is_idle_does_not_come_back_into_the_isr(
        tmp_path: Path) -> None:
    # a follower lost while nothing is written is at the leader's end: once the controller has
    # taken it out of the ISR, the leader finds it caught up and proposes it back. The store
    # leaves it out (its broker key is gone), and the leader must take that ISR, not the one it
    # proposed: else acks="all" waits for the dead broker until replica_lag_ms drops it again
    # (the txn failover bench took 10 s to commit a transaction after most kills)
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, replica_lag_ms=8000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            async with AsyncProducer(c.bootstrap, linger_ms=0, delivery_timeout_s=30,
                                     request_timeout_s=30) as p:
                await p.send(Message("orders", b"before"))
                leader = leader_of(c, "orders", 0)
                follower = next(b for b in c.brokers if b != leader)
                srv = c.brokers[leader]
                assert srv.replicas is not None and srv.cluster is not None
                lq = srv.replicas.leaders[("orders", 0)]
                await c.wait(lambda: lq.isr.isr == [leader, *sorted(set(c.brokers) - {leader})]
                             and lq.hw == lq.qs.log.end_offset, "both followers in sync")
                await c.stop(follower)
                view = srv.cluster.node.view
                await c.wait(lambda: follower not in view.queues[("orders", 0)].isr,
                             "the controller's shrink")
                await asyncio.sleep(1.5)  # the leader's ISR check runs (every second here)
                assert follower not in lq.isr.isr, lq.isr.isr
                t0 = time.monotonic()
                r = await p.send(Message("orders", b"after"))
                took = time.monotonic() - t0
                assert r.durability == Durability.REPLICATED
                assert took < 2, took  # not replica_lag_ms (8 s)
                assert lq.isr.isr == view.queues[("orders", 0)].isr

    run(body)


class EarlyTimerLoop(asyncio.SelectorEventLoop):
    """An event loop whose timers fire 2 ms early (an injected fault: uvloop rounds delays to
    whole milliseconds, so about half its timers fire up to 0.5 ms before the loop's clock
    reaches their time)."""

    def call_at(self, when: float, callback: Any, *args: Any,
                context: Any = None) -> asyncio.TimerHandle:
        return super().call_at(when - 0.002, callback, *args, context=context)


def test_a_producer_retry_is_sent_when_its_timer_fires_early(tmp_path: Path) -> None:
    # a batch refused (retriable) waits for its backoff on a timer; one firing early found the
    # retry not due yet and the sender went back to sleep for good: the send never finished,
    # not even at delivery_timeout_s (the txn failover bench, on uvloop, hung so)
    async def body() -> None:
        async with cluster(tmp_path, 2, metadata_lease_ms=2000, replica_lag_ms=2000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=2, min_insync=2)
            async with AsyncProducer(c.bootstrap, linger_ms=0, delivery_timeout_s=30) as p:
                await p.send(Message("orders", b"before"))
                leader = leader_of(c, "orders", 0)
                follower = next(b for b in c.brokers if b != leader)
                await c.stop(follower)
                view = c.brokers[leader].cluster.node.view  # type: ignore[union-attr]
                await c.wait(lambda: view.queues[("orders", 0)].isr == [leader],
                             "the stopped follower out of the ISR")
                sending = asyncio.ensure_future(p.send(Message("orders", b"after")))
                await asyncio.sleep(1.0)  # refused: NOT_ENOUGH_REPLICAS, retried
                assert not sending.done()
                await c.start(follower)
                r = await asyncio.wait_for(sending, 15)
                assert r.durability == Durability.REPLICATED

    with asyncio.Runner(loop_factory=EarlyTimerLoop) as runner:
        runner.run(asyncio.wait_for(body(), 120))


def test_a_retry_goes_to_the_new_leader_without_waiting_out_its_backoff(tmp_path: Path) -> None:
    # KIP-951: once a refresh names the queue's new leader, the retry goes at once
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, replica_lag_ms=2000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            async with AsyncProducer(c.bootstrap, linger_ms=0, delivery_timeout_s=30) as p:
                await p.send(Message("orders", b"before"))
                p._sender.backoff = Backoff(base_s=6, cap_s=6, floor_s=6)  # a batch's retry: 6 s
                victim = leader_of(c, "orders", 0)
                t0 = time.monotonic()
                sending = asyncio.ensure_future(p.send(Message("orders", b"after")))
                await c.stop(victim)  # graceful: its lease is revoked, a leader is elected
                res = await sending
                took = time.monotonic() - t0
                assert res.durability == Durability.REPLICATED
                assert leader_of(c, "orders", 0) != victim
                assert took < 4, took  # not the 6 s backoff

    run(body)


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_a_dedup_duplicate_on_a_replicated_queue_says_replicated(tmp_path: Path,
                                                                 flush: str) -> None:
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, flush=flush) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, {"dedup_window_ms": "60000"},
                                         replicas=3, min_insync=2)
            async with AsyncProducer(c.bootstrap, linger_ms=0) as p:
                first = await p.send(Message("orders", b"x", dedup_key="k1"))
                again = await p.send(Message("orders", b"x", dedup_key="k1"))
            assert first.durability == again.durability == Durability.REPLICATED
            assert (again.queue, again.offset) == (first.queue, first.offset)


def test_requests_to_a_leader_keep_their_order_while_its_session_connects(
        tmp_path: Path) -> None:
    # issue 20's stalled bench: the first batch to a leader not connected yet waited for the
    # connection while a later batch of the same queue, shipped once the connection was open,
    # was written before it; the broker took the later one first (a producer it did not know
    # yet may start at any sequence) and refused the first as out of order
    async def body() -> None:
        async with cluster(tmp_path) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 3, replicas=3, min_insync=2)
            home = next(q for q in range(3) if leader_of(c, "orders", q) == 1)
            q = next(q for q in range(3) if leader_of(c, "orders", q) != 1)
            leader = leader_of(c, "orders", q)
            one = c.brokers[1].address
            async with AsyncProducer(f"{one[0]}:{one[1]}", acks="leader", linger_ms=0,
                                     delivery_timeout_s=20,
                                     queue_selector=lambda msg, n: int(msg.body[:1])) as p:
                await p.send(Message("orders", b"%d" % home))  # metadata; broker 1 only
                assert leader not in p._cluster.sessions
                futs = [p.send_nowait(Message("orders", b"%d-0" % q))]  # starts the connect
                while (s := p._cluster.sessions.get(leader)) is None or s.open_connection is None:
                    await asyncio.sleep(0)
                for i in range(1, 4):  # shipped at once on the open connection
                    futs.append(p.send_nowait(Message("orders", b"%d-%d" % (q, i))))
                    await asyncio.sleep(0)
                results = await asyncio.wait_for(asyncio.gather(*futs), 30)
            assert [r.offset for r in results] == [0, 1, 2, 3]
            async with AsyncPullConsumer(c.bootstrap, group="", auto_offset_reset="earliest",
                                         auto_commit=False) as cons:
                await cons.assign([("orders", q)])
                got: list[bytes] = []
                deadline = time.monotonic() + 10
                while len(got) < 4 and time.monotonic() < deadline:
                    got += [msg.body for msg in await cons.poll(0.5)]
            assert got == [b"%d-%d" % (q, i) for i in range(4)]

    run(body)
