"""``%GROUPS%offsets`` is compacted (real in-process brokers on one memory store, real
clients): its leader snapshots the groups' offsets and deletes the segments the snapshot
replaced, its followers follow the leader's log start, and a new coordinator rebuilds every
group's offsets (and forgets deleted groups) from what is left."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient
from ferrymq.protocol.coordinator import OFFSETS_TOPIC
from tests.cluster.inprocess import cluster, leader_of, run
from tests.cluster.test_cluster_groups import coordinator_of, produce

pytestmark = pytest.mark.integration

SMALL = {"metadata_lease_ms": 2000, "replica_lag_ms": 2000, "offsets_topic_queues": 1,
         "offsets_segment_bytes": 1024}
GROUPS = [f"g{i}" for i in range(8)]
ROUNDS = 10


def test_a_compacted_offsets_log_keeps_every_groups_offsets_across_a_failover(
        tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, **SMALL) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            await produce(c, "orders", 60)
            coord = await coordinator_of(c, GROUPS[0])
            expected: dict[str, int] = {}
            async with AsyncAdminClient(c.bootstrap) as admin:
                for r in range(ROUNDS):  # many small records: several segments' worth
                    for i, g in enumerate(GROUPS):
                        to = (r * 7 + i) % 25
                        await admin.reset_offsets(g, "orders", to=to)
                        expected[g] = to
                await admin.delete_group(GROUPS[-1])
                del expected[GROUPS[-1]]
                await admin.reset_offsets(GROUPS[0], "orders", to=3)  # after the delete
                expected[GROUPS[0]] = 3
            logs = {b: srv.topics.queue(OFFSETS_TOPIC, 0).log for b, srv in c.brokers.items()}
            # the leader compacted (its start moved) and the followers followed
            await c.wait(lambda: all(lg.start_offset > 0 for lg in logs.values()),
                         "every copy's start past offset 0")
            lead = logs[coord]
            assert lead.size_bytes < 4 * SMALL["offsets_segment_bytes"], lead.segments()
            await c.stop(coord)
            await c.wait(lambda: leader_of(c, OFFSETS_TOPIC, 0) in c.brokers,
                         "a new coordinator")
            new = c.brokers[leader_of(c, OFFSETS_TOPIC, 0)]
            await asyncio.sleep(0)
            got = {g: new.consumer_groups.committed(g) for g in GROUPS}
            for g in GROUPS:
                if g in expected:
                    assert got[g] == {("orders", 0): expected[g], ("orders", 1): expected[g]}, g
                else:
                    assert not got[g], f"deleted group {g} came back: {got[g]}"

    run(body)
