"""FerryMQ for PySpark: ``spark.read/readStream.format("ferrymq")`` and ``df.write/writeStream``.

Needs ``pip install "ferrymq[spark]"`` (pyspark 4.2+, pyarrow, numpy). Installing FerryMQ also
installs the module ``pyspark_ferrymq``, which Spark finds by itself, so ``format("ferrymq")``
works without any call; :func:`register` registers the source explicitly (for a session created
before the package was installed, or when shipping the code by value). Options, columns and
guarantees: ``docs/spark.md``.
"""

from __future__ import annotations

from typing import Any

from ferrymq.spark.options import SinkOptions, SourceOptions
from ferrymq.spark.source import DATA_SOURCE_NAME, DataLossError, FerryMQDataSource

__all__ = ["DATA_SOURCE_NAME", "DataLossError", "FerryMQDataSource", "SinkOptions",
           "SourceOptions", "register"]


def register(spark: Any) -> None:
    """Register the ``ferrymq`` data source with a SparkSession."""
    spark.dataSource.register(FerryMQDataSource)
