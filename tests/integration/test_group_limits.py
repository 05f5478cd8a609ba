"""Group limits (issue 18 §3): ``max_delivery_groups`` and ``max_consumer_groups`` refuse a new
group with POLICY_VIOLATION naming the limit, before anything of it exists; and a flood of
delivery groups on a broker with few descriptors keeps it serving (a group's journal holds a
descriptor only while it is in use)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import (
    AdminClient,
    Broker,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
    SimpleConsumer,
)
from ferrymq.client._session import Session
from ferrymq.errors import PolicyViolationError
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import decode_records
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.integration

TOPIC = "gl-orders"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    with Broker(tmp_path / "data", max_delivery_groups=3, max_consumer_groups=2) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic(TOPIC, 1)
        with Producer(b.address) as p:
            p.send(Message(TOPIC, b"one"))
        yield b


def group_names(address: str) -> list[str]:
    with AdminClient(address) as admin:
        return sorted(g[0] for g in admin.list_groups())


def delivery_dirs(b: Broker) -> list[str]:
    return sorted(p.name for p in (b.server.data_dir / "delivery").iterdir())


def test_max_delivery_groups_refuses_a_new_group_before_creating_it(broker: Broker) -> None:
    consumers = [SimpleConsumer(broker.address, group=f"d{i}") for i in range(3)]
    try:
        for c in consumers:
            c.subscribe(TOPIC)
        with SimpleConsumer(broker.address, group="d3") as extra:
            with pytest.raises(PolicyViolationError) as info:
                extra.subscribe(TOPIC)
        assert str(info.value) == (
            "delivery group 'd3' not created: the broker has 3 delivery groups, "
            "max_delivery_groups=3 (delete unused ones: ferrymq group delete)")
        assert not info.value.retriable
        assert group_names(broker.address) == ["d0", "d1", "d2"]
        assert delivery_dirs(broker) == ["d0", "d1", "d2"]
        # a broadcasting consumer is a group too: refused at start, nothing left behind
        push = PushConsumer(broker.address, group="bc", mode="broadcasting")
        push.subscribe(TOPIC, "*", lambda msg: None)
        with pytest.raises(PolicyViolationError, match="max_delivery_groups=3"):
            push.start()
        push.close()
        assert delivery_dirs(broker) == ["d0", "d1", "d2"]
        # existing groups keep working, a second member of one joins
        with SimpleConsumer(broker.address, group="d0") as second:
            second.subscribe(TOPIC)
            got = second.receive(max_messages=1, invisible_duration=30, wait=5)
            assert [x.body for x in got] == [b"one"]
            second.ack(got[0])
    finally:
        for c in consumers:
            c.close()
    with AdminClient(broker.address) as admin:  # a deleted group frees its place
        admin.delete_group("d2")
    with SimpleConsumer(broker.address, group="d3") as extra:
        extra.subscribe(TOPIC)
    assert group_names(broker.address) == ["d0", "d1", "d3"]


def test_max_consumer_groups_refuses_joins_commits_and_resets(broker: Broker) -> None:
    with PullConsumer(broker.address, "p0", auto_offset_reset="earliest") as c0, \
            PullConsumer(broker.address, "p1", auto_offset_reset="earliest") as c1:
        c0.subscribe(TOPIC)
        c1.subscribe(TOPIC)
        assert [x.body for x in c0.poll(timeout=5)] == [b"one"]
        with PullConsumer(broker.address, "p2") as c2, \
                pytest.raises(PolicyViolationError) as info:
            c2.subscribe(TOPIC)  # joins
        assert "consumer group 'p2' not created: the broker has 2 consumer groups, " \
               "max_consumer_groups=2" in str(info.value)
        with PullConsumer(broker.address, "p3", auto_commit=False) as c3:  # assign + commit
            c3.assign([(TOPIC, 0)])
            with pytest.raises(PolicyViolationError, match="max_consumer_groups=2"):
                c3.commit({(TOPIC, 0): 1})
        with AdminClient(broker.address) as admin, \
                pytest.raises(PolicyViolationError, match="max_consumer_groups=2"):
            admin.reset_offsets("p4", TOPIC, to="earliest")
        names = {g for g in group_names(broker.address) if g.startswith("p")}
        assert names == {"p0", "p1"}
        assert not any(p.name.startswith(("p2", "p3", "p4"))
                       for p in (broker.server.data_dir / "groups").iterdir())
        # the limits are separate: delivery groups do not count against consumer groups
        with SimpleConsumer(broker.address, group="p0") as same_name:
            same_name.subscribe(TOPIC)


# --- a flood of delivery groups against a broker with few descriptors --------------------------

NOFILE = 256
GROUPS = 400  # one journal descriptor each under the old design: more than the limit


async def _flood(address: str, groups: int) -> None:
    """What a hostile (or careless) client does: one delivery group per request, each
    leasing and acknowledging a message (so each journal is written), over one connection."""
    s = Session(address)
    try:
        sem = asyncio.Semaphore(16)

        async def one(i: int) -> None:
            async with sem:
                g = f"flood-{i}"
                hb = await s.request(m.DeliveryHeartbeatRequest(
                    g, "", "flooder", [(TOPIC, "*")], 60_000, None, -1,
                    int(m.OffsetSpec.EARLIEST)), m.DeliveryHeartbeatResponse)
                resp = await s.request(m.ReceiveRequest(g, hb.member_id, [], 1, 1 << 20, 30_000,
                                                        2_000), m.ReceiveResponse)
                assert len(resp.deliveries) == 1, (g, resp)
                topic, queue, _tid, lease, _rc, first, last, data = resp.deliveries[0]
                assert [r.body for r in decode_records(data)] == [b"one"]
                ack = await s.request(m.AckRequest(g, hb.member_id, [
                    (topic, queue, lease, list(range(first, last + 1)))]), m.AckResponse)
                assert ack.failed == []
                await s.request(m.DeliveryLeaveRequest(g, hb.member_id), m.Empty)

        await asyncio.gather(*(one(i) for i in range(groups)))
    finally:
        await s.close()


def test_a_flood_of_delivery_groups_leaves_the_broker_serving(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data", nofile=NOFILE) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic(TOPIC, 1)
        with Producer(b.address) as p:
            p.send(Message(TOPIC, b"one"))
        t0 = time.monotonic()
        asyncio.run(_flood(b.address, GROUPS))
        assert time.monotonic() - t0 < 120
        assert b.open_descriptors() < NOFILE
        flooded = {f"flood-{i}" for i in range(GROUPS)}
        assert flooded <= set(group_names(b.address))
        # still serving: a producer, a new delivery group, a consumer group, an old group's state
        with Producer(b.address) as p:
            p.send(Message(TOPIC, b"two"))
        with SimpleConsumer(b.address, group="after-flood") as c:
            c.subscribe(TOPIC)
            got: list[bytes] = []
            deadline = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < deadline:
                for x in c.receive(max_messages=8, invisible_duration=30, wait=1):
                    got.append(x.body)
                    c.ack(x)
            assert sorted(got) == [b"one", b"two"]
        with PullConsumer(b.address, "pull-after", auto_offset_reset="earliest") as pc:
            pc.subscribe(TOPIC)
            assert [x.body for x in pc.poll(timeout=5)] == [b"one", b"two"]
        with SimpleConsumer(b.address, group="flood-7") as c:  # acked "one" before: only "two"
            c.subscribe(TOPIC)
            again = c.receive(max_messages=8, invisible_duration=30, wait=2)
            assert [x.body for x in again] == [b"two"]
            c.ack(again[0])
        text = b.log_text()
        assert "Traceback" not in text and "internal error" not in text
        assert "Too many open files" not in text and "out of file descriptors" not in text
        # a restart loads every group within the same budget
        assert b.terminate() == 0
        b.start(timeout=120)
        assert b.open_descriptors() < NOFILE
        assert flooded <= set(group_names(b.address))
        with SimpleConsumer(b.address, group="flood-9") as c:
            c.subscribe(TOPIC)
            again = c.receive(max_messages=8, invisible_duration=30, wait=2)
            assert [x.body for x in again] == [b"two"]
