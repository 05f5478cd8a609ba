"""Spark's lookup of Python data sources imports every top-level ``pyspark_*`` module and
registers its ``DefaultSource``: this module makes ``format("ferrymq")`` work with no call."""

from ferrymq.spark.source import FerryMQDataSource as DefaultSource

__all__ = ["DefaultSource"]
