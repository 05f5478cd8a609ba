"""Consumer groups on a cluster (real in-process brokers on one memory store, real clients): one
coordinator per group, the leader of its ``%GROUPS%offsets`` queue; committed offsets that
survive the loss of that broker; NOT_COORDINATOR from the others."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from ferrymq.client._session import Session
from ferrymq.errors import (
    IllegalGenerationError,
    NotCoordinatorError,
    UnknownGroupError,
    UnknownMemberError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, coordinator_queue
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd
from tests.cluster.inprocess import Cluster, address, cluster, leader_of, produce, run

pytestmark = pytest.mark.integration

FAST = {"metadata_lease_ms": 2000, "replica_lag_ms": 2000, "offsets_topic_queues": 4}


async def coordinator_of(c: Cluster, group: str) -> int:
    """Ask a broker about ``group`` (which creates ``%GROUPS%offsets``), wait until the group's
    queue has a leader, and return it."""
    first = next(iter(c.brokers))
    async with AsyncAdminClient(address(c, first)) as admin:
        with pytest.raises(UnknownGroupError):  # (asked of the coordinator, once there is one)
            await admin.describe_group(group)
    srv = c.brokers[first]
    await c.wait(lambda: OFFSETS_TOPIC in srv.topics.topics, f"{OFFSETS_TOPIC} created")
    q = coordinator_queue(group, len(srv.topics.topics[OFFSETS_TOPIC].queues))
    await c.wait(lambda: leader_of(c, OFFSETS_TOPIC, q) in c.brokers, "a coordinator")
    return leader_of(c, OFFSETS_TOPIC, q)


def test_members_bootstrapping_through_different_brokers_form_one_group(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 4, replicas=3, min_insync=2)
            coord = await coordinator_of(c, "g")
            other = next(b for b in c.brokers if b != coord)
            # a broker that does not coordinate the group refuses its requests
            s = Session(address(c, other))
            try:
                with pytest.raises(NotCoordinatorError, match=f"broker {coord} leads it"):
                    await s.request(m.DescribeGroupRequest("g"), m.DescribeGroupResponse,
                                    retry=False)
            finally:
                await s.close()
            consumers = [AsyncPullConsumer(address(c, bid), group="g", heartbeat_interval_s=0.2,
                                           auto_offset_reset="earliest")
                         for bid in (other, coord)]
            for consumer in consumers:
                await consumer.start()
                await consumer.subscribe("orders")
            deadline = time.monotonic() + 30
            while True:
                for consumer in consumers:
                    await consumer.poll(timeout=0.2)
                parts = [set(consumer.assignment()) for consumer in consumers]
                if all(parts) and sum(map(len, parts)) == 4 and len(set.union(*parts)) == 4:
                    break
                assert time.monotonic() < deadline, f"no split of the queues: {parts}"
            # one group, on the coordinator only, with both members
            g = c.brokers[coord].consumer_groups.groups["g"]
            assert len(g.members) == 2
            assert all("g" not in c.brokers[b].consumer_groups.groups for b in c.brokers
                       if b != coord)
            for consumer in consumers:
                await consumer.close()

    run(body)


def test_committed_offsets_survive_the_coordinators_loss(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            coord = await coordinator_of(c, "g")
            sent = await produce(c, "orders", 120)
            got1: list[bytes] = []
            async with AsyncPullConsumer(c.bootstrap, group="g", auto_commit=False,
                                         auto_offset_reset="earliest",
                                         heartbeat_interval_s=0.2) as c1:
                await c1.subscribe("orders")
                deadline = time.monotonic() + 30
                while len(got1) < 50:
                    got1 += [msg.body for msg in await c1.poll(timeout=0.5, max_messages=20)]
                    assert time.monotonic() < deadline
                await c1.commit()  # everything read: exactly got1
                committed = await c1.committed()
            assert sum(committed.values()) == len(got1)
            await c.stop(coord)  # graceful: the controller moves its queues at once
            q = coordinator_queue("g", 4)
            await c.wait(lambda: leader_of(c, OFFSETS_TOPIC, q) in c.brokers,
                         "a new coordinator")
            new = leader_of(c, OFFSETS_TOPIC, q)
            assert c.brokers[new].consumer_groups.committed("g") == committed
            got2: list[bytes] = []
            async with AsyncPullConsumer(c.bootstrap, group="g", auto_commit=False,
                                         auto_offset_reset="earliest",
                                         heartbeat_interval_s=0.2) as c2:
                await c2.subscribe("orders")
                deadline = time.monotonic() + 30
                while len(got1) + len(got2) < len(sent) and time.monotonic() < deadline:
                    got2 += [msg.body for msg in await c2.poll(timeout=0.5)]
                await asyncio.sleep(0.5)
                got2 += [msg.body for msg in await c2.poll(timeout=0.2)]  # nothing more
                await c2.commit()
                final = await c2.committed()
            assert not set(got1) & set(got2), "a message read again after the failover"
            assert sorted(got1 + got2) == sorted(sent), "messages skipped or doubled"
            assert sum(final.values()) == len(sent)

    run(body)


def test_a_consumer_rides_through_its_coordinators_loss(tmp_path: Path) -> None:
    """The same consumer keeps reading and committing across the failover: it finds the new
    coordinator, rejoins (a commit from before the rejoin is refused, as in Kafka: the new
    coordinator does not know the member), and resumes from its committed offsets: what was
    committed before the loss is never read again."""
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            coord = await coordinator_of(c, "g")
            sent = await produce(c, "orders", 60)
            got: list[bytes] = []
            async with AsyncPullConsumer(c.bootstrap, group="g", auto_commit=False,
                                         auto_offset_reset="earliest", heartbeat_interval_s=0.2,
                                         session_timeout_s=6) as c1:
                await c1.subscribe("orders")
                deadline = time.monotonic() + 30
                while len(got) < len(sent):
                    got += [msg.body for msg in await c1.poll(timeout=0.5)]
                    assert time.monotonic() < deadline
                await c1.commit()
                await c.stop(coord)
                more = await produce(c, "orders", 40, start=60)
                deadline = time.monotonic() + 30
                refused = 0
                while True:
                    got += [msg.body for msg in await c1.poll(timeout=0.5)]
                    try:
                        await c1.commit()
                    except (UnknownMemberError, IllegalGenerationError):
                        refused += 1  # the next poll rejoins at the new coordinator
                        continue
                    if sum((await c1.committed()).values()) == len(sent) + len(more):
                        break
                    assert time.monotonic() < deadline, f"read {len(got)}"
            assert set(got) == set(sent + more), "messages skipped"
            again = [b for b in got if got.count(b) > 1]
            assert not set(again) & set(sent), "read again though committed before the loss"

    run(body)


@needs_etcd
def test_committed_offsets_survive_a_kill_9_of_the_coordinator(tmp_path: Path) -> None:
    """The same with broker processes on etcd: the coordinator's broker is killed with
    SIGKILL (its lease expires, the controller elects another leader of the group's queue)."""
    env = {"FERRYMQ_METADATA_LEASE_MS": "2000", "FERRYMQ_REPLICA_LAG_MS": "2000",
           "FERRYMQ_OFFSETS_TOPIC_QUEUES": "4"}
    with ClusterProcess(3, tmp_path / "c", env=env) as procs:
        async def body() -> None:
            boot = procs.bootstrap
            async with AsyncAdminClient(boot) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
                with pytest.raises(UnknownGroupError):  # creates %GROUPS%offsets
                    await admin.describe_group("g")
                d = await admin.cluster_describe()
                n = sum(r.topic == OFFSETS_TOPIC for r in d.queues)
                assert n == 4  # offsets_topic_queues, from the environment
                q = coordinator_queue("g", n)
                coord = next(r.leader for r in d.queues if (r.topic, r.queue) == (OFFSETS_TOPIC, q))
            sent = []
            async with AsyncProducer(boot, delivery_timeout_s=30) as p:
                for i in range(80):
                    sent.append(f"m{i}".encode())
                    await p.send(Message("orders", sent[-1], sharding_key=str(i)))
            got1: list[bytes] = []
            async with AsyncPullConsumer(boot, group="g", auto_commit=False,
                                         auto_offset_reset="earliest") as c1:
                await c1.subscribe("orders")
                deadline = time.monotonic() + 30
                while len(got1) < 30:
                    got1 += [msg.body for msg in await c1.poll(timeout=0.5, max_messages=10)]
                    assert time.monotonic() < deadline
                await c1.commit()
            procs.kill9(coord)
            got2: list[bytes] = []
            async with AsyncPullConsumer(boot, group="g", auto_commit=False,
                                         auto_offset_reset="earliest",
                                         request_timeout_s=60) as c2:
                await c2.subscribe("orders")
                deadline = time.monotonic() + 60
                while len(got1) + len(got2) < len(sent) and time.monotonic() < deadline:
                    got2 += [msg.body for msg in await c2.poll(timeout=0.5)]
            assert not set(got1) & set(got2), "a committed message read again"
            assert sorted(got1 + got2) == sorted(sent), "messages skipped or doubled"

        asyncio.run(asyncio.wait_for(body(), 150))
