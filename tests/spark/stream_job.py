"""A streaming query run in its own process by the exactly-once test (so it can be SIGKILLed):
FerryMQ topic -> Parquet files, with a checkpoint.

    python -m tests.spark.stream_job SERVERS TOPIC CHECKPOINT OUTPUT processing|availableNow
"""

from __future__ import annotations

import sys

from tests.spark.helpers import spark_session


def main(servers: str, topic: str, chk: str, out: str, trigger: str) -> None:
    spark = spark_session("stream-job")
    src = (spark.readStream.format("ferrymq").option("servers", servers)
           .option("subscribe", topic).option("startingOffsets", "earliest")
           .option("maxOffsetsPerTrigger", "700").load())
    writer = (src.selectExpr("queue", "offset", "CAST(value AS STRING) AS v").writeStream
              .format("parquet").option("path", out).option("checkpointLocation", chk))
    if trigger == "availableNow":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime="300 milliseconds")
    query = writer.start()
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:6])
