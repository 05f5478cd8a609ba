"""``ferrymq bench cluster``: the workloads of ``ferrymq bench`` against a local cluster, and the
cluster's own figures (unavailability after a leader is killed, follower catch-up).

Theory of operation
-------------------
The bench starts a :class:`~ferrymq._cluster_launcher.ClusterProcess` (etcd and three brokers
as subprocesses on loopback, the tests' launcher) and, as the baseline of the same run, a
standalone broker (:class:`~ferrymq._launcher.BrokerProcess`, no cluster). The measuring code is
:mod:`ferrymq.admin.bench_workloads`'s (``run_produce``, ``run_consume``, ``run_e2e``), given a
:class:`~ferrymq.admin.bench_workloads.Replication` per setup:

* ``single``: the standalone broker (what the single-broker benches measure);
* ``rf1``: a topic of one replica per queue on the cluster (``acks="leader"``);
* ``rf3-leader`` / ``rf3-all``: three replicas, ``min_insync`` 2, ``acks="leader"`` / ``"all"``.

:func:`run_matrix` runs every (setup, workload) once per round, round after round, so the setups
alternate within minutes of each other (this machine's speed drifts); peers (NATS JetStream R3 in
``bench/cluster.py``) join the rotation as callables.

:func:`run_failover` sends single messages at a fixed rate with ``acks="all"`` to a one-queue
topic of three replicas, SIGKILLs the queue's leader, and measures the time from the kill until
the first message *sent after the kill* is acknowledged (the client's refresh, the lease's
expiry, the controller's election and the new leader's first ack all count); then it restarts
the killed broker and waits for it to be back in the ISR before the next kill.

:func:`run_catchup` stops a follower gracefully, writes ``megabytes`` to the queue
(``acks="all"`` with the two brokers left), restarts the follower and times until the leader
has taken it back into the ISR: the leader does so once the follower's position reached the
high watermark, which with no writes meanwhile is the leader's log end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferrymq._cluster_launcher import ClusterProcess
from ferrymq._launcher import BrokerProcess
from ferrymq._stop_signals import stop_signals_interrupt
from ferrymq.admin.bench_failover import (
    describe_cluster,
    queue_state,
    run_service_failover,
    wait_isr,
)
from ferrymq.admin.bench_measure import cpu_seconds, install_uvloop, rss_mb
from ferrymq.admin.bench_workloads import (
    Replication,
    _create_topic,
    _produce,
    run_consume,
    run_e2e,
    run_produce,
    run_push,
)
from ferrymq.client.admin import AsyncAdminClient

__all__ = ["EXTRA_WORKLOADS", "METRICS", "SETUPS", "WORKLOADS", "BenchCluster", "PeerRun",
           "Setup", "bench_cluster", "medians", "paired_ratios", "run_catchup", "run_failover",
           "run_matrix", "runs_of"]

BROKERS = 3


@dataclass(frozen=True)
class Setup:
    """One way of running a workload: on the standalone broker (``replication`` None) or on the
    cluster with this replication."""

    name: str
    replication: Replication | None


SETUPS: dict[str, Setup] = {
    "single": Setup("single", None),
    "rf1": Setup("rf1", Replication(replicas=1, min_insync=1, acks="leader")),
    "rf3-leader": Setup("rf3-leader", Replication(replicas=3, min_insync=2, acks="leader")),
    "rf3-all": Setup("rf3-all", Replication(replicas=3, min_insync=2, acks="all")),
}
"""The setups :func:`run_matrix` knows, by name."""

WORKLOADS = ("produce", "consume", "e2e")
"""The workloads :func:`run_matrix` runs by default (those its peers have too)."""
EXTRA_WORKLOADS = ("push",)
"""Workloads run only when named: ``push``, a push consumer handling and acking what was sent
(its delivery group coordinated by the leader of the group's retry queue on a cluster)."""


@dataclass
class BenchCluster:
    """The processes a cluster bench runs against: the cluster and a standalone broker."""

    cluster: ClusterProcess
    single: BrokerProcess
    flush: str

    def broker_pids(self) -> list[int]:
        """The cluster's broker processes now running."""
        return [b.pid for b in self.cluster.brokers.values() if b.pid is not None and b.running()]

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the cluster's running brokers."""
        return sum(cpu_seconds(pid) or 0.0 for pid in self.broker_pids())


@contextlib.contextmanager
def bench_cluster(flush: str, *, lease_ms: int | None = None,
                  single: bool = True) -> Iterator[BenchCluster]:
    """etcd and three brokers (``--flush flush``, ``metadata_lease_ms`` ``lease_ms`` or the
    default) and, with ``single``, a standalone broker; all stopped and deleted afterwards."""
    env = {"FERRYMQ_METADATA_LEASE_MS": str(lease_ms)} if lease_ms else None
    cluster = ClusterProcess(BROKERS, flush=flush, env=env, new_session=True)
    alone = BrokerProcess(flush=flush, new_session=True)
    with stop_signals_interrupt():  # a `kill` of the bench stops them too (SIGKILL cannot)
        try:
            cluster.start()
            if single:
                alone.start()
            yield BenchCluster(cluster, alone, flush)
        finally:
            try:
                alone.stop()
            finally:
                cluster.kill()


# -- throughput and latency ---------------------------------------------------------------------


PeerRun = Callable[[str], dict[str, Any]]
"""A peer system's run of one workload (``produce``, ``consume``, ``e2e``): its figures with
``msg_per_s`` or ``p50_ms``/``p99_ms`` as ``ferrymq bench`` names them."""


def run_matrix(bench: BenchCluster, setups: Sequence[str], workloads: Sequence[str], *,
               rounds: int, messages: int, size: int = 100, batch: int = 1000,
               inflight: int = 8, queues: int = 4, rate: float = 2000.0,
               duration: float = 10.0, peers: Mapping[str, PeerRun] | None = None,
               on_result: Callable[[dict[str, Any]], None] | None = None,
               keep_topics: bool = False) -> list[dict[str, Any]]:
    """Every workload of every setup (and peer) once per round, setups alternating; one result
    dict per run (``setup``, ``round``, ``workload`` and the workload's figures). Every other
    round runs the setups in the reverse order (A B C, C B A, ...), so no setup always runs
    first or right after the same one: :func:`paired_ratios` compares setups within a round.
    Each run's topic is deleted after it (``keep_topics``: kept, so later runs meet the queues
    of the earlier ones: every follower fetch names every queue it follows)."""
    results: list[dict[str, Any]] = []
    names = [*setups, *(peers or {})]
    for rnd in range(1, rounds + 1):
        for workload in workloads:
            for name in (names if rnd % 2 else names[::-1]):
                t0 = time.perf_counter()
                try:
                    if peers and name in peers:
                        res = peers[name](workload)
                    else:
                        res = _run_setup(bench, SETUPS[name], workload, messages=messages,
                                         size=size, batch=batch, inflight=inflight,
                                         queues=queues, rate=rate, duration=duration)
                        if not keep_topics:
                            asyncio.run(_drop_bench_topics(
                                bench.single.address if SETUPS[name].replication is None
                                else bench.cluster.bootstrap))
                except Exception as exc:  # noqa: BLE001 - one failed run is reported, not fatal
                    res = {"workload": workload, "error": repr(exc)}
                res.update(setup=name, round=rnd, flush=bench.flush,
                           wall_s=time.perf_counter() - t0,
                           loadavg_1m_after=os.getloadavg()[0])
                results.append(res)
                if on_result is not None:
                    on_result(res)
    return results


async def _drop_bench_topics(address: str) -> None:
    """Delete the benchmark's topics (``bench-...``) of a broker or cluster."""
    async with AsyncAdminClient(address) as admin:
        for t in await admin.list_topics():
            if t.name.startswith("bench-"):
                await admin.delete_topic(t.name)


def _run_setup(bench: BenchCluster, setup: Setup, workload: str, *, messages: int, size: int,
               batch: int, inflight: int, queues: int, rate: float,
               duration: float) -> dict[str, Any]:
    if setup.replication is None:
        address, pid, repl = bench.single.address, bench.single.pid, Replication()
    else:
        address, pid, repl = bench.cluster.bootstrap, None, setup.replication
    def used() -> float:
        return (cpu_seconds(pid) or 0.0) if pid is not None else bench.cpu_seconds()

    cpu0 = used()
    if workload == "produce":
        res = run_produce(address, messages=messages, size=size, batch=batch, queues=queues,
                          inflight=inflight, broker_pid=pid, show_progress=False,
                          replication=repl)
    elif workload == "consume":
        res = run_consume(address, messages=messages, size=size, batch=batch, queues=queues,
                          inflight=inflight, broker_pid=pid, show_progress=False,
                          replication=repl)
    elif workload == "e2e":
        res = run_e2e(address, rate=rate, duration=duration, size=size, queues=queues,
                      broker_pid=pid, show_progress=False, replication=repl)
    elif workload == "push":
        res = run_push(address, messages=messages, size=size, batch=batch, queues=queues,
                       inflight=inflight, broker_pid=pid, show_progress=False,
                       compare_pull=False, replication=repl)
    else:
        raise ValueError(f"unknown workload {workload!r}: one of "
                         f"{', '.join(WORKLOADS + EXTRA_WORKLOADS)}")
    res["brokers_cpu_s"] = used() - cpu0  # the whole run, the untimed parts included
    res["replicas"] = repl.replicas
    res["acks"] = repl.acks
    return res


# -- unavailability after a leader's SIGKILL ----------------------------------------------------


def run_failover(bench: BenchCluster, *, kills: int = 20, rate: float = 500.0, size: int = 100,
                 rejoin_timeout_s: float = 120.0, resume_timeout_s: float = 60.0,
                 settle_s: float = 1.0,
                 on_kill: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """SIGKILL the leader of a three-replica queue ``kills`` times while a producer sends at
    ``rate`` msg/s with ``acks="all"``; the unavailability of each kill (kill → first ack of a
    message sent after it) and its percentiles (:func:`~ferrymq.admin.bench_failover.
    run_service_failover` with the ``produce`` service, its counts named for sends)."""
    res = run_service_failover(bench, "produce", kills=kills, rate=rate, size=size,
                               rejoin_timeout_s=rejoin_timeout_s,
                               resume_timeout_s=resume_timeout_s, settle_s=settle_s,
                               on_kill=on_kill)
    res["acked"] = res.pop("succeeded")
    res["failed_sends"] = res.pop("failed_ops")
    for row in res["kills_detail"]:
        row["failed_sends"] = row.pop("failed_ops")
    return res


# -- follower catch-up --------------------------------------------------------------------------


def run_catchup(bench: BenchCluster, *, megabytes: int = 256, size: int = 10_240,
                batch: int = 100, inflight: int = 8, timeout_s: float = 300.0) -> dict[str, Any]:
    """Stop a follower of a three-replica queue, write ``megabytes`` MB to the queue, restart
    the follower and time until it is back in the ISR; MB/s of the catch-up."""
    install_uvloop()
    cluster = bench.cluster
    bootstrap = cluster.bootstrap

    async def main() -> dict[str, Any]:
        topic = await _create_topic(bootstrap, 1, prefix="bench-catchup",
                                    replication=Replication(replicas=3, min_insync=2))
        q = await wait_isr(bootstrap, topic, 0, 3, timeout_s)
        desc = await describe_cluster(bootstrap)
        # a follower that is not the controller: its stop moves nothing but this ISR
        followers = [b for b in q.replicas if b != q.leader]
        follower = next((b for b in followers if b != desc.controller), followers[0])
        await asyncio.to_thread(cluster.stop_broker, follower)
        deadline = time.perf_counter() + timeout_s
        while follower in (await queue_state(bootstrap, topic, 0)).isr:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"broker {follower} stayed in the ISR after its stop")
            await asyncio.sleep(0.05)
        messages = megabytes * 1_000_000 // size
        write_s = await _produce(bootstrap, topic, messages, size, batch, inflight, "write",
                                 False, "all")
        t0 = time.perf_counter()
        await asyncio.to_thread(cluster.restart, follower, 60.0)
        t_up = time.perf_counter()
        await wait_isr(bootstrap, topic, 0, 3, timeout_s, member=follower)
        t_isr = time.perf_counter()
        nbytes = (messages + 1) * size
        return {
            "workload": "catchup", "megabytes": nbytes / 1e6, "size": size,
            "follower": follower, "write_s": write_s, "write_mb_per_s": nbytes / 1e6 / write_s,
            "restart_s": t_up - t0, "catchup_s": t_isr - t_up,
            "catchup_mb_per_s": nbytes / 1e6 / (t_isr - t_up),
            "catchup_with_restart_mb_per_s": nbytes / 1e6 / (t_isr - t0),
            "follower_rss_mb": rss_mb(cluster.broker(follower).pid),
        }

    return asyncio.run(main())


# -- summary ------------------------------------------------------------------------------------


METRICS = {"produce": ("msg_per_s",), "consume": ("msg_per_s",), "e2e": ("p50_ms", "p99_ms")}
"""The figure(s) of each workload that the summary takes the median of."""


def medians(results: Sequence[dict[str, Any]]) -> dict[tuple[str, str, str, str], float]:
    """(flush, setup, workload, metric) → the median over the rounds (runs that failed or lack
    the metric are left out)."""
    groups: dict[tuple[str, str, str, str], list[float]] = {}
    for r in results:
        for metric in METRICS.get(r.get("workload", ""), ()):
            v = r.get(metric)
            if isinstance(v, (int, float)) and v == v:
                key = (str(r.get("flush")), str(r["setup"]), str(r["workload"]), metric)
                groups.setdefault(key, []).append(float(v))
    return {k: statistics.median(v) for k, v in groups.items()}


def runs_of(results: Sequence[dict[str, Any]], flush: str, setup: str, workload: str,
            metric: str) -> list[float]:
    """Every run's figure, in round order."""
    return [float(r[metric]) for r in results
            if str(r.get("flush")) == flush and r.get("setup") == setup
            and r.get("workload") == workload and isinstance(r.get(metric), (int, float))]


def paired_ratios(results: Sequence[dict[str, Any]], flush: str, workload: str, metric: str,
                  num: str, den: str) -> list[float]:
    """``num``'s figure over ``den``'s, per round in which both have one, in round order.

    The two runs of a round ran minutes apart at most, while this machine's speed drifts more
    between rounds than the setups differ: the median of these ratios is steadier than the
    ratio of the two medians (``bench/metrics_scrape.py`` pairs its runs the same way)."""
    by_round: dict[tuple[str, Any], float] = {}
    for r in results:
        v = r.get(metric)
        if (str(r.get("flush")) == flush and r.get("workload") == workload
                and r.get("setup") in (num, den) and isinstance(v, (int, float)) and v == v):
            by_round[(str(r["setup"]), r.get("round"))] = float(v)
    rounds = sorted({rnd for _s, rnd in by_round})
    return [by_round[(num, rnd)] / by_round[(den, rnd)] for rnd in rounds
            if (num, rnd) in by_round and by_round.get((den, rnd))]
