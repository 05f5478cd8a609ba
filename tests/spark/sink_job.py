"""A streaming copy job run in its own process by ``test_sink_recovery.py`` (so it can die by
SIGKILL): FerryMQ topic -> FerryMQ topic with the transactional sink, availableNow.

    python -m tests.spark.sink_job SERVERS IN OUT CHECKPOINT CRASH_AFTER_BATCH MARKER
"""

from __future__ import annotations

import sys

from tests.spark.crashing_sink import CrashingDataSource
from tests.spark.helpers import spark_session


def main(servers: str, src_topic: str, out: str, chk: str, crash_batch: str, marker: str) -> None:
    spark = spark_session("sink-job")
    spark.dataSource.register(CrashingDataSource)
    src = (spark.readStream.format("ferrymq").option("servers", servers)
           .option("subscribe", src_topic).option("startingOffsets", "earliest")
           .option("maxOffsetsPerTrigger", "1000").load())
    query = (src.selectExpr("value", "sharding_key").writeStream.format("ferrymq_crashing")
             .option("servers", servers).option("topic", out)
             .option("deliveryMode", "transactional").option("checkpointLocation", chk)
             .option("test.crashAfterBatch", crash_batch).option("test.crashMarker", marker)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:7])
