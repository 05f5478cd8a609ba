"""``ferrymq bench``: produce, consume and end-to-end latency benchmarks.

Every subcommand either starts its own broker (a subprocess on a free port of 127.0.0.1 with a
temporary data directory, stopped and deleted afterwards: :class:`ferrymq.testing.BrokerProcess`,
the tests' launcher) or, with ``--server HOST:PORT``, uses a
running one. When the bench owns the broker (or ``--broker-pid`` names it) it also reports the
broker's CPU time (``/proc/<pid>/stat`` utime+stime, before and after the timed part) and its
resident memory (``/proc/<pid>/status`` VmRSS) at the end.

The workloads are :mod:`ferrymq.admin.bench_workloads`, their measuring tools
:mod:`ferrymq.admin.bench_measure`; this module holds the commands and prints a result (a
table, or one JSON object with ``--json``). The names ``bench/*.py`` use are re-exported here:
:func:`run_produce`, :func:`run_consume`, :func:`run_push`, :func:`run_e2e` and
:func:`run_delayed` return plain dicts so that ``bench/compare.py`` can drive the same
workloads.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from ferrymq.admin.bench_cluster import (
    EXTRA_WORKLOADS,
    SETUPS,
    WORKLOADS,
    bench_cluster,
    medians,
    run_catchup,
    run_failover,
    run_matrix,
)
from ferrymq.admin.bench_failover import SERVICES, run_service_failover
from ferrymq.admin.bench_measure import (
    TIMER_RESOLUTION_S,
    BenchedBroker,
    CpuTime,
    broker_for,
    cpu_seconds,
    install_uvloop,
    paced,
    percentile,
    rss_mb,
)
from ferrymq.admin.bench_workloads import run_consume, run_delayed, run_e2e, run_produce, run_push

__all__ = ["TIMER_RESOLUTION_S", "BenchedBroker", "CpuTime", "bench", "broker_for", "cpu_seconds",
           "install_uvloop", "paced", "percentile", "rss_mb", "run_consume", "run_delayed",
           "run_e2e", "run_produce", "run_push"]


# -- reporting ---------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"ferrymq bench {result['workload']}", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        if k == "errors" and not v:
            continue
        table.add_row(k, _fmt(v))
    Console().print(table)


def _common(f: Any) -> Any:
    opts = [
        click.option("--server", default=None, metavar="HOST:PORT",
                     help="Use this broker (default: start one on a free port, stop it after)."),
        click.option("--flush", type=click.Choice(["sync", "async"]), default="async",
                     show_default=True, help="Flush mode of the broker the bench starts."),
        click.option("--broker-pid", type=int, default=None,
                     help="PID of the --server broker, for CPU and RSS figures."),
        click.option("--size", type=int, default=100, show_default=True,
                     help="Message body bytes."),
        click.option("--queues", type=int, default=4, show_default=True,
                     help="Queues of the bench topic."),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _run_with_broker(server: str | None, flush: str, broker_pid: int | None,
                     fn: Any, **kwargs: Any) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    with broker_for(server, flush, broker_pid) as b:
        res: dict[str, Any] = fn(b.address, broker_pid=b.pid, **kwargs)
        res["flush"] = flush if server is None else "(external)"
        res["broker_rss_end_mb"] = rss_mb(b.pid)
        res["broker_started_by"] = b.started_by
        res["loadavg_1m_before"] = load_before
        res["loadavg_1m_after"] = os.getloadavg()[0]
        return res


@click.group()
def bench() -> None:
    """Measure produce, consume, push-consume and end-to-end latency against a broker."""


@bench.command()
@_common
@click.option("--messages", type=int, default=1_000_000, show_default=True)
@click.option("--batch", type=int, default=1000, show_default=True,
              help="Messages per send_batch call.")
@click.option("--inflight", type=int, default=8, show_default=True,
              help="Concurrent send_batch calls.")
def produce(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
            as_json: bool, messages: int, batch: int, inflight: int) -> None:
    """Batched produce throughput (msg/s, MB/s, messages per broker CPU-second)."""
    res = _run_with_broker(server, flush, broker_pid, run_produce, messages=messages, size=size,
                           batch=batch, queues=queues, inflight=inflight,
                           show_progress=not as_json)
    _emit(res, as_json)


@bench.command()
@_common
@click.option("--messages", type=int, default=1_000_000, show_default=True)
@click.option("--batch", type=int, default=1000, show_default=True,
              help="Messages per send_batch call while pre-producing.")
@click.option("--inflight", type=int, default=8, show_default=True)
def consume(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
            as_json: bool, messages: int, batch: int, inflight: int) -> None:
    """Consume throughput from disk: pre-produce, then read everything back."""
    res = _run_with_broker(server, flush, broker_pid, run_consume, messages=messages, size=size,
                           batch=batch, queues=queues, inflight=inflight,
                           show_progress=not as_json)
    _emit(res, as_json)


@bench.command()
@_common
@click.option("--messages", type=int, default=1_000_000, show_default=True)
@click.option("--batch", type=int, default=1000, show_default=True,
              help="Messages per send_batch call while pre-producing.")
@click.option("--inflight", type=int, default=8, show_default=True)
@click.option("--concurrency", type=int, default=16, show_default=True,
              help="Handlers running at once.")
@click.option("--prefetch", type=int, default=2048, show_default=True,
              help="Messages buffered ahead of the handlers.")
@click.option("--compare-pull/--no-compare-pull", default=True, show_default=True,
              help="Also time a pull consumer reading the same messages (ack overhead).")
def push(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
         as_json: bool, messages: int, batch: int, inflight: int, concurrency: int,
         prefetch: int, compare_pull: bool) -> None:
    """Push consumer throughput: no-op handler, every message acked (acks batched on the wire)."""
    res = _run_with_broker(server, flush, broker_pid, run_push, messages=messages, size=size,
                           batch=batch, queues=queues, inflight=inflight,
                           concurrency=concurrency, prefetch=prefetch, compare_pull=compare_pull,
                           show_progress=not as_json)
    _emit(res, as_json)


@bench.command()
@_common
@click.option("--rate", type=float, default=2000.0, show_default=True, help="Messages per second.")
@click.option("--duration", type=float, default=10.0, show_default=True, help="Seconds of sending.")
@click.option("--warmup", type=float, default=1.0, show_default=True,
              help="Seconds at the start left out of the percentiles.")
@click.option("--pacing", type=click.Choice(["sleep", "spin"]), default="sleep",
              show_default=True,
              help="Between sends, sleep (>= 1 ms) or spin (a busy loop that keeps a CPU).")
def e2e(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
        as_json: bool, rate: float, duration: float, warmup: float, pacing: str) -> None:
    """End-to-end latency at a fixed rate (p50/p90/p99/max)."""
    res = _run_with_broker(server, flush, broker_pid, run_e2e, rate=rate, duration=duration,
                           size=size, queues=queues, warmup=warmup, show_progress=not as_json,
                           pacing=pacing)
    _emit(res, as_json)


@bench.command()
@_common
@click.option("--messages", type=int, default=10_000, show_default=True,
              help="Scheduled messages pending at once.")
@click.option("--measure", type=int, default=None,
              help="How many of them come due in the window (default: all); the rest are due "
                   "--far-hours later and stay pending on disk.")
@click.option("--window", type=float, default=10.0, show_default=True,
              help="Seconds over which the measured messages come due.")
@click.option("--lead", type=float, default=2.0, show_default=True,
              help="Seconds between the end of scheduling and the first due time.")
@click.option("--far-hours", type=float, default=10.0, show_default=True)
@click.option("--shuffle", is_flag=True,
              help="Due times in random order (not in send order).")
@click.option("--batch", type=int, default=1000, show_default=True)
def delayed(server: str | None, flush: str, broker_pid: int | None, size: int, queues: int,
            as_json: bool, messages: int, measure: int | None, window: float, lead: float,
            far_hours: float, shuffle: bool, batch: int) -> None:
    """Delayed-message lateness (receive time - due time, p50/p99/max) with N pending, and the
    broker's RSS."""
    res = _run_with_broker(server, flush, broker_pid, run_delayed, messages=messages,
                           measure=measure, window=window, lead=lead, far_hours=far_hours,
                           size=size, queues=queues, batch=batch, shuffle=shuffle,
                           show_progress=not as_json)
    _emit(res, as_json)


# -- the cluster -------------------------------------------------------------------------------


@bench.group("cluster")
def cluster_group() -> None:
    """Benchmarks of a local cluster (etcd and three brokers the bench starts) against a
    standalone broker of the same run (``ferrymq.admin.bench_cluster``)."""


def _lease_option(f: Any) -> Any:
    return click.option("--lease-ms", type=click.IntRange(min=2000), default=None,
                        help="The brokers' metadata_lease_ms (default: theirs, 3000): how long "
                             "a killed broker's lease outlives it.")(f)


@cluster_group.command("matrix")
@click.option("--flush", type=click.Choice(["sync", "async"]), default="sync", show_default=True)
@click.option("--setups", default=",".join(SETUPS), show_default=True,
              help=f"Comma-separated, of: {', '.join(SETUPS)}.")
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True,
              help=f"Comma-separated, of: {', '.join(WORKLOADS + EXTRA_WORKLOADS)}.")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="Each setup runs each workload once per round, setups alternating.")
@click.option("--messages", type=int, default=500_000, show_default=True)
@click.option("--size", type=int, default=100, show_default=True)
@click.option("--batch", type=int, default=1000, show_default=True)
@click.option("--inflight", type=int, default=8, show_default=True)
@click.option("--queues", type=int, default=4, show_default=True)
@click.option("--rate", type=float, default=2000.0, show_default=True)
@click.option("--duration", type=float, default=10.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run, then none.")
def cluster_matrix(flush: str, setups: str, workloads: str, rounds: int, messages: int,
                   size: int, batch: int, inflight: int, queues: int, rate: float,
                   duration: float, as_json: bool) -> None:
    """Produce, consume and e2e latency of a standalone broker, RF1 and RF3 (acks leader and
    all) on a cluster, in alternating rounds; medians and ratios to RF1."""
    names = _names(setups, SETUPS, "--setups")
    works = _names(workloads, dict.fromkeys(WORKLOADS + EXTRA_WORKLOADS), "--workloads")
    with bench_cluster(flush, single="single" in names) as b:
        results = run_matrix(b, names, works, rounds=rounds, messages=messages, size=size,
                             batch=batch, inflight=inflight, queues=queues, rate=rate,
                             duration=duration,
                             on_result=(lambda r: click.echo(json.dumps(r))) if as_json
                             else None)
    if not as_json:
        _emit_matrix(results)


def _names(value: str, known: Any, option: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise click.BadParameter(f"{', '.join(unknown) or 'nothing'}: choose from "
                                 f"{', '.join(known)}", param_hint=option)
    return names


def _emit_matrix(results: list[dict[str, Any]]) -> None:
    med = medians(results)
    table = Table(title="ferrymq bench cluster matrix (medians)", show_header=True)
    for col in ("flush", "setup", "workload", "metric", "median", "/ rf1"):
        table.add_column(col, justify="right" if col in ("median", "/ rf1") else "left")
    for (flush, setup, workload, metric), v in sorted(med.items()):
        base = med.get((flush, "rf1", workload, metric))
        table.add_row(flush, setup, workload, metric, _fmt(v),
                      _fmt(v / base) if base else "-")
    Console().print(table)
    for r in results:
        if "error" in r:
            click.echo(f"{r['setup']} {r['workload']} round {r['round']}: {r['error']}", err=True)


@cluster_group.command("failover")
@click.option("--flush", type=click.Choice(["sync", "async"]), default="sync", show_default=True)
@click.option("--kills", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--rate", type=float, default=500.0, show_default=True,
              help="Operations per second throughout (for produce: messages sent, acks=all).")
@click.option("--service", type=click.Choice(sorted(SERVICES)), default="produce",
              show_default=True, help="Which service's broker is killed and timed.")
@_lease_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cluster_failover(flush: str, kills: int, rate: float, service: str, lease_ms: int | None,
                     as_json: bool) -> None:
    """Unavailability after SIGKILL of the broker serving a service: time from the kill until
    an operation started after it succeeds (produce: a message acknowledged; commit: a pull
    consumer's offset commit), p50/p99/max over --kills kills; the killed broker restarts and
    rejoins the ISR between kills."""
    def shown(k: dict[str, Any]) -> None:
        click.echo(f"kill {k['kill']}: broker {k['victim']} -> {k['new_leader']}, unavailable "
                   f"{k['unavailable_s']:.2f} s, rejoined in {k['rejoin_isr_s']:.2f} s", err=True)

    with bench_cluster(flush, lease_ms=lease_ms, single=False) as b:
        if service == "produce":
            res = run_failover(b, kills=kills, rate=rate, on_kill=None if as_json else shown)
        else:
            res = run_service_failover(b, service, kills=kills, rate=rate,
                                       on_kill=None if as_json else shown)
    res.update(flush=flush, lease_ms=lease_ms)
    if not as_json:
        res.pop("kills_detail")
    _emit(res, as_json)


@cluster_group.command("catchup")
@click.option("--flush", type=click.Choice(["sync", "async"]), default="sync", show_default=True)
@click.option("--megabytes", type=click.IntRange(min=1), default=256, show_default=True,
              help="MB written while the follower is down.")
@click.option("--size", type=int, default=10_240, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cluster_catchup(flush: str, megabytes: int, size: int, as_json: bool) -> None:
    """Follower catch-up: stop a follower, write --megabytes, restart it, time until it is
    back in the ISR (MB/s)."""
    with bench_cluster(flush, single=False) as b:
        res = run_catchup(b, megabytes=megabytes, size=size)
    res["flush"] = flush
    _emit(res, as_json)


if __name__ == "__main__":
    bench()
