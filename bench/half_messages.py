#!/usr/bin/env python
"""Half messages (transactional messages): commits per second against a plain producer's sends.

    .venv/bin/python bench/half_messages.py [--messages N] [--size B] [--concurrency C]
                                           [--flush sync|async] [--json OUT.jsonl]

One broker subprocess (``python -m ferrymq.broker``, default settings, a temporary data dir),
one topic of 4 queues. Every scenario sends N messages of B bytes, C at once (C tasks on one
client, each waiting for its message's result before the next):

* ``plain send``: ``AsyncProducer.send`` (one PRODUCE round trip, waits for durability).
* ``half commit``: ``AsyncHalfMessageProducer.send_in_transaction`` with a local transaction that
  returns COMMIT at once: PREPARE (half message, durable) + END_HALF (copy durable, op
  written): two round trips and, in sync mode, two fsync waits.
* ``half rollback``: the same, rolled back (END_HALF writes only the op).

The figures are per message: ``msg/s`` overall and the latency of one send / one half message
(p50, p99), plus the broker's CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ferrymq import AsyncAdminClient, AsyncHalfMessageProducer, AsyncProducer, Message
from ferrymq import HalfState as TS
from ferrymq._launcher import BrokerProcess
from ferrymq.admin import bench as fb


async def run(n: int, concurrency: int, one: Callable[[int], Awaitable[object]]) -> tuple[float, list[float]]:
    """``one(i)`` for i < n, ``concurrency`` at once: (seconds, per-call latencies)."""
    lat: list[float] = []
    nxt = iter(range(n))

    async def worker() -> None:
        for i in nxt:
            t = time.perf_counter()
            await one(i)
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, sorted(lat)


async def scenario(address: str, name: str, n: int, size: int, c: int) -> tuple[float, list[float]]:
    body = os.urandom(size)
    if name == "plain send":
        async with AsyncProducer(address) as p:
            return await run(n, c, lambda i: p.send(Message("bench", body)))

    def never(_m: object) -> TS:
        return TS.UNKNOWN

    state = TS.COMMIT if name == "half commit" else TS.ROLLBACK
    async with AsyncHalfMessageProducer(address, "bench", never) as tp:
        return await run(n, c, lambda i: tp.send_in_transaction(Message("bench", body),
                                                                lambda _m: state))


async def setup(address: str) -> None:
    async with AsyncAdminClient(address) as a:
        await a.create_topic("bench", 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--flush", choices=["sync", "async"], default="sync")
    ap.add_argument("--json", metavar="OUT", help="Append one JSON line with every figure here.")
    args = ap.parse_args()
    fb.install_uvloop()
    root = Path(tempfile.mkdtemp(prefix="ferrymq-bench-half-"))
    result: dict[str, Any] = {
        "bench": "half_messages", "messages": args.messages, "size": args.size,
        "concurrency": args.concurrency, "flush": args.flush,
        "python": platform.python_version(), "loadavg_1m_before": os.getloadavg()[0],
        "scenarios": [],
    }
    b = BrokerProcess(root / "data", flush=args.flush, new_session=True).start()
    try:
        asyncio.run(setup(b.address))
        print(f"{'scenario':14} {'msg/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'broker CPU s':>12}")
        for name in ("plain send", "half commit", "half rollback"):
            cpu = fb.CpuTime(b.pid)
            cpu.begin()
            secs, lat = asyncio.run(scenario(b.address, name, args.messages, args.size,
                                             args.concurrency))
            cpu.end()
            row = {"scenario": name, "seconds": secs, "msg_per_s": args.messages / secs,
                   "p50_ms": fb.percentile(lat, 50) * 1000, "p99_ms": fb.percentile(lat, 99) * 1000,
                   "broker_cpu_s": cpu.used}
            result["scenarios"].append(row)
            print(f"{name:14} {row['msg_per_s']:>9,.0f} {row['p50_ms']:>8.2f} "
                  f"{row['p99_ms']:>8.2f} {cpu.used or 0:>12.2f}")
    finally:
        b.stop()
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
