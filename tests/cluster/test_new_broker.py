"""A broker added to a running cluster gets replicas (and leaderships) of the topics created
after it joined, and serves them (real in-process brokers on one memory store, real clients)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from tests.cluster.inprocess import cluster, run

pytestmark = pytest.mark.integration


def test_a_new_broker_gets_replicas_of_new_topics(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("before", 4, replicas=3, min_insync=2)
            await c.start(4)
            await c.wait(lambda: all(4 in s.cluster.node.view.brokers  # type: ignore[union-attr]
                                     for s in c.brokers.values()), "broker 4 known to all")
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("after", 4, replicas=3, min_insync=2)
                desc = await admin.cluster_describe()
            before = [q for q in desc.queues if q.topic == "before"]
            after = [q for q in desc.queues if q.topic == "after"]
            assert all(4 not in q.replicas for q in before)  # existing topics do not move
            assert sum(4 in q.replicas for q in after) == 3  # 4 queues x 3 replicas / 4
            assert sum(q.leader == 4 for q in after) == 1
            led = next(q.queue for q in after if q.leader == 4)
            sent = [f"m{i}".encode() for i in range(40)]
            async with AsyncProducer(c.bootstrap, acks="all") as p:
                for i, body in enumerate(sent):
                    await p.send(Message("after", body, sharding_key=str(i)))
            async with AsyncPullConsumer(c.bootstrap, auto_offset_reset="earliest") as consumer:
                await consumer.assign([("after", q) for q in range(4)])
                got: list[tuple[int, bytes]] = []
                while len(got) < len(sent):
                    got += [(m.queue, m.body) for m in await consumer.poll(timeout=1.0)]
            assert sorted(b for _q, b in got) == sorted(sent)
            assert any(q == led for q, _b in got)  # some were stored by broker 4

    run(body)
