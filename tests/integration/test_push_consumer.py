"""Push consumers against a real broker: automatic acks, retries on the ladder, dead letters,
batch prefix acks, lease renewal, graceful close, broadcasting, threads, consumer kill -9."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import queue
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import pytest

from ferrymq import (
    AdminClient,
    AsyncAdminClient,
    AsyncPushConsumer,
    Broker,
    ConsumeResult,
    LeasedMessage,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
)
from ferrymq.client._session import Session
from ferrymq.client.push import Later, broadcast_group, default_instance_name
from ferrymq.errors import (
    ConfigError,
    ConnectionClosedError,
    MemberConflictError,
    UnknownGroupError,
    UnknownTopicError,
)
from ferrymq.protocol import messages as m
from tests.helpers import BrokerProcess, free_port, wait_for

pytestmark = pytest.mark.integration

T = TypeVar("T")
EPS = 0.06  # the broker checks due retries every 50 ms


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def produce(broker: Broker, topic: str, n: int, *, queues: int = 2,
            prefix: str = "m") -> list[str]:
    with AdminClient(broker.address) as admin:
        if topic not in {t[0] for t in admin.list_topics()}:
            admin.create_topic(topic, queues)
    with Producer(broker.address) as p:
        results = p.send_batch([Message(topic, f"{prefix}{i}".encode()) for i in range(n)])
    return [r.msg_id for r in results]


async def request(address: str, req: m.Request, resp_type: type[Any]) -> Any:
    s = Session(address)
    try:
        return await s.request(req, resp_type)
    finally:
        await s.close()


async def describe(address: str, group: str) -> m.DescribeDeliveryResponse:
    async with AsyncAdminClient(address) as admin:
        return await admin.describe_delivery(group)


async def all_acked(address: str, group: str) -> bool:
    """Every queue of the group's topics is finished up to its end; no retry pending."""
    d = await describe(address, group)
    return (bool(d.queues) and all(floor == end for _, _, floor, _, end, _, _ in d.queues)
            and d.retry_pending == 0 and d.retry_in_flight == 0)


async def eventually(cond: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0,
                     what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = cond()
        if isinstance(res, Awaitable):
            res = await res
        if res:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not met in {timeout} s")


@contextlib.contextmanager
def member_process(script: str, *args: str, stderr: IO[str] | int = subprocess.DEVNULL
                   ) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str]]]:
    """``python -c script *args`` and a queue of its stdout lines ("" after the last one);
    killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=stderr, text=True)
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stdout or ():
            lines.put(line)
        lines.put("")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)
        proc.stdout.close()


def read_dlq(broker: Broker, group: str, want: int) -> list[Any]:
    with PullConsumer(broker.address, "dlq-reader", auto_offset_reset="earliest") as pc:
        pc.assign([("%DLQ%" + group, 0)])
        dead: list[Any] = []
        deadline = time.monotonic() + 5
        while len(dead) < want and time.monotonic() < deadline:
            dead += pc.poll(0.3)
    return dead


def test_success_acks_every_message_once(broker: Broker) -> None:
    ids = produce(broker, "t", 300, queues=4)

    async def main() -> None:
        seen: list[tuple[str, int]] = []
        c = AsyncPushConsumer(broker.address, "g", concurrency=8)

        @c.subscribe("t")
        async def handle(msg: LeasedMessage) -> ConsumeResult:
            seen.append((msg.msg_id, msg.reconsume_times))
            return ConsumeResult.SUCCESS

        async with c:
            await eventually(lambda: len(seen) >= 300, what="300 messages handled")
            await eventually(lambda: all_acked(broker.address, "g"), what="group floor at end")
        assert sorted(mid for mid, _ in seen) == sorted(ids)  # each exactly once
        assert {rt for _, rt in seen} == {0}
        assert c.stats["acked"] == 300 and c.stats["nacked"] == 0

        # nothing comes back to the group
        again: list[str] = []
        c2 = AsyncPushConsumer(broker.address, "g")

        @c2.subscribe("t")
        async def handle2(msg: LeasedMessage) -> None:
            again.append(msg.msg_id)

        async with c2:
            await asyncio.sleep(0.5)
        assert again == []

    run(main())


def test_later_failure_and_exceptions_are_retried_on_the_ladder(broker: Broker) -> None:
    produce(broker, "t", 3, queues=1)
    delays = [0.3, 0.6]

    async def main() -> None:
        times: dict[bytes, list[tuple[int, float]]] = {}
        loop = asyncio.get_running_loop()
        c = AsyncPushConsumer(broker.address, "g", retry_delays=delays, max_reconsume=5)

        @c.subscribe("t")
        async def handle(msg: LeasedMessage) -> ConsumeResult:
            times.setdefault(msg.body, []).append((msg.reconsume_times, loop.time()))
            if msg.reconsume_times >= 2:
                return ConsumeResult.SUCCESS
            if msg.body == b"m0":
                return ConsumeResult.LATER
            if msg.body == b"m1":
                return ConsumeResult.FAILURE
            raise RuntimeError("handler broke")

        async with c:
            await eventually(lambda: sum(len(v) for v in times.values()) >= 9, what="9 attempts")
            await eventually(lambda: all_acked(broker.address, "g"), what="all acked")
            await asyncio.sleep(0.3)
        assert sorted(times) == [b"m0", b"m1", b"m2"]
        for body, attempts in times.items():
            assert [rt for rt, _ in attempts] == [0, 1, 2], body
            gaps = [b - a for (_, a), (_, b) in itertools.pairwise(attempts)]
            for gap, delay in zip(gaps, delays, strict=True):
                assert delay - EPS <= gap < delay + 1.5, (body, gaps)
        assert c.stats["handler_errors"] == 2
        assert c.stats["nacked"] == 6 and c.stats["acked"] == 3

    run(main())


def test_dead_letter_after_max_reconsume_with_the_reason(broker: Broker) -> None:
    [mid] = produce(broker, "t", 1, queues=1)

    async def main() -> None:
        attempts: list[int] = []
        c = AsyncPushConsumer(broker.address, "gd", retry_delays=[0.1], max_reconsume=2)

        @c.subscribe("t")
        async def handle(msg: LeasedMessage) -> ConsumeResult:
            attempts.append(msg.reconsume_times)
            raise ValueError(f"boom on attempt {msg.reconsume_times}")

        async with c:
            await eventually(lambda: len(attempts) >= 3, what="3 attempts")

            async def dead() -> bool:
                return (await describe(broker.address, "gd")).dlq_size == 1

            await eventually(dead, what="message in the DLQ")
            await asyncio.sleep(0.4)  # no fourth attempt
        assert attempts == [0, 1, 2]

    run(main())
    [letter] = read_dlq(broker, "gd", 1)
    props = letter.properties
    assert props["%MSGID"] == mid and props["%TOPIC"] == "t"
    assert props["%RECONSUME"] == "3"
    assert "ValueError: boom on attempt 2" in props["%REASON"]


def test_handler_chooses_its_own_delay(broker: Broker) -> None:
    produce(broker, "t", 1, queues=1)

    async def main() -> None:
        seen: list[tuple[int, float]] = []
        loop = asyncio.get_running_loop()
        c = AsyncPushConsumer(broker.address, "g", retry_delays=[20.0])

        @c.subscribe("t")
        async def handle(msg: LeasedMessage) -> ConsumeResult | Later:
            seen.append((msg.reconsume_times, loop.time()))
            if msg.reconsume_times == 0:
                return ConsumeResult.later(0.4, "not yet")
            return ConsumeResult.SUCCESS

        async with c:
            await eventually(lambda: len(seen) >= 2, what="redelivery")
        [(rt0, t0), (rt1, t1)] = seen
        assert (rt0, rt1) == (0, 1)
        assert 0.4 - EPS <= t1 - t0 < 3.0  # its own delay, not the 20 s ladder

    run(main())
    with pytest.raises(ConfigError):
        ConsumeResult.later(-1)


def test_batch_handler_acks_a_prefix(broker: Broker) -> None:
    ids = produce(broker, "t", 10, queues=1)

    async def main() -> None:
        calls: list[list[tuple[str, int]]] = []
        c = AsyncPushConsumer(broker.address, "g", batch_size=10, concurrency=1,
                              retry_delays=[0.2])

        @c.subscribe("t")
        async def handle(msgs: list[LeasedMessage]) -> int | ConsumeResult:
            calls.append([(x.msg_id, x.reconsume_times) for x in msgs])
            if len(calls) == 1:
                return 4  # the first four succeeded
            return ConsumeResult.SUCCESS

        async with c:
            await eventually(lambda: sum(len(b) for b in calls) >= 16, what="redeliveries")
            await eventually(lambda: all_acked(broker.address, "g"), what="all acked")
            await asyncio.sleep(0.4)
        first, *rest = calls
        assert first == [(i, 0) for i in ids]  # one batch, in queue order
        redelivered = [x for batch in rest for x in batch]
        assert sorted(redelivered) == sorted((i, 1) for i in ids[4:])
        assert c.stats["acked"] == 10 and c.stats["nacked"] == 6

    run(main())


def test_slow_handler_keeps_its_lease_and_is_not_redelivered(broker: Broker) -> None:
    produce(broker, "t", 1, queues=1)

    async def main() -> None:
        a_seen: list[int] = []
        b_seen: list[int] = []
        a = AsyncPushConsumer(broker.address, "g", invisible_duration=1.0)
        b = AsyncPushConsumer(broker.address, "g", invisible_duration=1.0)

        @a.subscribe("t")
        async def slow(msg: LeasedMessage) -> ConsumeResult:
            a_seen.append(msg.reconsume_times)
            await asyncio.sleep(2.6)  # > 2.5 leases
            return ConsumeResult.SUCCESS

        @b.subscribe("t")
        async def other(msg: LeasedMessage) -> ConsumeResult:
            b_seen.append(msg.reconsume_times)
            return ConsumeResult.SUCCESS

        async with a:
            await eventually(lambda: len(a_seen) == 1, what="a got the message")
            async with b:
                await eventually(lambda: all_acked(broker.address, "g"), what="acked")
                await asyncio.sleep(1.2)  # a lease would have expired by now
        assert a_seen == [0] and b_seen == []
        assert a.stats["renewed"] >= 2 and a.stats["rejected"] == 0 and a.stats["acked"] == 1

    run(main())


def test_hung_handler_loses_its_message_after_consume_timeout(broker: Broker) -> None:
    produce(broker, "t", 1, queues=1)

    async def main() -> None:
        seen: list[tuple[str, int]] = []
        release = asyncio.Event()
        a = AsyncPushConsumer(broker.address, "g", invisible_duration=0.6, consume_timeout=1.0)
        b = AsyncPushConsumer(broker.address, "g", invisible_duration=0.6)

        @a.subscribe("t")
        async def hangs(msg: LeasedMessage) -> ConsumeResult:
            seen.append(("a", msg.reconsume_times))
            if msg.reconsume_times == 0:
                await release.wait()  # hangs until the test lets it go
            return ConsumeResult.SUCCESS

        @b.subscribe("t")
        async def other(msg: LeasedMessage) -> ConsumeResult:
            seen.append(("b", msg.reconsume_times))
            return ConsumeResult.SUCCESS

        async with a:
            await eventually(lambda: len(seen) == 1, what="a got the message")
            t0 = time.monotonic()
            async with b:
                # redelivered (to either member) once a stops renewing the hung message's lease
                await eventually(lambda: len(seen) == 2, timeout=8, what="redelivery")
                assert time.monotonic() - t0 < 6.0
                await eventually(lambda: all_acked(broker.address, "g"), what="acked")
                release.set()  # the hung handler finally returns: its ack is refused
                await eventually(lambda: a.stats["rejected"] >= 1, what="late ack refused")
        assert seen[0] == ("a", 0) and seen[1][1] == 1 and len(seen) == 2

    run(main())


def test_close_hands_back_prefetched_messages_at_once(broker: Broker) -> None:
    ids = produce(broker, "t", 20, queues=1)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        a_seen: list[str] = []
        b_seen: list[tuple[str, int, float]] = []
        release = asyncio.Event()
        a = AsyncPushConsumer(broker.address, "g", concurrency=1, prefetch=50)
        b = AsyncPushConsumer(broker.address, "g")

        @a.subscribe("t")
        async def busy(msg: LeasedMessage) -> ConsumeResult:
            a_seen.append(msg.msg_id)
            await release.wait()
            return ConsumeResult.SUCCESS

        @b.subscribe("t")
        async def other(msg: LeasedMessage) -> ConsumeResult:
            b_seen.append((msg.msg_id, msg.reconsume_times, loop.time()))
            return ConsumeResult.SUCCESS

        await a.start()
        await eventually(lambda: len(a_seen) == 1, what="a busy")
        async with b:
            await asyncio.sleep(0.3)
            assert b_seen == []  # a holds (and renews) all 20
            t0 = loop.time()
            closing = loop.create_task(a.close(timeout=10))
            await eventually(lambda: len(b_seen) >= 19, timeout=5, what="hand-back")
            assert not closing.done()  # a's handler is still running
            assert max(t for _, _, t in b_seen) - t0 < 1.0
            release.set()
            await closing
            await eventually(lambda: all_acked(broker.address, "g"), what="acked")
        assert a_seen == ids[:1]
        assert sorted(mid for mid, _, _ in b_seen) == sorted(ids[1:])
        assert {rt for _, rt, _ in b_seen} == {0}  # handing back is not a failed attempt
        # 19, or more when a's last long poll got some of them back first (it hands them back)
        assert a.stats["returned"] >= 19 and a.stats["acked"] == 1

    run(main())


def test_two_members_never_hold_one_message_at_once(broker: Broker) -> None:
    n = 200
    produce(broker, "t", n, queues=2)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(7)
        history: list[tuple[str, str, float, float, str]] = []
        members = [AsyncPushConsumer(broker.address, "g", concurrency=4, prefetch=16,
                                     invisible_duration=1.0, retry_delays=[0.1])
                   for _ in range(2)]
        for name, c in zip("ab", members, strict=True):

            async def handle(msg: LeasedMessage, name: str = name) -> ConsumeResult:
                start = loop.time()
                r = rng.random()
                await asyncio.sleep(1.4 if r < 0.02 else r * 0.02)
                res = (ConsumeResult.LATER if r > 0.85 and msg.reconsume_times == 0
                       else ConsumeResult.SUCCESS)
                history.append((msg.msg_id, name, start, loop.time(), res.value))
                return res

            c.subscribe("t", "*", handle)
        async with members[0], members[1]:
            await eventually(lambda: sum(h[4] == "success" for h in history) >= n, timeout=30,
                             what="all handled")
            await eventually(lambda: all_acked(broker.address, "g"), what="acked")
        by_id: dict[str, list[tuple[float, float, str, str]]] = {}
        for mid, name, start, end, res in history:
            by_id.setdefault(mid, []).append((start, end, name, res))
        assert len(by_id) == n
        for mid, runs in by_id.items():
            runs.sort()
            assert [r[3] for r in runs].count("success") == 1, (mid, runs)
            for (_, end, _, _), (start, _, _, _) in itertools.pairwise(runs):
                assert end <= start, f"{mid} handled twice at once: {runs}"
        assert {h[1] for h in history} == {"a", "b"}  # the work was shared
        assert all(c.stats["rejected"] == 0 for c in members)

    run(main())


def test_broadcasting_gives_every_member_every_message(broker: Broker) -> None:
    produce(broker, "t", 5, queues=2, prefix="old")  # before the members: not delivered

    async def main() -> tuple[list[bytes], list[bytes]]:
        got: dict[str, list[bytes]] = {"a": [], "b": []}
        members = []
        for name in ("a", "b"):
            c = AsyncPushConsumer(broker.address, "bc", mode="broadcasting", instance_name=name)

            async def handle(msg: LeasedMessage, name: str = name) -> None:
                got[name].append(msg.body)

            c.subscribe("t", "*", handle)
            members.append(c)
        assert [c.delivery_group for c in members] == ["bc.a", "bc.b"]
        async with members[0], members[1]:
            await asyncio.to_thread(produce, broker, "t", 50, prefix="new")
            await eventually(lambda: len(got["a"]) >= 50 and len(got["b"]) >= 50,
                             what="both got all")
            for g in ("bc.a", "bc.b"):
                await eventually(lambda g=g: all_acked(broker.address, g), what=f"{g} acked")
            await asyncio.sleep(0.2)
        return got["a"], got["b"]

    a, b = run(main())
    want = sorted(f"new{i}".encode() for i in range(50))
    assert sorted(a) == want and sorted(b) == want
    assert broadcast_group("bc", "host/1 x") == "bc.host_1_x"


def test_two_groups_on_one_topic_are_independent(broker: Broker) -> None:
    ids = produce(broker, "t", 30, queues=2)

    async def main() -> None:
        g1: list[tuple[str, int]] = []
        g2: list[tuple[str, int]] = []
        c1 = AsyncPushConsumer(broker.address, "g1")
        c2 = AsyncPushConsumer(broker.address, "g2", retry_delays=[0.2])

        @c1.subscribe("t")
        async def one(msg: LeasedMessage) -> ConsumeResult:
            g1.append((msg.msg_id, msg.reconsume_times))
            return ConsumeResult.SUCCESS

        @c2.subscribe("t")
        async def two(msg: LeasedMessage) -> ConsumeResult:
            g2.append((msg.msg_id, msg.reconsume_times))
            return ConsumeResult.SUCCESS if msg.reconsume_times else ConsumeResult.LATER

        async with c1, c2:
            await eventually(lambda: len(g2) >= 60, what="g2 retried everything")
            for g in ("g1", "g2"):
                await eventually(lambda g=g: all_acked(broker.address, g), what=f"{g} acked")
            await asyncio.sleep(0.3)
        assert sorted(g1) == sorted((i, 0) for i in ids)
        assert sorted(g2) == sorted([(i, 0) for i in ids] + [(i, 1) for i in ids])
        assert (await describe(broker.address, "g1")).retry_pending == 0

    run(main())


def test_sync_push_consumer_runs_handlers_on_its_threads(broker: Broker) -> None:
    ids = produce(broker, "t", 40, queues=2)
    lock = threading.Lock()
    seen: list[tuple[str, int, str]] = []
    running = [0, 0]  # now, most at once

    consumer = PushConsumer(broker.address, "gs", threads=4, retry_delays=[0.2])

    @consumer.subscribe("t")
    def handle(msg: LeasedMessage) -> ConsumeResult:
        with lock:
            seen.append((msg.msg_id, msg.reconsume_times, threading.current_thread().name))
            running[0] += 1
            running[1] = max(running)
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        if msg.msg_id == ids[0] and msg.reconsume_times == 0:
            raise RuntimeError("first try fails")
        return ConsumeResult.SUCCESS

    t0 = time.monotonic()
    with consumer:
        deadline = time.monotonic() + 10
        while len(seen) < 41 and time.monotonic() < deadline:
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 5
        while consumer.stats["acked"] < 40 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert sorted((mid, rt) for mid, rt, _ in seen) == sorted(
        [(i, 0) for i in ids] + [(ids[0], 1)])
    assert all(name.startswith("ferrymq-push") for _, _, name in seen)
    assert running[1] >= 2 and elapsed < 41 * 0.05  # in parallel
    assert consumer.stats["acked"] == 40 and consumer.stats["handler_errors"] == 1
    assert run(all_acked(broker.address, "gs"))


def test_sync_slow_handler_does_not_starve_heartbeats(broker: Broker) -> None:
    produce(broker, "t", 1, queues=1)
    seen: list[int] = []
    consumer = PushConsumer(broker.address, "gh", threads=1, session_timeout_s=1.0,
                            invisible_duration=1.0)

    @consumer.subscribe("t")
    def handle(msg: LeasedMessage) -> ConsumeResult:
        seen.append(msg.reconsume_times)
        time.sleep(2.5)  # blocks its thread, longer than the session timeout and the lease
        return ConsumeResult.SUCCESS

    with consumer:
        deadline = time.monotonic() + 10
        while consumer.stats["acked"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.2)
    assert seen == [0]
    assert consumer.stats["rejected"] == 0 and consumer.stats["acked"] == 1
    assert run(all_acked(broker.address, "gh"))


KILL_SCRIPT = textwrap.dedent("""
    import sys, threading
    from ferrymq import ConsumeResult, PushConsumer

    done = 0
    c = PushConsumer(sys.argv[1], "gk", threads=1, prefetch=100, invisible_duration=1.5)

    @c.subscribe("t")
    def handle(msg):
        global done
        if done < 5:
            done += 1
            print("ACK", msg.msg_id, flush=True)
            return ConsumeResult.SUCCESS
        print("BLOCK", msg.msg_id, flush=True)
        threading.Event().wait()  # until kill -9

    c.start()
    threading.Event().wait()
""")


def test_consumer_kill9_mid_batch(broker: Broker) -> None:
    ids = produce(broker, "t", 20, queues=1)
    with member_process(KILL_SCRIPT, broker.address) as (proc, lines):
        acked: list[str] = []
        while True:
            line = lines.get(timeout=20).split()
            if line[0] == "BLOCK":
                break
            acked.append(line[1])
        assert acked == ids[:5]

        async def main() -> list[tuple[str, int]]:
            async def consumed() -> bool:
                for mid in acked:
                    st = await request(broker.address, m.MessageStatusRequest(mid),
                                       m.MessageStatusResponse)
                    if [s[1] for s in st.statuses if s[0] == "gk"] != ["CONSUMED"]:
                        return False
                return True

            await eventually(consumed, what="the five acks reached the broker")
            got: list[tuple[str, int]] = []
            b = AsyncPushConsumer(broker.address, "gk")

            @b.subscribe("t")
            async def handle(msg: LeasedMessage) -> None:
                got.append((msg.msg_id, msg.reconsume_times))

            async with b:
                await asyncio.sleep(0.5)
                assert got == []  # the victim still holds (and renews) its leases
                proc.kill()
                proc.wait(10)
                await eventually(lambda: len(got) >= 15, timeout=10, what="redelivery")
                await eventually(lambda: all_acked(broker.address, "gk"), what="acked")
                await asyncio.sleep(0.3)
            return got

        got = run(main())
        assert sorted(got) == sorted((mid, 1) for mid in ids[5:])  # the acked five never again


def test_bad_usage_is_refused(broker: Broker) -> None:
    c = AsyncPushConsumer(broker.address, "g")

    def plain(msg: LeasedMessage) -> None:
        pass

    async def coro(msg: LeasedMessage) -> None:
        pass

    with pytest.raises(ConfigError):
        c.subscribe("t", "*", plain)
    with pytest.raises(ConfigError):
        AsyncPushConsumer(broker.address, "g", mode="fanout")
    with pytest.raises(ConfigError):
        AsyncPushConsumer(broker.address, "g", batch_size=0)
    sync = PushConsumer(broker.address, "g")
    try:
        with pytest.raises(ConfigError):
            sync.subscribe("t", "*", coro)
    finally:
        sync.close()

    async def unknown_topic() -> None:
        u = AsyncPushConsumer(broker.address, "gu", require_topic=True)
        u.subscribe("no-such-topic", "*", coro)
        try:
            with pytest.raises(UnknownTopicError, match="'no-such-topic' does not exist"):
                await u.start()
        finally:
            await u.close()
        with pytest.raises(UnknownGroupError):  # the failed start left no group behind
            await describe(broker.address, "gu")

    run(unknown_topic())
    with pytest.raises(ConfigError, match="invalid group name"):
        AsyncPushConsumer(broker.address, "no spaces")


def test_a_consumer_started_before_its_topic_waits_for_it(
        broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ferrymq.client")

    async def main() -> dict[str, list[bytes]]:
        got: dict[str, list[bytes]] = {"gw": [], "gw.b": []}
        members = [AsyncPushConsumer(broker.address, "gw"),
                   # broadcasting starts at "latest": a topic created after it subscribed is
                   # all news, so it gets the messages sent before it noticed the topic too
                   AsyncPushConsumer(broker.address, "gw", mode="broadcasting",
                                     instance_name="b")]
        for c in members:

            async def handle(msg: LeasedMessage, name: str = c.delivery_group) -> None:
                got[name].append(msg.body)

            c.subscribe("later", "*", handle)
        async with members[0], members[1]:  # no UnknownTopicError
            await asyncio.sleep(0.5)
            assert got == {"gw": [], "gw.b": []}
            await asyncio.to_thread(produce, broker, "later", 50, queues=3)
            await eventually(lambda: len(got["gw"]) >= 50 and len(got["gw.b"]) >= 50,
                             timeout=5, what="both got the topic's messages")
            for g in got:
                await eventually(lambda g=g: all_acked(broker.address, g), what=f"{g} acked")
        return got

    got = run(main())
    want = sorted(f"m{i}".encode() for i in range(50))
    assert sorted(got["gw"]) == want and sorted(got["gw.b"]) == want
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "'later'" in r.getMessage()]
    assert len(warned) == 2 and all("does not exist yet" in w for w in warned)  # one each


def test_broadcasting_consumers_in_one_process_each_get_every_message(broker: Broker) -> None:
    produce(broker, "t", 3, queues=2, prefix="old")  # before them: not delivered ("latest")
    got: list[list[bytes]] = [[], []]
    consumers = [PushConsumer(broker.address, "bc1", mode="broadcasting", threads=2)
                 for _ in got]
    for i, c in enumerate(consumers):
        c.subscribe("t", "*", lambda msg, i=i: got[i].append(msg.body))
    with consumers[0], consumers[1]:
        produce(broker, "t", 200, prefix="new")
        wait_for(lambda: len(got[0]) >= 200 and len(got[1]) >= 200, timeout=15)
        for c in consumers:
            run(eventually(lambda c=c: all_acked(broker.address, c.delivery_group)))
    want = sorted(f"new{i}".encode() for i in range(200))
    assert sorted(got[0]) == want and sorted(got[1]) == want
    names = [c.delivery_group for c in consumers]  # <group>.<hostname>-<pid>-<n>
    assert names[0] != names[1]
    assert all(re.fullmatch(rf"bc1\.{re.escape(default_instance_name())}-\d+", n) for n in names)


def test_a_broadcasting_instance_name_is_one_live_member_and_keeps_its_progress(
        broker: Broker) -> None:
    produce(broker, "t", 0, queues=2)
    first: list[bytes] = []
    a = PushConsumer(broker.address, "bc", mode="broadcasting", instance_name="node-1")
    a.subscribe("t", "*", lambda msg: first.append(msg.body))
    with a:
        produce(broker, "t", 20, prefix="a")
        wait_for(lambda: len(first) >= 20)
        b = PushConsumer(broker.address, "bc", mode="broadcasting", instance_name="node-1")
        b.subscribe("t", "*", lambda msg: None)
        with pytest.raises(MemberConflictError, match=r"'bc\.node-1'.*instance_name"):
            b.start()
        b.close()
        assert len(run(describe(broker.address, "bc.node-1")).members) == 1  # not merged
        run(eventually(lambda: all_acked(broker.address, "bc.node-1")))
    produce(broker, "t", 30, prefix="c")  # while node-1 is down
    later: list[bytes] = []
    c = PushConsumer(broker.address, "bc", mode="broadcasting", instance_name="node-1")
    c.subscribe("t", "*", lambda msg: later.append(msg.body))
    with c:  # the name is free again: it resumes node-1's progress
        wait_for(lambda: len(later) >= 30)
        time.sleep(0.3)
    assert sorted(first) == sorted(f"a{i}".encode() for i in range(20))
    assert sorted(later) == sorted(f"c{i}".encode() for i in range(30))


BROADCAST_SCRIPT = textwrap.dedent("""
    import sys, threading
    from ferrymq import PushConsumer

    c = PushConsumer(sys.argv[1], "bk", mode="broadcasting", instance_name="node-k")
    c.subscribe("t", "*", lambda msg: None)
    c.start()
    print("STARTED", flush=True)
    threading.Event().wait()  # until kill -9
""")


def test_a_killed_broadcasting_member_does_not_block_its_name(broker: Broker) -> None:
    produce(broker, "t", 0, queues=1)
    with member_process(BROADCAST_SCRIPT, broker.address) as (proc, lines):
        assert lines.get(timeout=20).strip() == "STARTED"
        other = PushConsumer(broker.address, "bk", mode="broadcasting", instance_name="node-k")
        other.subscribe("t", "*", lambda msg: None)
        with pytest.raises(MemberConflictError):  # live in another process
            other.start()
        proc.kill()
        proc.wait(10)
        t0 = time.monotonic()
        deadline = t0 + 5
        while True:  # its connection is closed: the name is free, long before 30 s
            try:
                other.start()
                break
            except MemberConflictError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            assert time.monotonic() - t0 < 5
            assert [mem[0] for mem in run(describe(broker.address, "bk.node-k")).members] == [
                other.member_id]
        finally:
            other.close()


CTRL_C_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from ferrymq import ConsumeResult, PushConsumer

    lock = threading.Lock()
    address, form, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
    c = PushConsumer(address, "gi", threads=2, prefetch=100, invisible_duration=60,
                     client_id="victim")

    def say(line):
        with lock:  # one line at a time from the two handler threads
            print(line, flush=True)

    @c.subscribe("t")
    def handle(msg):
        say(f"HANDLING {msg.msg_id}")
        time.sleep(pause)
        say(f"DONE {msg.msg_id}")
        return ConsumeResult.SUCCESS

    try:
        if form == "no-close":  # the program never closes it: the exit does
            c.start()
            while True:
                time.sleep(0.05)
        with c:
            while True:
                time.sleep(0.05)
    except KeyboardInterrupt:
        say("INTERRUPTED")
""")


@pytest.mark.parametrize(("form", "pause", "signals"), [
    ("with", 1.5, 1),  # the README's form: running handlers finish, the rest goes back
    ("no-close", 1.5, 1),  # Ctrl-C outside any with: closed at exit all the same
    ("with", 60.0, 2),  # a second Ctrl-C while closing abandons the running handlers
])
def test_ctrl_c_hands_back_leases_and_leaves_the_group(
        broker: Broker, tmp_path: Path, form: str, pause: float, signals: int) -> None:
    ids = produce(broker, "t", 40, queues=1)
    rescued: list[tuple[str, int, float]] = []
    rescuer = PushConsumer(broker.address, "gi", threads=4, client_id="rescuer")
    rescuer.subscribe("t", "*", lambda msg: rescued.append(
        (msg.msg_id, msg.reconsume_times, time.monotonic())))
    stderr = tmp_path / "stderr"
    with stderr.open("w") as f, member_process(CTRL_C_SCRIPT, broker.address, form, str(pause),
                                               stderr=f) as (proc, lines):
        handling = [lines.get(timeout=20), lines.get(timeout=20)]  # both threads busy
        assert all(x.startswith("HANDLING") for x in handling), (handling, stderr.read_text())
        with rescuer:
            time.sleep(0.5)
            assert rescued == []  # the victim holds (and renews) all 40
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            if signals == 2:
                time.sleep(1.0)  # closing: waiting for the two 60 s handlers
                proc.send_signal(signal.SIGINT)
            proc.wait(30)
            exited = time.monotonic() - t0
            out = list(iter(functools.partial(lines.get, timeout=10), ""))
            done = [x.split()[1] for x in out if x.startswith("DONE")]
            assert "INTERRUPTED\n" in out
            with contextlib.suppress(AssertionError):
                wait_for(lambda: len(rescued) >= 40 - len(done), timeout=10)
            assert len(rescued) == 40 - len(done), (out, rescued, stderr.read_text())
            assert max(t for _, _, t in rescued) - t0 < 10  # not after the 60 s leases
            run(eventually(lambda: all_acked(broker.address, "gi"), what="all acked"))
            members = run(describe(broker.address, "gi")).members
        err = stderr.read_text()
        assert "Traceback" not in err and "crashed" not in err, err
        assert exited < (20 if signals == 1 else 15)
        assert sorted([*done, *(mid for mid, _, _ in rescued)]) == sorted(ids)
        assert {rt for _, rt, _ in rescued} == {0}  # handing back is not a failed attempt
        assert [mem[1] for mem in members] == ["rescuer"]  # the victim left


def test_start_against_a_closed_port_fails_with_the_connection_error() -> None:
    port = free_port()
    c = PushConsumer(f"127.0.0.1:{port}", "g", connect_timeout_s=0.5, reconnect_timeout_s=1.0)
    c.subscribe("t", "*", lambda msg: None)
    t0 = time.monotonic()
    try:
        with pytest.raises(ConnectionClosedError, match=str(port)):
            c.start()
        assert time.monotonic() - t0 < 10  # not "DELIVERY_HEARTBEAT: no answer in 30 s"
    finally:
        c.close()


def _timeouts(c: AsyncPushConsumer) -> dict[str, float]:
    return {"reconnect_timeout_s": c._session.reconnect_timeout_s,
            "request_timeout_s": c._session.request_timeout_s,
            "session_timeout_s": c._core.session_timeout_ms / 1000}


@pytest.mark.parametrize("old", ["reconnect_timeout", "request_timeout", "session_timeout"])
def test_timeouts_without_unit_are_deprecated_aliases(broker: Broker, old: str) -> None:
    """Every client names its timeouts in seconds with ``_s`` (the pull consumer's names); the
    push consumer's older names still work and warn."""
    with pytest.warns(DeprecationWarning, match=f"{old}_s"):
        c = PushConsumer(broker.address, "g", **{old: 7.0})
    try:
        assert _timeouts(c._async)[f"{old}_s"] == 7.0
    finally:
        c.close()
    with pytest.warns(DeprecationWarning, match=f"{old}_s"):
        a = AsyncPushConsumer(broker.address, "g", **{old: 8.0})
    assert _timeouts(a)[f"{old}_s"] == 8.0


# --- ephemeral broadcasting groups (issue 18 §3) -------------------------------------------------


def group_names(address: str) -> set[str]:
    with AdminClient(address) as admin:
        return {g[0] for g in admin.list_groups()}


def topic_names(address: str) -> set[str]:
    with AdminClient(address) as admin:
        return {t[0] for t in admin.list_topics()}


def left_nothing(broker: Broker, group: str) -> bool:
    """No trace of ``group``: not listed, no retry or dead-letter topic, no files."""
    delivery = broker.server.data_dir / "delivery"
    return (group not in group_names(broker.address)
            and not {f"%RETRY%{group}", f"%DLQ%{group}"} & topic_names(broker.address)
            and not any(p.name.startswith(group) for p in delivery.iterdir()))


def fail_first(got: list[tuple[bytes, int]]) -> Callable[[LeasedMessage], ConsumeResult]:
    def handle(msg: LeasedMessage) -> ConsumeResult:
        got.append((msg.body, msg.reconsume_times))
        return ConsumeResult.FAILURE if msg.reconsume_times == 0 else ConsumeResult.SUCCESS
    return handle


def test_a_broadcasting_consumer_without_instance_name_leaves_no_group(broker: Broker) -> None:
    """Its group (state, journal, retry topic) is removed once it leaves; one with an
    instance_name stays and resumes its progress."""
    produce(broker, "t", 0, queues=2)
    got: list[tuple[bytes, int]] = []
    kept: list[tuple[bytes, int]] = []
    eph = PushConsumer(broker.address, "bc", mode="broadcasting", retry_delays=[0.1])
    eph.subscribe("t", "*", fail_first(got))
    named = PushConsumer(broker.address, "bc", mode="broadcasting", instance_name="node-1",
                         retry_delays=[0.1])
    named.subscribe("t", "*", fail_first(kept))
    with eph, named:
        produce(broker, "t", 3, prefix="a")
        wait_for(lambda: len(got) == 6 and len(kept) == 6)  # each failed once, then done
        assert broker.server.delivery.groups[eph.delivery_group].ephemeral
        assert not broker.server.delivery.groups["bc.node-1"].ephemeral
        assert {eph.delivery_group, "bc.node-1"} <= group_names(broker.address)
        assert f"%RETRY%{eph.delivery_group}" in topic_names(broker.address)
        run(eventually(lambda: all_acked(broker.address, eph.delivery_group)))
    wait_for(lambda: left_nothing(broker, eph.delivery_group), timeout=5)
    assert "bc.node-1" in group_names(broker.address)
    produce(broker, "t", 4, prefix="b")  # while node-1 is down
    later: list[tuple[bytes, int]] = []
    again = PushConsumer(broker.address, "bc", mode="broadcasting", instance_name="node-1")
    again.subscribe("t", "*", lambda msg: later.append((msg.body, msg.reconsume_times)))
    with again:  # resumes: gets what was sent meanwhile, nothing it acked before
        wait_for(lambda: len(later) >= 4)
        time.sleep(0.3)
    assert sorted(later) == [(f"b{i}".encode(), 0) for i in range(4)]


EPHEMERAL_SCRIPT = textwrap.dedent("""
    import sys, threading
    from ferrymq import PushConsumer

    c = PushConsumer(sys.argv[1], "bk", mode="broadcasting", session_timeout_s=2.0)
    c.subscribe("t", "*", lambda msg: None)
    c.start()
    print(c.delivery_group, flush=True)
    threading.Event().wait()  # until kill -9
""")


def test_a_killed_broadcasting_consumer_without_instance_name_leaves_no_group(
        broker: Broker) -> None:
    produce(broker, "t", 0, queues=1)
    with member_process(EPHEMERAL_SCRIPT, broker.address) as (proc, lines):
        name = lines.get(timeout=20).strip()
        assert name.startswith("bk.") and name in group_names(broker.address)
        proc.kill()
        proc.wait(10)
        t0 = time.monotonic()
        assert name in group_names(broker.address)  # until its session expires (2 s)
        wait_for(lambda: left_nothing(broker, name), timeout=10)
        assert time.monotonic() - t0 >= 1.5


def test_an_ephemeral_group_with_dead_letters_is_kept_until_they_are_handled(
        broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    """Dead letters are not dropped silently (as group delete without --delete-dlq): the group
    stays without members, with a warning, until its DLQ is purged or redriven."""
    produce(broker, "t", 0, queues=1)
    c = PushConsumer(broker.address, "bd", mode="broadcasting", max_reconsume=0)
    c.subscribe("t", "*", lambda msg: ConsumeResult.FAILURE)
    with c:
        produce(broker, "t", 1, prefix="doomed")
        run(eventually(lambda: describe_dlq(broker.address, c.delivery_group)))
    time.sleep(0.5)  # a few ticks
    assert c.delivery_group in group_names(broker.address)
    assert any("dead letters" in r.getMessage() and c.delivery_group in r.getMessage()
               for r in caplog.records)
    with AdminClient(broker.address) as admin:
        assert [d.body for d in admin.dlq_list(c.delivery_group)] == [b"doomed0"]
        admin.dlq_purge(c.delivery_group)
    wait_for(lambda: left_nothing(broker, c.delivery_group), timeout=5)


async def describe_dlq(address: str, group: str) -> bool:
    return (await describe(address, group)).dlq_size == 1


def test_ephemeral_is_asked_for_by_the_client_and_a_durable_member_keeps_the_group(
        broker: Broker) -> None:
    produce(broker, "t", 0, queues=1)

    def heartbeat(member: str, ephemeral: bool) -> m.DeliveryHeartbeatResponse:
        return run(request(broker.address, m.DeliveryHeartbeatRequest(
            "mixed", member, "c", [("t", "*")], 30_000, None, -1, -1, False, False, ephemeral),
            m.DeliveryHeartbeatResponse))

    first = heartbeat("", True)
    assert first.ephemeral
    second = heartbeat("", False)  # a durable member: the group is durable for good
    assert not second.ephemeral and not heartbeat(first.member_id, True).ephemeral
    for member in (first.member_id, second.member_id):
        run(request(broker.address, m.DeliveryLeaveRequest("mixed", member), m.Empty))
    time.sleep(0.3)
    assert "mixed" in group_names(broker.address)


def test_an_ephemeral_group_outlives_a_broker_restart_only_with_its_member(
        tmp_path: Path) -> None:
    """Members are not kept across a broker restart: an ephemeral group's member that comes
    back within its session keeps the group and its progress; a group whose member does not
    come back is removed after max_session_timeout_ms (here 3 s)."""
    env = {"FERRYMQ_MAX_SESSION_TIMEOUT_MS": "3000"}
    with BrokerProcess(tmp_path / "data", env=env) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic("t", 1)
        got: list[bytes] = []
        c = PushConsumer(b.address, "br", mode="broadcasting", session_timeout_s=2.0)
        c.subscribe("t", "*", lambda msg: got.append(msg.body))
        with c, Producer(b.address) as p:
            p.send(Message("t", b"before"))
            wait_for(lambda: got == [b"before"])
            assert b.terminate() == 0
            b.start()
            p.send(Message("t", b"after"))
            wait_for(lambda: got == [b"before", b"after"], timeout=20)
            time.sleep(3.5)  # past the restart's grace: its member is back, the group stays
            assert c.delivery_group in group_names(b.address)
        wait_for(lambda: c.delivery_group not in group_names(b.address), timeout=5)

        gone = PushConsumer(b.address, "br", mode="broadcasting", session_timeout_s=2.0,
                            reconnect_timeout_s=1.0)
        gone.subscribe("t", "*", lambda msg: None)
        gone.start()
        assert b.terminate() == 0
        gone.close()  # cannot tell the broker: it is down
        b.start()
        t0 = time.monotonic()
        assert gone.delivery_group in group_names(b.address)
        wait_for(lambda: gone.delivery_group not in group_names(b.address), timeout=10)
        assert time.monotonic() - t0 >= 2.0
        assert "Traceback" not in b.log_text()
