"""Why messages died: a consumer group's dead-letter topic summarised by original topic and
failure reason (the brokers' ``DLQ_ORIGIN_TOPIC`` and ``DLQ_REASON`` properties).

    spark-submit examples/spark/dlq_summary.py --namesrv ns-0:9876 --group order-workers
"""

from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from apogee.spark import register


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namesrv", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()

    spark = SparkSession.builder.appName("apogee-dlq-summary").getOrCreate()
    register(spark)
    dead = (
        spark.read.format("apogee")
        .option("namesrv", args.namesrv)
        .option("topic", f"%DLQ%{args.group}")
        .load()
    )
    summary = (
        dead.select(
            F.coalesce(F.col("properties")["DLQ_ORIGIN_TOPIC"], F.lit("?")).alias("topic"),
            # the first line of the reason: the exception, without its details
            F.substring_index(
                F.coalesce(F.col("properties")["DLQ_REASON"], F.lit("(none)")), "\n", 1
            ).alias("reason"),
            "delivery_attempt",
            "store_timestamp",
        )
        .groupBy("topic", "reason")
        .agg(
            F.count("*").alias("messages"),
            F.max("delivery_attempt").alias("most_attempts"),
            F.min("store_timestamp").alias("first"),
            F.max("store_timestamp").alias("last"),
        )
        .orderBy(F.desc("messages"))
    )
    summary.show(args.top, truncate=80)


if __name__ == "__main__":
    main()
