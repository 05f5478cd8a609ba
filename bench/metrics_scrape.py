#!/usr/bin/env python
"""The cost of ``/metrics`` (issue 21): what scraping every second costs the produce benchmark,
and how long one scrape of a big broker takes.

1. **Overhead**, by alternating pairs: one broker subprocess (``--http-port``, ``--flush`` as
   given), one warm-up run not counted, then ``--pairs`` pairs of ``ferrymq bench produce``
   runs of the same workload (``--messages`` x ``--size`` B, batches of 1000, 8 in flight):
   in each pair one run with a thread scraping ``/metrics`` (the first scrape as the run
   starts, then every ``--every`` s) and one without, the "with" run first in odd pairs and
   second in even ones, so a drift of the machine (a neighbour's load, the page cache, a
   growing log) falls on both sides alike. Each pair gives the ratio with/without; reported:
   the median throughput of each side, the median of the per-pair ratios and its overhead
   (``1 - ratio``; positive: scraping costs), every pair's overhead, the scrapes made and their
   latencies, the 1-minute load average after each pair. A "with" run that made fewer than
   ``MIN_SCRAPES_PER_RUN`` scrapes measured little: the report says so (raise
   ``--messages``). Runs of about 10 s or more are the meaningful ones.
2. **Big scrape**: a fresh broker with ``--topics`` topics x ``--queues`` queues (16 messages
   each topic) and ``--groups`` consumer groups, each with committed offsets (at the start:
   every queue with data lags) on ``--topics-per-group`` topics of its own; ``--settle-s`` idle
   (the broker freezes its grown heap once: :mod:`ferrymq.broker.heap`); then ``--scrapes``
   scrapes one after the other. Reported: the first (cold: the append times of the lagging
   offsets are read) and the median and max of the rest, the body size and the series count.

Progress (one line per pair, and the note on short runs) goes to stderr, the report (JSON) to
stdout. Usage: ``.venv/bin/python bench/metrics_scrape.py [--pairs 5] [--messages 300000] [--json]``
(a quick check that it runs: ``--pairs 2 --messages 3000 --every 0.05 --topics 5 --queues 2
--groups 3 --topics-per-group 2 --scrapes 2``; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from typing import Any

from ferrymq._launcher import BrokerProcess, free_port
from ferrymq.admin import bench as fb
from ferrymq.broker.heap import CHECK_INTERVAL_S as HEAP_CHECK_INTERVAL_S
from ferrymq.client import AsyncAdminClient, AsyncProducer, Message

MIN_SCRAPES_PER_RUN = 5
"""Fewer scrapes in a "with" run than this, and the run says little about their cost."""


def scrape(port: int) -> tuple[float, int, int]:
    """One GET /metrics: (seconds, body bytes, sample lines)."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        body = r.read()
        assert r.status == 200
    dt = time.perf_counter() - t0
    return dt, len(body), sum(1 for line in body.splitlines() if not line.startswith(b"#"))


class Scraper:
    """Scrapes /metrics every ``every`` s on a thread while in its ``with`` block."""

    def __init__(self, port: int, every: float) -> None:
        self.port, self.every = port, every
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:  # the first scrape as the run starts: a short run still has one
            self.latencies.append(scrape(self.port)[0])
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> Scraper:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def overhead(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    with_s: list[float] = []
    without_s: list[float] = []
    ratios: list[float] = []
    latencies: list[float] = []
    per_run: list[int] = []  # scrapes made during each "with" run
    load = [os.getloadavg()[0]]
    with BrokerProcess(flush=args.flush, extra=["--http-port", str(port)],
                       log_level="WARNING", new_session=True) as b:
        def one(scraping: bool) -> float:
            def run() -> float:
                res = fb.run_produce(b.address, messages=args.messages, size=args.size,
                                     show_progress=False)
                return float(res["msg_per_s"])
            if not scraping:
                return run()
            with Scraper(port, args.every) as s:
                rate = run()
            latencies.extend(s.latencies)
            per_run.append(len(s.latencies))
            return rate

        one(False)  # warm-up, not counted
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {scraping: one(scraping) for scraping in order}
            with_s.append(got[True])
            without_s.append(got[False])
            ratios.append(got[True] / got[False])
            load.append(os.getloadavg()[0])
            first = "with" if order[0] else "without"
            print(f"pair {i + 1} ({first} first): with {got[True]:,.0f} msg/s, without "
                  f"{got[False]:,.0f} msg/s, overhead {100 * (1 - ratios[-1]):+.1f} % "
                  f"({per_run[-1]} scrapes)", file=sys.stderr, flush=True)
    short = sum(1 for n in per_run if n < MIN_SCRAPES_PER_RUN)
    if short:
        print(f"note: {short} of {len(per_run)} scraping runs made fewer than "
              f"{MIN_SCRAPES_PER_RUN} scrapes: too short to measure the overhead (raise "
              "--messages)", file=sys.stderr, flush=True)
    return {
        "flush": args.flush, "messages": args.messages, "size": args.size,
        "pairs": args.pairs, "scrape_every_s": args.every,
        "with_msg_per_s_median": statistics.median(with_s),
        "without_msg_per_s_median": statistics.median(without_s),
        "ratio_median": statistics.median(ratios),
        "overhead_pct_median": 100 * (1 - statistics.median(ratios)),
        "overhead_pct_per_pair": [100 * (1 - r) for r in ratios],
        "with_first_in_pair": [i % 2 == 0 for i in range(args.pairs)],
        "with_msg_per_s": with_s, "without_msg_per_s": without_s,
        "scrapes": len(latencies), "scrapes_per_run": per_run,
        "runs_too_short": short,
        "scrape_ms_median": 1000 * statistics.median(latencies) if latencies else None,
        "scrape_ms_max": 1000 * max(latencies) if latencies else None,
        "loadavg_1m": load,
    }


async def populate(address: str, topics: int, queues: int, groups: int,
                   per_group: int) -> None:
    async with AsyncAdminClient(address) as admin:
        for t in range(topics):
            await admin.create_topic(f"t{t:04d}", queues)
        async with AsyncProducer(address) as p:
            await asyncio.gather(*(p.send(Message(f"t{t:04d}", b"m" * 100,
                                                  sharding_key=str(k)))
                                   for t in range(topics) for k in range(16)))
        for g in range(groups):
            for k in range(per_group):
                topic = f"t{(g * per_group + k) % topics:04d}"
                await admin.reset_offsets(f"g{g:03d}", topic, to="earliest")


def big_scrape(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    load = [os.getloadavg()[0]]
    with BrokerProcess(flush="async", extra=["--http-port", str(port)], log_level="WARNING",
                       new_session=True) as b:
        t0 = time.perf_counter()
        asyncio.run(populate(b.address, args.topics, args.queues, args.groups,
                             args.topics_per_group))
        setup_s = time.perf_counter() - t0
        time.sleep(args.settle_s)  # the broker's heap freezer settles after the growth
        first = scrape(port)
        rest = [scrape(port) for _ in range(args.scrapes)]
    load.append(os.getloadavg()[0])
    times = [r[0] for r in rest]
    return {
        "topics": args.topics, "queues_per_topic": args.queues, "groups": args.groups,
        "topics_per_group": args.topics_per_group, "setup_s": setup_s, "settle_s": args.settle_s,
        "first_scrape_ms": 1000 * first[0], "scrape_ms_median": 1000 * statistics.median(times),
        "scrape_ms_max": 1000 * max(times), "body_bytes": rest[-1][1], "samples": rest[-1][2],
        "loadavg_1m": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--flush", choices=("sync", "async"), default="async")
    ap.add_argument("--topics", type=int, default=1000)
    ap.add_argument("--queues", type=int, default=8)
    ap.add_argument("--groups", type=int, default=200)
    ap.add_argument("--topics-per-group", type=int, default=5)
    ap.add_argument("--scrapes", type=int, default=10)
    ap.add_argument("--settle-s", type=float, default=2 * HEAP_CHECK_INTERVAL_S,
                    help="idle time between the set-up and the scrapes: the broker freezes its "
                         "grown heap once (one full collection, ferrymq.broker.heap) within "
                         "CHECK_INTERVAL_S; the scrapes measure the steady state after it")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not args.skip_overhead:
        out["overhead"] = overhead(args)
    if not args.skip_big:
        out["big_scrape"] = big_scrape(args)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
