#!/usr/bin/env python
"""Median table of a ``bench/run_ferrymq.sh`` results file (JSON lines)."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def main(path: str) -> None:
    groups: dict[tuple[str, str, int], list[dict[str, object]]] = defaultdict(list)
    with open(path) as fh:
        rows = [json.loads(line) for line in fh]
    for r in rows:
        workload = str(r["workload"])
        if workload == "e2e" and r.get("pacing") == "spin":  # sender busy-looping (see bench.py)
            workload = "e2e-spin"
        groups[(workload, str(r["flush"]), int(r["size"]))].append(r)
    keys = {"produce": ["msg_per_s", "mb_per_s", "msgs_per_broker_cpu_s", "broker_rss_end_mb"],
            "consume": ["msg_per_s", "mb_per_s", "msgs_per_broker_cpu_s", "broker_rss_end_mb"],
            "e2e": ["p50_ms", "p90_ms", "p99_ms", "max_ms", "broker_rss_end_mb"]}
    keys["e2e-spin"] = keys["e2e"]
    print("| workload | flush | size | runs | metric: median (all runs) |")
    print("|---|---|---:|---:|---|")
    for (w, f, s), rs in sorted(groups.items()):
        cells = []
        for k in keys[w]:
            vals = [float(r[k]) for r in rs if r.get(k) is not None]  # type: ignore[arg-type]
            if not vals:
                continue
            med = statistics.median(vals)
            spec = ",.2f" if k.endswith(("_ms", "_mb")) or k.startswith("mb_") else ",.0f"
            cells.append(f"{k} {format(med, spec)} ({', '.join(format(v, spec) for v in vals)})")
        loads = [float(r["loadavg_1m_before"]) for r in rs]  # type: ignore[arg-type]
        cells.append(f"load {min(loads):.1f}-{max(loads):.1f}")
        print(f"| {w} | {f} | {s} | {len(rs)} | {'; '.join(cells)} |")


if __name__ == "__main__":
    main(sys.argv[1])
