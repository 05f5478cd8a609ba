#!/usr/bin/env python
"""Delayed-message lateness: the scenarios of bench/README.md ("Delayed messages"), each in a
fresh broker subprocess (``ferrymq bench delayed`` under the hood).

    .venv/bin/python bench/delayed.py [--flush async|sync] [--only NAME] [--json OUT.jsonl]

Scenarios (N = scheduled messages pending once scheduling ends):

* ``10k``: N = 10,000, all due evenly over 10 s.
* ``1M-far``: N = 1,000,000; 10,000 due over 10 s, the other 990,000 due 10 h later (pending
  on disk while the 10,000 fire: the memory bound).
* ``5M-far``: N = 5,000,000; 10,000 due over 10 s, the rest 10 h later.
* ``1M-burst``: N = 1,000,000, all due over 60 s (16,700 due per second, all in the look-ahead).
* ``200k-shuffled``: N = 200,000 due over 20 s in random order (the originals of one producer
  batch come due far apart: the batch cache at work).

Lateness = receive time in the consumer minus the due time (``%SCHEDULED_DUE``), one clock (one
machine); "broker" lateness = the copy's append time minus the due time.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ferrymq.admin import bench as fb

SCENARIOS: dict[str, dict[str, Any]] = {
    "10k": {"messages": 10_000, "window": 10.0},
    "1M-far": {"messages": 1_000_000, "measure": 10_000, "window": 10.0},
    "5M-far": {"messages": 5_000_000, "measure": 10_000, "window": 10.0},
    "1M-burst": {"messages": 1_000_000, "window": 60.0},
    "200k-shuffled": {"messages": 200_000, "window": 20.0, "shuffle": True},
}


def run(name: str, flush: str) -> dict[str, Any]:
    load = os.getloadavg()[0]
    with fb.broker_for(None, flush) as b:
        res = fb.run_delayed(b.address, broker_pid=b.pid, show_progress=False,
                             **SCENARIOS[name])
    res.update(scenario=name, flush=flush, loadavg_1m_before=load,
               loadavg_1m_after=os.getloadavg()[0])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flush", choices=["sync", "async"], default="async")
    ap.add_argument("--only", choices=sorted(SCENARIOS), action="append")
    ap.add_argument("--json", metavar="OUT", help="Append one JSON line per scenario here.")
    args = ap.parse_args()
    print(f"{'scenario':14} {'pending':>9} {'min ms':>7} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'max ms':>7} {'early':>5} {'lost':>5} {'dup':>4} {'RSS MB':>7} {'clock step':>10}")
    for name in args.only or list(SCENARIOS):
        r = run(name, args.flush)
        print(f"{name:14} {r['pending_after_scheduling']:>9,} {r['min_ms']:>7.1f} "
              f"{r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f} {r['max_ms']:>7.1f} {r['early']:>5} "
              f"{r['lost']:>5} {r['duplicates']:>4} {r['broker_rss_mb_max']:>7.1f} "
              f"{r['wall_clock_step_ms']:>10.1f}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
