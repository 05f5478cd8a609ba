#!/usr/bin/env python
"""Dedup windows: produce throughput with dedup keys against without, what a duplicate costs,
the broker's memory per remembered key, and the start-up rebuild of a full window.

    .venv/bin/python bench/dedup.py [--messages N] [--size B] [--batch N] [--inflight N]
                                    [--flush async|sync] [--json OUT.jsonl]

One broker subprocess (``python -m ferrymq.broker``, default settings, a temporary data dir),
two topics of 4 queues: ``plain`` (no dedup window) and ``dedup`` (``dedup_window_ms`` 10 min).
Every scenario sends N messages of B bytes with ``AsyncProducer.send_batch`` (``--batch``
messages per call, ``--inflight`` calls at once); the messages are built before the clock
starts, so the figures compare what the producer and the broker do with them:

* ``no key -> plain``: the baseline.
* ``no key -> dedup``: plain messages to the topic with a window (no per-record work either).
* ``unique keys -> dedup``: every message has a new key (``order-<12 digits>``): the broker
  reads each key, checks and remembers it.
* ``same keys again -> dedup``: the previous N keys sent again: every message is a duplicate,
  acknowledged with the stored one's place, nothing stored.
* ``unique keys -> plain``: keys to a topic without a window (just stored as a property).

Then the broker is stopped (SIGTERM) and started again on the same data: the time from process
start to listening, and the rebuild itself (``Deduplicator.load`` on that data in this process,
after the broker stopped again): keys, bytes read, seconds. Broker RSS before and after the N
keys were remembered gives the memory per key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ferrymq import AsyncAdminClient, AsyncProducer, Message
from ferrymq._launcher import BrokerProcess
from ferrymq.admin import bench as fb
from ferrymq.broker.dedup import Deduplicator
from ferrymq.broker.topics import TopicRegistry
from ferrymq.storage import LogConfig

WINDOW_MS = 600_000


def messages(topic: str, n: int, size: int, batch: int, keys: bool) -> list[list[Message]]:
    body = os.urandom(size)
    out: list[list[Message]] = []
    for start in range(0, n, batch):
        out.append([Message(topic, body, dedup_key=f"order-{i:012d}" if keys else None)
                    for i in range(start, min(n, start + batch))])
    return out


async def produce(address: str, batches: list[list[Message]], inflight: int) -> tuple[float, int]:
    """Send every batch, ``inflight`` calls at once; (seconds, duplicates reported)."""
    dups = 0
    async with AsyncProducer(address, client_id="bench-dedup") as p:
        await p.send(Message(batches[0][0].topic, b"warm-up"))  # connection, metadata: untimed
        it = iter(batches)

        async def worker() -> None:
            nonlocal dups
            for b in it:
                res = await p.send_batch(b)  # not `dups += ... await ...`: that reads dups first
                dups += sum(r.duplicate for r in res)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        return time.perf_counter() - t0, dups


async def setup(address: str) -> None:
    async with AsyncAdminClient(address) as admin:
        await admin.create_topic("plain", 4, {})
        await admin.create_topic("dedup", 4, {"dedup_window_ms": str(WINDOW_MS)})


def rebuild(data_dir: Path) -> dict[str, Any]:
    """Open the stopped broker's topics here and time the dedup rebuild alone."""
    reg = TopicRegistry(data_dir, LogConfig(retention_ms=None), sync_visibility=True,
                        clean_shutdown=True, max_queues=1024)
    now = int(time.time() * 1000)
    reg.open_all(now)
    try:
        report = Deduplicator(reg).load(now)
    finally:
        reg.close()
    return {"rebuild_keys": report.keys, "rebuild_bytes": report.bytes_read,
            "rebuild_s": report.elapsed_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=500_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--flush", choices=["sync", "async"], default="async")
    ap.add_argument("--json", metavar="OUT", help="Append one JSON line with every figure here.")
    args = ap.parse_args()
    fb.install_uvloop()
    n = args.messages
    plan = [
        ("no key -> plain", "plain", False),
        ("no key -> dedup", "dedup", False),
        ("unique keys -> dedup", "dedup", True),
        ("same keys again -> dedup", "dedup", True),
        ("unique keys -> plain", "plain", True),
    ]
    built = {(t, k): messages(t, n, args.size, args.batch, k) for _, t, k in plan}
    root = Path(tempfile.mkdtemp(prefix="ferrymq-bench-dedup-"))
    result: dict[str, Any] = {
        "bench": "dedup", "messages": n, "size": args.size, "batch": args.batch,
        "inflight": args.inflight, "flush": args.flush, "window_ms": WINDOW_MS,
        "python": platform.python_version(), "loadavg_1m_before": os.getloadavg()[0],
        "scenarios": [],
    }
    try:
        b = BrokerProcess(root / "data", flush=args.flush, new_session=True).start()
        try:
            asyncio.run(setup(b.address))
            rss: dict[str, float | None] = {}
            print(f"{'scenario':28} {'msg/s':>10} {'broker CPU s':>12} {'msg/CPU-s':>10} "
                  f"{'dups':>8} {'RSS MB':>7}")
            for name, topic, keys in plan:
                cpu = fb.CpuTime(b.pid)
                cpu.begin()
                secs, dups = asyncio.run(produce(b.address, built[(topic, keys)], args.inflight))
                cpu.end()
                rss[name] = fb.rss_mb(b.pid)
                row = {"scenario": name, "seconds": secs, "msg_per_s": n / secs,
                       "broker_cpu_s": cpu.used, "duplicates": dups, "broker_rss_mb": rss[name],
                       "msgs_per_broker_cpu_s": n / cpu.used if cpu.used else None}
                result["scenarios"].append(row)
                print(f"{name:28} {row['msg_per_s']:>10,.0f} {cpu.used or 0:>12.2f} "
                      f"{row['msgs_per_broker_cpu_s'] or 0:>10,.0f} {dups:>8,} "
                      f"{rss[name] or 0:>7.1f}", flush=True)
            before, after = rss["no key -> dedup"], rss["unique keys -> dedup"]
            if before is not None and after is not None:
                result["rss_per_key_bytes"] = (after - before) * 1024 * 1024 / n
        finally:
            b.stop()
        data = sum(f.stat().st_size for f in (root / "data").rglob("*") if f.is_file())
        t0 = time.perf_counter()
        b = BrokerProcess(root / "data", flush=args.flush, new_session=True).start()
        result["restart_to_listening_s"] = time.perf_counter() - t0
        b.stop()
        result.update(rebuild(root / "data"), data_bytes=data)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["loadavg_1m_after"] = os.getloadavg()[0]
    print(f"broker RSS per remembered key: {result.get('rss_per_key_bytes', float('nan')):.0f} "
          "bytes")
    print(f"data dir {result['data_bytes'] / 2**20:.0f} MiB; restart to listening "
          f"{result['restart_to_listening_s']:.2f} s; rebuild of {result['rebuild_keys']:,} keys "
          f"from {result['rebuild_bytes'] / 2**20:.0f} MiB: {result['rebuild_s']:.2f} s")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
