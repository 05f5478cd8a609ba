"""The Structured Streaming job: revenue per category per minute.

    python examples/pipeline/job.py --servers 127.0.0.1:9876 --work ./pipeline-work [--available-now]
        [--shuffle-partitions 4]

Reads JSON orders from the FerryMQ topic ``pipeline-orders``, computes revenue per category in one-minute
event-time windows (watermark: 1 minute, so each window is emitted once, when it closes), and
writes every closed window to the FerryMQ topic ``pipeline-revenue`` (sharding key: the category) and to
Parquet under ``<work>/revenue-parquet``. Two queries, two checkpoints: each sink is
exactly-once on its own. Runs unchanged on a cluster (``spark-submit --master spark://host:7077
job.py ...`` with FerryMQ installed on the nodes and ``--work`` on shared storage).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

ORDER_SCHEMA = "order_id STRING, category STRING, amount DOUBLE, ts TIMESTAMP"


def revenue_per_minute(spark: Any, servers: str) -> Any:
    """The windowed aggregate as a streaming DataFrame."""
    orders = (spark.readStream.format("ferrymq").option("servers", servers)
              .option("subscribe", "pipeline-orders").option("startingOffsets", "earliest")
              .option("maxOffsetsPerTrigger", "5000").load()
              .select(F.from_json(F.col("value").cast("string"), ORDER_SCHEMA).alias("o"))
              .select("o.*"))
    return (orders.withWatermark("ts", "1 minute")
            .groupBy(F.window("ts", "1 minute").alias("w"), "category")
            .agg(F.round(F.sum("amount"), 2).alias("revenue"), F.count("*").alias("orders"))
            .select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                    "category", "revenue", "orders"))


def start_queries(spark: Any, servers: str, work: Path, available_now: bool) -> list[Any]:
    """Start the FerryMQ and the Parquet query."""
    def trigger(w: Any) -> Any:
        return w.trigger(availableNow=True) if available_now else w.trigger(processingTime="2 seconds")

    revenue = revenue_per_minute(spark, servers)
    to_ferrymq = trigger(
        revenue.select(F.to_json(F.struct("*")).alias("value"), F.col("category").alias("sharding_key"))
        .writeStream.format("ferrymq").outputMode("append").option("servers", servers)
        .option("topic", "pipeline-revenue").option("checkpointLocation", str(work / "chk-ferrymq")))
    to_parquet = trigger(
        revenue_per_minute(spark, servers).writeStream.format("parquet").outputMode("append")
        .option("path", str(work / "revenue-parquet"))
        .option("checkpointLocation", str(work / "chk-parquet")))
    return [to_ferrymq.start(), to_parquet.start()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--servers", default="127.0.0.1:9876")
    ap.add_argument("--work", type=Path, default=Path("pipeline-work"))
    ap.add_argument("--available-now", action="store_true", help="process what is there, then stop")
    ap.add_argument("--shuffle-partitions", type=int, default=4,
                    help="state partitions of the aggregate (Spark's default, 200, costs minutes "
                         "on a laptop; fixed by the first run of a checkpoint)")
    args = ap.parse_args()
    spark = (SparkSession.builder.appName("ferrymq-revenue")
             .config("spark.sql.shuffle.partitions", str(args.shuffle_partitions)).getOrCreate())
    for q in start_queries(spark, args.servers, args.work, args.available_now):
        q.awaitTermination()


if __name__ == "__main__":
    main()
