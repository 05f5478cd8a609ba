"""Delivery groups (simple and push consumers) on a cluster: one coordinator per group, the
leader of its retry queue ``%RETRY%<group>``, whose records hold the group's state; leases, acks
and retries that survive the loss of that broker (docs/delivery.md, "In a cluster")."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ferrymq.client import (
    AsyncAdminClient,
    AsyncProducer,
    AsyncPushConsumer,
    AsyncSimpleConsumer,
    Message,
)
from ferrymq.client._delivery import LeasedMessage
from ferrymq.client._session import Session
from ferrymq.cluster.node import ClusterView
from ferrymq.errors import NotCoordinatorError
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import RETRY_TOPIC_PREFIX
from tests.cluster.inprocess import Cluster, address, cluster, leader_of, produce, run

pytestmark = pytest.mark.integration

FAST = {"metadata_lease_ms": 2000, "replica_lag_ms": 2000}


async def receive_all(sc: AsyncSimpleConsumer, n: int, invisible: float = 60.0,
                      timeout: float = 30.0) -> list:  # type: ignore[type-arg]
    got: list = []  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"received {len(got)} of {n}"
        got += await sc.receive(max_messages=n - len(got), invisible_duration=invisible, wait=0.5)
    return got


def coordinator(c: Cluster, group: str) -> int:
    return leader_of(c, RETRY_TOPIC_PREFIX + group, 0)


def test_members_through_different_brokers_share_one_group_at_its_coordinator(
        tmp_path: Path) -> None:
    """Two members bootstrapping through two brokers join one group, held only by the leader
    of its retry queue; each message goes to one of them; the others refuse the group's
    requests with NOT_COORDINATOR."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 3, replicas=3, min_insync=2)
            sent = await produce(c, "orders", 60)
            a = AsyncSimpleConsumer(address(c, 1), group="g", await_duration=0.5)
            b = AsyncSimpleConsumer(address(c, 2), group="g", await_duration=0.5)
            async with a, b:
                await a.subscribe("orders")
                await b.subscribe("orders")
                got: list[bytes] = []
                deadline = time.monotonic() + 30
                while len(got) < len(sent):
                    assert time.monotonic() < deadline
                    for sc in (a, b):
                        msgs = await sc.receive(max_messages=7, wait=0.2)
                        got += [x.body for x in msgs]
                        await sc.ack_batch(msgs)
                assert sorted(got) == sorted(sent)
                coord = coordinator(c, "g")
                holders = [i for i, s in c.brokers.items() if "g" in s.delivery.groups]
                assert holders == [coord]
                other = next(i for i in c.brokers if i != coord)
                s = Session([address(c, other)])
                try:
                    with pytest.raises(NotCoordinatorError):
                        await s.request(m.DescribeDeliveryRequest("g"),
                                        m.DescribeDeliveryResponse, retry=False)
                finally:
                    await s.close()

    run(body)


def test_leases_acks_and_retries_survive_the_coordinators_loss(tmp_path: Path) -> None:
    """Before the loss: 10 messages acked, 10 leased for a minute, 5 nacked twice (retry at
    once) and 5 leased for 1 s. The coordinator's broker stops; at the new coordinator the member's
    old receipts of the minute-long leases are still current (the lease is honoured: its acks
    are accepted), the nacked messages come again with reconsume_times 1, the short leases
    expire and come again with reconsume_times 1, and nothing acked comes back."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            sent = await produce(c, "orders", 30)
            sc = AsyncSimpleConsumer(c.bootstrap, group="g", retry_delays=[0],
                                     await_duration=0.5, session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                first = await receive_all(sc, 25, invisible=60)
                acked, held, nacked = first[:10], first[10:20], first[20:25]
                await sc.ack_batch(acked)
                for x in nacked:
                    await sc.nack(x, delay=0)
                short = await receive_all(sc, 10, invisible=60)
                short_ids = {x.msg_id for x in short if x.reconsume_times == 0}
                assert len(short_ids) == 5  # the 5 not delivered yet (and the 5 nacked again)
                for x in short:
                    if x.reconsume_times:
                        await sc.nack(x, delay=0)  # nacked twice: reconsume 2 next time
                    else:
                        await sc.change_invisible_duration(x, 1.0)  # a lease that will end
                coord = coordinator(c, "g")
                await c.stop(coord)
                await c.wait(lambda: coordinator(c, "g") in c.brokers, "a new coordinator")
                await sc.ack_batch(held)  # old receipts, new coordinator: honoured
                again = await receive_all(sc, 10, invisible=60)
                by_id = {x.msg_id: x for x in again}
                assert set(by_id) == short_ids | {x.msg_id for x in nacked}
                for x in again:
                    want = 1 if x.msg_id in short_ids else 2
                    assert x.reconsume_times == want, (x.msg_id, x.reconsume_times)
                await sc.ack_batch(again)
                assert await sc.receive(max_messages=10, wait=1.5) == []
            done = [x.body for x in acked + held + again]
            assert sorted(done) == sorted(sent)  # each acked once, none lost

    run(body)


def test_an_orderly_groups_failing_head_keeps_its_key_blocked_across_the_loss(
        tmp_path: Path) -> None:
    """An orderly group: the head of key k fails (nacked) before the coordinator's broker
    stops; at the new coordinator the head comes again (reconsume_times 1), and k's next
    message only after the head's ack, while another key flows."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                for body_, key in ((b"k1", "k"), (b"k2", "k"), (b"o1", "o")):
                    await p.send(Message("orders", body_, sharding_key=key))
            sc = AsyncSimpleConsumer(c.bootstrap, group="og", orderly=True, await_duration=0.5,
                                     session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                first = await receive_all(sc, 2)
                assert sorted(x.body for x in first) == [b"k1", b"o1"]
                await sc.nack(next(x for x in first if x.body == b"k1"), delay=0)
                await sc.ack(next(x for x in first if x.body == b"o1"))
                await c.stop(coordinator(c, "og"))
                await c.wait(lambda: coordinator(c, "og") in c.brokers, "a new coordinator")
                (again,) = await receive_all(sc, 1)
                assert (again.body, again.reconsume_times) == (b"k1", 1)
                assert await sc.receive(max_messages=5, wait=1.0) == []  # k2 waits for k1
                await sc.ack(again)
                (nxt,) = await receive_all(sc, 1)
                assert nxt.body == b"k2"
                await sc.ack(nxt)

    run(body)


def test_an_ephemeral_groups_retry_queue_leaves_the_cluster_with_it(tmp_path: Path) -> None:
    """A broadcasting push consumer without an instance name has an ephemeral group: its retry
    queue is created in the cluster when it joins and deleted from the cluster when it
    leaves."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            await produce(c, "orders", 5)
            got: list[bytes] = []

            async def handle(msg: LeasedMessage) -> None:
                got.append(msg.body)

            pc = AsyncPushConsumer(c.bootstrap, group="b", mode="broadcasting",
                                   start_from="earliest")
            pc.subscribe("orders", "*", handle)
            await pc.start()
            retry = RETRY_TOPIC_PREFIX + pc.delivery_group
            srv = c.brokers[1]
            await c.wait(lambda: len(got) == 5, "5 messages handled")
            assert retry in srv.topics.topics
            await pc.close()
            await c.wait(lambda: all(retry not in s.topics.topics for s in c.brokers.values()),
                         "the retry topic deleted from every broker")
            assert not any(pc.delivery_group in s.delivery.groups for s in c.brokers.values())

    run(body)


def test_message_status_is_answered_through_any_broker_and_survives_the_loss(
        tmp_path: Path) -> None:
    """``message_status`` asks every broker (each answers for the groups it coordinates): an
    acked message is CONSUMED with its ack time and a leased one DELIVERED, through a broker
    that does not coordinate the group, before and after the coordinator's loss."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            await produce(c, "orders", 2)
            sc = AsyncSimpleConsumer(c.bootstrap, group="sg", await_duration=0.5,
                                     session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                acked, leased = sorted(await receive_all(sc, 2), key=lambda x: x.offset)
                await sc.ack(acked)

                async def states(via: int) -> dict[str, tuple[str, int]]:
                    async with AsyncAdminClient(address(c, via)) as admin:
                        out = {}
                        for x in (acked, leased):
                            (st,) = (await admin.message_status(x.msg_id)).statuses
                            assert st.group == "sg"
                            out[x.msg_id] = (st.state, st.at_ms)
                        return out

                coord = coordinator(c, "sg")
                other = next(i for i in c.brokers if i != coord)
                before = await states(other)
                assert before[acked.msg_id][0] == "CONSUMED" and before[acked.msg_id][1] > 0
                assert before[leased.msg_id][0] == "DELIVERED"
                await c.stop(coord)
                await c.wait(lambda: coordinator(c, "sg") in c.brokers, "a new coordinator")
                via = next(i for i in c.brokers if i != coordinator(c, "sg"))
                assert await states(via) == before

    run(body)


def test_dead_letters_survive_the_coordinators_loss(tmp_path: Path) -> None:
    """The dead-letter queue is a cluster topic led by the group's coordinator: letters
    dead-lettered before the coordinator's broker stops are listed, counted and shown DEAD
    after it, and the new coordinator takes the queue's leadership over."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            await produce(c, "orders", 3)
            sc = AsyncSimpleConsumer(c.bootstrap, group="dg", max_reconsume=0,
                                     await_duration=0.5, session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                msgs = await receive_all(sc, 3)
                for x in msgs:
                    await sc.nack(x, delay=0, reason="poison")
            dlq = "%DLQ%dg"
            coord = coordinator(c, "dg")
            assert leader_of(c, dlq, 0) == coord
            await c.stop(coord)
            await c.wait(lambda: coordinator(c, "dg") in c.brokers, "a new coordinator")
            await c.wait(lambda: leader_of(c, dlq, 0) == coordinator(c, "dg"),
                         "the dead-letter queue led by the new coordinator")
            async with AsyncAdminClient(c.bootstrap) as admin:
                assert (await admin.describe_delivery("dg")).dlq_size == 3
                letters = await admin.dlq_list("dg")
                assert sorted(d.msg_id for d in letters) == sorted(x.msg_id for x in msgs)
                assert all("poison" in d.reason for d in letters)
                (st,) = (await admin.message_status(msgs[0].msg_id)).statuses
                assert st.state == "DEAD"

    run(body)


def test_a_delayed_retry_pending_at_the_loss_comes_from_the_new_coordinator(
        tmp_path: Path) -> None:
    """A message nacked with a 2 s delay just before the coordinator's broker stops: its
    scheduled retry letter is replicated with the retry queue, indexed by every replica, and
    fired by the new coordinator when due (not before), with reconsume_times 1."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            await produce(c, "orders", 1)
            sc = AsyncSimpleConsumer(c.bootstrap, group="rg", await_duration=0.5,
                                     session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                (msg,) = await receive_all(sc, 1)
                nacked = time.monotonic()
                await sc.nack(msg, delay=2.0)
                await c.stop(coordinator(c, "rg"))
                await c.wait(lambda: coordinator(c, "rg") in c.brokers, "a new coordinator")
                (again,) = await receive_all(sc, 1)
                assert time.monotonic() - nacked >= 1.9  # never early
                assert (again.msg_id, again.reconsume_times) == (msg.msg_id, 1)
                await sc.ack(again)
                assert await sc.receive(max_messages=5, wait=1.0) == []

    run(body)


def view_of(c: Cluster) -> ClusterView:
    srv = next(iter(c.brokers.values()))
    assert srv.cluster is not None
    return srv.cluster.node.view


def replicas_of(c: Cluster, topic: str, queue: int) -> list[int]:
    return list(view_of(c).queues[(topic, queue)].replicas)


def test_queues_the_coordinator_does_not_replicate_are_read_from_their_leaders(
        tmp_path: Path) -> None:
    """A topic of one replica per queue on 3 brokers: the group's coordinator holds at most one
    of its 3 queues and reads the others from their leaders. Every message is received, the
    acked ones once; nacked ones come again from the retry queue (reconsume_times 1), and an
    expired lease on a remote queue is redelivered; then nothing is left."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 3, replicas=1, min_insync=1)
            sent = await produce(c, "orders", 60)
            sc = AsyncSimpleConsumer(c.bootstrap, group="rg", retry_delays=[0],
                                     await_duration=0.5, session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                first = await receive_all(sc, 60, invisible=60)
                coord = coordinator(c, "rg")
                remote = {q for q in range(3) if coord not in replicas_of(c, "orders", q)}
                assert remote, "every queue is on the coordinator: nothing read remotely"
                from_remote = [x for x in first if x.queue in remote]
                assert from_remote
                assert sorted(x.body for x in first) == sorted(sent)
                nacked = from_remote[:5]
                short = from_remote[5:8]
                for x in nacked:
                    await sc.nack(x, delay=0)
                for x in short:
                    await sc.change_invisible_duration(x, 1.0)  # a lease that ends
                done = {x.msg_id for x in nacked + short}
                await sc.ack_batch([x for x in first if x.msg_id not in done])
                again = await receive_all(sc, 8, invisible=60)
                assert sorted(x.msg_id for x in again) == sorted(done)
                assert all(x.reconsume_times == 1 for x in again)
                await sc.ack_batch(again)
                assert await sc.receive(max_messages=10, wait=1.5) == []
            async with AsyncAdminClient(c.bootstrap) as admin:
                d = await admin.describe_delivery("rg")
                assert d.dlq_size == 0
                ends = {q.queue: (q.acked_below, q.end_offset) for q in d.queues}
                assert sum(e for _, e in ends.values()) == 60  # the remote queues' too
                assert all(a == e for a, e in ends.values())

    run(body)


def test_remote_reads_of_every_group_share_the_brokers_buffer_budget(tmp_path: Path) -> None:
    """delivery_remote_buffers_total_bytes far below what two groups would buffer: both still
    receive every message once, and the buffers together stay within the budget plus one batch
    per queue read remotely (a fetch returns at least one)."""
    budget = 2048

    async def body() -> None:
        async with cluster(tmp_path, **FAST, delivery_remote_buffers_total_bytes=budget) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 3, replicas=1, min_insync=1)
            sent = await produce(c, "orders", 300)
            peaks: list[int] = []
            for group in ("ga", "gb"):
                sc = AsyncSimpleConsumer(c.bootstrap, group=group, await_duration=0.5)
                async with sc:
                    await sc.subscribe("orders")
                    got: list = []  # type: ignore[type-arg]
                    deadline = time.monotonic() + 60
                    while len(got) < len(sent):
                        assert time.monotonic() < deadline, f"{group}: {len(got)} received"
                        msgs = await sc.receive(max_messages=20, invisible_duration=60, wait=0.5)
                        await sc.ack_batch(msgs)
                        got += msgs
                        peaks.append(max(b.cluster.delivery.reads.budget.used
                                         for b in c.brokers.values() if b.cluster is not None))
                    assert sorted(x.body for x in got) == sorted(sent)
                    coord = coordinator(c, group)
                    assert any(coord not in replicas_of(c, "orders", q) for q in range(3))
            assert max(peaks) <= budget + 2 * 1024  # one small batch per remote queue over it

    run(body)


def test_messages_of_a_queue_read_from_its_leader_are_dead_lettered(tmp_path: Path) -> None:
    """A group with max_reconsume 0 nacks messages of queues its coordinator does not hold:
    they go to its dead-letter queue (listed with the reason, status DEAD), and the group's
    queues are all finished."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 3, replicas=1, min_insync=1)
            await produce(c, "orders", 30)
            sc = AsyncSimpleConsumer(c.bootstrap, group="dg", max_reconsume=0,
                                     await_duration=0.5, session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                msgs = await receive_all(sc, 30)
                coord = coordinator(c, "dg")
                remote = [x for x in msgs if coord not in replicas_of(c, "orders", x.queue)]
                assert remote
                for x in remote:
                    await sc.nack(x, delay=0, reason="poison")
                await sc.ack_batch([x for x in msgs if x not in remote])
                assert await sc.receive(max_messages=10, wait=1.0) == []
            async with AsyncAdminClient(c.bootstrap) as admin:
                d = await admin.describe_delivery("dg")
                assert d.dlq_size == len(remote)
                letters = await admin.dlq_list("dg")
                assert sorted(x.msg_id for x in letters) == sorted(x.msg_id for x in remote)
                assert all("poison" in x.reason for x in letters)
                (st,) = (await admin.message_status(remote[0].msg_id)).statuses
                assert (st.group, st.state) == ("dg", "DEAD")

    run(body)


def test_a_queue_read_from_its_leader_is_followed_to_its_new_leader(tmp_path: Path) -> None:
    """Queues of two replicas on 3 brokers: one queue is not on the group's coordinator. Its
    leader's broker stops; the coordinator reads the queue from the new leader: messages
    produced before and after are each received."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 3, replicas=2, min_insync=1)
            sent = await produce(c, "orders", 30)
            sc = AsyncSimpleConsumer(c.bootstrap, group="fg", await_duration=0.5,
                                     session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                first = await receive_all(sc, 30)
                await sc.ack_batch(first)
                coord = coordinator(c, "fg")
                (q,) = [q for q in range(3) if coord not in replicas_of(c, "orders", q)]
                old = leader_of(c, "orders", q)
                await c.stop(old)
                await c.wait(lambda: leader_of(c, "orders", q) not in (old, -1),
                             "a new leader of the queue")
                sent += await produce(c, "orders", 30, start=30)
                again = await receive_all(sc, 30)
                await sc.ack_batch(again)
                assert any(x.queue == q for x in again)
                assert sorted(x.body for x in first + again) == sorted(sent)
                assert await sc.receive(max_messages=10, wait=1.0) == []

    run(body)


def test_group_delete_reaches_the_delivery_groups_coordinator(tmp_path: Path) -> None:
    """``ferrymq group delete`` of a delivery group whose coordinator (the leader of its retry
    queue) is not the broker coordinating the consumer group of that name: the delivery group
    is deleted with its retry and dead-letter topics; a member still live refuses it first."""
    from ferrymq.errors import NonEmptyGroupError, UnknownGroupError
    from ferrymq.protocol.coordinator import OFFSETS_TOPIC, coordinator_queue

    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 1, replicas=3, min_insync=2)
            await produce(c, "orders", 1)
            view = view_of(c)
            async with AsyncAdminClient(c.bootstrap) as admin:
                with pytest.raises(UnknownGroupError):  # (the consumer groups' topic made)
                    await admin.describe_group("none")
            for i in range(30):  # a name whose two coordinators differ
                name = f"dg{i}"
                sc = AsyncSimpleConsumer(c.bootstrap, group=name, await_duration=0.5)
                await sc.start()
                await sc.subscribe("orders")

                def has_coordinator(n: str = name) -> bool:
                    return (RETRY_TOPIC_PREFIX + n, 0) in view.queues and coordinator(c, n) > 0

                await c.wait(has_coordinator, "the retry queue")
                n_offsets = view.topics[OFFSETS_TOPIC].queues
                pull = leader_of(c, OFFSETS_TOPIC, coordinator_queue(name, n_offsets))
                if pull != coordinator(c, name):
                    break
                await sc.close()
            else:
                raise AssertionError("no name whose coordinators differ")
            async with AsyncAdminClient(c.bootstrap) as admin:
                with pytest.raises(NonEmptyGroupError):
                    await admin.delete_group(name)  # its member is live
                await sc.close()
                resp = await admin.delete_group(name)
                assert (resp.consumer_group, resp.delivery_group) == (False, True)
            await c.wait(lambda: RETRY_TOPIC_PREFIX + name not in view.topics
                         and "%DLQ%" + name not in view.topics, "the group's topics deleted")

    run(body)


def test_an_orderly_group_reads_a_queue_on_another_broker_in_key_order(tmp_path: Path) -> None:
    """An orderly group whose keys live in a queue its coordinator does not hold: one message
    per key at a time, in send order; a nacked head comes again before its key's next one,
    while another key of the same queue flows."""
    from ferrymq.client.partitioner import queue_for_key

    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 3, replicas=1, min_insync=1)
            sc = AsyncSimpleConsumer(c.bootstrap, group="og", orderly=True, await_duration=0.5,
                                     session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                await c.wait(lambda: (RETRY_TOPIC_PREFIX + "og", 0) in view_of(c).queues
                             and coordinator(c, "og") > 0, "the group's coordinator")
                coord = coordinator(c, "og")
                (q, *_) = [q for q in range(3) if coord not in replicas_of(c, "orders", q)]
                k, o = [key for key in (f"key{i}" for i in range(200))
                        if queue_for_key(key, 3) == q][:2]
                async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                    for body_, key in ((b"k1", k), (b"k2", k), (b"o1", o), (b"o2", o)):
                        await p.send(Message("orders", body_, sharding_key=key))
                first = await receive_all(sc, 2)
                assert sorted(x.body for x in first) == [b"k1", b"o1"]
                assert all(x.queue == q for x in first)
                await sc.nack(next(x for x in first if x.body == b"k1"), delay=0)
                await sc.ack(next(x for x in first if x.body == b"o1"))
                second = await receive_all(sc, 2)
                assert sorted((x.body, x.reconsume_times) for x in second) == [
                    (b"k1", 1), (b"o2", 0)]
                assert await sc.receive(max_messages=5, wait=1.0) == []  # k2 waits for k1
                await sc.ack_batch(second)
                (nxt,) = await receive_all(sc, 1)
                assert nxt.body == b"k2"
                await sc.ack(nxt)

    run(body)


def test_leases_on_queues_read_from_their_leaders_survive_the_coordinators_loss(
        tmp_path: Path) -> None:
    """Queues of one replica on 3 brokers. Messages of the queues not on the coordinator are
    leased (some for a minute, some for 1 s) when the coordinator's broker stops; the new
    coordinator honours the long leases (their acks are accepted) and redelivers the short
    ones when they end (reconsume_times 1), reading those queues from their leaders (one of
    them is not on the new coordinator's broker either)."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 3, replicas=1, min_insync=1)
            sent = await produce(c, "orders", 30)
            sc = AsyncSimpleConsumer(c.bootstrap, group="lg", retry_delays=[0],
                                     await_duration=0.5, session_timeout_s=20)
            async with sc:
                await sc.subscribe("orders")
                first = await receive_all(sc, 30, invisible=60)
                coord = coordinator(c, "lg")
                lost = [q for q in range(3) if coord in replicas_of(c, "orders", q)]
                await sc.ack_batch([x for x in first if x.queue in lost])
                kept = [x for x in first if x.queue not in lost]
                held, short = kept[: len(kept) // 2], kept[len(kept) // 2:]
                assert held and short
                for x in short:
                    await sc.change_invisible_duration(x, 1.0)
                await c.stop(coord)
                await c.wait(lambda: coordinator(c, "lg") in c.brokers, "a new coordinator")
                new = coordinator(c, "lg")
                assert any(new not in replicas_of(c, "orders", x.queue) for x in kept)
                await sc.ack_batch(held)  # old receipts, new coordinator: honoured
                again = await receive_all(sc, len(short), invisible=60)
                assert sorted(x.msg_id for x in again) == sorted(x.msg_id for x in short)
                assert all(x.reconsume_times == 1 for x in again)
                await sc.ack_batch(again)
                assert await sc.receive(max_messages=10, wait=1.5) == []
            assert sorted(x.body for x in first) == sorted(sent)

    run(body)
