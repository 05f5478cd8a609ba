"""``ferrymq cluster reassign``: a queue moves to other brokers (the new ones copy it, then the
old ones leave, leadership moving if its leader leaves) while a producer keeps sending; nothing
is lost; bad requests are refused before anything changes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from ferrymq import Broker
from ferrymq.client import AdminClient, AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from ferrymq.client.message import Durability
from ferrymq.cluster.controller import decide_reassigned
from ferrymq.cluster.model import QueueRecord
from ferrymq.cluster.operations import start_reassignment
from ferrymq.errors import (
    InvalidReplicationFactorError,
    InvalidRequestError,
    UnknownQueueError,
    UnknownTopicError,
)
from tests.cluster.inprocess import Cluster, cluster, run
from tests.integration.test_cli import ferrymq, ok

pytestmark = pytest.mark.integration


def record(c: Cluster, topic: str, queue: int) -> QueueRecord | None:
    srv = c.brokers[min(c.brokers)]
    assert srv.cluster is not None
    return srv.cluster.node.view.queues.get((topic, queue))


async def one_queue(c: Cluster, replicas: int, min_insync: int) -> QueueRecord:
    """Topic ``r`` of one queue; its record once the view has it."""
    async with AsyncAdminClient(c.bootstrap) as admin:
        await admin.create_topic("r", 1, replicas=replicas, min_insync=min_insync)
    await c.wait(lambda: record(c, "r", 0) is not None, "the queue in the view")
    rec = record(c, "r", 0)
    assert rec is not None
    return rec


def test_a_queue_moves_to_other_brokers_under_load_and_keeps_every_message(
        tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, 4, replica_lag_ms=2000) as c:
            old = await one_queue(c, 3, 2)
            newcomer = next(b for b in c.brokers if b not in old.replicas)
            target = [newcomer, *[b for b in old.replicas if b != old.leader]]  # leader leaves
            sent: list[bytes] = []
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                async def send(n: int) -> None:
                    for _ in range(n):
                        body = f"m{len(sent)}".encode()
                        r = await p.send(Message("r", body))
                        assert r.durability == Durability.REPLICATED
                        sent.append(body)

                await send(300)
                async with AsyncAdminClient(c.bootstrap) as admin:
                    started = await admin.reassign_queue("r", 0, target)
                assert started == ([newcomer], [old.leader])
                sending = asyncio.ensure_future(send(300))  # through the move
                await c.wait(lambda: getattr(record(c, "r", 0), "replicas", None) == target,
                             "the reassignment to finish", timeout=30)
                await sending
                now = record(c, "r", 0)
                assert now is not None and now.target is None
                assert now.leader in target and now.leader_epoch > old.leader_epoch
                assert sorted(now.isr) == sorted(target)
                await send(50)
            # the newcomer holds the whole queue; every acknowledged message is there
            ends = {b: c.brokers[b].topics.queue("r", 0).log.end_offset for b in target}
            assert set(ends.values()) == {len(sent)}, ends
            got: list[bytes] = []
            async with AsyncPullConsumer(c.bootstrap, group="g",
                                         auto_offset_reset="earliest") as consumer:
                await consumer.subscribe("r")
                for _ in range(100):
                    got += [m.body for m in await consumer.poll(timeout=0.5)]
                    if len(got) >= len(sent):
                        break
            assert got == sent
    run(body)


def test_bad_reassignments_are_refused(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, 3) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("r", 2, replicas=2, min_insync=2)
                cases: list[tuple[type[Exception], str, tuple[str, int, list[int]]]] = [
                    (UnknownTopicError, "unknown topic", ("nope", 0, [1, 2])),
                    (UnknownQueueError, "queues 0..1", ("r", 5, [1, 2])),
                    (InvalidReplicationFactorError, "not live", ("r", 0, [1, 9])),
                    (InvalidReplicationFactorError, "distinct", ("r", 0, [1, 1])),
                    (InvalidReplicationFactorError, "min_insync", ("r", 0, [1])),
                ]
                before = record(c, "r", 0)
                for err, match, args in cases:
                    with pytest.raises(err, match=match):
                        await admin.reassign_queue(*args)
                assert record(c, "r", 0) == before  # nothing changed
    run(body)


def test_a_single_broker_refuses_a_reassignment(broker: Broker) -> None:
    with AdminClient(broker.address) as admin:
        admin.create_topic("r", 1)
        with pytest.raises(InvalidRequestError, match="not part of a cluster"):
            admin.reassign_queue("r", 0, [0])
    res = ferrymq(broker.address, "cluster", "reassign", "r", "0", "--replicas", "1,x")
    assert res.returncode == 2 and "broker ids" in res.stderr, res.stderr


def test_cli_reassign_waits_for_the_move(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, 3, replica_lag_ms=2000) as c:
            old = await one_queue(c, 2, 1)
            target = [b for b in (1, 2, 3) if b not in old.replicas] + old.replicas[:1]
            spec = ",".join(map(str, target))
            out = await asyncio.to_thread(ok, c.bootstrap, "--json", "cluster", "reassign", "r",
                                          "0", "--replicas", spec, "--wait", "30")
            assert json.loads(out) == {"topic": "r", "queue": 0, "replicas": target,
                                       "adding": target[:1], "removing": old.replicas[1:],
                                       "done": True}
            assert getattr(record(c, "r", 0), "replicas", None) == target
    run(body)


def test_the_reassignment_decisions() -> None:
    rec = QueueRecord([1, 2, 3], 1, 4, [1, 2, 3])
    started = start_reassignment(rec, [4, 2, 3])
    assert started.replicas == [1, 2, 3, 4] and started.target == [4, 2, 3]
    assert decide_reassigned(started, {1, 2, 3, 4}) is None  # 4 is not in sync yet
    synced = QueueRecord(started.replicas, 1, 4, [1, 2, 3, 4], target=[4, 2, 3])
    done = decide_reassigned(synced, {1, 2, 3, 4})
    assert done == QueueRecord([4, 2, 3], 4, 5, [2, 3, 4])  # the leader left: a new epoch
    kept = decide_reassigned(QueueRecord([1, 2, 3], 1, 4, [1, 2, 3], target=[1, 2]), {1, 2, 3})
    assert kept == QueueRecord([1, 2], 1, 4, [1, 2])  # the leader stays: same epoch
