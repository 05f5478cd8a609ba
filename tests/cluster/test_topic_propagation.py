"""A topic created in the cluster reaches each broker through its watch, a moment later on some:
a producer asking such a broker (which tries to auto-create it and finds it exists) must get
the topic, not UNKNOWN_TOPIC (the chaos tests saw hundreds of sends fail that way right after
``topic create``). Real in-process brokers on one memory store, the real producer."""

from __future__ import annotations

import time
from pathlib import Path

from ferrymq.client import AsyncProducer, Message
from ferrymq.cluster.topics import create_topic
from tests.cluster.test_cluster_inprocess import cluster, run


def test_a_broker_that_has_not_applied_a_new_topic_yet_waits_for_it(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, n=2, metadata_lease_ms=2000) as c:
            late = c.brokers[2]
            assert late.cluster is not None
            node = late.cluster.node
            c.store.lose_watches()  # the brokers read the store again 0.2 s later
            await create_topic(c.store, node.keys, "fresh", 2, 2, 1, {}, int(time.time() * 1000))
            assert "fresh" not in late.topics.topics  # not applied here yet
            addr = f"{late.address[0]}:{late.address[1]}"
            async with AsyncProducer(addr, delivery_timeout_s=10) as p:
                r = await p.send(Message("fresh", b"x", sharding_key="k"))
            assert r.topic == "fresh"

    run(body)
