"""The in-process cluster of the cluster tests: real brokers (``BrokerServer`` on port 0, real
sockets, real logs) joined through one memory metadata store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.server import BrokerServer
from ferrymq.client import AsyncProducer, Message
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from tests.helpers import free_port


def run(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 120))


class Cluster:
    """Brokers 1..n on one memory store."""

    def __init__(self, tmp: Path, store: MemoryMetadataStore, **cfg: Any) -> None:
        self.tmp = tmp
        self.store = store
        self.cfg = cfg
        self.brokers: dict[int, BrokerServer] = {}

    async def start(self, broker_id: int, **own: Any) -> BrokerServer:
        """Start broker ``broker_id`` with the cluster's settings and its ``own``."""
        cfg = {"http_port": 0, **self.cfg, **own}  # HTTP off unless a test asks for it
        config = BrokerConfig(data_dir=str(self.tmp / f"b{broker_id}"), port=0,
                              broker_id=broker_id, metadata="memory://", cluster="t",
                              **cfg).validate()
        srv = BrokerServer(config, metadata_store=self.store)
        await srv.start()
        self.brokers[broker_id] = srv
        return srv

    async def start_with_http(self, ids: Iterable[int]) -> dict[int, int]:
        """Start brokers ``ids``, each with its HTTP listener on a free port; their ports."""
        ports: dict[int, int] = {}
        for i in ids:
            ports[i] = free_port()
            await self.start(i, http_port=ports[i])
        return ports

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


def address(c: Cluster, broker_id: int) -> str:
    """``host:port`` of broker ``broker_id``."""
    host, port = c.brokers[broker_id].address
    return f"{host}:{port}"


async def produce(c: Cluster, topic: str, n: int, start: int = 0) -> list[bytes]:
    """Send ``m<start>`` .. ``m<start+n-1>`` to ``topic`` (each its own sharding key)."""
    sent = []
    async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
        for i in range(start, start + n):
            body = f"m{i}".encode()
            await p.send(Message(topic, body, sharding_key=str(i)))
            sent.append(body)
    return sent


def leader_of(c: Cluster, topic: str, queue: int) -> int:
    srv = next(iter(c.brokers.values()))
    assert srv.cluster is not None
    return srv.cluster.node.view.queues[(topic, queue)].leader
