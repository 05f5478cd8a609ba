"""Cluster-aware clients against real brokers: a single broker is a cluster of one (one
connection, every queue led by it), acks, refreshes coalescing, and routing to two brokers.

The brokers of a cluster are not there yet (issue 20 builds them in parallel), so a view in
which two brokers lead different queues cannot come from a broker's answer today. The last
tests give the client such a view by hand (an injected fault, labelled so) and check, over real
sockets, that each queue's produce and fetch go to the broker the view names (two real single
brokers), and that a NOT_LEADER answer (from a stand-in for a deposed leader,
tests/cluster/deposed.py) sends the client to the leader a real broker names.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ferrymq import Broker
from ferrymq.client import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Durability, Message
from ferrymq.client._cluster import Cluster
from ferrymq.client._session import Session
from ferrymq.errors import ConfigError
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import decode_header
from tests.cluster.deposed import DeposedLeader
from tests.helpers import wait_for


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def create(address: str, topic: str, queues: int) -> int:
    async with AsyncAdminClient(address) as admin:
        await admin.create_topic(topic, queues)
        return next(t.topic_id for t in await admin.list_topics() if t.name == topic)


def test_a_single_broker_is_one_connection_leading_every_queue(broker: Broker) -> None:
    async def main() -> None:
        await create(broker.address, "a", 4)
        await create(broker.address, "b", 3)
        async with AsyncProducer(broker.address, linger_ms=0) as p:
            for i in range(40):
                await p.send(Message("a" if i % 2 else "b", b"x%d" % i, sharding_key=str(i)))
            cluster: Cluster = p._cluster
            assert cluster.sessions == {}  # no broker session besides the bootstrap one
            assert {cluster.route(t, q) for t, n in (("a", 4), ("b", 3)) for q in range(n)} == {
                p._session}
            assert 1 <= cluster.refreshes <= 2  # one per topic first used, nothing per send
            assert len(broker.server.connections) == 1
            async with AsyncPullConsumer(broker.address, group="", auto_offset_reset="earliest",
                                         auto_commit=False) as c:
                await c.assign([("a", q) for q in range(4)] + [("b", q) for q in range(3)])
                got: list[bytes] = []
                deadline = time.monotonic() + 10
                while len(got) < 40 and time.monotonic() < deadline:
                    got += [msg.body for msg in await c.poll(0.5)]
                assert sorted(got) == sorted(b"x%d" % i for i in range(40))
                assert c._cluster.sessions == {}
                assert len(broker.server.connections) == 2  # the producer's and the consumer's

    run(main())


def test_cluster_metadata_of_a_single_broker_names_itself(broker: Broker) -> None:
    async def main() -> None:
        await create(broker.address, "t", 2)
        session = Session(broker.address)
        cluster = Cluster(session)
        try:
            await cluster.ensure("t")
            host, port = broker.server.address
            assert cluster.leaders.brokers == {0: (host, port)}
            assert [cluster.leaders.leader("t", q) for q in range(2)] == [0, 0]
            assert [cluster.leaders.epoch("t", q) for q in range(2)] == [0, 0]
        finally:
            await cluster.close()
            await session.close()

    run(main())


@pytest.mark.parametrize("acks", ["all", "leader"])
def test_both_acks_store_on_a_single_broker(broker: Broker, acks: str) -> None:
    async def main() -> None:
        async with AsyncProducer(broker.address, acks=acks) as p:
            assert p._sender._acks == {"all": m.Acks.ALL, "leader": m.Acks.LEADER}[acks]
            res = await p.send(Message("t", b"hello"))
            assert res.durability is Durability.FSYNCED  # one broker: its own flush
            results = await p.send_batch([Message("t", b"%d" % i) for i in range(5)])
            assert [r.offset for r in results] == list(range(res.offset + 1, res.offset + 6))

    run(main())


@pytest.mark.parametrize("bad", ["x", "ALL", 1, None])
def test_a_bad_acks_is_refused_naming_the_choices(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"acks must be one of 'all', 'leader', not "):
        AsyncProducer("127.0.0.1:1", acks=bad)


def test_refreshes_coalesce_and_keep_their_interval(broker: Broker) -> None:
    async def main() -> None:
        await create(broker.address, "t", 1)
        await create(broker.address, "u", 1)
        session = Session(broker.address)
        cluster = Cluster(session, min_refresh_interval_s=0.2)
        try:
            await cluster.ensure("t")
            started = time.monotonic()
            await cluster.ensure("u")  # a topic's first use does not wait for the interval
            assert time.monotonic() - started < 0.15
            assert cluster.refreshes == 2
            await cluster.ensure("t")  # known: nothing asked
            assert cluster.refreshes == 2
            started = time.monotonic()
            for _ in range(50):  # a burst of NOT_LEADER answers after a failover
                cluster.refresh_soon(["t"])
            await cluster.refresh()
            # the burst became one refresh, after the interval (+1 asked for meanwhile at most)
            assert cluster.refreshes in (3, 4)
            assert time.monotonic() - started >= 0.15
        finally:
            await cluster.close()
            await session.close()

    run(main())


def test_a_dead_bootstrap_address_is_skipped(broker: Broker) -> None:
    async def main() -> None:
        async with AsyncProducer(f"127.0.0.1:1,{broker.address}", connect_timeout_s=5) as p:
            res = await p.send(Message("t", b"x"))
            assert res.offset == 0

    run(main())


# -- two brokers, and a view the brokers cannot give yet (injected) -------------------------


@pytest.fixture
def two_brokers(tmp_path: Path) -> Iterator[tuple[Broker, Broker]]:
    one = Broker(tmp_path / "one", broker_id=1).start()
    two = Broker(tmp_path / "two", broker_id=2).start()
    try:
        yield one, two
    finally:
        one.stop()
        two.stop()


def view(one: Broker, two: Broker, topic_id: int) -> m.ClusterMetadataResponse:
    """Queue 0 led by broker 1, queue 1 by broker 2 (epoch 5: newer than either broker's own
    answer, which a client takes for a lagging broker's)."""
    h1, p1 = one.server.address
    h2, p2 = two.server.address
    return m.ClusterMetadataResponse("test", 1, [(1, h1, p1), (2, h2, p2)], [
        ("t", 0, topic_id, 1, [(0, 1, 5, [1, 2], [1, 2]), (1, 2, 5, [2, 1], [2, 1])])])


def test_each_queue_goes_to_its_leader_over_a_session_per_broker(
        two_brokers: tuple[Broker, Broker]) -> None:
    one, two = two_brokers

    async def main() -> None:
        topic_id = await create(one.address, "t", 2)
        await create(two.address, "t", 2)
        async with AsyncProducer(one.address, linger_ms=0,
                                 queue_selector=lambda msg, n: int(msg.body[:1])) as p:
            p._cluster.leaders.update(view(one, two, topic_id))  # injected: see the docstring
            r0 = await p.send(Message("t", b"0-first"))
            r1 = await p.send(Message("t", b"1-first"))
            results = await p.send_batch([Message("t", b"%d-more" % (i % 2)) for i in range(6)])
            assert (r0.queue, r1.queue) == (0, 1)
            assert [r.queue for r in results] == [0, 1] * 3
            to_two = p._cluster.sessions[2]
            assert to_two.hello is not None and to_two.hello.broker_id == 2
            assert set(p._cluster.sessions) == {2}  # broker 1 is the bootstrap session
        async with AsyncAdminClient(one.address) as a1, AsyncAdminClient(two.address) as a2:
            d1 = await a1.describe_topic("t")
            d2 = await a2.describe_topic("t")
        ends1 = [q.end_offset for q in d1.queues]
        ends2 = [q.end_offset for q in d2.queues]
        assert (ends1, ends2) == ([4, 0], [0, 4])  # each queue only on its leader

        async with AsyncPullConsumer(one.address, group="", auto_offset_reset="earliest",
                                     auto_commit=False) as c:
            c._cluster.leaders.update(view(one, two, topic_id))  # injected, as above
            await c.assign([("t", 0), ("t", 1)])
            got: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + 10
            while len(got) < 8 and time.monotonic() < deadline:
                got += [(msg.queue, msg.body) for msg in await c.poll(0.5)]
            assert sorted(got) == sorted([(0, b"0-first"), (1, b"1-first")]
                                         + [(i % 2, b"%d-more" % (i % 2)) for i in range(6)])

    run(main())


def test_an_idle_leaders_long_poll_does_not_hold_another_leaders_messages(
        two_brokers: tuple[Broker, Broker]) -> None:
    one, two = two_brokers

    async def main() -> None:
        topic_id = await create(one.address, "t", 2)
        await create(two.address, "t", 2)
        async with AsyncProducer(one.address, queue_selector=lambda msg, n: 0) as p:
            await p.send(Message("t", b"0-on-one"))
        async with AsyncPullConsumer(one.address, group="", auto_offset_reset="earliest",
                                     auto_commit=False) as c:
            c._cluster.leaders.update(view(one, two, topic_id))  # injected, as above
            await c.assign([("t", 0), ("t", 1)])  # queue 1: broker 2, empty (long polls)
            started = time.monotonic()
            got = await c.poll(10.0)
            assert [msg.body for msg in got] == [b"0-on-one"]
            assert time.monotonic() - started < 5.0  # not broker 2's 10 s long poll

    run(main())


def test_a_lost_leader_is_replaced_by_the_leader_a_refresh_names(
        two_brokers: tuple[Broker, Broker]) -> None:
    one, two = two_brokers

    async def main() -> None:
        topic_id = await create(one.address, "t", 2)
        h1, p1 = one.server.address
        h2, p2 = two.server.address
        # queue 1 led by broker 2 at epoch 0: broker 1's own answer is as new
        moved = m.ClusterMetadataResponse("test", 1, [(1, h1, p1), (2, h2, p2)], [
            ("t", 0, topic_id, 1, [(0, 1, 0, [1, 2], [1, 2]), (1, 2, 0, [2, 1], [2, 1])])])
        async with AsyncProducer(one.address, linger_ms=0, connect_timeout_s=1,
                                 delivery_timeout_s=20,
                                 queue_selector=lambda msg, n: int(msg.body[:1])) as p:
            p._cluster.leaders.update(moved)  # injected, as above
            to_two = p._cluster.route("t", 1)
            assert to_two is not None and to_two is not p._session
            await to_two.connection()
            two.stop()  # the leader of queue 1 dies with the producer connected to it
            res = await p.send(Message("t", b"1-after"))
            assert (res.queue, res.offset) == (1, 0)
            assert p._cluster.leaders.leader("t", 1) == 1 and p._cluster.sessions == {}
        async with AsyncAdminClient(one.address) as a1:
            assert [q.end_offset for q in (await a1.describe_topic("t")).queues] == [0, 1]

    run(main())


def test_a_broker_that_left_the_view_loses_its_session(
        two_brokers: tuple[Broker, Broker]) -> None:
    one, two = two_brokers

    async def main() -> None:
        topic_id = await create(one.address, "t", 2)
        session = Session(one.address)
        cluster = Cluster(session, min_refresh_interval_s=0.0)
        try:
            await session.connection()
            cluster.leaders.update(view(one, two, topic_id))  # injected
            s2 = cluster.route("t", 1)
            assert s2 is not None and s2 is not session
            await s2.connection()
            wait_for(lambda: len(two.server.connections) == 1)
            # broker 1's own answer: it is the only live broker (broker 2 left the view)
            await cluster.refresh()
            assert cluster.sessions == {} and s2.closed
            assert cluster.route("t", 1) is None  # its leader is gone: wait for an election
            assert cluster.route("t", 0) is session
            await asyncio.to_thread(wait_for, lambda: len(two.server.connections) == 0)
        finally:
            await cluster.close()
            await session.close()

    run(main())


# -- a deposed leader answering NOT_LEADER (an injected fault: tests/cluster/deposed.py) -----


def moved_view(real: Broker, deposed: DeposedLeader, topic_id: int) -> m.ClusterMetadataResponse:
    """Queue 1 led by the deposed broker 1 at epoch 0: the real broker's (id 0) own answer (it
    leads every queue at epoch 0) is as new, so a refresh moves queue 1 to it."""
    h0, p0 = real.server.address
    h1, p1 = deposed.address.rsplit(":", 1)
    return m.ClusterMetadataResponse("test", 0, [(0, h0, p0), (1, h1, int(p1))], [
        ("t", 0, topic_id, 1, [(0, 0, 0, [0, 1], [0, 1]), (1, 1, 0, [1, 0], [1, 0])])])


@pytest.mark.parametrize("whole", [False, True], ids=["per-queue", "whole-request"])
def test_not_leader_moves_the_retry_to_the_new_leader_with_the_same_sequence(
        broker: Broker, whole: bool) -> None:
    async def main() -> None:
        topic_id = await create(broker.address, "t", 2)
        deposed = await DeposedLeader(1, whole).start()
        try:
            async with AsyncProducer(broker.address, linger_ms=0, delivery_timeout_s=20,
                                     queue_selector=lambda msg, n: int(msg.body[:1])) as p:
                p._cluster.leaders.update(moved_view(broker, deposed, topic_id))
                res = await p.send(Message("t", b"1-moved"))
                assert (res.queue, res.offset) == (1, 0)
                assert p._cluster.leaders.leader("t", 1) == 0
                assert p._cluster.sessions == {}  # broker 1 left the view: its session closed
                pid = p.producer_id
        finally:
            await deposed.close()
        # the deposed leader was sent the batch first; the real broker stored the same batch
        # (same producer id and sequence), once
        [(t, q, refused)] = deposed.produced[0].entries
        assert (t, q) == ("t", 1)
        h = decode_header(bytes(refused))
        assert (h.producer_id, h.base_sequence) == (pid, 0)
        session = Session(broker.address)
        try:
            resp = await session.request(m.FetchRequest(0, 1, 1 << 20, [("t", 1, 0, 1 << 20, "*")]),
                                         m.FetchResponse)
        finally:
            await session.close()
        [(_, _, code, _, hw, _, _, data)] = resp.results
        assert code == 0 and hw == 1
        stored = decode_header(bytes(data))
        assert (stored.producer_id, stored.base_sequence, stored.base_offset) == (pid, 0, 0)

    run(main())


@pytest.mark.parametrize("whole", [False, True], ids=["per-queue", "whole-request"])
def test_a_consumer_follows_not_leader_to_the_new_leader_from_the_same_offset(
        broker: Broker, whole: bool) -> None:
    async def main() -> None:
        topic_id = await create(broker.address, "t", 2)
        async with AsyncProducer(broker.address,
                                 queue_selector=lambda msg, n: int(msg.body[:1])) as p:
            await p.send_batch([Message("t", b"1-%d" % i) for i in range(5)])
        deposed = await DeposedLeader(1, whole).start()
        try:
            async with AsyncPullConsumer(broker.address, group="",
                                         auto_offset_reset="earliest", auto_commit=False) as c:
                c._cluster.leaders.update(moved_view(broker, deposed, topic_id))
                await c.assign([("t", 0), ("t", 1)])
                got: list[bytes] = []
                deadline = time.monotonic() + 10
                while len(got) < 5 and time.monotonic() < deadline:
                    got += [msg.body for msg in await c.poll(0.5)]
                assert got == [b"1-%d" % i for i in range(5)]
                assert c.position()[("t", 1)] == 5
            # a position known already (a seek): the FETCH itself meets the deposed leader
            async with AsyncPullConsumer(broker.address, group="", auto_commit=False) as c:
                c._cluster.leaders.update(moved_view(broker, deposed, topic_id))
                await c.assign([("t", 1)])
                await c.seek("t", 1, 2)
                got = []
                deadline = time.monotonic() + 10
                while len(got) < 3 and time.monotonic() < deadline:
                    got += [msg.body for msg in await c.poll(0.5)]
                assert got == [b"1-%d" % i for i in range(2, 5)]
        finally:
            await deposed.close()
        # the deposed leader was asked where queue 1 starts (LIST_OFFSETS), then for its
        # messages from offset 2 (FETCH), and refused both
        assert [e[:2] for r in deposed.listed for e in r.entries] == [("t", 1)]
        assert {e[:3] for r in deposed.fetched for e in r.entries} == {("t", 1, 2)}

    run(main())
