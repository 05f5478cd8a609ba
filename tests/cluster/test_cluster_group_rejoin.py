"""A pull consumer whose commit meets a new coordinator (which knows no member yet) rejoins at
its next poll, not at its next heartbeat: the commit service's failover time does not wait for
``heartbeat_interval_s`` (real in-process brokers on one memory store, real clients)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient, AsyncPullConsumer
from ferrymq.errors import UnknownMemberError
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, coordinator_queue
from tests.cluster.inprocess import cluster, leader_of, run
from tests.cluster.test_cluster_groups import FAST, coordinator_of, produce

pytestmark = pytest.mark.integration


def test_a_commit_refused_by_a_new_coordinator_makes_the_next_poll_rejoin(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, **FAST) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            coord = await coordinator_of(c, "g")
            await produce(c, "orders", 40)
            async with AsyncPullConsumer(c.bootstrap, group="g", auto_commit=False,
                                         auto_offset_reset="earliest",
                                         heartbeat_interval_s=60) as consumer:
                await consumer.subscribe("orders")
                while not await consumer.poll(timeout=0.5):
                    pass
                await consumer.commit()
                await c.stop(coord)
                q = coordinator_queue("g", FAST["offsets_topic_queues"])
                await c.wait(lambda: leader_of(c, OFFSETS_TOPIC, q) in c.brokers,
                             "a new coordinator")
                await produce(c, "orders", 10, start=40)
                while not await consumer.poll(timeout=0.5):  # something new to commit
                    pass
                refused = 0
                deadline = time.monotonic() + 15
                while True:
                    try:
                        await consumer.commit()
                        break
                    except UnknownMemberError:
                        refused += 1
                    assert time.monotonic() < deadline, "no commit: the member never rejoined"
                    await consumer.poll(timeout=0.2)
                assert refused >= 1  # the new coordinator did not know the member

    run(body)
