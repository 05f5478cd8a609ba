"""LIST_GROUPS on a cluster: the admin client asks every live broker and merges the answers, so
groups coordinated by other brokers than the one asked show."""

from __future__ import annotations

from pathlib import Path

from ferrymq.client import AsyncAdminClient, AsyncPullConsumer, AsyncSimpleConsumer
from ferrymq.client._admin_results import GroupListing, merge_group_listings
from ferrymq.protocol.coordinator import coordinator_queue
from ferrymq.protocol.messages import DELIVERY_GROUP_STATE
from tests.cluster.inprocess import cluster, leader_of, run


def test_every_brokers_groups_are_listed_through_one_bootstrap(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, offsets_topic_queues=6) as c:
            one, two = (f"{s.address[0]}:{s.address[1]}" for s in (c.brokers[1], c.brokers[2]))
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("t", 3, replicas=2)
            groups = [f"g{i}" for i in range(6)]
            consumers = []
            for g in groups:
                pc = AsyncPullConsumer(c.bootstrap, group=g)
                await pc.__aenter__()
                await pc.subscribe("t")
                await pc.poll(timeout=0.5)  # joined: its coordinator lists it
                consumers.append(pc)
            coordinators = {leader_of(c, "%GROUPS%offsets", coordinator_queue(g, 6))
                            for g in groups}
            assert len(coordinators) > 1, coordinators  # some groups live elsewhere than 1
            simple = [AsyncSimpleConsumer(addr, group="d") for addr in (one, two)]
            for sc in simple:
                await sc.__aenter__()
                await sc.subscribe("t")
            try:
                async with AsyncAdminClient(one) as admin:  # only broker 1 given
                    listed = await admin.list_groups()
            finally:
                for x in [*consumers, *simple]:
                    await x.__aexit__(None, None, None)
            assert [r.group for r in listed if r.state != DELIVERY_GROUP_STATE] == groups
            assert all(r.members == 1 for r in listed if r.state != DELIVERY_GROUP_STATE)
            assert [r for r in listed if r.state == DELIVERY_GROUP_STATE] == [
                GroupListing("d", DELIVERY_GROUP_STATE, 2)]  # both members, at its coordinator
    run(body)


def test_merging_keeps_one_row_per_group_and_kind() -> None:
    rows = [GroupListing("a", "STABLE", 2), GroupListing("a", "PREPARING_REBALANCE", 0),
            GroupListing("a", DELIVERY_GROUP_STATE, 1), GroupListing("a", DELIVERY_GROUP_STATE, 3),
            GroupListing("b", "EMPTY", 0)]
    assert merge_group_listings(rows) == [
        GroupListing("a", DELIVERY_GROUP_STATE, 4), GroupListing("a", "STABLE", 2),
        GroupListing("b", "EMPTY", 0)]
