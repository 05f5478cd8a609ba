"""Broker kill -9 with delivery-group messages acked, leased, retrying and dead: nothing lost,
nothing acked comes back, out-of-order acks survive."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer, PullConsumer, SimpleConsumer
from ferrymq.client._delivery import LeasedMessage
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.crash


def _drain(c: SimpleConsumer, *, quiet_s: float, timeout: float = 30.0) -> list[LeasedMessage]:
    got: list[LeasedMessage] = []
    deadline = time.monotonic() + timeout
    last = time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - last < quiet_s:
        batch = c.receive(64, wait=0.3)
        if batch:
            last = time.monotonic()
            got.extend(batch)
            c.ack_batch(batch)
    return got


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_kill9_keeps_acks_leases_retries_and_dead_letters(tmp_path: Path, flush: str) -> None:
    with BrokerProcess(tmp_path / "data", flush=flush) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 2)
        with Producer(bp.address) as p:
            ids = [r.msg_id for r in p.send_batch([Message("t", f"m{i}".encode())
                                                   for i in range(60)])]
        c = SimpleConsumer(bp.address, "g", retry_delays=[0.5], max_reconsume=1,
                           invisible_duration=2.0)
        c.subscribe("t")
        got: list[LeasedMessage] = []
        deadline = time.monotonic() + 10
        while len(got) < 60 and time.monotonic() < deadline:
            got.extend(c.receive(64, wait=0.3))
        assert len(got) == 60
        by_id = {x.msg_id: x for x in got}
        acked = {mid for i, mid in enumerate(ids) if i % 3 == 0}  # out of order across queues
        c.ack_batch([by_id[i] for i in sorted(acked, reverse=True)])
        retrying = [ids[i] for i in range(1, 60, 6)]
        nacked_at = time.time() * 1000
        for mid in retrying:
            c.nack(by_id[mid], delay=30, reason="later")  # due long after the restart check
        dead = [ids[i] for i in range(2, 60, 6)]
        for mid in dead:
            c.nack(by_id[mid], delay=0, reason="first failure")
        again: list[LeasedMessage] = []
        deadline = time.monotonic() + 10
        while len(again) < len(dead) and time.monotonic() < deadline:
            again.extend(x for x in c.receive(64, wait=0.3) if x.msg_id in dead)
        for x in again:
            c.nack(x, reason="second failure")  # max_reconsume 1: now dead
        if flush == "async":
            time.sleep(0.5)  # async mode promises survival of kill -9 once written
        bp.kill9()
        bp.start()
        # everything not acked, not retrying and not dead was leased: back after the lease
        leased = set(ids) - acked - set(retrying) - set(dead)
        with SimpleConsumer(bp.address, "g") as c2:
            c2.subscribe("t")
            back = _drain(c2, quiet_s=3.0)
        back_ids = [x.msg_id for x in back]
        assert not set(back_ids) & acked, "an acked message came back after kill -9"
        assert not set(back_ids) & set(dead), "a dead letter came back"
        assert set(back_ids) == leased, f"lost: {sorted(leased - set(back_ids))[:5]}"
        assert all(x.reconsume_times == 1 for x in back)  # expired leases count as a failure
        with PullConsumer(bp.address, "reader", auto_offset_reset="earliest") as pc:
            pc.assign([("%DLQ%g", 0)])
            letters = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                letters.extend(pc.poll(0.3))
        dlq = {x.properties["%MSGID"] for x in letters if x.topic == "%DLQ%g"}
        assert dlq == set(dead)
        # the retry letters (30 s) are scheduled: pending in the broker's scheduler, on disk
        with AdminClient(bp.address) as admin:
            for mid in retrying:
                (row,) = [s for s in admin.message_status(mid).statuses if s[0] == "g"]
                assert (row[1], row[4], row[6]) == ("RETRYING", 1, "later"), row
                assert nacked_at + 29_000 <= row[5] <= time.time() * 1000 + 31_000, row
        with contextlib.suppress(Exception):  # its broker was killed under it
            c.close()


def test_latest_start_survives_kill9(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path / "data") as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 1)
        with Producer(bp.address) as p:
            p.send(Message("t", b"before"))
        with SimpleConsumer(bp.address, "g", start_from="latest") as c:
            c.subscribe("t")
            assert c.receive(10, wait=0.2) == []
        bp.kill9()
        bp.start()
        with Producer(bp.address) as p:
            p.send(Message("t", b"after"))
        with SimpleConsumer(bp.address, "g") as c:
            c.subscribe("t")
            got = []
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                got = c.receive(10, wait=0.3)
            assert [x.body for x in got] == [b"after"]
