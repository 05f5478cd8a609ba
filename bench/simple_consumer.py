"""Simple consumer throughput: receive(2000) + ack_batch against an in-process broker.

    python bench/simple_consumer.py [--messages N] [--flush sync|async]

Pre-produces N messages of 100 B on an auto-created 4-queue topic, then one
AsyncSimpleConsumer receives and acks them all; prints msg/s. The broker runs in the same
process (its own thread and loop), so the figure is a client+broker total on one interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from ferrymq import AsyncProducer, AsyncSimpleConsumer, Broker, Message


async def main(address: str, n: int) -> float:
    async with AsyncProducer(address) as p:
        body = b"x" * 100
        for _ in range(0, n, 1000):
            await p.send_batch([Message("bench", body) for _ in range(1000)])
    async with AsyncSimpleConsumer(address, "bench-simple") as c:
        await c.subscribe("bench")
        t0 = time.perf_counter()
        got = 0
        while got < n:
            msgs = await c.receive(2000, wait=1.0)
            got += len(msgs)
            await c.ack_batch(msgs)
        return got / (time.perf_counter() - t0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--flush", choices=["sync", "async"], default="sync")
    args = ap.parse_args()
    with Broker(tempfile.mkdtemp(), flush=args.flush) as b:
        rate = asyncio.run(main(b.address, args.messages))
    print(f"simple consumer receive(2000) + ack_batch, flush {args.flush}: {rate:,.0f} msg/s")
