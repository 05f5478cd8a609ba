"""PySpark data source throughput: FerryMQ source and sink against Spark's own Parquet reader.

    .venv/bin/python bench/spark.py [--rows 2000000] [--size 100] [--queues 2] [--runs 3]
                                    [--flush async] [--mode transactional]
                                    [--json bench/results/spark-....jsonl]

Starts a broker in its own process (``python -m ferrymq.broker``), then a local[2] SparkSession, and
measures, each ``--runs`` times (JVM start and the first warm-up job excluded):

* **sink**: ``spark.range(N)`` projected to 100-byte string values ->
  ``write.format("ferrymq")`` (Arrow writer; ``--mode`` is its ``deliveryMode``: the default
  ``transactional`` stages each task's rows and commits them in one driver call,
  ``idempotent``, ``atLeastOnce``), rows/s; the same DataFrame
  into Spark's ``noop`` sink gives the cost of generating the rows alone;
* **source**: ``read.format("ferrymq")`` of the N rows -> ``noop`` sink (every row crosses from
  the Python worker to the JVM as Arrow), rows/s;
* **parquet**: the same rows (the source's columns) written once to Parquet, then
  ``read.parquet`` -> ``noop``, rows/s.

Prints a table and appends one JSON line per run (machine, date, load average, arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ferrymq._launcher import BrokerProcess

ROOT = Path(__file__).resolve().parents[1]


def _loadavg() -> float:
    return os.getloadavg()[0]


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--size", type=int, default=100, help="value bytes")
    ap.add_argument("--queues", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--flush", choices=["async", "sync"], default="async")
    ap.add_argument("--mode", choices=["transactional", "idempotent", "atLeastOnce"],
                    default="transactional", help="the sink's deliveryMode")
    ap.add_argument("--json", type=Path, default=None, help="append results here (JSON lines)")
    args = ap.parse_args()

    os.environ.update({"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
                       "PYSPARK_DRIVER_PYTHON": sys.executable})
    work = Path(tempfile.mkdtemp(prefix="ferrymq-spark-bench-"))
    broker = BrokerProcess(work / "data", flush=args.flush).start()
    try:
        _run(args, broker.address, work)
    finally:
        broker.stop(30)
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, servers: str, work: Path) -> None:
    from pyspark.sql import SparkSession

    from ferrymq import AdminClient

    deadline = time.monotonic() + 20
    while True:
        try:
            with AdminClient(servers) as admin:
                admin.list_topics()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    spark = (SparkSession.builder.master("local[2]").appName("ferrymq-bench")
             .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    n, size = args.rows, args.size
    gen = spark.range(0, n, 1, 2).selectExpr(f"rpad(CAST(id AS STRING), {size}, 'x') AS value")

    def sink_into(topic: str) -> None:
        gen.write.format("ferrymq").option("servers", servers).option("topic", topic).option(
            "deliveryMode", args.mode).mode("append").save()

    def source_of(topic: str) -> Any:
        return spark.read.format("ferrymq").option("servers", servers).option(
            "subscribe", topic).load()

    with AdminClient(servers) as admin:
        admin.create_topic("warmup", args.queues)
        for r in range(args.runs):
            admin.create_topic(f"bench{r}", args.queues)
    # warm-up: JVM, Python workers, the data source lookup
    spark.range(0, 10_000, 1, 2).selectExpr("CAST(id AS STRING) AS value").write.format(
        "ferrymq").option("servers", servers).option("topic", "warmup").mode("append").save()
    source_of("warmup").write.format("noop").mode("overwrite").save()

    results: list[dict[str, Any]] = []
    parquet = work / "parquet"
    for r in range(args.runs):
        load0 = _loadavg()
        gen_s = _timed(lambda: gen.write.format("noop").mode("overwrite").save())
        sink_s = _timed(lambda r=r: sink_into(f"bench{r}"))
        src = source_of(f"bench{r}")
        count = src.count()
        assert count == n, f"read {count} rows, wrote {n}"
        source_s = _timed(lambda src=src: src.write.format("noop").mode("overwrite").save())
        if not parquet.exists():
            src.write.parquet(str(parquet))
        pq_s = _timed(lambda: spark.read.parquet(str(parquet)).write.format("noop").mode(
            "overwrite").save())
        row = {
            "bench": "spark", "run": r + 1, "rows": n, "value_bytes": size, "queues": args.queues,
            "flush": args.flush, "delivery_mode": args.mode, "master": "local[2]",
            "generate_noop_rows_per_s": round(n / gen_s),
            "sink_rows_per_s": round(n / sink_s),
            "source_rows_per_s": round(n / source_s),
            "parquet_rows_per_s": round(n / pq_s),
            "loadavg_1m_before": load0, "loadavg_1m_after": _loadavg(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": f"{platform.node()} {os.cpu_count()} cpu, Python {platform.python_version()}",
        }
        results.append(row)
        print(json.dumps(row), flush=True)
        if args.json is not None:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    spark.stop()

    def med(key: str) -> str:
        vals = [row[key] for row in results]
        return f"{statistics.median(vals):,.0f} ({', '.join(f'{v / 1e6:.2f}M' for v in vals)})"

    print(f"\n{n:,} rows of {size} B, {args.queues} queues, local[2], flush {args.flush}, "
          f"sink deliveryMode {args.mode}; "
          "median rows/s (all runs)")
    print(f"  ferrymq source -> noop : {med('source_rows_per_s')}")
    print(f"  parquet        -> noop : {med('parquet_rows_per_s')}")
    print(f"  range -> ferrymq sink  : {med('sink_rows_per_s')}")
    print(f"  range -> noop          : {med('generate_noop_rows_per_s')}")


if __name__ == "__main__":
    main()
