"""The retry ladder of delivery groups runs on the broker's scheduler: a nacked message waits in
the scheduler (on disk), not in the group's memory, and comes back after its ladder delay, never
before; ``message status`` shows it RETRYING with the next attempt time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import pytest

from ferrymq import AdminClient, Broker, LeasedMessage, Message, Producer, SimpleConsumer
from ferrymq.broker.delivery.letters import make_letter
from ferrymq.client._session import Session
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import Letter
from ferrymq.protocol.records import decode_records
from ferrymq.storage import read_checkpoint, write_checkpoint

pytestmark = pytest.mark.integration


def produce(addr: str, topic: str, n: int, *, queues: int = 1) -> list[str]:
    with AdminClient(addr) as admin:
        if topic not in {t[0] for t in admin.list_topics()}:
            admin.create_topic(topic, queues)
    with Producer(addr) as p:
        return [r.msg_id for r in p.send_batch([Message(topic, f"m{i}".encode())
                                                for i in range(n)])]


def receive_n(c: SimpleConsumer, n: int, *, timeout: float = 10.0) -> list[LeasedMessage]:
    got: list[LeasedMessage] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got.extend(c.receive(64, wait=0.3))
    assert len(got) == n, f"received {len(got)} of {n}"
    return got


def status(admin: AdminClient, msg_id: str, group: str) -> tuple[str, int, int, str]:
    """(state, reconsume_times, next attempt wall ms, reason) of ``msg_id`` in ``group``."""
    (row,) = [s for s in admin.message_status(msg_id).statuses if s[0] == group]
    return row[1], row[4], row[5], row[6]


def test_nack_comes_back_after_its_ladder_delay_never_before(broker: Broker) -> None:
    addr = broker.address
    (mid,) = produce(addr, "t", 1)
    delay = 1.0
    with SimpleConsumer(addr, "g", retry_delays=[delay, 5.0]) as c, AdminClient(addr) as admin:
        c.subscribe("t")
        (msg,) = receive_n(c, 1)
        nacked_wall = time.time() * 1000
        t0 = time.monotonic()
        c.nack(msg, reason="db down")  # the ladder's first step
        state, attempts, next_ms, reason = status(admin, mid, "g")
        assert (state, attempts, reason) == ("RETRYING", 1, "db down")
        assert nacked_wall + delay * 1000 - 5 <= next_ms <= nacked_wall + delay * 1000 + 500
        early = c.receive(16, wait=delay * 0.7)  # a long poll shorter than the delay
        assert early == [], "redelivered before its retry delay"
        back: list[LeasedMessage] = []
        while not back and time.monotonic() - t0 < delay + 5:
            back = c.receive(16, wait=1.0)  # woken by the copy's append to the retry queue
        took = time.monotonic() - t0
        assert [x.msg_id for x in back] == [mid]
        assert back[0].body == b"m0"
        assert back[0].reconsume_times == 1
        assert delay - 0.01 <= took < delay + 0.5, took
        assert status(admin, mid, "g")[0] == "DELIVERED"
        c.ack(back[0])
        assert status(admin, mid, "g")[0] == "CONSUMED"


def test_pending_retries_live_in_the_scheduler_not_in_the_group(broker: Broker) -> None:
    addr = broker.address
    n = 300
    ids = produce(addr, "t", n, queues=2)
    srv = broker.server
    with SimpleConsumer(addr, "g", retry_delays=[60.0]) as c, AdminClient(addr) as admin:
        c.subscribe("t")
        got = receive_n(c, n)
        soon = got[:5]
        for x in got[5:]:
            c.nack(x, reason="later")  # the ladder: 60 s
        for x in soon:
            c.nack(x, delay=0.3, reason="soon")
        g = srv.delivery.groups["g"]
        rt = srv.topics.topics["%RETRY%g"]
        assert srv.scheduler.topic_stats(rt.topic_id)[0] == n
        assert not g.retry.ready and not g.retry.letters and not g.retry.leased
        assert admin.describe_delivery("g").retry_pending == n
        back = receive_n(c, 5)
        assert sorted(x.msg_id for x in back) == sorted(x.msg_id for x in soon)
        assert all(x.reconsume_times == 1 for x in back)
        # the other letters are still pending in the scheduler, none of them in the group
        assert len(g.retry.ready) == 0 and len(g.retry.letters) == 5
        assert c.receive(16, wait=0.3) == []
        d = admin.describe_delivery("g")
        assert (d.retry_pending, d.retry_in_flight) == (n - 5, 5)
        assert got[-1].msg_id in ids
        state, attempts, next_ms, reason = status(admin, got[-1].msg_id, "g")
        assert (state, attempts, reason) == ("RETRYING", 1, "later")
        assert time.time() * 1000 + 50_000 < next_ms < time.time() * 1000 + 61_000
        c.ack_batch(back)
        assert status(admin, back[0].msg_id, "g")[0] == "CONSUMED"
        assert admin.describe_delivery("g").retry_in_flight == 0


def test_lease_expiry_and_redrive_are_visible_at_once(broker: Broker) -> None:
    addr = broker.address
    (mid,) = produce(addr, "t", 1)
    with SimpleConsumer(addr, "g", retry_delays=[60.0], max_reconsume=1) as c, \
            AdminClient(addr) as admin:
        c.subscribe("t")
        (msg,) = receive_n(c, 1)
        c.change_invisible_duration(msg, 0.2)
        t0 = time.monotonic()
        (again,) = c.receive(16, wait=5.0)  # delay 0: a plain letter, visible at once
        took = time.monotonic() - t0
        assert 0.15 < took < 1.5, f"lease expiry redelivered after {took:.3f} s"
        assert again.msg_id == mid and again.reconsume_times == 1
        c.nack(again, reason="poison")  # max_reconsume 1: dead
        assert status(admin, mid, "g")[0] == "DEAD"
        t0 = time.monotonic()
        assert admin.dlq_redrive("g").count == 1
        (back,) = c.receive(16, wait=5.0)
        took = time.monotonic() - t0
        assert took < 1.5, f"redriven letter delivered after {took:.3f} s"
        assert back.msg_id == mid and back.reconsume_times == 0
        assert status(admin, mid, "g")[0] == "DELIVERED"
        c.ack(back)
        assert status(admin, mid, "g")[0] == "CONSUMED"
    g = broker.server.delivery.groups["g"]
    assert not g.retry.ready and not g.retry.leased


def test_letters_read_ahead_are_bounded_by_max_retry_loaded(tmp_path: Path) -> None:
    """Visible letters a receiver does not ask for are read ahead at most ``max_retry_loaded``
    at a time (then the scan pauses); a receiver of their topic drains them."""
    with Broker(tmp_path / "data", port=0, max_retry_loaded=4) as b:
        addr = b.address
        ids = produce(addr, "a", 10) + produce(addr, "b", 3)
        g_state = b.server.delivery

        async def scenario() -> tuple[list[str], list[str]]:
            s = Session(addr)
            try:
                hb = await s.request(m.DeliveryHeartbeatRequest(
                    group="g", member_id="", client_id="t", subscriptions=[("a", "*"), ("b", "*")],
                    session_timeout_ms=30_000, retry_delays_ms=[100], max_reconsume=16,
                    start_from=int(m.OffsetSpec.EARLIEST)), m.DeliveryHeartbeatResponse)
                member = hb.member_id

                async def receive(subs: list[tuple[str, str]], n: int,
                                  wait_s: float = 5.0) -> list[tuple[str, int, int, int, str]]:
                    """(topic, queue, offset, lease, original msg id) of up to n leased."""
                    out: list[tuple[str, int, int, int, str]] = []
                    deadline = time.monotonic() + wait_s
                    while len(out) < n and time.monotonic() < deadline:
                        resp = await s.request(m.ReceiveRequest(
                            "g", member, subs, n - len(out), 1 << 20, 60_000, 300),
                            m.ReceiveResponse)
                        for topic, queue, _tid, lease, _rc, first, last, data in resp.deliveries:
                            out.extend((topic, queue, r.offset, lease,
                                        r.properties.get("%MSGID", ""))
                                       for r in decode_records(data) if first <= r.offset <= last)
                        assert len(g_state.groups["g"].retry.ready) <= 4
                    return out

                first = await receive([("a", "*"), ("b", "*")], 13)
                first.sort(key=lambda x: x[0] != "a")  # a's letters first in the retry queue
                resp = await s.request(m.NackRequest("g", member, [
                    (topic, queue, off, lease, 0, "again", True)
                    for topic, queue, off, lease, _ in first
                ]), m.ReceiptResponse)
                assert all(code == 0 for code, _ in resp.results)
                only_b = await receive([("b", "*")], 3, wait_s=1.0)
                assert len(g_state.groups["g"].retry.ready) == 4  # a's, read ahead: the bound
                rest = await receive([("a", "*"), ("b", "*")], 13 - len(only_b))
                return [x[4] for x in only_b], [x[4] for x in rest]
            finally:
                await s.close()

        only_b, rest = asyncio.run(scenario())
        assert only_b == []  # behind 10 of a's letters, with 4 read ahead: the scan waits
        assert sorted(rest) == sorted(ids)  # each letter once


def test_state_of_the_previous_format_loads_and_its_letters_wait_for_their_due_time(
    tmp_path: Path,
) -> None:
    """A group snapshot of format 1 (retry letters all in memory, delayed ones written visible
    with a future ``%DUE``) still loads: such a letter is not delivered before its due time."""
    data = tmp_path / "data"
    delay_ms = 1500
    with Broker(data, port=0) as b:
        (mid,) = produce(b.address, "t", 1)
        with SimpleConsumer(b.address, "g") as c:
            c.subscribe("t")
            (msg,) = receive_n(c, 1)
            c.ack(msg)
        srv = b.server
        assert b._loop is not None

        async def write_old_letter() -> int:  # what the previous broker wrote for a nack
            dm = srv.delivery
            g = dm.groups["g"]
            record = dm.queues.read_record(g, ("t", 0), 0)
            assert record is not None
            letter = Letter("t", 0, 0, mid, 1, srv.clock.wall_ms() + delay_ms, "old")
            qs = dm.queues.retry_queue(g)
            qs.log.append(make_letter(record, letter), now_ms=srv.clock.wall_ms())
            return letter.due_wall

        due = asyncio.run_coroutine_threadsafe(write_old_letter(), b._loop).result(10)
    state = data / "delivery" / "g" / "state"
    snap = msgpack.unpackb(read_checkpoint(state), raw=False, strict_map_key=False)
    floor, nxt, ready, done, leases = snap["retry"]
    assert (floor, nxt, ready, done, leases) == (0, 0, [], [], [])
    snap["v"] = 1
    snap["retry"] = [floor, 1, done, leases]  # format 1: next = end, pending letters in memory
    write_checkpoint(state, msgpack.packb(snap, use_bin_type=True))
    with Broker(data, port=0) as b, SimpleConsumer(b.address, "g") as c:
        c.subscribe("t")
        got: list[LeasedMessage] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = c.receive(16, wait=0.5)
        assert time.time() * 1000 >= due - 5, "a letter of the old format came early"
        assert [(x.msg_id, x.reconsume_times) for x in got] == [(mid, 1)]
        c.ack(got[0])
