"""Issue 4: a failing sharding key does not delay the other keys of its queue by more than the
normal latency (RocketMQ and Kafka block the whole queue behind it)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Broker, ConsumeResult, Message, Producer, PushConsumer
from ferrymq.client.simple import LeasedMessage

pytestmark = pytest.mark.integration

RATE = 300  # good messages per second, over 10 keys, all on one queue
SECONDS = 2.5


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def run_phase(addr: str, topic: str, with_bad_key: bool) -> tuple[list[int], int]:
    """Produce at a steady rate (plus a key that always fails, if asked) into one queue and
    consume with an orderly push consumer: the good keys' latencies (send to handler, ms) and how
    many times the failing key was handled."""
    latencies: list[int] = []
    bad_calls = [0]
    lock = threading.Lock()
    total = int(RATE * SECONDS)

    def handle(msg: LeasedMessage) -> ConsumeResult:
        if msg.sharding_key == "bad":
            with lock:
                bad_calls[0] += 1
            return ConsumeResult.FAILURE
        sent = int(msg.properties["sent_ms"])
        with lock:
            latencies.append(wall_ms() - sent)
        return ConsumeResult.SUCCESS

    c = PushConsumer(addr, f"g-{topic}", orderly=True, threads=4, max_reconsume=1000)
    c.subscribe(topic, handler=handle)
    c.start()
    try:
        with Producer(addr, linger_ms=0) as p:
            if with_bad_key:
                for i in range(5):  # five messages of one key that never succeed
                    p.send(Message(topic, f"bad:{i}", sharding_key="bad",
                                   properties={"sent_ms": str(wall_ms())}))
            t0 = time.monotonic()
            for i in range(total):
                pause = t0 + i / RATE - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                p.send_async(Message(topic, f"k{i % 10}:{i}", sharding_key=f"k{i % 10}",
                                     properties={"sent_ms": str(wall_ms())}))
            p.flush()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with lock:
                if len(latencies) >= total:
                    break
            time.sleep(0.05)
    finally:
        c.close()
    assert len(latencies) == total, f"only {len(latencies)}/{total} good messages handled"
    return sorted(latencies), bad_calls[0]


def p99(xs: list[int]) -> int:
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def test_a_failing_key_adds_no_latency_to_the_other_keys_of_its_queue(tmp_path: Path) -> None:
    # default orderly_retry_ms (1 s): a queue blocked behind the failing key would add ~1 s
    with Broker(tmp_path / "data", port=0) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic("base", 1)
            admin.create_topic("fail", 1)
        base, _ = run_phase(b.address, "base", with_bad_key=False)
        fail, bad_calls = run_phase(b.address, "fail", with_bad_key=True)
    assert bad_calls >= 2, "the failing key was not retried"
    normal = p99(base)
    print(f"good keys p50/p99/max ms: alone {base[len(base) // 2]}/{normal}/{base[-1]}, "
          f"next to a failing key {fail[len(fail) // 2]}/{p99(fail)}/{fail[-1]}")
    assert p99(fail) <= 3 * normal + 100, (normal, p99(fail))
    assert fail[-1] < 900, f"a good key waited {fail[-1]} ms: blocked behind the failing key?"
