"""The web console's cluster page on an in-process cluster (three real brokers, each with its
HTTP listener and console, over real sockets): brokers, leaders, ISR, under-replication."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from ferrymq.client import AsyncAdminClient
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from tests.cluster.inprocess import Cluster, leader_of, run

pytestmark = pytest.mark.integration


def rows(text: str, cls: str) -> list[list[str]]:
    table = re.search(rf'<table class="{cls}">(.*?)</table>', text, re.S)
    assert table, text
    body = table.group(1).split("<tbody>", 1)[1]
    return [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>(.*?)</td>", r, re.S)]
            for r in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


def test_cluster_page_shows_brokers_leaders_and_isr(tmp_path: Path) -> None:
    async def body() -> None:
        c = Cluster(tmp_path, MemoryMetadataStore(), metadata_lease_ms=2000,
                    replica_lag_ms=1000)
        try:
            ports = await c.start_with_http((1, 2, 3))
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            jar = aiohttp.CookieJar(unsafe=True)
            async with aiohttp.ClientSession(cookie_jar=jar) as s:

                async def cluster_page(broker: int) -> str:
                    async with s.get(f"http://127.0.0.1:{ports[broker]}/cluster") as r:
                        assert r.status == 200
                        return await r.text()

                text = await cluster_page(1)
                assert re.search(r"Cluster .*: 3 brokers, 0 queues offline, 0 under-replicated",
                                 text)
                brokers = rows(text, "brokers")
                assert [(b[0], b[2]) for b in brokers] == [("1", "yes"), ("2", "yes"),
                                                           ("3", "yes")]
                assert sum(1 for b in brokers if b[3] == "controller") == 1
                leader = leader_of(c, "orders", 0)
                (q0,) = [r for r in rows(text, "replication") if r[:2] == ["orders", "0"]]
                assert q0[2] == str(leader)
                assert sorted(q0[4].split(", ")) == ["1", "2", "3"]
                victim = next(b for b in (1, 2, 3) if b != leader)
                await c.stop(victim)
                survivor = next(b for b in c.brokers if b != victim)
                for _ in range(400):
                    text = await cluster_page(survivor)
                    q0 = next(r for r in rows(text, "replication") if r[:2] == ["orders", "0"])
                    if q0[6] == "under-replicated":
                        break
                    await asyncio.sleep(0.05)
                assert q0[6] == "under-replicated"
                assert str(victim) not in q0[5].split(", ")
                assert re.search(r"[1-9]\d* under-replicated", text.split("<h2>")[0])
        finally:
            for i in list(c.brokers):
                await c.stop(i)

    run(body)
