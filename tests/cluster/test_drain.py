"""``ferrymq cluster drain BROKER``: before maintenance, every leadership of a broker moves to
another in-sync replica (asked of any broker), the producer follows without an error, the
broker stays a follower, and what cannot move is counted; bad requests are refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ferrymq import Broker
from ferrymq.client import AdminClient, AsyncAdminClient, AsyncProducer, Message
from ferrymq.client.message import Durability
from ferrymq.errors import InvalidRequestError
from tests.cluster.inprocess import Cluster, cluster, run
from tests.integration.test_cli import ferrymq, ok

pytestmark = pytest.mark.integration


def leaders(c: Cluster, topic: str, queues: int) -> dict[int, tuple[int, list[int]]]:
    """queue -> (leader, ISR) as broker 1 sees it."""
    srv = c.brokers[1]
    assert srv.cluster is not None
    v = srv.cluster.node.view.queues
    return {q: (v[(topic, q)].leader, list(v[(topic, q)].isr)) for q in range(queues)}


def test_draining_a_broker_moves_its_leaders_and_the_producer_follows(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("d", 6, replicas=3, min_insync=2)
                await admin.create_topic("solo", 3, replicas=1)
            await c.wait(lambda: len(leaders(c, "d", 6)) == 6, "the topic in broker 1's view")
            victim = leaders(c, "d", 6)[0][0]
            solo = sum(1 for q, (lead, _) in leaders(c, "solo", 3).items() if lead == victim)
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                for i in range(30):
                    r = await p.send(Message("d", f"a{i}".encode(), sharding_key=str(i)))
                    assert r.durability == Durability.REPLICATED
                other = next(s for bid, s in c.brokers.items() if bid != victim)
                async with AsyncAdminClient(f"{other.address[0]}:{other.address[1]}") as admin:
                    led = sum(1 for lead, _ in leaders(c, "d", 6).values() if lead == victim)
                    result = await admin.drain_broker(victim)
                    assert result == (led, solo)  # only the single-replica queues stay
                    with pytest.raises(InvalidRequestError, match="not a live broker"):
                        await admin.drain_broker(42)
                await c.wait(lambda: all(lead != victim for lead, _ in leaders(c, "d", 6).values()),
                             "no queue of d led by the drained broker")
                assert all(victim in isr for _, isr in leaders(c, "d", 6).values())  # a follower
                for i in range(30):  # the producer follows the leaders: no error
                    r = await p.send(Message("d", f"b{i}".encode(), sharding_key=str(i)))
                    assert r.durability == Durability.REPLICATED
    run(body)


def test_a_single_broker_refuses_a_drain(broker: Broker) -> None:
    with AdminClient(broker.address) as admin, \
            pytest.raises(InvalidRequestError, match="not part of a cluster"):
        admin.drain_broker(0)
    res = ferrymq(broker.address, "cluster", "drain", "0")
    assert res.returncode == 1 and "not part of a cluster" in res.stderr, res.stderr
    res = ferrymq(broker.address, "cluster", "drain", "minus-one")
    assert res.returncode == 2, res.stderr  # a usage error, before anything is sent


def test_cli_drain_on_a_cluster_as_text_and_json(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("d", 3, replicas=2)
            await c.wait(lambda: len(leaders(c, "d", 3)) == 3, "the topic in broker 1's view")
            victim = leaders(c, "d", 3)[0][0]
            mine = sum(1 for lead, _ in leaders(c, "d", 3).values() if lead == victim)
            out = await asyncio.to_thread(ok, c.bootstrap, "cluster", "drain", str(victim))
            assert out.startswith(f"{mine} queue{'' if mine == 1 else 's'} moved away from "
                                  f"broker {victim}"), out
            again = await asyncio.to_thread(ok, c.bootstrap, "--json", "cluster", "drain",
                                            str(victim))
            assert json.loads(again) == {"broker": victim, "moved": 0, "left": 0}
    run(body)
