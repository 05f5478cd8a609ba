"""The example pipeline end to end on an embedded broker (``make pipeline``).

1. starts a FerryMQ broker in this process (data in a temporary directory);
2. the generator produces orders over six minutes of event time;
3. the Spark job (local[2]) computes revenue per category per minute with ``Trigger.AvailableNow``
   into the topic ``pipeline-revenue`` and into Parquet; it runs twice, as a scheduled job would, so
   the second run emits the windows that the first run's final watermark closed;
4. the consumer prints the windows, and the result is checked against the same sums computed
   directly from the generated orders.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from consumer import read_revenue
from generator import make_orders, produce

from ferrymq import AdminClient, Broker


def main() -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    work = Path(tempfile.mkdtemp(prefix="ferrymq-pipeline-"))
    with Broker(work / "data", port=0) as broker:
        servers = broker.address
        with AdminClient(servers) as admin:
            admin.create_topic("pipeline-orders", 3)
            admin.create_topic("pipeline-revenue", 2)
        start = dt.datetime(2026, 11, 21, 10, 0, tzinfo=dt.UTC)
        orders = make_orders(12_000, start, minutes=6)
        produce(servers, orders)
        print(f"broker {servers}: produced {len(orders)} orders (event time 10:00-10:06)")

        from job import start_queries
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master("local[2]").appName("ferrymq-pipeline")
                 .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2").config("spark.sql.session.timeZone", "UTC")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        for _ in range(2):
            for q in start_queries(spark, servers, work, available_now=True):
                q.awaitTermination()
        parquet_rows = spark.read.parquet(str(work / "revenue-parquet")).count()
        spark.stop()

        # windows closed by the watermark: those ending at least 1 minute before the last order
        expected: dict[tuple[str, str], float] = defaultdict(float)
        for o in orders:
            ts = dt.datetime.fromisoformat(str(o["ts"]).replace("Z", "+00:00"))
            if ts < start + dt.timedelta(minutes=4):
                w = ts.replace(second=0, microsecond=0).strftime("%Y-%m-%dT%H:%M")
                expected[(w, str(o["category"]))] += float(o["amount"])  # type: ignore[arg-type]
        rows = read_revenue(servers, expect=len(expected))
        print(f"\nrevenue per category per minute (topic 'pipeline-revenue', {len(rows)} windows; "
              f"Parquet: {parquet_rows} rows in {work / 'revenue-parquet'}):")
        for r in rows:
            print(f"  {str(r['window_start'])[:16]}  {r['category']:<8} {r['revenue']:>10.2f}"
                  f"  ({r['orders']} orders)")
        got = {(str(r["window_start"])[:16], str(r["category"])): float(r["revenue"])  # type: ignore[arg-type]
               for r in rows}
        ok = (set(expected) <= set(got) and parquet_rows == len(rows)
              and all(abs(got[k] - round(v, 2)) < 0.011 for k, v in expected.items()))
        print("\ncheck against the generated orders:", "OK" if ok else "MISMATCH")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
