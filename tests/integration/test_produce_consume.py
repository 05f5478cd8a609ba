"""Producer -> broker -> pull consumer, against a real in-process broker over real sockets."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker, Durability, Message, Producer, PullConsumer
from ferrymq.errors import MessageTooLargeError, UnknownTopicError
from ferrymq.protocol.records import decode_msg_id, iter_batches
from tests.helpers import free_port

pytestmark = pytest.mark.integration


def drain(c: PullConsumer, n: int, timeout: float = 10.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += c.poll(0.5)
    return got


def test_send_and_consume_all_fields(broker: Broker) -> None:
    with Producer(broker.address) as p:
        r = p.send(Message("orders", "héllo", tags="created", keys=["o-1", "c-9"],
                           sharding_key="c-9", properties={"source": "web"}))
        assert r.durability is Durability.FSYNCED
        assert decode_msg_id(r.msg_id)[1:] == (r.queue, r.offset)
    with PullConsumer(broker.address, "g", auto_offset_reset="earliest") as c:
        c.subscribe("orders")
        [m] = drain(c, 1)
    assert (m.body, m.tags, m.keys, m.sharding_key, m.properties) == (
        "héllo".encode(), "created", ("o-1", "c-9"), "c-9", {"source": "web"})
    assert (m.topic, m.queue, m.offset, m.msg_id) == ("orders", r.queue, r.offset, r.msg_id)
    assert m.born_ms <= m.stored_ms <= time.time() * 1000 + 1


def test_batch_async_oneway_and_order_per_queue(broker: Broker) -> None:
    with Producer(broker.address, linger_ms=20) as p:
        results = p.send_batch([Message("t", f"b{i}") for i in range(200)])
        futs = [p.send_async(Message("t", f"a{i}")) for i in range(200)]
        for i in range(10):
            p.send_oneway(Message("t", f"o{i}"))
        p.flush()
        async_results = [f.result(10) for f in futs]
    assert len(results) == 200 and len(async_results) == 200
    assert len({(r.queue, r.offset) for r in results + async_results}) == 400
    with PullConsumer(broker.address, "g", auto_offset_reset="earliest") as c:
        c.subscribe("t")
        got = drain(c, 410)
    assert len(got) == 410
    for q in range(4):
        offs = [m.offset for m in got if m.queue == q]
        assert offs == list(range(len(offs)))  # contiguous, in order, no duplicates
    bodies = [m.body for m in got]
    assert sorted(bodies) == sorted([f"b{i}".encode() for i in range(200)] + [
        f"a{i}".encode() for i in range(200)] + [f"o{i}".encode() for i in range(10)])


def test_sharding_key_sticks_to_one_queue_in_order(broker: Broker) -> None:
    with Producer(broker.address) as p:
        rs = [p.send_async(Message("s", f"{k}:{i}", sharding_key=f"key-{k}"))
              for i in range(50) for k in range(5)]
        results = [f.result(10) for f in rs]
    by_key: dict[str, set[int]] = {}
    for i, r in enumerate(results):
        by_key.setdefault(f"key-{i % 5}", set()).add(r.queue)
    assert all(len(qs) == 1 for qs in by_key.values())
    with PullConsumer(broker.address, "g", auto_offset_reset="earliest") as c:
        c.subscribe("s")
        got = drain(c, 250)
    for k in range(5):
        seq = [int(m.body.split(b":")[1]) for m in got if m.body.startswith(f"{k}:".encode())]
        assert seq == list(range(50))


def test_keyless_messages_stick_to_a_queue_for_its_byte_share(broker: Broker) -> None:
    """Kafka's uniform sticky partitioner: 16 KB of bodies to one queue, then the next."""
    kb = b"x" * 1024
    with Producer(broker.address, linger_ms=0) as p:
        small = [p.send(Message("sticky", b"s")) for _ in range(10)]
        assert len({r.queue for r in small}) == 1  # 10 bytes: still the first queue's share
        runs = [p.send(Message("sticky", kb)).queue for _ in range(64)]
        batch = p.send_batch([Message("sticky", kb) for _ in range(20)])  # one call, one queue
        after = p.send(Message("sticky", b"next"))
        # a call moves on once, however many shares its bytes are worth
        big = [p.send_batch([Message("sticky", kb * 10) for _ in range(8)]) for _ in range(2)]
    first = small[0].queue
    # the first queue had 10 bytes; 16 KB bodies reach its share at the 16th 1 KB message
    assert runs[:16] == [first] * 16
    assert runs[16:32] == [(first + 1) % 4] * 16
    assert runs[32:48] == [(first + 2) % 4] * 16
    assert runs[48:64] == [(first + 3) % 4] * 16
    assert {r.queue for r in batch} == {first}
    assert after.queue == (first + 1) % 4  # the 20 KB call used up the queue's share
    assert [{r.queue for r in rs} for rs in big] == [{(first + 1) % 4}, {(first + 2) % 4}]
    with Producer(broker.address, linger_ms=0, sticky_queue_bytes=0) as p:
        rr = [p.send(Message("sticky", b"r")).queue for _ in range(8)]
    assert [(b - a) % 4 for a, b in itertools.pairwise(rr)] == [1] * 7


def test_user_selector(broker: Broker) -> None:
    with Producer(broker.address, queue_selector=lambda msg, n: n - 1) as p:
        assert {p.send(Message("sel", b"x")).queue for _ in range(5)} == {3}


def test_group_offsets_survive_consumer_restart_and_groups_are_independent(broker: Broker) -> None:
    with Producer(broker.address) as p:
        p.send_batch([Message("t", f"m{i}") for i in range(100)])
    with PullConsumer(broker.address, "g1", auto_offset_reset="earliest",
                      auto_commit=False) as c:
        c.subscribe("t")
        first = drain(c, 60)[:60]
        # commit exactly what we processed: positions after the first 60 handed out
        c.commit({(m.topic, m.queue): m.offset + 1 for m in first})
    with PullConsumer(broker.address, "g1", auto_offset_reset="earliest") as c:
        c.subscribe("t")
        rest = drain(c, 40)
    seen = {(m.queue, m.offset) for m in first} | {(m.queue, m.offset) for m in rest}
    assert len(seen) == 100
    with PullConsumer(broker.address, "g2", auto_offset_reset="earliest") as c:
        c.subscribe("t")
        assert len(drain(c, 100)) == 100  # another group sees everything again


def test_tag_filtering_is_done_by_the_broker(broker: Broker) -> None:
    with Producer(broker.address) as p:
        msgs = [Message("tags", f"{t}{i}", tags=t) for i in range(30) for t in ("A", "B", "C")]
        msgs += [Message("tags", f"none{i}") for i in range(10)]
        p.send_batch(msgs)
    with PullConsumer(broker.address, "ab", auto_offset_reset="earliest") as c:
        c.subscribe("tags", "A || B")
        got = drain(c, 60)
        time.sleep(0.2)
        got += c.poll(0.3)
        pos = c.position()
    assert sorted(m.tags for m in got) == ["A"] * 30 + ["B"] * 30
    assert sum(pos.values()) == 100  # the consumer moved past the filtered-out messages too


def test_long_poll_wakes_on_new_data(broker: Broker) -> None:
    with Producer(broker.address) as p:
        p.send(Message("lp", b"warmup"))
        with PullConsumer(broker.address, "g", auto_offset_reset="latest") as c:
            c.subscribe("lp")
            assert c.poll(0.2) == []
            out: list = []
            t0 = time.monotonic()
            th = threading.Thread(target=lambda: out.extend(c.poll(10.0)))
            th.start()
            time.sleep(0.3)
            p.send(Message("lp", b"wake"))
            th.join(5)
            elapsed = time.monotonic() - t0
    assert [m.body for m in out] == [b"wake"]
    assert elapsed < 2.0  # woke on data, did not sit out the 10 s poll


def test_seek_to_time_and_reset_offset_replay(broker: Broker) -> None:
    with Producer(broker.address) as p:
        p.send_batch([Message("r", f"old{i}") for i in range(20)])
        time.sleep(0.05)
        cut = int(time.time() * 1000)
        time.sleep(0.05)
        p.send_batch([Message("r", f"new{i}") for i in range(20)])
    with PullConsumer(broker.address, "replay", auto_offset_reset="earliest") as c:
        c.subscribe("r")
        assert len(drain(c, 40)) == 40
        c.seek_to_time("r", cut)
        got = drain(c, 20)
        assert sorted(m.body for m in got) == sorted(f"new{i}".encode() for i in range(20))
        c.commit()
    with AdminClient(broker.address) as admin:
        d = admin.describe_group("replay")
        assert all(lag == 0 for *_, lag in d.offsets)
        new = admin.reset_offsets("replay", "r", to="earliest")
        assert all(o == 0 for _, _, o in new)
        d = admin.describe_group("replay")
        assert sum(lag for *_, lag in d.offsets) == 40
    with PullConsumer(broker.address, "replay") as c:
        c.subscribe("r")
        assert len(drain(c, 40)) == 40  # 回溯消费: everything again


def test_seek_and_positions_with_assign(broker: Broker) -> None:
    with AdminClient(broker.address) as admin:
        admin.create_topic("a", 2)
    with Producer(broker.address, queue_selector=lambda m, n: 1) as p:
        p.send_batch([Message("a", f"{i}") for i in range(10)])
    with PullConsumer(broker.address, "g", auto_offset_reset="earliest", auto_commit=False) as c:
        c.assign([("a", 1)])
        assert [m.offset for m in drain(c, 10)] == list(range(10))
        assert c.position() == {("a", 1): 10}
        assert c.high_watermarks() == {("a", 1): 10}  # the leader's answer: lag 0
        c.seek("a", 1, 7)
        assert [m.offset for m in drain(c, 3)] == [7, 8, 9]
        c.seek_to_beginning()
        assert len(drain(c, 10)) == 10
        c.seek_to_end()
        assert c.poll(0.2) == []
        assert c.committed() == {}


def test_rebalance_spreads_queues_and_takes_over_on_leave(broker: Broker) -> None:
    with AdminClient(broker.address) as admin:
        admin.create_topic("rb", 4)
    opts = {"auto_offset_reset": "earliest", "heartbeat_interval_s": 0.2}
    c1 = PullConsumer(broker.address, "g", **opts)
    c1.subscribe("rb")
    c2 = PullConsumer(broker.address, "g", **opts)
    c2.subscribe("rb")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(c1.assignment()) != 2:
        c1.poll(0.2)
    assert len(c1.assignment()) == 2 and len(c2.assignment()) == 2
    assert set(c1.assignment()).isdisjoint(c2.assignment())
    c2.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(c1.assignment()) != 4:
        c1.poll(0.2)
    assert len(c1.assignment()) == 4
    c1.close()


def test_errors_are_clear(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", auto_create_topics=False, max_message_bytes=10_000) as b:
        with Producer(b.address, delivery_timeout_s=5) as p:
            with pytest.raises(UnknownTopicError):
                p.send(Message("nope", b"x"))
            with AdminClient(b.address) as admin:
                admin.create_topic("yes", 1)
            with pytest.raises(MessageTooLargeError):
                p.send(Message("yes", b"x" * 20_000))
            assert p.send(Message("yes", b"fine")).offset == 0


def test_async_flush_mode_reports_written(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", flush="async") as b, Producer(b.address) as p:
        assert p.send(Message("t", b"x")).durability is Durability.WRITTEN


def test_clients_reconnect_across_broker_restart(tmp_path: Path) -> None:
    port = free_port()
    b = Broker(tmp_path / "d", port=port).start()
    p = Producer(b.address, delivery_timeout_s=30)
    p.send_batch([Message("t", f"before{i}") for i in range(50)])
    c = PullConsumer(b.address, "g", auto_offset_reset="earliest", reconnect_timeout_s=30)
    c.subscribe("t")
    got = drain(c, 50)
    assert len(got) == 50
    b.stop()
    futs = [p.send_async(Message("t", f"during{i}")) for i in range(20)]  # buffered, retried
    time.sleep(0.5)
    b = Broker(tmp_path / "d", port=port).start()
    try:
        results = [f.result(30) for f in futs]
        assert len(results) == 20
        p.send_batch([Message("t", f"after{i}") for i in range(30)])
        more = drain(c, 50, timeout=20)
        bodies = sorted(m.body.decode() for m in more)
        assert bodies == sorted([f"during{i}" for i in range(20)] + [f"after{i}" for i in range(30)])
    finally:
        p.close()
        c.close()
        b.stop()


def test_data_and_offsets_survive_restart(tmp_path: Path) -> None:
    with Broker(tmp_path / "d") as b:
        with Producer(b.address) as p:
            p.send_batch([Message("t", f"m{i}") for i in range(100)])
        with PullConsumer(b.address, "g", auto_offset_reset="earliest") as c:
            c.subscribe("t")
            drain(c, 100)
            c.commit()  # the last batch is finished (close alone commits the batches before it)
    with Broker(tmp_path / "d") as b:
        with AdminClient(b.address) as admin:
            d = admin.describe_topic("t")
            assert sum(end for _, _, end, *_ in d.queues) == 100
            g = admin.describe_group("g")
            assert sum(lag for *_, lag in g.offsets) == 0
        with PullConsumer(b.address, "g2", auto_offset_reset="earliest") as c:
            c.subscribe("t")
            assert len(drain(c, 100)) == 100


def test_buffered_sends_are_split_into_batches_within_the_byte_limit(broker: Broker) -> None:
    # 400 x 10 KB buffered while lingering = 4 MB; batches must stay under 64 KiB each
    with Producer(broker.address, linger_ms=200, batch_max_bytes=64 * 1024) as p:
        futs = [p.send_async(Message("big", b"x" * 10_000)) for _ in range(400)]
        p.flush()
        results = [f.result(10) for f in futs]
    assert len({(r.queue, r.offset) for r in results}) == 400
    log = broker.server.topics.queue("big", results[0].queue).log
    data = log.read(0, 1 << 30)
    sizes = [h.size for _, h in iter_batches(data)]
    assert len(sizes) > 1
    assert max(sizes) <= 64 * 1024 + 64 * 20
