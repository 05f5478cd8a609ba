"""Broker restart time with a given amount of data (issue: under 2 s with 2 GB).

Produces ``--gb`` of 10 KB messages into a broker subprocess (async flush), then measures the
time from process start to "listening" for (1) a clean restart after SIGTERM and (2) a restart
after kill -9 (recovery re-checks what was written after the last recovery point).

    .venv/bin/python bench/restart.py --gb 2
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from ferrymq import AsyncProducer, Message
from ferrymq._launcher import BrokerProcess


async def fill(address: str, total_bytes: int, size: int) -> None:
    async with AsyncProducer(address, linger_ms=2) as p:
        body = b"x" * size
        sent = 0
        sem = asyncio.Semaphore(8)

        async def one() -> None:
            async with sem:
                await p.send_batch([Message("big", body) for _ in range(64)])

        tasks = []
        while sent < total_bytes:
            tasks.append(asyncio.ensure_future(one()))
            sent += 64 * size
            if len(tasks) >= 64:
                await asyncio.gather(*tasks)
                tasks.clear()
        await asyncio.gather(*tasks)


def timed_start(bp: BrokerProcess) -> float:
    t0 = time.perf_counter()
    bp.start()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--size", type=int, default=10240)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ferrymq-restart-"))
    try:
        bp = BrokerProcess(root / "data", flush="async")
        bp.start()
        t0 = time.perf_counter()
        asyncio.run(fill(bp.address, int(args.gb * 1024**3), args.size))
        fill_s = time.perf_counter() - t0
        assert bp.terminate() == 0
        data = sum(f.stat().st_size for f in (root / "data").rglob("*") if f.is_file())
        clean = timed_start(bp)
        bp.kill9()
        unclean = timed_start(bp)
        bp.terminate()
        print(f"data on disk: {data / 1024**3:.2f} GiB (filled in {fill_s:.1f} s)")
        print(f"restart after clean shutdown: {clean:.3f} s (process start to listening)")
        print(f"restart after kill -9:        {unclean:.3f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
