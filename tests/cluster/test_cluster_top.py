"""``ferrymq top``'s samples on a cluster: each queue's end and size as its leader reports them,
whichever broker the view is given, so rates count every broker's traffic."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.admin.top import build_view, take_sample
from ferrymq.client import AsyncAdminClient, AsyncProducer, Message
from tests.cluster.inprocess import cluster, run


def test_a_sample_through_one_broker_counts_every_leaders_queues(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path) as c:
            one = "{}:{}".format(*c.brokers[1].address)
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("t", 6, replicas=1)
                before = await take_sample(admin, topics=["t"])
            async with AsyncProducer(c.bootstrap) as p:
                for i in range(60):
                    await p.send(Message("t", b"x" * 50, sharding_key=str(i)))
            async with AsyncAdminClient(one) as admin:  # only broker 1 given
                after = await take_sample(admin, topics=["t"])
            (row,) = build_view(before, after).topics
            assert (row.queues, row.end_offset) == (6, 60)
            assert row.size_bytes > 60 * 50
            assert row.messages_per_s * (after.at_s - before.at_s) == pytest.approx(60)
    run(body)
