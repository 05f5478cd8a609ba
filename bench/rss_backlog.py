#!/usr/bin/env python
"""Broker RSS with a large backlog: produce ``--gb`` GB of large messages into a fresh broker
(async flush), then report the broker's VmRSS while producing, while idle, and while a consumer
reads the start of the log. The data directory is deleted afterwards.

Usage: ``.venv/bin/python bench/rss_backlog.py --gb 10 [--size 1048576] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from typing import Any

from ferrymq._launcher import BrokerProcess
from ferrymq.admin import bench as fb
from ferrymq.client.consumer import AsyncPullConsumer


class Sampler:
    def __init__(self, pid: int | None, every_s: float = 0.2) -> None:
        self.pid, self.every_s = pid, every_s
        self.values: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            v = fb.rss_mb(self.pid)
            if v is not None:
                self.values.append(v)
            self._stop.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=10.0)
    ap.add_argument("--size", type=int, default=1024 * 1024)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--consume-gb", type=float, default=2.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = int(args.gb * 1e9 / args.size)
    res: dict[str, Any] = {"messages": n, "size": args.size, "bytes": n * args.size}
    fb.install_uvloop()
    with BrokerProcess(flush="async", new_session=True) as b:
        res["rss_start_mb"] = fb.rss_mb(b.pid)
        with Sampler(b.pid) as s:
            r = fb.run_produce(b.address, messages=n, size=args.size, batch=4,
                               queues=args.queues, inflight=4, broker_pid=b.pid,
                               show_progress=not args.json)
        res["produce_msg_per_s"], res["produce_mb_per_s"] = r["msg_per_s"], r["mb_per_s"]
        res["rss_max_during_produce_mb"] = max(s.values)
        time.sleep(5)
        with Sampler(b.pid) as s:
            time.sleep(5)
        res["rss_idle_mb"] = max(s.values)
        assert b.data_dir is not None
        res["data_dir_bytes"] = sum(p.stat().st_size for p in b.data_dir.rglob("*") if p.is_file())
        want = int(args.consume_gb * 1e9 / args.size)

        async def consume(name: str) -> tuple[int, float]:
            c = AsyncPullConsumer(b.address, group="rss", auto_commit=False,
                                  auto_offset_reset="earliest")
            async with c:
                await c.assign([(name, q) for q in range(args.queues)])
                got = 0
                t0 = time.perf_counter()
                while got < want:
                    msgs = await c.poll(timeout=10, max_messages=100)
                    if not msgs:
                        break
                    for m in msgs:
                        len(m.body)
                    got += len(msgs)
                return got, time.perf_counter() - t0

        with Sampler(b.pid) as s:
            got, secs = asyncio.run(consume(r["topic"]))
        res["consumed_messages"], res["consume_mb_per_s"] = got, got * args.size / secs / 1e6
        res["rss_max_during_consume_mb"] = max(s.values)
        res["rss_end_mb"] = fb.rss_mb(b.pid)
    print(json.dumps(res) if args.json else json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
