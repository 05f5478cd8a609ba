"""``ferrymq cluster preferred-leaders`` on a real cluster (three in-process brokers on one memory
store): after a leader's loss and return, leadership goes back to the first replicas, asked of a
broker that is not the controller, while a producer and a consumer keep working."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from ferrymq.client.message import Durability
from ferrymq.errors import UnknownTopicError
from tests.cluster.inprocess import Cluster, cluster, run

pytestmark = pytest.mark.integration

TOPIC = "pref"
QUEUES = 3


def records(c: Cluster) -> dict[int, tuple[int, list[int], list[int]]]:
    """queue -> (leader, replicas, ISR) as every live broker sees it (asserted equal)."""
    views = []
    for srv in c.brokers.values():
        assert srv.cluster is not None
        v = srv.cluster.node.view.queues
        views.append({q: (v[(TOPIC, q)].leader, list(v[(TOPIC, q)].replicas),
                          list(v[(TOPIC, q)].isr)) for q in range(QUEUES)})
    return views[0] if all(v == views[0] for v in views) else {}


def test_leadership_goes_back_to_the_preferred_replicas(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, replica_lag_ms=2000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic(TOPIC, QUEUES, replicas=3, min_insync=2)
            await c.wait(lambda: bool(records(c)), "every broker's view of the topic")
            first = records(c)
            assert {q: r[0] for q, r in first.items()} == {q: r[1][0] for q, r in first.items()}
            assert len({r[0] for r in first.values()}) == 3  # spread over the brokers

            sent: list[bytes] = []
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                async def send(n: int) -> None:
                    for _ in range(n):
                        body = f"m{len(sent)}".encode()
                        r = await p.send(Message(TOPIC, body, sharding_key=str(len(sent))))
                        assert r.durability == Durability.REPLICATED
                        sent.append(body)

                await send(60)
                victim = first[0][0]
                await c.stop(victim)
                await c.wait(lambda: records(c).get(0, (victim,))[0] not in (victim, -1),
                             "a new leader of queue 0")
                await send(60)  # while the victim is down
                await c.start(victim)  # same data dir: it catches up and rejoins the ISR
                await c.wait(lambda: all(victim in r[2] for r in records(c).values()),
                             "the restarted broker back in every ISR", timeout=30)
                moved_away = [q for q, r in records(c).items() if r[0] != r[1][0]]
                assert moved_away, "the failover left some queue off its preferred leader"

                controller = next(iter(c.brokers.values())).cluster.node.view.controller
                other = next(s for bid, s in c.brokers.items() if bid != controller)
                async with AsyncAdminClient(f"{other.address[0]}:{other.address[1]}") as admin:
                    with pytest.raises(UnknownTopicError, match="unknown topic 'nope'"):
                        await admin.elect_preferred_leaders([TOPIC, "nope"])
                    assert await admin.elect_preferred_leaders([TOPIC]) == len(moved_away)
                    await c.wait(lambda: all(r[0] == r[1][0] for r in records(c).values()),
                                 "leadership back on the first replicas")
                    assert await admin.elect_preferred_leaders() == 0
                await send(60)  # the producer follows the leaders back

            got: list[bytes] = []
            async with AsyncPullConsumer(c.bootstrap, group="g", auto_offset_reset="earliest",
                                         ) as consumer:
                await consumer.subscribe(TOPIC)
                deadline = time.monotonic() + 30
                while len(got) < len(sent) and time.monotonic() < deadline:
                    got.extend(msg.body for msg in await consumer.poll(timeout=1.0))
            assert sorted(got) == sorted(sent)

    run(body)
