"""Orderly consumption throughput: 1,000 sharding keys over 8 queues.

    python bench/orderly.py [--messages N] [--keys K] [--flush sync|async]

Pre-produces N messages of 100 B spread round-robin over K sharding keys on an 8-queue topic,
then consumes them all three ways and prints msg/s for each:

* an orderly AsyncPushConsumer (no-op async handler, concurrency 64);
* the same consumer in a concurrent (not orderly) group, for comparison;
* an orderly AsyncSimpleConsumer loop: receive(2000) + ack_batch.

Every run also checks the order: per key, handled indexes must be 0, 1, 2, ... The broker runs
in the same process (its own thread and loop), so each figure is a client+broker total on one
interpreter, as in bench/simple_consumer.py.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from ferrymq import AsyncProducer, AsyncPushConsumer, AsyncSimpleConsumer, Broker, Message
from ferrymq.client.simple import LeasedMessage


async def produce(address: str, n: int, keys: int) -> None:
    async with AsyncProducer(address) as p:
        batch: list[Message] = []
        for i in range(n):
            k = i % keys
            batch.append(Message("ord", b"%d:%d" % (k, i // keys), sharding_key=f"key-{k}"))
            if len(batch) == 1000:
                await p.send_batch(batch)
                batch = []
        if batch:
            await p.send_batch(batch)


def check(order: dict[bytes, list[int]], ordered: bool) -> None:
    for k, idx in order.items():
        if ordered and idx != list(range(len(idx))):
            raise AssertionError(f"key {k!r} out of order: {idx[:20]}")


async def push(address: str, n: int, group: str, orderly: bool) -> float:
    order: dict[bytes, list[int]] = {}
    done = asyncio.Event()
    count = 0
    c = AsyncPushConsumer(address, group, orderly=orderly, concurrency=64, prefetch=4096)

    @c.subscribe("ord")
    async def handle(msg: LeasedMessage) -> None:
        nonlocal count
        k, i = msg.body.split(b":")
        order.setdefault(k, []).append(int(i))
        count += 1
        if count >= n:
            done.set()

    t0 = time.perf_counter()
    async with c:
        await asyncio.wait_for(done.wait(), 600)
        rate = count / (time.perf_counter() - t0)
    check(order, orderly)
    return rate


async def simple(address: str, n: int) -> float:
    order: dict[bytes, list[int]] = {}
    async with AsyncSimpleConsumer(address, "bench-orderly-simple", orderly=True) as c:
        await c.subscribe("ord")
        t0 = time.perf_counter()
        got = 0
        while got < n:
            msgs = await c.receive(2000, wait=1.0)
            for msg in msgs:
                k, i = msg.body.split(b":")
                order.setdefault(k, []).append(int(i))
            got += len(msgs)
            await c.ack_batch(msgs)
        rate = got / (time.perf_counter() - t0)
    check(order, True)
    return rate


async def main(address: str, n: int, keys: int) -> dict[str, float]:
    from ferrymq import AsyncAdminClient

    async with AsyncAdminClient(address) as admin:
        await admin.create_topic("ord", 8)
    await produce(address, n, keys)
    return {
        "push, orderly": await push(address, n, "bench-orderly-push", True),
        "push, concurrent (not orderly)": await push(address, n, "bench-plain-push", False),
        "simple receive(2000)+ack_batch, orderly": await simple(address, n),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--flush", choices=["sync", "async"], default="sync")
    args = ap.parse_args()
    with Broker(tempfile.mkdtemp(), flush=args.flush) as b:
        results = asyncio.run(main(b.address, args.messages, args.keys))
    for name, rate in results.items():
        print(f"{name}, {args.keys} keys / 8 queues, flush {args.flush}: {rate:,.0f} msg/s")
