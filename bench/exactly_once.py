#!/usr/bin/env python
"""Exactly-once transactions: commits per second, transactional vs plain producer throughput,
and read_committed vs read_uncommitted consumers.

    .venv/bin/python bench/exactly_once.py [--messages N] [--size B] [--flush sync|async]
                                           [--json OUT.jsonl]

One broker subprocess (``python -m ferrymq.broker``, default settings, a temporary data dir),
topics of 4 queues.

* ``commits c=C``: transactions of one message (begin, send, commit), C producers with their
  own transactional ids at once; latency of one whole transaction (p50, p99).
* ``plain`` / ``idempotent off`` / ``txn K/txn``: N messages of B bytes sent with
  ``send_nowait`` then flushed (plain) or committed every K messages (transactional).
* ``read_committed`` / ``read_uncommitted``: a pull consumer reading N messages written in
  transactions of 1,000, one in 100 of them aborted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from ferrymq import AsyncAdminClient, AsyncProducer, AsyncPullConsumer, Message
from ferrymq._launcher import BrokerProcess
from ferrymq.admin import bench as fb


async def commits(address: str, n: int, c: int, body: bytes) -> tuple[float, list[float]]:
    lat: list[float] = []
    per = n // c

    async def worker(w: int) -> None:
        async with AsyncProducer(address, transactional_id=f"bench-c{c}-{w}") as p:
            for _ in range(per):
                t = time.perf_counter()
                await p.begin()
                p.send_nowait(Message("commits", body))
                await p.commit()
                lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(c)))
    return time.perf_counter() - t0, sorted(lat)


async def throughput(address: str, topic: str, n: int, body: bytes, per_txn: int,
                     **opts: Any) -> float:
    tid = {"transactional_id": f"bench-t{per_txn}"} if per_txn else {}
    async with AsyncProducer(address, linger_ms=5, **tid, **opts) as p:
        t0 = time.perf_counter()
        sent = 0
        while sent < n:
            k = min(per_txn or n, n - sent)
            if per_txn:
                await p.begin()
            for _ in range(k):
                p.send_nowait(Message(topic, body))
            if per_txn:
                await p.commit()
            else:
                await p.flush()
            sent += k
        return time.perf_counter() - t0


async def fill_with_aborts(address: str, n: int, body: bytes) -> None:
    async with AsyncProducer(address, transactional_id="bench-fill") as p:
        for t in range(n // 1000):
            await p.begin()
            for _ in range(1000):
                p.send_nowait(Message("mixed", body))
            if t % 100 == 99:
                await p.flush()  # store the aborted messages, as a failed job would
                await p.abort()
            else:
                await p.commit()


async def consume(address: str, isolation: str, want: int) -> tuple[float, int]:
    async with AsyncPullConsumer(address, f"bench-{isolation}", auto_offset_reset="earliest",
                                 auto_commit=False, isolation=isolation) as c:
        await c.subscribe("mixed")
        got = 0
        t0 = time.perf_counter()
        idle = 0
        while got < want and idle < 5:
            batch = await c.poll(timeout=0.5, max_messages=10_000)
            got += len(batch)
            idle = 0 if batch else idle + 1
        return time.perf_counter() - t0, got


async def setup(address: str) -> None:
    async with AsyncAdminClient(address) as a:
        for t in ("commits", "plain", "txn", "mixed"):
            await a.create_topic(t, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--commits", type=int, default=4_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--flush", choices=["sync", "async"], default="sync")
    ap.add_argument("--json", metavar="OUT", help="Append one JSON line with every figure here.")
    args = ap.parse_args()
    fb.install_uvloop()
    root = Path(tempfile.mkdtemp(prefix="ferrymq-bench-eos-"))
    body = os.urandom(args.size)
    result: dict[str, Any] = {
        "bench": "exactly_once", "messages": args.messages, "size": args.size,
        "flush": args.flush, "python": platform.python_version(),
        "loadavg_1m_before": os.getloadavg()[0], "rows": [],
    }
    b = BrokerProcess(root / "data", flush=args.flush, new_session=True).start()
    rows: list[dict[str, Any]] = result["rows"]
    try:
        asyncio.run(setup(b.address))
        print(f"{'scenario':22} {'per s':>10} {'p50 ms':>8} {'p99 ms':>8}")
        for c in (1, 8, 64):
            secs, lat = asyncio.run(commits(b.address, args.commits, c, body[:100]))
            row = {"scenario": f"commits c={c}", "per_s": len(lat) / secs,
                   "p50_ms": fb.percentile(lat, 50) * 1000,
                   "p99_ms": fb.percentile(lat, 99) * 1000}
            rows.append(row)
            print(f"{row['scenario']:22} {row['per_s']:>10,.0f} {row['p50_ms']:>8.2f} "
                  f"{row['p99_ms']:>8.2f}")
        for name, per_txn in (("plain", 0), ("txn 100/txn", 100), ("txn 1000/txn", 1000),
                              ("txn 10000/txn", 10_000)):
            secs = asyncio.run(throughput(b.address, "plain" if not per_txn else "txn",
                                          args.messages, body, per_txn))
            row = {"scenario": name, "per_s": args.messages / secs}
            rows.append(row)
            print(f"{name:22} {row['per_s']:>10,.0f}")
        asyncio.run(fill_with_aborts(b.address, args.messages, body[:100]))
        committed = args.messages - (args.messages // 1000 // 100) * 1000
        for iso in ("read_committed", "read_uncommitted"):
            secs, got = asyncio.run(consume(b.address, iso, committed if iso ==
                                            "read_committed" else args.messages))
            row = {"scenario": iso, "per_s": got / secs, "messages": got}
            rows.append(row)
            print(f"{iso:22} {row['per_s']:>10,.0f}   ({got} messages)")
    finally:
        b.stop()
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
