"""Pull consumer groups under load while the group's coordinator is SIGKILLed, again and again
(etcd and three broker processes): a history checker over what was acknowledged, read and
committed.

The promise checked: every acknowledged message is read by the group (nothing lost, at least
once); a successful commit is never undone (the committed offset of a queue, as each new
coordinator reports it, never goes below what a commit returned); the members ride through each
failover without an error reaching the application (``poll``/``commit`` may refuse a commit at
a moved generation, as in Kafka; nothing else).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from ferrymq.errors import IllegalGenerationError, RebalanceInProgressError, UnknownMemberError
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, coordinator_queue
from ferrymq.testing import ClusterProcess
from tests.cluster.conftest import needs_etcd

pytestmark = [pytest.mark.integration, needs_etcd]

TOPIC = "gchaos"
GROUP = "gchaos-readers"
QUEUES = 4
KILLS = 3
FENCED = (IllegalGenerationError, UnknownMemberError, RebalanceInProgressError)


@dataclass
class GroupHistory:
    acked: set[str] = field(default_factory=set)
    read: dict[str, int] = field(default_factory=dict)  # id -> times read
    committed: dict[int, int] = field(default_factory=dict)  # queue -> highest returned commit
    refused_commits: int = 0
    errors: list[str] = field(default_factory=list)


async def _produce(boot: str, h: GroupHistory, stop: asyncio.Event) -> None:
    async with AsyncProducer(boot, acks="all", idempotent=True, linger_ms=0,
                             delivery_timeout_s=60) as p:
        n = 0
        while not stop.is_set():
            ids = [f"m{n + i}" for i in range(10)]
            n += 10
            results = await asyncio.gather(
                *(p.send(Message(TOPIC, i.encode(), sharding_key=i)) for i in ids),
                return_exceptions=True)
            h.acked.update(i for i, r in zip(ids, results, strict=True)
                           if not isinstance(r, BaseException))
            await asyncio.sleep(0.02)


async def _member(boot: str, h: GroupHistory, stop: asyncio.Event) -> None:
    async with AsyncPullConsumer(boot, group=GROUP, auto_commit=False,
                                 auto_offset_reset="earliest", heartbeat_interval_s=0.3,
                                 request_timeout_s=30) as c:
        await c.subscribe(TOPIC)
        while not stop.is_set():
            try:
                batch = await c.poll(timeout=0.3, max_messages=50)
            except Exception as exc:
                h.errors.append(f"poll: {exc!r}")
                continue
            for msg in batch:
                key = msg.body.decode()
                h.read[key] = h.read.get(key, 0) + 1
            positions = {q: o for (_t, q), o in c.position().items()}
            try:
                await c.commit()
            except FENCED:
                h.refused_commits += 1
                continue
            except Exception as exc:
                h.errors.append(f"commit: {exc!r}")
                continue
            for q, o in positions.items():
                h.committed[q] = max(h.committed.get(q, 0), o)


async def _committed_now(boot: str) -> dict[int, int]:
    deadline = time.monotonic() + 60
    while True:
        try:
            async with AsyncAdminClient(boot, request_timeout_s=10) as admin:
                desc = await admin.describe_group(GROUP)
            return {o.queue: o.committed for o in desc.offsets if o.topic == TOPIC}
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _coordinator(boot: str) -> int:
    async with AsyncAdminClient(boot) as admin:
        d = await admin.cluster_describe()
    qs = {q.queue: q for q in d.queues if q.topic == OFFSETS_TOPIC}
    rec = qs[coordinator_queue(GROUP, len(qs))]
    return int(rec.leader)


def test_pull_groups_ride_through_coordinator_kills_under_load(tmp_path: Path) -> None:
    env = {"FERRYMQ_METADATA_LEASE_MS": "2000", "FERRYMQ_REPLICA_LAG_MS": "2000",
           "FERRYMQ_OFFSETS_TOPIC_QUEUES": "2"}
    with ClusterProcess(3, tmp_path / "c", env=env, flush="async") as procs:
        async def body() -> None:
            boot = procs.bootstrap
            async with AsyncAdminClient(boot) as admin:
                await admin.create_topic(TOPIC, QUEUES, replicas=3, min_insync=2)
            h = GroupHistory()
            stop_producing, stop_reading = asyncio.Event(), asyncio.Event()
            producer = asyncio.create_task(_produce(boot, h, stop_producing))
            members = [asyncio.create_task(_member(boot, h, stop_reading)) for _ in range(2)]
            await asyncio.sleep(3)
            for _ in range(KILLS):
                victim = await _coordinator(boot)
                before = dict(h.committed)
                procs.kill9(victim)
                await asyncio.sleep(4)  # the lease runs out, another broker coordinates
                after = await _committed_now(boot)
                for q, o in before.items():  # a returned commit survives its coordinator
                    assert after.get(q, 0) >= o, (q, o, after)
                await asyncio.to_thread(procs.restart, victim, 60.0)
                await asyncio.sleep(2)
            stop_producing.set()
            await producer
            deadline = time.monotonic() + 60
            while not h.acked <= h.read.keys() and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            stop_reading.set()
            await asyncio.gather(*members)
            lost = h.acked - h.read.keys()
            assert not lost, f"{len(lost)} acknowledged messages never read: {sorted(lost)[:5]}"
            assert not h.errors, h.errors[:5]
            final = await _committed_now(boot)
            for q, o in h.committed.items():
                assert final.get(q, 0) >= o, (q, o, final)
            again = sum(1 for n in h.read.values() if n > 1)
            print(f"acked {len(h.acked)}, read {len(h.read)}, read twice {again}, commits "
                  f"refused {h.refused_commits}")

        asyncio.run(asyncio.wait_for(body(), 240))
