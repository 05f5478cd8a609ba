"""Delayed and scheduled messages against a real broker: never early, lateness recorded, cancel,
limits, introspection, and every kind of consumer seeing the fired copy exactly once."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import (
    AdminClient,
    Broker,
    ConsumeResult,
    LeasedMessage,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
    ReceivedMessage,
    SimpleConsumer,
)
from ferrymq.client._session import Session
from ferrymq.errors import InvalidRequestError, NotScheduledError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    RecordInput,
    decode_header,
    decode_msg_id,
    encode_batch,
    encode_properties,
)
from ferrymq.protocol.schedule import DELAY, SCHEDULED_DUE, SCHEDULED_ID

pytestmark = pytest.mark.integration

LATENESS_BOUND_MS = 1000  # generous for a shared CI machine; the bench measures the real figure


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    with Broker(tmp_path_factory.mktemp("delayed"), port=0, max_delay_ms=3_600_000) as b:
        yield b


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def create(broker: Broker, topic: str, queues: int = 2) -> None:
    with AdminClient(broker.address) as a:
        a.create_topic(topic, queues)


def poll_until(c: PullConsumer, n: int, timeout: float = 10.0) -> list[tuple[ReceivedMessage, int]]:
    """Poll until ``n`` messages arrived (then a little longer, to catch extras)."""
    got: list[tuple[ReceivedMessage, int]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(got) < n:
        for msg in c.poll(timeout=0.2):
            got.append((msg, now_ms()))
    extra_until = time.monotonic() + 0.3
    while time.monotonic() < extra_until:
        got.extend((msg, now_ms()) for msg in c.poll(timeout=0.1))
    return got


def original_append_ms(broker: Broker, msg_id: str) -> int:
    """The append time the broker stamped on a stored original (looked up in its log)."""
    tid, q, off = decode_msg_id(msg_id)
    qs = broker.server.topics.by_id[tid].queues[q]
    return decode_header(qs.log.read(off, 1)).append_time_ms


def check_copy(broker: Broker, msg: ReceivedMessage, recv_ms: int, expect_due: int) -> int:
    """Assert the copy is never early and return its lateness (receive time - due)."""
    due = int(msg.properties[SCHEDULED_DUE])
    assert due == expect_due
    assert msg.stored_ms >= due, "the copy was appended before the message was due"
    assert recv_ms >= due, "delivered early"
    return recv_ms - due


def test_delays_of_every_kind_are_never_early(broker: Broker) -> None:
    topic = "d-kinds"
    create(broker, topic)
    with Producer(broker.address) as p, PullConsumer(
        broker.address, "g", auto_offset_reset="earliest"
    ) as c:
        c.subscribe(topic)
        c.poll(timeout=0.2)
        sent = now_ms()
        at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1.2)
        at_ms = int(at.timestamp() * 1000) + (1 if at.microsecond % 1000 else 0)
        specs = {
            "ms": Message(topic, b"ms", delay=0.3, tags="a", keys=["k1"], properties={"u": "1"}),
            "s": Message(topic, b"s", delay=1, sharding_key="sk"),
            "td": Message(topic, b"td", delay=dt.timedelta(milliseconds=700)),
            "at": Message(topic, b"at", deliver_at=at),
            "lvl": Message(topic, b"lvl", delay_level=1),
            "now": Message(topic, b"now"),
        }
        ids = {k: p.send(msg).msg_id for k, msg in specs.items()}
        delays = {"ms": 300, "s": 1000, "td": 700, "lvl": 1000}
        got = poll_until(c, len(specs))
    by_body = {msg.body.decode(): (msg, t) for msg, t in got}
    assert sorted(by_body) == sorted(specs) and len(got) == len(specs), "lost or duplicated"
    msg, t = by_body["now"]
    assert SCHEDULED_ID not in msg.properties and t - sent < LATENESS_BOUND_MS
    lateness = {}
    for k, delay in delays.items():
        msg, t = by_body[k]
        assert msg.properties[SCHEDULED_ID] == ids[k]
        lateness[k] = check_copy(broker, msg, t, original_append_ms(broker, ids[k]) + delay)
    msg, t = by_body["at"]
    lateness["at"] = check_copy(broker, msg, t, at_ms)
    print("lateness ms:", lateness)
    assert max(lateness.values()) < LATENESS_BOUND_MS
    # the copy keeps the original's fields (born time, tag, keys, sharding key, properties)
    msg, _ = by_body["ms"]
    assert (msg.tags, msg.keys, msg.properties["u"]) == ("a", ("k1",), "1")
    assert DELAY not in msg.properties
    assert abs(msg.born_ms - sent) < 5000 and msg.born_ms <= msg.stored_ms - 300
    assert by_body["s"][0].sharding_key == "sk"
    # consumers skipped the originals: they are gaps, the copies are new offsets
    offsets = {(msg.queue, msg.offset) for msg, _ in got}
    assert all((decode_msg_id(i)[1], decode_msg_id(i)[2]) not in offsets
               for k, i in ids.items() if k != "now")


def test_plain_messages_stay_immediate_when_mixed_with_delayed_ones(broker: Broker) -> None:
    topic = "d-mixed"
    create(broker, topic, 1)
    with Producer(broker.address, linger_ms=50) as p, PullConsumer(
        broker.address, "g", auto_offset_reset="earliest"
    ) as c:
        c.subscribe(topic)
        c.poll(timeout=0.2)
        sent = now_ms()
        futs = []
        for i in range(20):  # one queue, buffered together: kinds must not share a batch
            futs.append(p.send_async(Message(topic, f"d{i}".encode(), delay=1.5)
                                     if i % 2 else Message(topic, f"p{i}".encode())))
        batch = p.send_batch([Message(topic, b"bp"), Message(topic, b"bd", delay=1.5),
                              Message(topic, b"bp2")])
        results = [f.result(10) for f in futs]
        assert len({r.msg_id for r in results} | {r.msg_id for r in batch}) == 23
        first = poll_until(c, 12, timeout=1.0)
        plain = sorted(msg.body.decode() for msg, _ in first)
        assert plain == sorted([f"p{i}" for i in range(0, 20, 2)] + ["bp", "bp2"])
        assert all(t - sent < 1400 for _, t in first)
        later = poll_until(c, 11, timeout=5.0)
    assert sorted(msg.body.decode() for msg, _ in later) == sorted(
        [f"d{i}" for i in range(1, 20, 2)] + ["bd"])
    assert all(t >= int(msg.properties[SCHEDULED_DUE]) for msg, t in later)
    by_id = {msg.properties[SCHEDULED_ID]: msg.body for msg, _ in later}
    assert by_id[batch[1].msg_id] == b"bd"  # send_batch results stay in input order
    assert by_id[results[1].msg_id] == b"d1"


def test_cancel(broker: Broker) -> None:
    topic = "d-cancel"
    create(broker, topic)
    with Producer(broker.address) as p, PullConsumer(
        broker.address, "g", auto_offset_reset="earliest"
    ) as c, AdminClient(broker.address) as admin:
        c.subscribe(topic)
        keep = p.send(Message(topic, b"keep", delay=1.0))
        drop = p.send(Message(topic, b"drop", delay=1.0))
        plain = p.send(Message(topic, b"plain"))
        assert admin.describe_topic(topic).scheduled_pending == 2
        p.cancel(drop.msg_id)
        assert admin.describe_topic(topic).scheduled_pending == 1
        with pytest.raises(NotScheduledError, match="already cancelled"):
            p.cancel(drop.msg_id)
        with pytest.raises(NotScheduledError, match="not a scheduled message"):
            p.cancel(plain.msg_id)
        with pytest.raises(NotScheduledError):
            p.cancel("0000FFFF00000000000000000000")  # no such topic
        with pytest.raises(InvalidRequestError):
            p.cancel("nonsense")
        got = poll_until(c, 2, timeout=3.0)
        assert sorted(msg.body for msg, _ in got) == [b"keep", b"plain"]
        with pytest.raises(NotScheduledError, match="already due"):
            p.cancel(keep.msg_id)
        assert admin.describe_topic(topic).scheduled_pending == 0
    states = {broker.server.scheduler.lookup(*decode_msg_id(i))[0]
              for i in (keep.msg_id, drop.msg_id, plain.msg_id)}
    assert states == {"FIRED", "CANCELLED", "NOT_SCHEDULED"}


def test_too_long_a_delay_is_refused_and_nothing_is_stored(broker: Broker) -> None:
    topic = "d-limits"
    create(broker, topic, 1)
    with Producer(broker.address) as p:  # the client checks first (the broker said 1 h)
        with pytest.raises(InvalidRequestError, match="max_delay_ms"):
            p.send(Message(topic, b"x", delay=3601))
        with pytest.raises(InvalidRequestError, match="max_delay_ms"):
            p.send(Message(topic, b"x", deliver_at=dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)))
        p.send(Message(topic, b"ok", delay=3599))
    with pytest.raises(ValueError, match="delay_level"):
        Message(topic, b"x", delay_level=19)
    with pytest.raises(ValueError, match="at most one"):
        Message(topic, b"x", delay=1, delay_level=2)
    with pytest.raises(ValueError, match="negative"):
        Message(topic, b"x", delay=-1)
    assert Message(topic, b"x", delay=0).delay_ms is None  # 0: a plain message

    def batch(props: list[dict[str, str]]) -> bytes:
        return bytes(encode_batch([RecordInput(b"b", now_ms(), properties=encode_properties(pr))
                                   for pr in props], attributes=ATTR_SCHEDULED))

    async def raw() -> list[m.ProduceResult]:  # what the broker does without the client's check
        s = Session(broker.address)
        try:
            resp = await s.request(m.ProduceRequest(5000, [
                (topic, 0, batch([{DELAY: "10"}, {DELAY: str(3_600_001)}])),
                (topic, 0, batch([{DELAY: "10"}, {"no": "due"}])),
                (topic, 0, batch([{DELAY: "ten"}])),
                (topic, 0, batch([{DELAY: "10"}])),
            ]), m.ProduceResponse)
            return resp.results
        finally:
            await s.close()

    end = broker.server.topics.queue(topic, 0).log.end_offset
    results = asyncio.run(raw())
    assert [r[2] for r in results] == [ErrorCode.INVALID_REQUEST] * 3 + [0]
    assert "max_delay_ms" in results[0][3] and "exactly one" in results[1][3]
    assert results[3][4] == end  # the refused batches took no offsets


def test_topic_describe_shows_pending_count_and_next_due(broker: Broker) -> None:
    topic = "d-describe"
    create(broker, topic, 3)
    with Producer(broker.address) as p:
        p.send_batch([Message(topic, f"{i}".encode(), delay=600 + i) for i in range(5)])
        first = p.send(Message(topic, b"first", delay=300))
    due = original_append_ms(broker, first.msg_id) + 300_000
    with AdminClient(broker.address) as admin:
        d = admin.describe_topic(topic)
    assert (d.scheduled_pending, d.next_due_ms) == (6, due)
    cli = [sys.executable, "-m", "ferrymq.admin.cli", "--server", broker.address]
    out = subprocess.run([*cli, "--json", "topic", "describe", topic], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    j = json.loads(out)
    assert j["scheduled_pending"] == 6 and j["next_due_ms"] == due
    text = subprocess.run([*cli, "topic", "describe", topic], capture_output=True, text=True,
                          timeout=30, check=True).stdout
    assert "scheduled: 6 pending, next due" in text
    res = subprocess.run([*cli, "message", "cancel", first.msg_id], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and "cancelled scheduled message" in res.stdout, res.stderr
    res = subprocess.run([*cli, "message", "cancel", first.msg_id], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 1 and "already cancelled" in res.stderr
    assert "Traceback" not in res.stderr
    with AdminClient(broker.address) as admin:
        d = admin.describe_topic(topic)
    assert d.scheduled_pending == 5 and d.next_due_ms > due


def test_simple_and_push_consumers_see_each_copy_once_with_tag_filters(broker: Broker) -> None:
    topic = "d-groups"
    create(broker, topic)
    with Producer(broker.address) as p:
        ids = [r.msg_id for r in p.send_batch(
            [Message(topic, f"{t}{i}".encode(), tags=t, delay=0.5)
             for i in range(10) for t in ("a", "b")])]
        p.send(Message(topic, b"a-now", tags="a"))
    sent = now_ms()
    # a simple consumer of everything, a push consumer of tag "a", a pull consumer of tag "b"
    simple_got: list[tuple[LeasedMessage, int]] = []
    with SimpleConsumer(broker.address, "simple", invisible_duration=5) as sc:
        sc.subscribe(topic)
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and len(simple_got) < 21:
            batch = sc.receive(64, wait=0.3)
            simple_got.extend((x, now_ms()) for x in batch)
            if batch:
                sc.ack_batch(batch)
        simple_got.extend((x, now_ms()) for x in sc.receive(64, wait=0.5))
    bodies = sorted(x.body.decode() for x, _ in simple_got)
    assert bodies == sorted([f"{t}{i}" for i in range(10) for t in "ab"] + ["a-now"])
    for x, t in simple_got:
        if x.body != b"a-now":
            assert t >= int(x.properties[SCHEDULED_DUE]) >= sent - 1000
    assert {x.properties.get(SCHEDULED_ID) for x, _ in simple_got} == {*ids, None}

    pushed: list[LeasedMessage] = []
    pc = PushConsumer(broker.address, "push", threads=2)

    @pc.subscribe(topic, "a")
    def handle(msg: LeasedMessage) -> ConsumeResult:
        pushed.append(msg)
        return ConsumeResult.SUCCESS

    pc.start()
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and len(pushed) < 11:
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        pc.close()
    assert sorted(x.body.decode() for x in pushed) == sorted(
        [f"a{i}" for i in range(10)] + ["a-now"])

    with PullConsumer(broker.address, "pull", auto_offset_reset="earliest") as c:
        c.subscribe(topic, "b")
        got = poll_until(c, 10, timeout=5)
    assert sorted(msg.body.decode() for msg, _ in got) == sorted(f"b{i}" for i in range(10))


def test_restart_with_pending_messages_and_finished_buckets_deleted(tmp_path: Path) -> None:
    cfg = {"schedule_bucket_ms": 500, "schedule_lookahead_ms": 500}
    data = tmp_path / "data"
    with Broker(data, port=0, **cfg) as b:
        with Producer(b.address) as p:
            far = [r.msg_id for r in p.send_batch(
                [Message("t", f"far{i}".encode(), delay=2.5) for i in range(50)])]
            soon = p.send(Message("t", b"soon", delay=0.6)).msg_id
        sched = b.server.scheduler
        assert sched.pending == 51
        assert len(sched.index.heap) <= 1  # the far bucket is on disk only (look-ahead 0.5 s)
        assert sched.lookup(*decode_msg_id(far[0]))[0] == "PENDING"
    with Broker(data, port=0, **cfg) as b, PullConsumer(
        b.address, "g", auto_offset_reset="earliest"
    ) as c:
        c.subscribe("t")
        got = poll_until(c, 51, timeout=8)
        assert sorted(msg.properties[SCHEDULED_ID] for msg, _ in got) == sorted([*far, soon])
        assert all(t >= int(msg.properties[SCHEDULED_DUE]) for msg, t in got)
        sched = b.server.scheduler
        deadline = time.monotonic() + 5  # watermarks checkpointed, then finished buckets go
        while time.monotonic() < deadline and sched.store.bucket_starts():
            time.sleep(0.1)
        assert sched.store.bucket_starts() == []
        assert sched.pending == 0 and b.server.scheduler.lookup(*decode_msg_id(soon))[0] == "DONE"


def test_retention_keeps_segments_with_pending_scheduled_messages(tmp_path: Path) -> None:
    with Broker(tmp_path / "data", port=0, segment_bytes=2048, retention_ms=0,
                retention_check_interval_ms=100) as b:
        with Producer(b.address) as p:
            pending = p.send(Message("t", b"x" * 100, delay=30, sharding_key="k")).msg_id
            for i in range(40):
                p.send(Message("t", f"filler {i}".encode() * 20, sharding_key="k"))
        _tid, q, off = decode_msg_id(pending)
        lg = b.server.topics.queue("t", q).log
        time.sleep(1.5)  # several retention passes
        assert lg.start_offset <= off, "retention deleted a pending scheduled message"
        assert len(lg.segments()) > 1
        with Producer(b.address) as p:
            p.cancel(pending)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and lg.start_offset <= off:
            time.sleep(0.1)
        assert lg.start_offset > off  # nothing pending any more: retention proceeds


def test_internal_writers_schedule_with_one_call(broker: Broker) -> None:
    """The hook for the broker's own writers (retry letters): append a scheduled batch to a log
    on the event loop, call ``scheduler.on_append``; the copy appears when due."""
    import concurrent.futures

    srv = broker.server
    done: concurrent.futures.Future[int] = concurrent.futures.Future()

    def on_loop() -> None:
        t = srv.topics.create("%RETRY%hook", 1, {}, srv.clock.wall_ms(), internal_ok=True)
        qs = t.queues[0]
        batch = encode_batch([RecordInput(b"letter", now_ms(), properties=encode_properties(
            {DELAY: "300", "%TOPIC": "orders"}))], attributes=ATTR_SCHEDULED)
        res = qs.log.append(batch, now_ms=srv.clock.wall_ms())
        srv.scheduler.on_append(qs, batch, res.base_offset, res.append_time_ms)
        srv.flusher.mark_dirty(qs)
        done.set_result(res.append_time_ms)

    assert broker._loop is not None
    broker._loop.call_soon_threadsafe(on_loop)
    appended = done.result(5)
    with PullConsumer(broker.address, "g", auto_offset_reset="earliest") as c:
        c.assign([("%RETRY%hook", 0)])
        got = poll_until(c, 1, timeout=5)
    assert len(got) == 1
    msg, t = got[0]
    assert msg.body == b"letter" and msg.offset == 1 and msg.properties["%TOPIC"] == "orders"
    assert int(msg.properties[SCHEDULED_DUE]) == appended + 300 <= min(t, msg.stored_ms)
