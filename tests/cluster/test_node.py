"""ClusterNode's membership over the memory store: registration, identity, the view."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.cluster.metadata.store import Check, Put
from ferrymq.cluster.model import Keys, QueueRecord, TopicRecord
from ferrymq.cluster.node import ClusterNode
from ferrymq.errors import ClusterStartError, LeaderNotAvailableError, NotLeaderError


def sync(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))
    return run


def node(store: MemoryMetadataStore, tmp: Path, broker_id: int, cluster: str = "c") -> ClusterNode:
    return ClusterNode(broker_id=broker_id, cluster=cluster, metadata_url="memory://",
                       data_dir=tmp / f"b{broker_id}", advertised=("127.0.0.1", 9000 + broker_id),
                       lease_ms=3000, store=store, monotonic=time.monotonic)


@sync
async def test_a_second_broker_with_a_live_id_refuses_to_start(tmp_path: Path) -> None:
    store = MemoryMetadataStore()
    a = node(store, tmp_path, 1)
    await a.start()
    b = ClusterNode(broker_id=1, cluster="c", metadata_url="memory://", data_dir=tmp_path / "other",
                    advertised=("127.0.0.1", 9999), lease_ms=3000, store=store,
                    monotonic=time.monotonic)
    with pytest.raises(ClusterStartError, match=r"broker id 1 is held by a live broker at 127\.0\.0\.1:9001"):
        await b.start()
    # the refused broker left nothing behind: the live one's record is intact
    kv = await store.get(Keys("c").broker(1))
    assert kv is not None and b'"port":9001' in kv.value


@sync
async def test_the_id_is_free_again_once_the_holders_lease_ends(tmp_path: Path) -> None:
    now = [0.0]
    store = MemoryMetadataStore(clock=lambda: now[0])
    a = node(store, tmp_path, 1)
    a._monotonic = lambda: now[0]
    await a.start()
    first = a.incarnation
    now[0] += 10  # a's lease (3 s) expired: kill -9 and no renewal
    store.expire_leases()
    b = node(store, tmp_path, 1)  # the same data dir: the same broker restarted
    await b.start()
    assert b.incarnation > first


@sync
async def test_a_data_dir_of_another_cluster_is_refused(tmp_path: Path) -> None:
    store = MemoryMetadataStore()
    a = node(store, tmp_path, 1, cluster="east")
    await a.start()
    await a.stop()
    other = MemoryMetadataStore()  # a different cluster: a new identity
    b = node(other, tmp_path, 1, cluster="east")
    with pytest.raises(ClusterStartError, match="belongs to cluster 'east'"):
        await b.start()


@sync
async def test_the_view_follows_the_store_and_answers_who_leads(tmp_path: Path) -> None:
    store = MemoryMetadataStore()
    a = node(store, tmp_path, 1)
    await a.start()
    a.start_background()
    keys = Keys("c")
    t = TopicRecord("orders", 1 << 24, 2, 2, 1)
    await store.commit([Check(keys.topic("orders"), 0)], [
        Put(keys.topic("orders"), t.encode()),
        Put(keys.queue("orders", 0), QueueRecord([1, 2], 1, 0, [1, 2]).encode()),
        Put(keys.queue("orders", 1), QueueRecord([2, 1], 2, 0, [2, 1]).encode()),
    ])
    assert await a.wait_for_topic("orders", 1 << 24, 2)
    for _ in range(100):
        if len(a.roles) == 2:
            break
        await asyncio.sleep(0.01)
    assert a.check_leader("orders", 0).leader_epoch == 0
    with pytest.raises(NotLeaderError, match="broker 2 does"):
        a.check_leader("orders", 1)
    kv = await store.get(keys.queue("orders", 1))
    assert kv is not None
    await store.commit([Check(kv.key, kv.mod_revision)],
                       [Put(kv.key, QueueRecord([2, 1], -1, 1, [2]).encode())])
    for _ in range(100):
        if a.view.queues[("orders", 1)].leader == -1:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(LeaderNotAvailableError):
        a.check_leader("orders", 1)
    await a.stop()


@sync
async def test_a_restart_waits_for_its_former_selfs_lease(tmp_path: Path) -> None:
    store = MemoryMetadataStore()
    a = ClusterNode(broker_id=1, cluster="c", metadata_url="memory://", data_dir=tmp_path / "b1",
                    advertised=("127.0.0.1", 9001), lease_ms=2000, store=store,
                    monotonic=time.monotonic)
    await a.start()  # then "kill -9": no stop, the lease runs out by itself
    b = ClusterNode(broker_id=1, cluster="c", metadata_url="memory://", data_dir=tmp_path / "b1",
                    advertised=("127.0.0.1", 9001), lease_ms=2000, store=store,
                    monotonic=time.monotonic)
    t0 = time.monotonic()
    await b.start()
    assert 0.5 < time.monotonic() - t0 < 3.5  # waited for the 2 s lease, no longer
    assert b.incarnation > a.incarnation


@sync
async def test_stop_ends_a_background_task_that_swallowed_its_cancel(tmp_path: Path) -> None:
    """On Python 3.11 a cancel that lands as an asyncio.wait_for gets its result is lost
    (CPython gh-86296): the controller then retried an unreachable store for ever and a
    SIGTERM never stopped the broker. stop() cancels again until the task ends."""
    store = MemoryMetadataStore()
    a = node(store, tmp_path, 1)
    await a.start()
    swallowed = []

    async def controller() -> None:  # the fault, injected: the first cancel is lost
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)

    a.start_background(controller)
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    with contextlib.suppress(TimeoutError):  # (the old stop() waited for ever)
        await asyncio.wait_for(a.stop(), 20)
    assert swallowed == [True] and time.monotonic() - t0 < 5
