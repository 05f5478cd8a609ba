"""A whole cluster in one process: three real brokers (``BrokerServer`` on port 0, real sockets,
real logs) joined through one memory metadata store, driven by the real clients. The node, the
controller and replication run as they do under etcd; only the store is the in-process backend
(the same tests against etcd and broker processes are in ``test_cluster_etcd.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.server import BrokerServer
from ferrymq.client import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from ferrymq.client.message import Durability
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.errors import ClusterStartError, InvalidReplicationFactorError

pytestmark = pytest.mark.integration


def run(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 120))


class Cluster:
    """Brokers 1..n on one memory store."""

    def __init__(self, tmp: Path, store: MemoryMetadataStore, **cfg: Any) -> None:
        self.tmp = tmp
        self.store = store
        self.cfg = cfg
        self.brokers: dict[int, BrokerServer] = {}

    async def start(self, broker_id: int) -> BrokerServer:
        config = BrokerConfig(data_dir=str(self.tmp / f"b{broker_id}"), port=0,
                              broker_id=broker_id, metadata="memory://", cluster="t",
                              **self.cfg).validate()
        srv = BrokerServer(config, metadata_store=self.store)
        await srv.start()
        self.brokers[broker_id] = srv
        return srv

    async def stop(self, broker_id: int) -> None:
        await self.brokers.pop(broker_id).stop()

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{s.address[0]}:{s.address[1]}" for s in self.brokers.values())

    async def wait(self, cond: Callable[[], bool], what: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.02)


@asynccontextmanager
async def cluster(tmp: Path, n: int = 3, **cfg: Any) -> AsyncIterator[Cluster]:
    c = Cluster(tmp, MemoryMetadataStore(), **cfg)
    try:
        for i in range(1, n + 1):
            await c.start(i)
        yield c
    finally:
        for i in list(c.brokers):
            await c.stop(i)


def leader_of(c: Cluster, topic: str, queue: int) -> int:
    srv = next(iter(c.brokers.values()))
    assert srv.cluster is not None
    return srv.cluster.node.view.queues[(topic, queue)].leader


def test_replicated_topic_survives_its_leaders_loss(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, replica_lag_ms=2000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
                with pytest.raises(InvalidReplicationFactorError):
                    await admin.create_topic("too-many", 1, replicas=4)
                d = await admin.cluster_describe()
                assert sorted(b.broker_id for b in d.brokers) == [1, 2, 3]
            sent: list[bytes] = []
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                for i in range(200):
                    body = f"m{i}".encode()
                    r = await p.send(Message("orders", body, sharding_key=str(i % 7)))
                    assert r.durability == Durability.REPLICATED
                    sent.append(body)
                # every in-sync replica holds what was acknowledged
                for q in (0, 1):
                    ends = {bid: s.topics.queue("orders", q).log.end_offset
                            for bid, s in c.brokers.items()}
                    assert len(set(ends.values())) == 1, ends
                victim = leader_of(c, "orders", 0)
                await c.stop(victim)  # graceful: the lease is revoked, the controller moves it
                await c.wait(lambda: leader_of(c, "orders", 0) not in (victim, -1),
                             "a new leader of orders/0")
                for i in range(200, 300):
                    body = f"m{i}".encode()
                    r = await p.send(Message("orders", body, sharding_key=str(i % 7)))
                    assert r.durability == Durability.REPLICATED  # min_insync 2 of 2 live
                    sent.append(body)
            got: list[bytes] = []
            async with AsyncPullConsumer(c.bootstrap, group="g", auto_offset_reset="earliest",
                                         ) as consumer:
                await consumer.subscribe("orders")
                deadline = time.monotonic() + 30
                while len(got) < len(sent) and time.monotonic() < deadline:
                    for msg in await consumer.poll(timeout=1.0):
                        got.append(msg.body)
            assert sorted(got) == sorted(sent)
            assert len(got) == len(set(got)), "no duplicates"

    run(body)


def test_a_second_broker_with_the_same_id_refuses_to_start(tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, n=1) as c:
            config = BrokerConfig(data_dir=str(tmp_path / "again"), port=0, broker_id=1,
                                  metadata="memory://", cluster="t").validate()
            srv = BrokerServer(config, metadata_store=c.store)
            with pytest.raises(ClusterStartError, match="broker id 1 is held by a live broker"):
                await srv.start()

    run(body)

