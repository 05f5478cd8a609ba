#!/usr/bin/env python
"""Broker restart time with many scheduled messages pending (all far in the future).

    .venv/bin/python bench/restart_delayed.py [--messages 1000000]

Starts a broker (async flush, temporary data directory), schedules N messages of 100 B due
over the hours ahead (one bucket file per minute of due times), stops it with SIGTERM, then
times two restarts from process start to listening: after that clean stop, and after a kill -9.
The scheduler reads every bucket file at start (pending counts per topic); see
docs/scheduled.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import shutil
import signal
import tempfile
import time
from pathlib import Path

from ferrymq import AsyncProducer, Message
from ferrymq._launcher import BrokerProcess
from ferrymq.admin import bench as fb


async def schedule(address: str, n: int) -> None:
    far = time.time() + 5 * 3600
    async with AsyncProducer(address) as p:
        async def worker(first: int) -> None:
            for start in range(first, n, 8000):
                await p.send_batch([
                    Message("t", b"x" * 100,
                            deliver_at=dt.datetime.fromtimestamp(far + i * 0.01, dt.UTC))
                    for i in range(start, min(start + 1000, n))])

        await asyncio.gather(*(worker(k * 1000) for k in range(8)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ferrymq-restart-delayed-"))
    try:
        b = BrokerProcess(root / "data", flush="async", new_session=True).start()
        asyncio.run(schedule(b.address, args.messages))
        print(f"{args.messages:,} pending: broker RSS {fb.rss_mb(b.pid):.1f} MB, "
              f"{len(list((root / 'data' / 'schedule').glob('*.bucket')))} bucket files")
        assert b.proc is not None
        b.proc.send_signal(signal.SIGTERM)
        b.proc.wait()
        for how in ("after a clean stop", "after kill -9"):
            t0 = time.monotonic()
            b = BrokerProcess(root / "data", flush="async", new_session=True).start()
            print(f"restart {how}: {time.monotonic() - t0:.2f} s to listening, "
                  f"RSS {fb.rss_mb(b.pid):.1f} MB")
            assert b.proc is not None
            b.proc.kill()  # the next start is after a kill -9
            b.proc.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
