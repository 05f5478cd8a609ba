"""A new coordinator knows the group's members and generation from ``%GROUPS%offsets`` (a
MEMBERS record at every rebalance, as Kafka's group metadata record): after its coordinator's
loss a member goes on heartbeating and committing at its generation, with no rejoin; a stale
generation stays fenced (real in-process brokers on one memory store, real clients)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient, AsyncPullConsumer
from ferrymq.client._session import Session
from ferrymq.errors import IllegalGenerationError
from ferrymq.protocol import messages as m
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, coordinator_queue
from tests.cluster.inprocess import cluster, leader_of, run
from tests.cluster.test_cluster_groups import FAST, coordinator_of, produce

pytestmark = pytest.mark.integration


def test_a_new_coordinator_keeps_the_members_and_fences_stale_generations(
        tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            coord = await coordinator_of(c, "g")
            await produce(c, "orders", 40)
            async with AsyncPullConsumer(c.bootstrap, group="g", auto_commit=False,
                                         auto_offset_reset="earliest",
                                         heartbeat_interval_s=0.2) as consumer:
                await consumer.subscribe("orders")
                while not await consumer.poll(timeout=0.5):
                    pass
                await consumer.commit()
                before = c.brokers[coord].consumer_groups.groups["g"]
                member, generation = next(iter(before.members)), before.generation
                assert generation >= 1
                await c.stop(coord)
                q = coordinator_queue("g", FAST["offsets_topic_queues"])
                await c.wait(lambda: leader_of(c, OFFSETS_TOPIC, q) in c.brokers,
                             "a new coordinator")
                new = c.brokers[leader_of(c, OFFSETS_TOPIC, q)]
                after = new.consumer_groups.groups["g"]
                assert (list(after.members), after.generation) == ([member], generation)
                assert after.members[member].assignment == [("orders", 0), ("orders", 1)]
                await produce(c, "orders", 10, start=40)
                while not await consumer.poll(timeout=0.5):  # something new to commit
                    pass
                await consumer.commit()  # the same member and generation: no rejoin
                assert new.consumer_groups.groups["g"].generation == generation
                assert list(new.consumer_groups.groups["g"].members) == [member]
                # a commit at an older generation is still refused
                host, port = new.address
                s = Session(f"{host}:{port}")
                try:
                    with pytest.raises(IllegalGenerationError):
                        await s.request(m.CommitOffsetsRequest("g", member, generation - 1,
                                                               [("orders", 0, 1)]),
                                        m.CommitOffsetsResponse, retry=False)
                finally:
                    await s.close()

    run(body)
