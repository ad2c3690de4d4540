"""apogee.spark: a Spark 4 Python data source named ``apogee``.

::

    from apogee.spark import register

    register(spark)  # spark.dataSource.register(ApogeeDataSource)
    df = (
        spark.read.format("apogee")
        .option("namesrv", "127.0.0.1:9876")
        .option("topic", "Orders")
        .load()
    )

See ``docs/spark.md`` for the options, the schema and the guarantees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apogee.spark.source import ApogeeDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["ApogeeDataSource", "register"]


def register(spark: SparkSession) -> None:
    """Make ``format("apogee")`` known to ``spark``."""
    spark.dataSource.register(ApogeeDataSource)
