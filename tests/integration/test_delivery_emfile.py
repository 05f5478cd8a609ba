"""Delivery groups while the broker is out of file descriptors (issue 18 §3, EMFILE handled like
ENOSPC): acks, nacks, expired leases, moves to the retry queue and the DLQ, journal compaction.

The broker runs in a subprocess limited to 256 descriptors; connections then take every
descriptor it has left (as in ``test_topic_flood.py``), twice, while simple consumers nack
messages and let leases expire and a push consumer's handler fails. Everything a move needs
that is not open yet (the group's retry and dead-letter topics, a new snapshot) cannot be
created meanwhile. The broker must answer retriable errors (the clients retry), postpone the
moves of expired leases quietly (one warning per episode), keep every message leased to the one
member that had it until it can move it, and once the connections go, finish everything without
a restart: each message ends acknowledged or dead exactly as the consumers' history says, with no
delivery twice at once, no retry letter written twice and nothing lost.

The broker flushes asynchronously with a long interval here, so the descriptors it holds have
unsynced writes and cannot be closed to make room: without that the descriptor cache would give
up clean descriptors to the first open that fails and the shortage would hit different paths
from run to run (the code paths do not depend on the flush mode: an open fails the same way).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ferrymq import (
    AdminClient,
    ConsumeResult,
    LeasedMessage,
    Message,
    Producer,
    PushConsumer,
    SimpleConsumer,
)
from tests.helpers import BrokerProcess, wait_for

pytestmark = pytest.mark.integration

NOFILE = 256
TOPIC = "emf-work"
N = 48
INVISIBLE_S = 3.0
GROUP = "emf"
PUSH_GROUP = "emf-push"
EPISODE_START = "delivery groups: "
EPISODE_WARNING = "wait and are retried at every tick"
EPISODE_END = "the work that waited"


@dataclass
class Delivery:
    member: str
    asked: float  # when the receive that leased it was sent
    got: float
    reconsume: int
    until: float  # its lease lasts at least until then
    settled: tuple[str, float] | None = None  # ("ack" | "nack", when the request was sent)


@dataclass
class History:
    """What the consumers saw, per message body index."""

    deliveries: dict[int, list[Delivery]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, i: int, d: Delivery) -> None:
        with self.lock:
            self.deliveries.setdefault(i, []).append(d)


class Hog:
    """Connections that take every descriptor the broker has left, until closed."""

    def __init__(self, b: BrokerProcess) -> None:
        self.b = b
        self.socks: list[socket.socket] = []

    def __enter__(self) -> Hog:
        for _ in range(NOFILE + 50):
            try:
                self.socks.append(socket.create_connection(("127.0.0.1", self.b.port), timeout=5))
            except OSError:
                break
        wait_for(lambda: self.b.open_descriptors() >= NOFILE - 2, timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.socks:
            s.close()
        wait_for(lambda: self.b.open_descriptors() < NOFILE - 50, timeout=10)


def index(msg: LeasedMessage) -> int:
    return int(msg.body.decode().split("-")[1])


ASYNC_ENV = {"FERRYMQ_FLUSH_INTERVAL_MS": "600000"}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    with BrokerProcess(tmp_path / "data", nofile=NOFILE, flush="async", env=ASYNC_ENV) as b:
        yield b


def receive_all(c: SimpleConsumer, name: str, history: History, want: int, *,
                timeout: float = 20.0) -> list[LeasedMessage]:
    out: list[LeasedMessage] = []
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        asked = time.monotonic()
        got = c.receive(max_messages=want - len(out), invisible_duration=INVISIBLE_S, wait=0.5)
        now = time.monotonic()
        for msg in got:
            history.add(index(msg), Delivery(name, asked, now, msg.reconsume_times,
                                             asked + INVISIBLE_S))
        out.extend(got)
    return out


def extend(c: SimpleConsumer, history: History, msg: LeasedMessage, seconds: float) -> None:
    """A longer lease, so that a nack waiting out the shortage finds it still current."""
    with history.lock:
        d = history.deliveries[index(msg)][-1]
    d.until = max(d.until, time.monotonic() + seconds)
    c.change_invisible_duration(msg, seconds)


def receive_redeliveries(members: dict[str, SimpleConsumer], history: History, want: int, *,
                         timeout: float = 30.0) -> dict[str, list[LeasedMessage]]:
    """The retried messages, taken by both members in turn, each lease made long at once: the
    moves out of the shortage and the retry delay may take a while on a crowded machine, and a
    lease that expired while the other member still waited would deliver a message a third
    time. Waits at most ``timeout`` for all ``want`` of them."""
    out: dict[str, list[LeasedMessage]] = {name: [] for name in members}
    deadline = time.monotonic() + timeout
    while sum(map(len, out.values())) < want and time.monotonic() < deadline:
        for name, c in members.items():
            left = want - sum(map(len, out.values()))
            if left <= 0:
                break
            got = receive_all(c, name, history, left, timeout=0.2)
            for msg in got:
                extend(c, history, msg, 60)
            out[name].extend(got)
    return out


def shorten(c: SimpleConsumer, history: History, msg: LeasedMessage, seconds: float) -> None:
    """A lease cut back to ``seconds`` from now, so that it expires on purpose."""
    with history.lock:
        d = history.deliveries[index(msg)][-1]
    asked = time.monotonic()
    c.change_invisible_duration(msg, seconds)
    d.until = asked + seconds


def settle(c: SimpleConsumer, history: History, msg: LeasedMessage, how: str) -> None:
    with history.lock:
        d = history.deliveries[index(msg)][-1]
    d.settled = (how, time.monotonic())
    if how == "ack":
        c.ack(msg)
    else:
        c.nack(msg, reason=f"fails on purpose ({how})")


def test_delivery_groups_out_of_descriptors_lose_nothing_and_recover(
        broker: BrokerProcess) -> None:
    b = broker
    history = History()
    pushed: dict[int, list[int]] = {}  # index -> reconsume_times of each handler call
    hog_up = threading.Event()

    push = PushConsumer(b.address, group=PUSH_GROUP, threads=4, retry_delays=[1],
                        max_reconsume=3, invisible_duration=30)  # no expiry while settling

    @push.subscribe(TOPIC)
    def handle(msg: LeasedMessage) -> ConsumeResult:
        i = index(msg)
        with history.lock:
            pushed.setdefault(i, []).append(msg.reconsume_times)
        if msg.reconsume_times == 0:
            hog_up.wait(30)  # settle the first attempts while descriptors are out
            if i % 2:
                return ConsumeResult.FAILURE
        return ConsumeResult.SUCCESS

    with AdminClient(b.address) as admin:
        admin.create_topic(TOPIC, 4)
    ids: dict[int, str] = {}
    with Producer(b.address) as p:
        for i in range(N):
            ids[i] = p.send(Message(TOPIC, f"m-{i}".encode())).msg_id
    members = {name: SimpleConsumer(b.address, group=GROUP, retry_delays=[1], max_reconsume=1)
               for name in ("a", "b")}
    admin = AdminClient(b.address)
    admin.list_groups()  # connected before descriptors run out
    pool = ThreadPoolExecutor(8)
    try:
        for c in members.values():
            c.subscribe(TOPIC)
        push.start()
        leased = {name: receive_all(c, name, history, N // 2) for name, c in members.items()}
        assert sorted(index(x) for xs in leased.values() for x in xs) == list(range(N))
        for name, msgs in leased.items():
            for msg in msgs:
                if index(msg) % 4 == 3:
                    settle(members[name], history, msg, "ack")
                elif index(msg) % 4 != 1:
                    extend(members[name], history, msg, 60)

        # episode 1: nacks of first deliveries and expiring leases, the push handler's results
        with Hog(b):
            hog_up.set()
            nacks: list[Future[None]] = [
                pool.submit(settle, members[name], history, msg, "nack")
                for name, msgs in leased.items() for msg in msgs if index(msg) % 4 in (0, 2)]
            time.sleep(INVISIBLE_S + 1.5)  # the leases of i % 4 == 1 expired meanwhile
            for name, msgs in leased.items():
                for msg in msgs:
                    if index(msg) % 4 == 1:  # could not be moved: still leased to its member
                        row = status(admin, ids[index(msg)], GROUP)
                        assert row[1:3] == ("DELIVERED", members[name].member_id), row
            assert not members["b"].receive(max_messages=N, invisible_duration=INVISIBLE_S,
                                            wait=0.5)  # nobody else gets them
            assert not any(f.done() for f in nacks)  # BUSY, retried by the client
            info = admin.describe_delivery(GROUP)
            assert sum(m[4] for m in info.members) == N - N // 4  # all but the acked leased
        for f in nacks:
            f.result(timeout=30)

        # redeliveries: ack i % 4 in (0, 1) and keep i % 4 == 2 for episode 2
        again = receive_redeliveries(members, history, N - N // 4)
        got = sorted(index(x) for xs in again.values() for x in xs)
        assert got == sorted(i for i in range(N) if i % 4 != 3), got
        for name, msgs in again.items():
            for msg in msgs:
                assert msg.reconsume_times == 1
                if index(msg) % 4 != 2:
                    settle(members[name], history, msg, "ack")
                elif index(msg) % 8 == 6:  # its lease is to expire in episode 2
                    shorten(members[name], history, msg, INVISIBLE_S)

        # episode 2: the second failure of i % 4 == 2 (a nack, or an expired lease for
        # i % 8 == 6) sends them to the DLQ
        with Hog(b):
            nacks = [pool.submit(settle, members[name], history, msg, "nack")
                     for name, msgs in again.items() for msg in msgs if index(msg) % 8 == 2]
            time.sleep(INVISIBLE_S + 1.5)
            assert not any(f.done() for f in nacks)
        for f in nacks:
            f.result(timeout=30)

        dead = {ids[i] for i in range(N) if i % 4 == 2}
        wait_for(lambda: admin.describe_delivery(GROUP).dlq_size == len(dead), timeout=15)
        wait_for(lambda: len(pushed) == N and all(
            len(v) == (2 if i % 2 else 1) for i, v in pushed.items()), timeout=20)
        for c in members.values():  # nothing more comes
            assert not c.receive(max_messages=N, invisible_duration=INVISIBLE_S, wait=1.5)

        # the broker's view matches the history
        for i in range(N):
            ds = history.deliveries[i]
            assert len(ds) == (1 if i % 4 == 3 else 2), (i, ds)  # no letter written twice
            assert [d.reconsume for d in ds] == list(range(len(ds)))
            for d1, d2 in itertools.pairwise(ds):  # never leased to two at once
                assert d1.settled is None or d1.settled[0] == "nack"
                end = d1.until if d1.settled is None else min(d1.settled[1], d1.until)
                assert d2.got >= end, (i, ds)
            row = status(admin, ids[i], GROUP)
            if i % 4 == 2:
                assert row[1] == "DEAD" and row[4] == 2, row
            else:
                assert row[1] == "CONSUMED" and row[7] > 0, row
            assert status(admin, ids[i], PUSH_GROUP)[1] == "CONSUMED"
            assert pushed[i] == ([0, 1] if i % 2 else [0])
        assert {d.msg_id for d in admin.dlq_list(GROUP, limit=N)} == dead
        for group, dlq in ((GROUP, len(dead)), (PUSH_GROUP, 0)):
            info = admin.describe_delivery(group)
            assert sum(info.lag) == 0 and info.retry_pending == 0, info
            assert info.retry_in_flight == 0 and info.dlq_size == dlq, info
            assert all(m[4] == 0 for m in info.members), info
    finally:
        push.close()
        for c in members.values():
            c.close()
        admin.close()
        pool.shutdown(wait=False, cancel_futures=True)

    text = b.log_text()
    assert text.count(EPISODE_WARNING) == 2, text[-4000:]  # one per episode, not per tick
    assert text.count(EPISODE_END) == 2
    assert "Traceback" not in text and "delivery tick failed" not in text
    assert "internal error" not in text
    assert "out of file descriptors" in text


def status(admin: AdminClient, msg_id: str, group: str) -> tuple[str, str, str, int, int, int,
                                                                 str, int]:
    (row,) = [s for s in admin.message_status(msg_id).statuses if s[0] == group]
    return row


def test_a_journal_compaction_out_of_descriptors_waits_and_loses_nothing(tmp_path: Path) -> None:
    """A group's journal passes delivery_journal_bytes while the broker has no descriptor: the
    compaction (a new journal, a snapshot) is retried at every tick with one warning, acks go
    on meanwhile, and it happens once descriptors are free; a restart finds every ack."""
    env = {**ASYNC_ENV, "FERRYMQ_DELIVERY_JOURNAL_BYTES": "4096"}
    with BrokerProcess(tmp_path / "data", nofile=NOFILE, flush="async", env=env) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic(TOPIC, 1)
        with Producer(b.address) as p:
            for i in range(200):
                p.send(Message(TOPIC, f"m-{i}".encode()))
        group_dir = tmp_path / "data" / "delivery" / GROUP
        acked: list[int] = []
        with SimpleConsumer(b.address, group=GROUP) as c:
            c.subscribe(TOPIC)
            msgs = []
            deadline = time.monotonic() + 10
            while len(msgs) < 200 and time.monotonic() < deadline:
                msgs += c.receive(max_messages=200 - len(msgs), invisible_duration=60, wait=0.5)
            assert len(msgs) == 200
            c.ack(msgs[0])  # its journal has unsynced writes now: the cache keeps it open
            acked.append(index(msgs[0]))
            before = {p.name for p in group_dir.iterdir()}
            with Hog(b):
                for msg in msgs[1:]:  # one record each: well past 4096 bytes
                    c.ack(msg)
                    acked.append(index(msg))
                time.sleep(0.5)  # ticks that try to compact
                assert {p.name for p in group_dir.iterdir()} == before  # nothing half-done
            wait_for(lambda: any(p.name == "state" for p in group_dir.iterdir()), timeout=10)
        assert sorted(acked) == list(range(200))
        text = b.log_text()
        assert text.count(EPISODE_WARNING) == 1 and "compact the delivery journal" in text
        assert text.count(EPISODE_END) == 1 and "Traceback" not in text
        b.kill9()
        b.start()
        with SimpleConsumer(b.address, group=GROUP) as c:
            c.subscribe(TOPIC)
            assert not c.receive(max_messages=10, invisible_duration=60, wait=1.0)
        with AdminClient(b.address) as admin:
            assert sum(admin.describe_delivery(GROUP).lag) == 0
