"""Delayed messages on an in-process cluster (three brokers on one memory store): cancel and
status asked through a follower reach the queue's leader; the cancel record reaches the
followers, so after the leader leaves the new one still knows the cancel; a message pending
across the failover is delivered once, by the new leader, not before it is due."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ferrymq.client import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from ferrymq.errors import NotScheduledError
from ferrymq.protocol.schedule import SCHEDULED_DUE, SCHEDULED_ID
from tests.cluster.inprocess import cluster, leader_of, run

pytestmark = pytest.mark.integration


def address(c: object, broker_id: int) -> str:
    srv = c.brokers[broker_id]  # type: ignore[attr-defined]
    return f"{srv.address[0]}:{srv.address[1]}"


def test_cancel_and_status_through_a_follower_survive_the_leaders_departure(
        tmp_path: Path) -> None:
    async def body() -> None:
        async with cluster(tmp_path, metadata_lease_ms=2000, replica_lag_ms=2000) as c:
            async with AsyncAdminClient(c.bootstrap) as admin:
                await admin.create_topic("d", 1, replicas=3, min_insync=2)
            leader = leader_of(c, "d", 0)
            follower = next(b for b in c.brokers if b != leader)
            async with AsyncProducer(c.bootstrap) as p:
                cancelled = (await p.send(Message("d", b"no", delay=60))).msg_id
                before_ms = time.time_ns() // 1_000_000
                kept = (await p.send(Message("d", b"yes", delay=4))).msg_id
            async with AsyncAdminClient(address(c, follower)) as admin:  # asks the leader
                await admin.cancel_scheduled(cancelled)
                states = {s.state for s in (await admin.message_status(cancelled)).statuses}
                assert states == {"CANCELLED"}
                with pytest.raises(NotScheduledError, match="already cancelled"):
                    await admin.cancel_scheduled(cancelled)
            await c.stop(leader)
            await c.wait(lambda: leader_of(c, "d", 0) not in (leader, -1), "a new leader")
            async with AsyncAdminClient(c.bootstrap) as admin:  # the new leader knows it
                states = {s.state for s in (await admin.message_status(cancelled)).statuses}
                assert states == {"CANCELLED"}
                with pytest.raises(NotScheduledError):
                    await admin.cancel_scheduled(cancelled)
            copies = []
            async with AsyncPullConsumer(c.bootstrap, auto_offset_reset="earliest") as consumer:
                await consumer.assign([("d", 0)])
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline and not copies:
                    copies += [m for m in await consumer.poll(timeout=0.5)
                               if SCHEDULED_ID in m.properties]
                await asyncio.sleep(1.5)  # a second copy would come by now
                copies += [m for m in await consumer.poll(timeout=0.5)
                           if SCHEDULED_ID in m.properties]
            assert [m.properties[SCHEDULED_ID] for m in copies] == [kept]
            (copy,) = copies
            due = int(copy.properties[SCHEDULED_DUE])
            assert due >= before_ms + 4000 and copy.stored_ms >= due
    run(body)
