"""Order checker over a recorded history: orderly push consumers with random handler failures
and member churn. Per sharding key, first deliveries come in send order, a message is never
handled before its predecessor succeeded, and no key is handled by two handlers at once."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, PushConsumer
from ferrymq.client.push import ConsumeResult
from ferrymq.client.simple import LeasedMessage

pytestmark = pytest.mark.integration

KEYS = 24
PER_KEY = 25


@pytest.fixture
def fast_broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "data", port=0, orderly_retry_ms=30).start()
    try:
        yield b
    finally:
        b.stop()


class History:
    """Handler calls: (key, index, member, start, end, succeeded), thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int, str, float, float, bool]] = []
        self.done: set[tuple[str, int]] = set()

    def handler(self, member: str, rng: random.Random) -> object:
        def handle(msg: LeasedMessage) -> ConsumeResult:
            key, idx = msg.body.decode().split(":")
            start = time.monotonic()
            time.sleep(rng.uniform(0, 0.004))
            ok = rng.random() >= 0.15  # 15% of attempts fail: retried in place
            end = time.monotonic()
            with self.lock:
                self.calls.append((key, int(idx), member, start, end, ok))
                if ok:
                    self.done.add((key, int(idx)))
            return ConsumeResult.SUCCESS if ok else ConsumeResult.LATER

        return handle


def test_order_checker_with_failures_and_member_churn(fast_broker: Broker) -> None:
    addr = fast_broker.address
    with AdminClient(addr) as admin:
        admin.create_topic("ord", 4)
    with Producer(addr) as p:
        for i in range(PER_KEY):
            p.send_batch([Message("ord", f"k{k}:{i}", sharding_key=f"k{k}")
                          for k in range(KEYS)])
    total = KEYS * PER_KEY
    hist = History()

    def member(name: str, seed: int) -> PushConsumer:
        # prefetch 8 < KEYS: one member cannot hold every key's head, so each member that is
        # up while others are gets keys (with 64, the first member could starve the second)
        c = PushConsumer(addr, "og", orderly=True, threads=4, max_reconsume=1000,
                         prefetch=8, client_id=name)
        c.subscribe("ord", handler=hist.handler(name, random.Random(seed)))  # type: ignore[arg-type]
        return c.start()

    def progress() -> int:
        with hist.lock:
            return len(hist.done)

    def wait_for(n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while progress() < n:
            assert time.monotonic() < deadline, f"stuck at {progress()}/{n}"
            time.sleep(0.02)

    a, b = member("a", 1), member("b", 2)
    wait_for(total // 4)
    c = member("c", 3)  # joins mid-way
    wait_for(total // 2)
    a.close()  # leaves mid-way: what it held goes to the others
    d = member("d", 4)
    wait_for(3 * total // 4)
    b.close()
    wait_for(total)
    c.close()
    d.close()

    calls = hist.calls
    assert hist.done == {(f"k{k}", i) for k in range(KEYS) for i in range(PER_KEY)}
    members = {m for _, _, m, _, _, _ in calls}
    assert members == {"a", "b", "c", "d"}, members
    assert sum(1 for *_, ok in calls if not ok) > 0, "no failure was injected"
    for k in range(KEYS):
        key = f"k{k}"
        mine = sorted((c for c in calls if c[0] == key), key=lambda c: c[3])
        # never two handlers of one key at once
        for prev, cur in itertools.pairwise(mine):
            assert cur[3] >= prev[4], f"{key}: {prev} overlaps {cur}"
        # in send order: an index is handled only after every earlier one succeeded
        succeeded = -1
        for _, idx, _, _, _, ok in mine:
            assert idx == succeeded + 1, (
                f"{key}: message {idx} handled while {succeeded + 1} was next")
            if ok:
                succeeded = idx
        assert succeeded == PER_KEY - 1
