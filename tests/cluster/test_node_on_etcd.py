"""ClusterNode over a real etcd (the memory store's tests in test_node.py, on the real thing): a
live broker id is refused, the view follows a watch, and losing etcd fences acks=all until it is
back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ferrymq.cluster.metadata.store import Check, Put
from ferrymq.cluster.model import Keys, QueueRecord, TopicRecord
from ferrymq.cluster.node import ClusterNode
from ferrymq.errors import ClusterStartError
from ferrymq.testing import EtcdProcess
from tests.cluster.conftest import needs_etcd

pytestmark = needs_etcd


def node(etcd: EtcdProcess, data_dir: Path, broker_id: int) -> ClusterNode:
    return ClusterNode(broker_id=broker_id, cluster="c", metadata_url=etcd.url, data_dir=data_dir,
                       advertised=("127.0.0.1", 9000 + broker_id), lease_ms=2000,
                       monotonic=time.monotonic)


async def until(cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_a_node_on_etcd_registers_follows_and_fences_while_etcd_is_gone(
        etcd: EtcdProcess, tmp_path: Path) -> None:
    async def body() -> None:
        a = node(etcd, tmp_path / "a", 1)
        await a.start()
        a.start_background()
        try:
            twin = node(etcd, tmp_path / "twin", 1)
            with pytest.raises(ClusterStartError, match="broker id 1 is held by a live broker"):
                await twin.start()
            await twin.store.close()
            keys = Keys("c")
            assert await a.store.commit([Check(keys.topic("orders"), 0)], [
                Put(keys.topic("orders"), TopicRecord("orders", 1 << 24, 1, 1, 1).encode()),
                Put(keys.queue("orders", 0), QueueRecord([1], 1, 0, [1]).encode())]) is not None
            assert await a.wait_for_topic("orders", 1 << 24, 5)
            await until(lambda: ("orders", 0) in a.roles, 5)
            assert a.roles[("orders", 0)].role == "leader"
            etcd.kill9()
            await until(lambda: a.fenced, 5)
            etcd.start()
            await until(lambda: not a.fenced, 10)
        finally:
            await a.stop()
    asyncio.run(body())
