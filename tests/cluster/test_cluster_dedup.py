"""Dedup windows on a cluster: a dedup key (without a sharding key) always goes to the queue it
hashes to, so it meets the same leader's window, and a broker that starts leading a queue reads
that queue's keys again from its copy: after a failover the same keys are still duplicates."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient, AsyncProducer, Message
from ferrymq.client.partitioner import queue_for_key
from tests.cluster.inprocess import cluster, leader_of, run

pytestmark = pytest.mark.integration

QUEUES = 3


def test_dedup_keys_stay_duplicates_across_a_failover(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, replica_lag_ms=2000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("d", QUEUES, replicas=3, min_insync=2,
                                         config={"dedup_window_ms": "60000"})
            keys = [f"order-{i}" for i in range(60)]
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                first = [await p.send(Message("d", k.encode(), dedup_key=k)) for k in keys]
                assert not any(r.duplicate for r in first)
                assert [r.queue for r in first] == [queue_for_key(k, QUEUES) for k in keys]
                victim = leader_of(c, "d", 0)
                await c.stop(victim)
                await c.wait(lambda: leader_of(c, "d", 0) not in (victim, -1),
                             "a new leader of d/0")
                again = [await p.send(Message("d", b"again", dedup_key=k)) for k in keys]
            stored_twice = [k for k, r in zip(keys, again, strict=True) if not r.duplicate]
            assert not stored_twice, f"{len(stored_twice)} keys stored again after the failover"
            assert [(r.queue, r.offset) for r in again] == [(r.queue, r.offset) for r in first]
    run(body)
