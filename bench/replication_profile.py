#!/usr/bin/env python
"""A profile of the replication path, not a benchmark: three brokers *in this process* (real
``BrokerServer``\\ s on port 0 and real sockets, joined through a memory metadata store), a
topic of ``--queues`` queues with three replicas (``min_insync`` 2) and an ``acks="all"``
producer in the same event loop.

One process holds everything, so its CPU time (``time.process_time``) is the whole cost of a
message, brokers and client together, without three processes competing for two cores; the
numbers compare code versions (run both on the same machine, alternating), not systems.

* ``--rate R`` (default 2000): single sends paced at R msg/s (the e2e workload's shape): CPU
  microseconds per message, the acknowledgement's p50/p99, and per message the followers'
  REPLICA_FETCH answers (``Fetcher.rounds``: long polls and position reports) and the flush
  rounds of all three brokers.
* ``--rate 0``: batches of ``--batch`` with 8 in flight, as fast as they go (the produce
  workload's shape): msg/s and the same counts.
* ``--cprofile N``: also print the N functions of most cumulative time (cProfile slows every
  Python call: read its shares, not its times).

Usage: ``.venv/bin/python bench/replication_profile.py [--rate 2000] [--messages 6000]
[--flush sync] [--cprofile 40]``
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ferrymq.admin.bench_measure import percentile
from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.server import BrokerServer
from ferrymq.client.admin import AsyncAdminClient
from ferrymq.client.message import Message
from ferrymq.client.producer import AsyncProducer
from ferrymq.cluster.metadata.memory import MemoryMetadataStore

BROKERS = 3


def _counts(brokers: list[BrokerServer]) -> dict[str, int]:
    answers = sum(f.rounds for b in brokers if b.replicas is not None
                  for f in b.replicas.fetchers.values())
    return {"follower_answers": answers, "flush_rounds": sum(b.flusher.rounds for b in brokers)}


async def _run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    store = MemoryMetadataStore()
    brokers: list[BrokerServer] = []
    try:
        for i in range(1, BROKERS + 1):
            config = BrokerConfig(data_dir=str(tmp / f"b{i}"), port=0, http_port=0,
                                  broker_id=i, metadata="memory://", cluster="prof",
                                  flush=args.flush).validate()
            srv = BrokerServer(config, metadata_store=store)
            await srv.start()
            brokers.append(srv)
        bootstrap = ",".join(f"{b.address[0]}:{b.address[1]}" for b in brokers)
        async with AsyncAdminClient(bootstrap) as admin:
            await admin.create_topic("prof", args.queues, replicas=BROKERS, min_insync=2)
        body = b"x" * args.size
        async with AsyncProducer(bootstrap, acks="all") as producer:
            for i in range(16 * args.queues):  # every queue replicating before the clock
                await producer.send(Message("prof", body, sharding_key=str(i)))
            await asyncio.sleep(0.5)
            prof = cProfile.Profile() if args.cprofile else None
            before = _counts(brokers)
            t0, c0 = time.perf_counter(), time.process_time()
            if prof is not None:
                prof.enable()
            latencies: list[float] = []
            if args.rate > 0:
                await _paced(producer, body, args.rate, args.messages, latencies)
            else:
                await _batched(producer, body, args.batch, args.messages)
            if prof is not None:
                prof.disable()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            after = _counts(brokers)
    finally:
        for srv in brokers:
            await srv.stop()
    n = args.messages
    res: dict[str, Any] = {"flush": args.flush, "rate": args.rate, "messages": n,
                           "wall_s": round(wall, 3), "cpu_us_per_msg": round(cpu / n * 1e6, 1),
                           **{f"{k}_per_msg": round((after[k] - before[k]) / n, 3)
                              for k in after}}
    if latencies:
        latencies.sort()
        res["ack_p50_ms"] = round(percentile(latencies, 50) * 1e3, 2)
        res["ack_p99_ms"] = round(percentile(latencies, 99) * 1e3, 2)
    else:
        res["msg_per_s"] = round(n / wall)
    if prof is not None:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(
            "ferrymq", args.cprofile)
    return res


async def _paced(producer: AsyncProducer, body: bytes, rate: float, n: int,
                 latencies: list[float]) -> None:
    start = time.perf_counter()
    sends = []
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.perf_counter()
        fut = asyncio.ensure_future(producer.send(Message("prof", body)))
        fut.add_done_callback(
            lambda _f, sent=sent: latencies.append(time.perf_counter() - sent))
        sends.append(fut)
    await asyncio.gather(*sends)


async def _batched(producer: AsyncProducer, body: bytes, batch: int, n: int) -> None:
    full = [Message("prof", body) for _ in range(batch)]
    left = [n // batch]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            await producer.send_batch(full)

    await asyncio.gather(*(worker() for _ in range(8)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=2000.0, help="msg/s; 0: batches, flat out")
    ap.add_argument("--messages", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--queues", type=int, default=4)
    ap.add_argument("--flush", choices=("sync", "async"), default="sync")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ferrymq-repl-prof-") as d:
        print(json.dumps(asyncio.run(_run(args, Path(d)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
