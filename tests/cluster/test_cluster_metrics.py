"""The cluster's part of /metrics and /readyz on an in-process cluster (three real brokers, each
with its HTTP listener, over real sockets): leaders, ISR sizes, under-replication, replica lag."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ferrymq.client import AsyncAdminClient, AsyncProducer, Message
from ferrymq.cluster.metadata.memory import MemoryMetadataStore
from ferrymq.ops.metrics import METRICS
from tests.cluster.inprocess import Cluster, leader_of, run

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(session: aiohttp.ClientSession, port: int) -> tuple[Samples, set[str]]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    samples: Samples = {}
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.add(f"{fam.name}_total" if fam.type == "counter" else fam.name)
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, names


def q(topic: str, queue: int, **more: object) -> frozenset[tuple[str, str]]:
    return frozenset({"topic": topic, "queue": str(queue), **{k: str(v) for k, v in more.items()}
                      }.items())


def test_cluster_metrics_show_leaders_isr_and_under_replication(tmp_path: Path) -> None:
    async def body() -> None:
        c = Cluster(tmp_path, MemoryMetadataStore(), metadata_lease_ms=2000,
                    replica_lag_ms=1000)
        try:
            ports = await c.start_with_http((1, 2, 3))
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("orders", 2, replicas=3, min_insync=2)
            async with AsyncProducer(c.bootstrap, delivery_timeout_s=30) as p:
                for i in range(30):
                    await p.send(Message("orders", b"m", sharding_key=str(i)))
            async with aiohttp.ClientSession() as session:
                for i, port in ports.items():
                    async with session.get(f"http://127.0.0.1:{port}/readyz") as r:
                        assert (r.status, json.loads(await r.text())["ready"]) == (200, True), i
                leader = leader_of(c, "orders", 0)
                samples, names = await scrape(session, ports[leader])
                assert {s.name for s in METRICS if s.cluster} <= names <= {s.name for s in METRICS}
                assert samples[("ferrymq_cluster_queue_leader", q("orders", 0))] == leader
                assert samples[("ferrymq_cluster_queue_replicas", q("orders", 0))] == 3
                assert samples[("ferrymq_cluster_fenced", frozenset())] == 0

                def caught_up(s: Samples) -> bool:
                    return all(s.get(("ferrymq_cluster_replica_lag_messages",
                                      q("orders", 0, replica=r))) == 0
                               for r in (1, 2, 3) if r != leader)
                for _ in range(200):
                    samples, _ = await scrape(session, ports[leader])
                    if (caught_up(samples) and samples[(
                            "ferrymq_cluster_queue_in_sync_replicas", q("orders", 0))] == 3):
                        break
                    await asyncio.sleep(0.05)
                assert caught_up(samples)
                assert samples[("ferrymq_cluster_queue_under_replicated", q("orders", 0))] == 0
                # the followers see the same leader, and report no replica lag of their own
                follower = next(b for b in ports if b != leader)
                fs, _ = await scrape(session, ports[follower])
                assert fs[("ferrymq_cluster_queue_leader", q("orders", 0))] == leader
                assert not any(n == "ferrymq_cluster_replica_lag_messages"
                               and ("topic", "orders") in lb and ("queue", "0") in lb
                               for n, lb in fs)
                # a follower stops: the ISR shrinks, the queue is under-replicated
                victim = next(b for b in ports if b != leader)
                await c.stop(victim)
                survivor = next(b for b in c.brokers if b != victim)
                for _ in range(400):
                    samples, _ = await scrape(session, ports[survivor])
                    if samples[("ferrymq_cluster_queue_under_replicated", q("orders", 0))]:
                        break
                    await asyncio.sleep(0.05)
                assert samples[("ferrymq_cluster_queue_under_replicated", q("orders", 0))] == 1
                assert samples[("ferrymq_cluster_queue_in_sync_replicas", q("orders", 0))] == 2
        finally:
            for i in list(c.brokers):
                await c.stop(i)

    run(body)
