"""Helpers of the Spark tests, importable by the query subprocess of the exactly-once test."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ferrymq import AdminClient, Message, Producer

SPARK_ENV = {
    "SPARK_LOCAL_IP": "127.0.0.1",
    "SPARK_LOCAL_HOSTNAME": "localhost",
    "PYSPARK_PYTHON": sys.executable,
    "PYSPARK_DRIVER_PYTHON": sys.executable,
}


def spark_session(app: str, master: str = "local[2]") -> Any:
    """A local[2] SparkSession on loopback, quiet (``local[2,F]``: tasks get F attempts)."""
    os.environ.update(SPARK_ENV)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master).appName(app)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def create_topic(address: str, name: str, queues: int = 3) -> None:
    """Create a topic."""
    with AdminClient(address) as admin:
        admin.create_topic(name, queues)


def produce(address: str, topic: str, values: list[bytes], **fields: Any) -> list[tuple[int, int]]:
    """Send ``values`` (one message each, round robin over the queues); their (queue, offset)."""
    with Producer(address, sticky_queue_bytes=0) as p:
        results = p.send_batch([Message(topic, v, **fields) for v in values])
    return [(r.queue, r.offset) for r in results]


def checkpoint(tmp_path: Path, name: str = "chk") -> str:
    """A fresh checkpoint directory path."""
    return str(tmp_path / name)
