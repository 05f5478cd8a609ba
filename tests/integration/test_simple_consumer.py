"""Simple consumers against a real broker: leases, acks, nacks, retries, dead letters."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import (
    AdminClient,
    Broker,
    LeasedMessage,
    Message,
    Producer,
    PullConsumer,
    SimpleConsumer,
)
from ferrymq.errors import (
    AccessDeniedError,
    ConfigError,
    ConnectionClosedError,
    InvalidReceiptError,
    InvalidTopicNameError,
    UnknownGroupError,
    UnknownTopicError,
)
from ferrymq.protocol import messages as m
from tests.helpers import free_port
from tests.security_helpers import make_user, write_users

pytestmark = pytest.mark.integration


def produce(broker: Broker, topic: str, n: int, *, queues: int = 2, tag: str | None = None,
            prefix: str = "m") -> list[str]:
    with AdminClient(broker.address) as admin:
        if topic not in {t[0] for t in admin.list_topics()}:
            admin.create_topic(topic, queues)
    with Producer(broker.address) as p:
        results = p.send_batch([Message(topic, f"{prefix}{i}".encode(), tags=tag)
                                for i in range(n)])
    return [r.msg_id for r in results]


def receive_all(c: SimpleConsumer, want: int, *, timeout: float = 10.0,
                invisible: float | None = None) -> list[LeasedMessage]:
    got: list[LeasedMessage] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got.extend(c.receive(64, invisible, wait=0.5))
    return got


@pytest.fixture
def consumer(broker: Broker) -> Iterator[SimpleConsumer]:
    c = SimpleConsumer(broker.address, "g1", retry_delays=[0.3, 0.6], max_reconsume=2)
    try:
        yield c
    finally:
        c.close()


def describe(broker: Broker, group: str) -> m.DescribeDeliveryResponse:
    with AdminClient(broker.address) as admin:
        return admin.describe_delivery(group)


def test_receive_ack_finishes_every_message(broker: Broker, consumer: SimpleConsumer) -> None:
    ids = produce(broker, "t", 50)
    consumer.subscribe("t")
    got = receive_all(consumer, 50)
    assert sorted(x.msg_id for x in got) == sorted(ids)
    assert all(x.reconsume_times == 0 for x in got)
    consumer.ack_batch(got)
    assert consumer.receive(10, wait=0.3) == []
    d = describe(broker, "g1")
    assert all(q[2] == q[4] and q[5] == 0 for q in d.queues)  # floor == end, none in flight


def test_first_deliveries_are_fifo_per_queue(broker: Broker, consumer: SimpleConsumer) -> None:
    produce(broker, "t", 40, queues=1)
    consumer.subscribe("t")
    got = receive_all(consumer, 40)
    assert [x.offset for x in got] == list(range(40))
    assert [x.body for x in got] == [f"m{i}".encode() for i in range(40)]


def test_nack_redelivers_after_delay_with_original_identity(
    broker: Broker, consumer: SimpleConsumer
) -> None:
    [mid] = produce(broker, "t", 1)
    consumer.subscribe("t")
    [msg] = receive_all(consumer, 1)
    t0 = time.monotonic()
    consumer.nack(msg, delay=0.5, reason="not yet")
    again = receive_all(consumer, 1, timeout=5)
    waited = time.monotonic() - t0
    assert len(again) == 1
    r = again[0]
    assert waited >= 0.45
    assert r.reconsume_times == 1
    assert (r.topic, r.queue, r.offset, r.msg_id, r.body) == (
        msg.topic, msg.queue, msg.offset, mid, msg.body)
    assert r.properties == msg.properties  # the broker's % bookkeeping is hidden
    consumer.ack(r)
    assert consumer.receive(5, wait=0.8) == []


def test_ladder_then_dead_letter_queue(broker: Broker, consumer: SimpleConsumer) -> None:
    [mid] = produce(broker, "t", 1)
    consumer.subscribe("t")
    times = []
    attempts = []
    t0 = time.monotonic()
    for _ in range(3):  # max_reconsume=2: deliveries 0, 1, 2; then dead
        [m] = receive_all(consumer, 1, timeout=5)
        times.append(time.monotonic() - t0)
        attempts.append(m.reconsume_times)
        consumer.nack(m, reason=f"fail {m.reconsume_times}")
        t0 = time.monotonic()
    assert attempts == [0, 1, 2]
    assert times[1] >= 0.25 and times[2] >= 0.55  # ladder [0.3, 0.6]
    assert consumer.receive(5, wait=1.0) == []
    with PullConsumer(broker.address, "dlq-reader", auto_offset_reset="earliest") as pc:
        pc.assign([("%DLQ%g1", 0)])
        dead = []
        deadline = time.monotonic() + 5
        while not dead and time.monotonic() < deadline:
            dead = pc.poll(0.5)
    assert len(dead) == 1
    props = dead[0].properties
    assert props["%MSGID"] == mid and props["%TOPIC"] == "t"
    assert props["%RECONSUME"] == "3" and "fail 2" in props["%REASON"]
    assert describe(broker, "g1").dlq_size == 1


def test_expired_lease_goes_to_another_member_and_old_receipt_is_refused(
    broker: Broker,
) -> None:
    produce(broker, "t", 5, queues=1)
    with SimpleConsumer(broker.address, "g2") as a, SimpleConsumer(broker.address, "g2") as b:
        a.subscribe("t")
        b.subscribe("t")
        got_a = receive_all(a, 5, invisible=0.5)
        assert len(got_a) == 5
        a.ack_batch(got_a[:2])
        assert b.receive(10, wait=0.2) == []  # invisible while leased
        got_b = receive_all(b, 3, timeout=5)
        assert sorted(x.offset for x in got_b) == [2, 3, 4]
        assert all(x.reconsume_times == 1 for x in got_b)
        with pytest.raises(InvalidReceiptError):
            a.ack(got_a[3])  # too late: the message went to b
        b.ack_batch(got_b)
        with pytest.raises(InvalidReceiptError):
            b.ack(got_b[0])  # already acked


def test_change_invisible_duration_keeps_a_message(broker: Broker, consumer: SimpleConsumer) -> None:
    produce(broker, "t", 1)
    consumer.subscribe("t")
    [m] = receive_all(consumer, 1, invisible=0.5)
    consumer.change_invisible_duration(m, 3)
    time.sleep(0.8)
    with SimpleConsumer(broker.address, "g1") as other:
        other.subscribe("t")
        assert other.receive(5, wait=0.3) == []
    consumer.ack(m)  # the message object carries the new receipt


def test_more_members_than_queues_share_the_work(broker: Broker) -> None:
    produce(broker, "t", 30, queues=1)
    members = [SimpleConsumer(broker.address, "g3") for _ in range(3)]
    try:
        for c in members:
            c.subscribe("t")
        seen: list[list[int]] = [[] for _ in members]
        for _ in range(10):
            for i, c in enumerate(members):
                got = c.receive(4, wait=0.1)
                seen[i].extend(x.offset for x in got)
                c.ack_batch(got)
        everything = sorted(o for s in seen for o in s)
        assert everything == list(range(30))
        assert all(seen), "every member got work from the single queue"
    finally:
        for c in members:
            c.close()


def test_groups_are_independent(broker: Broker) -> None:
    produce(broker, "t", 10)
    with SimpleConsumer(broker.address, "ga") as a, SimpleConsumer(broker.address, "gb") as b:
        a.subscribe("t")
        b.subscribe("t")
        ga = receive_all(a, 10)
        a.ack_batch(ga)
        gb = receive_all(b, 10)
        assert sorted(x.msg_id for x in ga) == sorted(x.msg_id for x in gb)


def test_tag_filter_and_start_from_latest(broker: Broker) -> None:
    produce(broker, "t", 6, tag="a")
    produce(broker, "t", 6, tag="b", prefix="b")
    with SimpleConsumer(broker.address, "gt") as c:
        c.subscribe("t", "b")
        got = receive_all(c, 6)
        assert sorted(x.body for x in got) == sorted(f"b{i}".encode() for i in range(6))
        assert c.receive(10, wait=0.3) == []
    with SimpleConsumer(broker.address, "glatest", start_from="latest") as c:
        c.subscribe("t")
        assert c.receive(10, wait=0.3) == []
        produce(broker, "t", 3, prefix="new")
        got = receive_all(c, 3)
        assert sorted(x.body for x in got) == [b"new0", b"new1", b"new2"]


def test_leave_gives_leases_back_at_once_without_counting(broker: Broker) -> None:
    produce(broker, "t", 4, queues=1)
    a = SimpleConsumer(broker.address, "gl")
    a.subscribe("t")
    assert len(receive_all(a, 4, invisible=60)) == 4
    a.close()
    with SimpleConsumer(broker.address, "gl") as b:
        b.subscribe("t")
        t0 = time.monotonic()
        got = receive_all(b, 4, timeout=5)
        assert time.monotonic() - t0 < 3  # not after the 60 s lease
        assert sorted(x.offset for x in got) == [0, 1, 2, 3]
        assert all(x.reconsume_times == 0 for x in got)


def test_bad_input_gets_clear_errors(broker: Broker) -> None:
    with SimpleConsumer(broker.address, "gx", require_topic=True) as c:
        with pytest.raises(UnknownTopicError, match="'nope' does not exist"):
            c.subscribe("nope")
        with pytest.raises(ConfigError):
            c.receive(5)  # nothing subscribed
    with SimpleConsumer(broker.address, "gx") as c:
        with pytest.raises(InvalidTopicNameError):
            c.subscribe("bad topic!")
    with pytest.raises(ConfigError, match="invalid group name 'bad name!'"):
        SimpleConsumer(broker.address, "bad name!")
    with pytest.raises(ConfigError):
        SimpleConsumer(broker.address, "g", invisible_duration=0)
    with pytest.raises(UnknownGroupError):  # none of the refused subscriptions made a group
        describe(broker, "gx")


def test_subscribing_before_the_topic_exists_waits_for_it(
        broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ferrymq.client")
    # start_from="latest": the topic appears after the subscription, so all of it is news
    with SimpleConsumer(broker.address, "gw", start_from="latest") as c:
        c.subscribe("later")
        c.subscribe("later", "*")  # again: no second warning
        assert c.receive(10, wait=0.2) == []
        warnings = [r.getMessage() for r in caplog.records if "'later'" in r.getMessage()]
        assert len(warnings) == 1 and "does not exist yet" in warnings[0]

        got: list[LeasedMessage] = []
        t0 = 0.0

        def send_soon() -> None:
            nonlocal t0
            time.sleep(0.3)
            t0 = time.monotonic()
            produce(broker, "later", 20, queues=3)  # creates the topic

        sender = threading.Thread(target=send_soon)
        sender.start()
        got = c.receive(64, wait=10)  # one long poll: the broker looks for the topic itself
        waited = time.monotonic() - t0
        sender.join()
        got += receive_all(c, 20 - len(got))
        assert sorted(x.body for x in got) == sorted(f"m{i}".encode() for i in range(20))
        assert waited < 2.5  # looked for again about every second, not at the end of the poll
        c.ack_batch(got)
    queues = describe(broker, "gw").queues
    assert len(queues) == 3 and all(floor == end for _, _, floor, _, end, _, _ in queues)


def test_a_refused_first_subscription_leaves_no_group(tmp_path: Path) -> None:
    secret = "s3cret"
    users = write_users(tmp_path / "users.toml", make_user("root", secret, admin=True),
                        make_user("cons", secret, consume=("orders*",), groups=("team-*",)))
    with Broker(tmp_path / "data", users_file=str(users)) as b:
        with AdminClient(b.address, auth=("root", secret)) as admin:
            admin.create_topic("orders", 1)
            admin.create_topic("audit", 1)
        with SimpleConsumer(b.address, "team-a", auth=("cons", secret)) as c:
            with pytest.raises(AccessDeniedError):
                c.subscribe("audit")  # may join the group, may not read the topic
            with pytest.raises(InvalidTopicNameError):
                c.subscribe("orders no such topic")
        with AdminClient(b.address, auth=("root", secret)) as admin:
            with pytest.raises(UnknownGroupError):
                admin.describe_delivery("team-a")
            with SimpleConsumer(b.address, "team-a", auth=("cons", secret)) as c:
                c.subscribe("orders")  # the first accepted subscription makes the group
                assert [mem[0] for mem in admin.describe_delivery("team-a").members] == [
                    c.member_id]


def test_a_closed_port_fails_fast_with_the_connection_error() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosedError, match=str(port)):
        SimpleConsumer(f"127.0.0.1:{port}", "g", connect_timeout_s=0.5, reconnect_timeout_s=1.0)
    assert time.monotonic() - t0 < 10  # not the 30 s request timeout of a heartbeat


@pytest.mark.parametrize("old", ["reconnect_timeout", "request_timeout", "session_timeout"])
def test_timeouts_without_unit_are_deprecated_aliases(broker: Broker, old: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"{old}_s"):
        c = SimpleConsumer(broker.address, "g", **{old: 7.0})
    try:
        got = {"reconnect_timeout_s": c._async._session.reconnect_timeout_s,
               "request_timeout_s": c._async._session.request_timeout_s,
               "session_timeout_s": c._async._core.session_timeout_ms / 1000}
        assert got[f"{old}_s"] == 7.0
    finally:
        c.close()
