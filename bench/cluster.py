#!/usr/bin/env python
"""Issue 20's cluster benchmarks in one run: a standalone broker, RF1 and RF3 (acks leader and
all) on a local cluster and NATS JetStream R3 on three servers, alternating round by round,
for each flush mode; then the unavailability after leader kills and the follower catch-up.

The FerryMQ parts are ``ferrymq bench cluster``'s (:mod:`ferrymq.admin.bench_cluster`, over the
workloads of ``ferrymq bench``); NATS is ``bench/compare.py``'s client with R3 streams on
three ``nats-server`` processes joined by routes (:class:`compare.NatsJetStreamCluster`). One
JSON line per run in ``--out`` (the first line: machine, date, command, HEAD), then a summary
table with the medians, the ratios and the issue's targets.

Usage: ``.venv/bin/python bench/cluster.py [--rounds 5] [--flush sync,async] [--kills 20]
[--lease-ms 2000] [--parts matrix,failover,catchup]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import compare

from ferrymq._stop_signals import stop_signals_interrupt
from ferrymq.admin import bench_cluster as bc
from ferrymq.admin.bench_measure import install_uvloop

HERE = Path(__file__).resolve().parent


def _nats_peer(nats: compare.NatsJetStreamCluster, args: argparse.Namespace) -> bc.PeerRun:
    def run(workload: str) -> dict[str, Any]:
        cpu0 = nats.cpu_seconds()
        res: dict[str, Any] = {"workload": workload, "size": args.size}
        if workload == "produce":
            res["msg_per_s"] = nats.produce(args.messages, args.size, args.batch, args.inflight)
        elif workload == "consume":
            res["msg_per_s"] = nats.consume(args.messages, args.size, args.batch, args.inflight)
        else:
            res["p50_ms"], res["p99_ms"] = nats.e2e(args.rate, args.duration, args.size)
        res["brokers_cpu_s"] = nats.cpu_seconds() - cpu0
        return res

    return run


def _machine() -> dict[str, Any]:
    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  timeout=10).stdout.strip()
        except OSError:
            return ""

    model = next((line.split(":", 1)[1].strip() for line in sh(["lscpu"]).splitlines()
                  if line.startswith("Model name")), "?")
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "host": platform.node(), "nproc": os.cpu_count(), "cpu": model,
            "python": platform.python_version(),
            "head": sh(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"]),
            "dirty": bool(sh(["git", "-C", str(HERE), "status", "--porcelain", "--", "../src"])),
            "nats_server": sh(["nats-server", "--version"]),
            "command": " ".join(sys.argv), "loadavg_1m": os.getloadavg()[0]}


def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None or v != v:
        return "-"
    return f"{v:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(results: list[dict[str, Any]]) -> str:
    """Markdown: per flush mode the medians per setup, ratios, and the targets."""
    med = bc.medians([r for r in results if "setup" in r])
    lines: list[str] = []
    targets: list[str] = []
    for flush in sorted({k[0] for k in med}):
        def m(setup: str, workload: str, metric: str, flush: str = flush) -> float | None:
            return med.get((flush, setup, workload, metric))

        def runs(setup: str, workload: str, metric: str, flush: str = flush) -> str:
            vals = bc.runs_of(results, flush, setup, workload, metric)
            digits = 2 if metric.endswith("_ms") else 0
            return ", ".join(_fmt(v, digits) for v in vals)

        lines += [f"### flush {flush}", "",
                  "| setup | produce msg/s | / rf1 | consume msg/s | / single | e2e p50 ms | "
                  "e2e p99 ms | p99 / rf1 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        setups = [s for s in [*bc.SETUPS, "nats-r3"] if any(k[1] == s and k[0] == flush
                                                             for k in med)]
        for s in setups:
            lines.append(
                f"| {s} | {_fmt(m(s, 'produce', 'msg_per_s'))} ({runs(s, 'produce', 'msg_per_s')})"
                f" | {_fmt(_ratio(m(s, 'produce', 'msg_per_s'), m('rf1', 'produce', 'msg_per_s')), 2)}"
                f" | {_fmt(m(s, 'consume', 'msg_per_s'))} ({runs(s, 'consume', 'msg_per_s')})"
                f" | {_fmt(_ratio(m(s, 'consume', 'msg_per_s'), m('single', 'consume', 'msg_per_s')), 2)}"
                f" | {_fmt(m(s, 'e2e', 'p50_ms'), 2)}"
                f" | {_fmt(m(s, 'e2e', 'p99_ms'), 2)} ({runs(s, 'e2e', 'p99_ms')})"
                f" | {_fmt(_ratio(m(s, 'e2e', 'p99_ms'), m('rf1', 'e2e', 'p99_ms')), 2)} |")
        lines.append("")
        nats, nats_runs = _paired(results, flush, "produce", "msg_per_s", "rf3-all", "nats-r3")
        rf1, rf1_runs = _paired(results, flush, "produce", "msg_per_s", "rf3-all", "rf1")
        targets.append(f"| RF3 acks=all produce ≥ 1.5x NATS R3 ({flush}) | "
                       f"{_fmt(nats, 2)}x ({nats_runs}) | {_met(nats, 1.5)} |")
        targets.append(f"| RF3 acks=all produce ≥ 40 % of RF1 ({flush}) | "
                       f"{_fmt(100 * rf1 if rf1 else None)} % ({rf1_runs}) | {_met(rf1, 0.4)} |")
        for s in ("rf1", "rf3-leader", "rf3-all"):
            c = _ratio(m(s, "consume", "msg_per_s"), m("single", "consume", "msg_per_s"))
            targets.append(f"| consume {s} within 20 % of a single broker ({flush}) | "
                           f"{_fmt(c, 2)}x | {_met(c, 0.8)} |")
        if flush == "sync":
            e, e_runs = _paired(results, flush, "e2e", "p99_ms", "rf3-all", "rf1")
            targets.append(f"| e2e p99 RF3 acks=all ≤ 2x RF1 (sync, 2,000 msg/s) | "
                           f"{_fmt(e, 2)}x ({e_runs}; medians "
                           f"{_fmt(m('rf3-all', 'e2e', 'p99_ms'), 2)} against "
                           f"{_fmt(m('rf1', 'e2e', 'p99_ms'), 2)} ms) | "
                           f"{_met(None if e is None else 1 / e, 0.5)} |")
    for r in results:
        if r.get("workload") == "failover":
            lease = r.get("lease_ms") or "default (3000)"
            lines += [f"Unavailability after a leader's SIGKILL (lease {lease} ms, flush "
                      f"{r['flush']}, {r['kills']} kills): p50 {r['unavailable_p50_s']:.2f} s, "
                      f"p99 {r['unavailable_p99_s']:.2f} s, max {r['unavailable_max_s']:.2f} s, "
                      f"min {r['unavailable_min_s']:.2f} s; "
                      f"controller killed too in {r['controller_kills']} of them (p50 "
                      f"{_fmt(r['controller_p50_s'], 2)} s), leader only in the others (p50 "
                      f"{_fmt(r['leader_only_p50_s'], 2)} s); failed sends {r['failed_sends']}",
                      ""]
            targets.append(f"| unavailability p50 ≤ 3 s (lease {lease}) | "
                           f"{r['unavailable_p50_s']:.2f} s | "
                           f"{_met(3 / r['unavailable_p50_s'], 1)} |")
            targets.append(f"| unavailability max ≤ 10 s (lease {lease}) | "
                           f"{r['unavailable_max_s']:.2f} s | "
                           f"{_met(10 / r['unavailable_max_s'], 1)} |")
        if r.get("workload") == "catchup":
            lines += [f"Follower catch-up ({r['flush']}): {r['megabytes']:.0f} MB in "
                      f"{r['catchup_s']:.2f} s after the restart = "
                      f"**{r['catchup_mb_per_s']:.0f} MB/s** ({r['catchup_with_restart_mb_per_s']:.0f}"
                      f" MB/s counting the broker's start, {r['restart_s']:.2f} s); written at "
                      f"{r['write_mb_per_s']:.0f} MB/s with acks=all", ""]
    lines += ["| target | measured | met? |", "|---|---|---|", *targets]
    return "\n".join(lines)


def _paired(results: list[dict[str, Any]], flush: str, workload: str, metric: str, num: str,
            den: str) -> tuple[float | None, str]:
    """The median of the per-round ratios ``num`` / ``den`` (:func:`bc.paired_ratios`: the
    two ran in the same round) and the ratios themselves, for the targets' table."""
    ratios = bc.paired_ratios(results, flush, workload, metric, num, den)
    return (statistics.median(ratios) if ratios else None,
            "per round: " + (", ".join(f"{r:.2f}" for r in ratios) or "-"))


def _met(ratio: float | None, need: float) -> str:
    if ratio is None:
        return "not measured"
    return "**yes**" if ratio >= need else "**no**"


def _failover_split(res: dict[str, Any]) -> None:
    detail = res["kills_detail"]
    ctrl = [k["unavailable_s"] for k in detail if k["victim_was_controller"]]
    other = [k["unavailable_s"] for k in detail if not k["victim_was_controller"]]
    res["controller_kills"] = len(ctrl)
    res["controller_p50_s"] = statistics.median(ctrl) if ctrl else None
    res["leader_only_p50_s"] = statistics.median(other) if other else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of every setup; the targets take the median of the per-round "
                         "ratios")
    ap.add_argument("--flush", default="sync,async")
    ap.add_argument("--setups", default=",".join(bc.SETUPS))
    ap.add_argument("--workloads", default=",".join(bc.WORKLOADS))
    ap.add_argument("--no-nats", action="store_true", help="leave NATS JetStream R3 out")
    ap.add_argument("--keep-topics", action="store_true",
                    help="keep each run's topic (later runs then meet every earlier queue)")
    ap.add_argument("--messages", type=int, default=1_000_000,
                    help="per produce/consume run (200,000 lasted 0.3 s: too short to be "
                         "stable)")
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--parts", default="matrix,failover,catchup")
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--kill-rate", type=float, default=500.0,
                    help="msg/s sent (acks=all) during the kills")
    ap.add_argument("--lease-ms", default="",
                    help="comma-separated metadata_lease_ms values for the kills "
                         "(empty: the brokers' default)")
    ap.add_argument("--catchup-mb", type=int, default=256)
    ap.add_argument("--out", default=None, help="JSON lines (default: bench/results/"
                                                "cluster-<time>.jsonl)")
    args = ap.parse_args(argv)
    install_uvloop()
    parts = set(args.parts.split(","))
    out = Path(args.out or HERE / "results" /
               f"cluster-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []

    with contextlib.ExitStack() as stack, out.open("w") as f:
        def record(r: dict[str, Any]) -> None:
            results.append(r)
            f.write(json.dumps(r) + "\n")
            f.flush()
            brief = {k: r[k] for k in ("setup", "round", "workload", "msg_per_s", "p50_ms",
                                       "p99_ms", "error") if k in r}
            print(f"  {r.get('flush', '')} {brief}", file=sys.stderr)

        f.write(json.dumps({"machine": _machine()}) + "\n")
        stack.enter_context(stop_signals_interrupt())  # `kill`: the finally blocks run
        nats = None if args.no_nats or "matrix" not in parts else compare.NatsJetStreamCluster()
        peers: dict[str, bc.PeerRun] = {}
        if nats is not None:
            try:
                nats.start()
                peers["nats-r3"] = _nats_peer(nats, args)
            except compare.Skip as exc:
                print(f"SKIP NATS R3: {exc}", file=sys.stderr)
                nats = None
        try:
            if "matrix" in parts:
                for flush in args.flush.split(","):
                    with bc.bench_cluster(flush) as b:
                        bc.run_matrix(b, args.setups.split(","), args.workloads.split(","),
                                      rounds=args.rounds, messages=args.messages,
                                      size=args.size, batch=args.batch, inflight=args.inflight,
                                      queues=args.queues, rate=args.rate,
                                      duration=args.duration, peers=peers, on_result=record,
                                      keep_topics=args.keep_topics)
        finally:
            if nats is not None:
                nats.stop()
        if "failover" in parts:
            for lease in [int(x) if x else None for x in args.lease_ms.split(",")]:
                t = time.perf_counter()
                with bc.bench_cluster("sync", lease_ms=lease, single=False) as b:
                    res = bc.run_failover(
                        b, kills=args.kills, rate=args.kill_rate,
                        on_kill=lambda k: print(f"  kill {k}", file=sys.stderr))
                res.update(flush="sync", lease_ms=lease, wall_s=time.perf_counter() - t)
                _failover_split(res)
                record(res)
        if "catchup" in parts:
            with bc.bench_cluster("sync", single=False) as b:
                res = bc.run_catchup(b, megabytes=args.catchup_mb)
            res["flush"] = "sync"
            record(res)
    print(summary(results))
    print(f"\n{out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
